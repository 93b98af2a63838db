"""What a run is answered by: a `Host`, and the checks before it pays for anything.

A `Host` is a provider, tools and hooks, either scripted from a scenario or
real (a provider from the config, plugins), plus the `HostSettings` a
checkpoint records so that a resume can rebuild it without secrets.
`preflight` refuses what would stop a run after it had paid for some. Runs
are started and resumed with a host by `mklang.runs`; `mklang/host/` (the
user's config and plugins) stays below.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mklang.errors import UsageError
from mklang.model import Machine
from mklang.scenarios import Scenario, ScriptedHost

if TYPE_CHECKING:
    from mklang.checkpoint.envelope import HostSettings
    from mklang.checkpoint.journal import HostState
    from mklang.engine import Toolbox
    from mklang.host.config import HostConfig
    from mklang.mcp.client import McpHub
    from mklang.runs import Resumable

__all__ = ["Host", "preflight"]


@dataclass
class Host:
    """Provider, tools and hooks of a run, and how to record them in a checkpoint."""

    provider: Any
    tools: dict[str, Any] = field(default_factory=dict)
    hooks: dict[str, Any] = field(default_factory=dict)
    state: HostState | None = None  # what the host remembers across calls, saved with a checkpoint
    scenario: Scenario | None = None
    # The `HostSettings` fields a checkpoint records, kept plain: pydantic is
    # imported only when a run is checkpointed.
    settings: dict[str, Any] = field(default_factory=dict)
    read_only_tools: frozenset[str] = frozenset()  # the host config's `[tools] read_only`
    mcp: McpHub | None = None  # the sessions of the MCP servers whose tools are among `tools`

    @classmethod
    def for_scenario(cls, scenario: Scenario, settings: dict[str, Any] | None = None) -> Host:
        """A host answering from a scenario's scripted model, tools and hooks; its settings
        name the script, so `mklang resume` answers from it too."""
        scripted = ScriptedHost(scenario)
        script = str(Path(scenario.source).resolve()) if scenario.source else None
        return cls(
            provider=scripted.provider,
            tools=scripted.tools.functions(),
            hooks=scripted.hooks.functions(),
            state=scripted.state,
            scenario=scenario,
            settings=settings or {"scenario": scenario.name, "script": script},
        )

    @classmethod
    def build(cls, *, max_cost: float | None = None, priced_for: str = "--max-cost", **chosen: Any) -> Host:
        """A host from the host settings a caller chooses (keywords of `host.settings.given`; the
        options of `mklang run`): a scenario script, or a real provider.

        A dollar limit (`max_cost`, given as the option `priced_for`) is refused here when
        a model has no price: it could not be kept."""
        from mklang.host.plugins import load_plugins
        from mklang.host.settings import SETTINGS, files_renamed, given

        chosen = given(**chosen)
        settings = {**chosen, **files_renamed(chosen, lambda file: str(Path(file).resolve()))}
        settings.update({setting.name: settings[setting.name] or [] for setting in SETTINGS if setting.many})
        script, scenario, provider, model = (chosen[name] for name in ("script", "scenario", "provider", "model"))
        loaded: HostConfig | None = None
        if script is not None:
            if any(chosen[name] for name in ("provider", "model", "replay", "record", "config")):
                raise UsageError(
                    "--script answers offline: it cannot be combined with --provider, --model, --config, "
                    "--replay or --record"
                )
            if max_cost is not None:
                raise UsageError(f"{priced_for} needs model prices, and a scripted model has none: use --max-tokens")
            from mklang.scenarios import find_scenario, load_script

            found = find_scenario(load_script(script), scenario, str(script))
            host = cls.for_scenario(found, {**settings, "scenario": found.name})
        else:
            if scenario is not None:
                raise UsageError("--scenario needs --script")
            from mklang.host.config import load_config
            from mklang.providers.factory import make_provider

            replay = chosen["replay"]
            # Loaded here once, for its read-only tools too: a cassette replays with no config.
            loaded = None if replay else load_config(chosen["config"], provider=provider, model=model)
            host = cls(
                provider=make_provider(
                    record=chosen["record"], replay=replay, max_cost=max_cost, config=loaded, priced_for=priced_for
                ),
                settings=settings,
                read_only_tools=loaded.read_only_tools if loaded else frozenset(),
            )
        plugin_tools, plugin_hooks = load_plugins(settings["plugins"])
        host.mcp = connect_mcp(settings["mcp"], loaded)
        mcp_tools = host.mcp.tools() if host.mcp else {}
        # Plugins win over MCP servers, scripted answers over both: a scenario pins what the tools say.
        host.tools = {**mcp_tools, **plugin_tools, **host.tools}
        host.hooks = {**plugin_hooks, **host.hooks}
        return host

    @classmethod
    def resumed(cls, resumable: Resumable, given: dict[str, Any], max_cost: float | None) -> Host:
        """The host settings `given` (`host.settings.given`), filled in from a trusted checkpoint
        (never re-recording).

        From an untrusted one nothing is filled in; stderr names what was ignored (ADR 0014).
        """
        from mklang.checkpoint.trust import host_choice

        chosen, ignored = host_choice(resumable.envelope.host, given, resumable.trusted)
        if ignored:
            print(
                f"mklang: the checkpoint is not signed with your key: ignored its recorded {', '.join(ignored)}",
                file=sys.stderr,
            )
        return cls.build(**chosen, max_cost=max_cost or resumable.envelope.budgets.max_cost)

    def recorded(self) -> HostSettings:
        """The settings as a checkpoint records them."""
        from mklang.checkpoint.envelope import HostSettings

        return HostSettings(**self.settings)

    def toolbox(self) -> Toolbox:
        """What a run's runtime takes from its host besides the provider: its tools and hooks,
        and which tools the host classifies read-only."""
        return {"tools": self.tools, "hooks": self.hooks, "read_only_tools": self.read_only_tools}

    def run_setting(self, key: str, given: Any, default: Any = None) -> Any:
        """A caller's value wins over the scenario's `run:` setting, which wins over the default."""
        if given is not None:
            return given
        if self.scenario is not None and self.scenario.run.get(key) is not None:
            return self.scenario.run[key]
        return default

    def close(self) -> None:
        closer = getattr(self.provider, "close", None)
        if closer is not None:
            closer()
        if self.mcp is not None:
            self.mcp.close()

    def __enter__(self) -> Host:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect_mcp(given: list[str] | None, config: HostConfig | None) -> McpHub | None:
    """The MCP servers of the config and of `--mcp` (NAME=COMMAND or NAME=URL), started and their
    tools listed; None when there are none. One name means one server."""
    from mklang.mcp.servers import parse_option

    servers = [*(config.mcp_servers if config else ()), *(parse_option(text) for text in given or [])]
    if not servers:
        return None
    names = [server.name for server in servers]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise UsageError(f"MCP server {twice[0]!r} is configured twice (in the config and by --mcp, or twice)")
    from mklang.mcp.client import McpHub, require_sdk

    require_sdk()
    return McpHub(servers, config.read_only_tools if config else frozenset()).connect()


def preflight(machine: Machine, host: Host) -> None:
    """Refuse, before the first model call, what would stop a run after it had paid for some.

    Every machine the run may call passes its static checks (the `mklang`
    version line among them; `mklang.load` and the CLI check the root). A scenario scripts only tools and hooks that
    the machines declare or use; any other host implements all of them. The
    provider's API key was checked when the provider was built.
    """
    from mklang.checker import require_runnable
    from mklang.host.registry import BUILTIN_TOOLS, as_registry
    from mklang.model import ToolUse
    from mklang.scenarios import check_names
    from mklang.syntax.machines import machine_tree

    machines = machine_tree(machine)
    for called in machines[1:]:  # every way to start a run has checked the root already
        require_runnable(called)
    tools = {d.name for m in machines for d in m.tools}
    tools |= {s.face.tool for m in machines for s in m.states if isinstance(s.face, ToolUse)}
    hooks = {d.name for m in machines for d in m.hooks}
    hooks |= {g.hook for m in machines for s in m.states for g in s.gates if g.hook}
    if host.scenario is not None:
        check_names(host.scenario, tools, hooks)
        return
    for kind, names, registry in (
        ("tool", tools, as_registry("mklang.tools", BUILTIN_TOOLS, host.tools)),
        ("hook", hooks, as_registry("mklang.hooks", None, host.hooks)),
    ):
        missing = sorted(name for name in names if registry.get(name) is None)
        if missing:
            raise UsageError(
                f'{kind} "{missing[0]}" has no implementation: provide it with --plugin MODULE|FILE.py '
                f'(a {kind.upper()}S map), a "mklang.{kind}s" entry point, or {kind}s= in the Python API'
            )
