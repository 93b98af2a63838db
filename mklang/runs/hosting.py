"""The one way a run's host is built: `build_host`, from a `RunRequest` (and, continuing a run, its checkpoint).

The host settings chosen make a scenario's scripted host or a real provider
(from a provider name, the config, a cassette), plugins and MCP servers beside; a
provider object the caller keeps is used as it is. Continuing a run, a
checkpoint signed with this user's key fills in the settings left out, as
the run was hosted (ADR 0014). The caller's tools and hooks win over plugins,
and a scenario's scripted answers over both.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from mklang.errors import UsageError
from mklang.runs.opening import Resumable
from mklang.runs.request import RunRequest, Tell, on_stderr
from mklang.session import Host, connect_mcp

if TYPE_CHECKING:
    from mklang.host.config import HostConfig

__all__ = ["build_host"]


def build_host(request: RunRequest, resumable: Resumable | None = None, tell: Tell = on_stderr) -> Host:
    """The host that answers `request`'s run; `resumable` is its opened checkpoint when it
    continues one, and `tell` is told what of the checkpoint's settings were ignored."""
    host = _own(request) if request.provider is not None else _chosen(request, resumable, tell)
    scenario = host.scenario
    scripted_tools = {name: host.tools[name] for name in scenario.tools} if scenario else {}
    scripted_hooks = {name: host.hooks[name] for name in scenario.hooks} if scenario else {}
    host.tools = {**host.tools, **(request.tools or {}), **scripted_tools}
    host.hooks = {**host.hooks, **(request.hooks or {}), **scripted_hooks}
    return host


def _own(request: RunRequest) -> Host:
    """A host around the caller's provider object, which stays the caller's to close."""
    from mklang.host.plugins import load_plugins

    words, chosen = request.words, request.hosting
    clash = [name for name, value in chosen.items() if value is not None and name not in ("plugins", "mcp")]
    if clash:
        raise UsageError(f"{words(clash[0])} builds a provider: it cannot be combined with a provider object")
    plugin_tools, plugin_hooks = load_plugins(list(chosen["plugins"] or []))
    hub = connect_mcp(chosen["mcp"], None)
    tools = {**(hub.tools() if hub else {}), **plugin_tools}
    return Host(request.provider, tools, plugin_hooks, mcp=hub, owns_provider=False)


def _chosen(request: RunRequest, resumable: Resumable | None, tell: Tell) -> Host:
    """A host from the settings chosen, filled in from a trusted checkpoint (never re-recording);
    from an untrusted one nothing is filled in, and `tell` names what was ignored."""
    chosen, max_cost = dict(request.hosting), request.max_cost
    if resumable is not None:
        from mklang.checkpoint.trust import host_choice

        chosen, ignored = host_choice(resumable.envelope.host, chosen, resumable.trusted)
        if ignored:
            tell(f"the checkpoint is not signed with your key: ignored its recorded {', '.join(ignored)}")
        max_cost = max_cost or resumable.envelope.budgets.max_cost
    return _made(chosen, max_cost, request)


def _made(chosen: dict[str, Any], max_cost: float | None, request: RunRequest) -> Host:
    """A scenario's scripted host, or one with a real provider; a dollar limit is refused here when a
    model has no price: it could not be kept."""
    from mklang.host.plugins import load_plugins
    from mklang.host.settings import SETTINGS, files_renamed

    words = request.words
    settings = {**chosen, **files_renamed(chosen, lambda file: str(Path(file).resolve()))}
    settings.update({setting.name: settings[setting.name] or [] for setting in SETTINGS if setting.many})
    script, scenario, provider, model = (chosen[name] for name in ("script", "scenario", "provider", "model"))
    loaded: HostConfig | None = None
    if script is not None:
        offline = [name for name in ("provider", "model", "config", "replay", "record") if chosen[name]]
        if offline:
            raise UsageError(
                f"{words('script')} answers offline: it cannot be combined with "
                f"{words.listed('provider', 'model', 'config', 'replay', 'record')}"
            )
        if max_cost is not None:
            raise UsageError(
                f"{words(request.priced_for)} needs model prices, and a scripted model has none: "
                f"use {words('max_tokens')}"
            )
        from mklang.scenarios import find_scenario, load_script

        found = find_scenario(load_script(script), scenario, str(script), words("scenario"))
        host = Host.for_scenario(found, {**settings, "scenario": found.name})
    else:
        if scenario is not None:
            raise UsageError(f"{words('scenario')} needs {words('script')}")
        if chosen["record"] is not None and chosen["replay"] is not None:
            raise UsageError(f"{words('record')} and {words('replay')} cannot be used together")
        from mklang.host.config import load_config
        from mklang.providers.factory import make_provider

        replay = chosen["replay"]
        # Loaded here once, for its read-only tools too: a cassette replays with no config.
        loaded = None if replay else load_config(chosen["config"], provider=provider, model=model)
        made = make_provider(
            record=chosen["record"],
            replay=replay,
            max_cost=max_cost,
            config=loaded,
            priced_for=words(request.priced_for),
        )
        host = Host(provider=made, settings=settings, read_only_tools=loaded.read_only_tools if loaded else frozenset())
    plugin_tools, plugin_hooks = load_plugins(settings["plugins"])
    host.mcp = connect_mcp(settings["mcp"], loaded)
    mcp_tools = host.mcp.tools() if host.mcp else {}
    # Plugins win over MCP servers, scripted answers over both: a scenario pins what the tools say.
    host.tools = {**mcp_tools, **plugin_tools, **host.tools}
    host.hooks = {**plugin_hooks, **host.hooks}
    return host
