"""What a run is answered by: a `Host`, and the checks before it pays for anything.

A `Host` is a provider, tools and hooks, either scripted from a scenario or
real (a provider from the config, plugins), plus the `HostSettings` a
checkpoint records so that a resume can rebuild it without secrets.
`preflight` refuses what would stop a run after it had paid for some. A host
is built from the settings a caller chooses by `mklang.runs.build_host`, and
runs are started and resumed with it by `mklang.runs`; `mklang/host/` (the
user's config and plugins) stays below.
"""

from __future__ import annotations

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
    owns_provider: bool = True  # closed with the host; a provider object a caller passed stays the caller's

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
        closer = getattr(self.provider, "close", None) if self.owns_provider else None
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


def preflight(machine: Machine, host: Host, checked: frozenset[str] = frozenset()) -> None:
    """Refuse, before the first model call, what would stop a run after it had paid for some.

    Every machine the run may call passes its static checks (the `mklang`
    version line among them; `mklang.load` and the CLI check the root), but
    those `checked` already: a resume names the files its checkpoint found
    unchanged, which passed them when the run started (`Resumable.checked`).
    A scenario scripts only tools and hooks that the machines declare or use;
    any other host implements all of them. The provider's API key was checked
    when the provider was built.
    """
    from mklang.checker import require_runnable
    from mklang.host.registry import BUILTIN_TOOLS, as_registry
    from mklang.model import ToolUse
    from mklang.scenarios import check_names
    from mklang.syntax.machines import machine_tree

    machines = machine_tree(machine)
    for called in machines[1:]:  # every way to start a run has checked the root already
        if called.path not in checked:
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
