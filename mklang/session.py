"""Build a run the one way the CLI, the Python API and the tests all use.

A `Host` is what a run is answered by: a provider, tools and hooks, either
scripted from a scenario or real (a provider from the config, plugins), plus
the `HostSettings` a checkpoint records so that a resume can rebuild it
without secrets. `start` runs a machine with a host (durably when given a
checkpoint); `resume` continues a checkpoint with one. This module sits above
the engine and the checkpoint package; `mklang/host/` stays below both.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mklang.engine import Control, RunResult
from mklang.errors import CheckpointError, UsageError
from mklang.model import Machine
from mklang.scenarios import Scenario, ScriptedHost
from mklang.terminal import printable

if TYPE_CHECKING:
    from mklang.checkpoint import Resumable
    from mklang.checkpoint.envelope import Envelope, HostSettings
    from mklang.stores import Location, RunLock

__all__ = ["Host", "opened", "proceed", "resume", "start"]


@dataclass
class Host:
    """Provider, tools and hooks of a run, and how to record them in a checkpoint."""

    provider: Any
    tools: dict[str, Any] = field(default_factory=dict)
    hooks: dict[str, Any] = field(default_factory=dict)
    scripted: ScriptedHost | None = None  # lets a checkpoint save which scripted answers were used
    scenario: Scenario | None = None
    # The `HostSettings` fields a checkpoint records, kept plain: pydantic is
    # imported only when a run is checkpointed.
    settings: dict[str, Any] = field(default_factory=dict)
    read_only_tools: frozenset[str] = frozenset()  # the host config's `[tools] read_only`

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
            scripted=scripted,
            scenario=scenario,
            settings=settings or {"scenario": scenario.name, "script": script},
        )

    @classmethod
    def build(
        cls,
        *,
        script: str | Path | None = None,
        scenario: str | None = None,
        provider: str | None = None,
        model: str | None = None,
        config: str | Path | None = None,
        replay: str | Path | None = None,
        record: str | Path | None = None,
        max_cost: float | None = None,
        plugins: list[str] | None = None,
        priced_for: str = "--max-cost",
    ) -> Host:
        """A host from the options of `mklang run`: a scenario script, or a real provider.

        A dollar limit (`max_cost`, given as the option `priced_for`) is refused here when
        a model has no price: it could not be kept."""
        from mklang.host.plugins import load_plugins

        plugin_paths = [str(Path(p).resolve()) if p.endswith(".py") else p for p in plugins or []]
        settings = dict(
            script=str(Path(script).resolve()) if script else None,
            provider=provider,
            model=model,
            config=str(Path(config).resolve()) if config else None,
            replay=str(Path(replay).resolve()) if replay else None,
            record=str(Path(record).resolve()) if record else None,
            plugins=plugin_paths,
        )
        if script is not None:
            if provider or model or replay or record or config:
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

            loaded = None if replay else load_config(config, provider=provider, model=model)
            host = cls(
                provider=make_provider(
                    provider=provider,
                    model=model,
                    config_path=config,
                    record=record,
                    replay=replay,
                    max_cost=max_cost,
                    config=loaded,
                    priced_for=priced_for,
                ),
                settings=settings,
                read_only_tools=loaded.read_only_tools if loaded else frozenset(),
            )
        plugin_tools, plugin_hooks = load_plugins(plugin_paths)
        # Scripted answers win over plugins: a scenario pins what the tools say.
        host.tools = {**plugin_tools, **host.tools}
        host.hooks = {**plugin_hooks, **host.hooks}
        return host

    @classmethod
    def resumed(
        cls, resumable: Resumable, given: dict[str, Any], record: str | Path | None, max_cost: float | None
    ) -> Host:
        """The host `given` (the keyword arguments of `build` but `record` and `max_cost`, None when
        not given), filled in from a trusted checkpoint (never re-recording).

        From an untrusted one nothing is filled in; stderr names what was ignored (ADR 0014).
        """
        from mklang.checkpoint.trust import host_choice

        chosen, ignored = host_choice(resumable.envelope.host, given, resumable.trusted)
        if ignored:
            print(
                f"mklang: the checkpoint is not signed with your key: ignored its recorded {', '.join(ignored)}",
                file=sys.stderr,
            )
        return cls.build(record=record, max_cost=max_cost or resumable.envelope.budgets.max_cost, **chosen)

    def recorded(self) -> HostSettings:
        """The settings as a checkpoint records them."""
        from mklang.checkpoint.envelope import HostSettings

        return HostSettings(**self.settings)

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

    def __enter__(self) -> Host:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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


def start(
    machine: Machine,
    context: dict[str, Any] | None,
    host: Host,
    *,
    checkpoint: str | Path | Location | None = None,
    max_tokens: int | None = None,
    max_cost: float | None = None,
    max_time: float | None = None,
    concurrency: int | None = None,
    hitl: bool | None = None,
    untrusted_flow: str | None = None,
    suspendable: bool = False,
    control: Control | None = None,
    observer: Any = None,
    replace: bool = False,
    held: RunLock | None = None,
    texts: dict[str, str] | None = None,
) -> RunResult:
    """Run `machine` with `host`; with a checkpoint the run persists and suspends.

    Without one, `suspendable` makes budgets suspend into the result's frames.
    A run not finished at the checkpoint is refused unless `replace`; `held`
    is the checkpoint's lock when the caller took it already; `texts` the
    machine texts its store keeps already (`mklang.checkpoint.texts`).

    A scenario's input lies under `context`, and its `run:` settings under the
    given options. Scripted branches run concurrently like real ones: a
    scripted host answers them by branch index, so the answers stay the same.
    """
    preflight(machine, host)
    if host.scenario is not None:
        context = {**host.scenario.input, **(context or {})}
    budget = host.run_setting("budget", None)
    if budget is not None:
        machine = machine.replace(budget=int(budget))
    options: dict[str, Any] = dict(
        provider=host.provider,
        tools=host.tools,
        hooks=host.hooks,
        max_tokens=host.run_setting("max_tokens", max_tokens),
        max_cost=host.run_setting("max_cost", max_cost),
        max_time=max_time,
        concurrency=host.run_setting("concurrency", concurrency, 8),
        hitl=bool(host.run_setting("hitl", hitl, False)),
        untrusted_flow=host.run_setting("on_untrusted_flow", untrusted_flow, "report"),
        read_only_tools=host.read_only_tools,
        control=control,
        observer=observer,
    )
    if checkpoint is None:
        if replace:
            raise UsageError("replace=True replaces the run at a checkpoint: it needs checkpoint=")
        from mklang.engine import run

        return run(machine, context, suspendable=suspendable, **options)
    from mklang.checkpoint import start as start_durably

    return start_durably(
        machine,
        context,
        checkpoint=checkpoint,
        host=host.recorded(),
        scripted=host.scripted,
        replace=replace,
        held=held,
        texts=texts,
        **options,
    )


@contextmanager
def opened(
    source: str | Path | Location,
    *,
    force: bool = False,
    machine_path: str | None = None,
    trust: bool = False,
    kept_texts: bool = False,
    allow_rollback: bool = False,
    held: RunLock | None = None,
) -> Iterator[Resumable]:
    """Lock (unless `held` is its lock), read and verify a checkpoint; the lock is held until
    the run ends or the block does.

    Everything that can make it unresumable is raised here, before the caller
    sets up any provider; what the user should know before it runs (a rollback
    allowed, a torn journal) is printed on stderr. `trust` accepts a checkpoint
    not signed with this user's key, as untrusted data (ADR 0014);
    `allow_rollback` an older generation than one already written (ADR 0022).
    `kept_texts` runs the machine texts the store keeps in place of edited
    files, not only of missing ones.
    """
    from mklang.checkpoint import open_checkpoint

    resumable = open_checkpoint(
        source,
        force=force,
        machine_path=machine_path,
        trust=trust,
        kept_texts=kept_texts,
        allow_rollback=allow_rollback,
        held=held,
    )
    for note in resumable.notes:
        print(f"mklang: note: {printable(note)}", file=sys.stderr)
    try:
        yield resumable
    finally:
        resumable.release()


def proceed(resumable: Resumable, host: Host, **options: Any) -> RunResult:
    """Continue an opened checkpoint with `host`; options are those of `continue_checkpoint`.

    The checkpoint then records `host`'s settings, not the ones it was read with.
    """
    from mklang.checkpoint import continue_checkpoint

    preflight(resumable.chain[0].machine, host)
    return continue_checkpoint(
        resumable,
        provider=host.provider,
        tools=host.tools,
        hooks=host.hooks,
        read_only_tools=host.read_only_tools,
        scripted=host.scripted,
        host=host.recorded(),
        **options,
    )


def resume(
    source: str | Path | Location | Envelope,
    host: Host,
    *,
    force: bool = False,
    machine_path: str | None = None,
    trust: bool = False,
    allow_rollback: bool = False,
    checkpoint: str | Path | Location | None = None,
    **options: Any,
) -> RunResult:
    """Verify a checkpoint, then continue it with `host`.

    `source` is a checkpoint file or an `Envelope`; an envelope is first
    written to `checkpoint` (required then). A re-suspension goes to
    `checkpoint`, by default the same file. Other options are those of
    `mklang.checkpoint.continue_checkpoint`.
    """
    from mklang.checkpoint.envelope import Envelope, save

    if isinstance(source, Envelope):
        if checkpoint is None:
            raise CheckpointError("resuming an Envelope needs checkpoint=PATH to persist the run to")
        save(checkpoint, source)
        source = checkpoint
    with opened(
        source, force=force, machine_path=machine_path, trust=trust, allow_rollback=allow_rollback
    ) as resumable:
        return proceed(resumable, host, checkpoint=checkpoint, **options)


@dataclass
class Part:
    """One run of a scenario (the first, or a resume) with its expectation and what differed."""

    label: str  # "run", "resumes[1]", ...
    result: RunResult
    problems: list[str]


def play(machine: Machine, scenario: Scenario, untrusted_flow: str | None = None) -> list[Part]:
    """Run a scenario as `mklang run` and `mklang resume` would, and compare every part;
    `untrusted_flow` overrides the scenario's `run.on_untrusted_flow`.

    A durable scenario runs with a real checkpoint in a temporary folder; each
    of its `resumes` continues that checkpoint through `resume`,
    the code path of `mklang resume`, with a fresh scripted host whose position
    comes from the checkpoint.
    """
    import tempfile

    from mklang.scenarios import compare

    if not scenario.durable:
        with Host.for_scenario(scenario) as host:
            result = start(machine, {}, host, untrusted_flow=untrusted_flow)
        return [Part("run", result, compare(scenario.expect, result))]
    with tempfile.TemporaryDirectory(prefix="mklang-test-") as folder:
        checkpoint = Path(folder) / "checkpoint.json"
        with Host.for_scenario(scenario) as host:
            result = start(machine, {}, host, checkpoint=checkpoint, untrusted_flow=untrusted_flow)
        parts = [Part("run", result, compare(scenario.expect, result))]
        for number, step in enumerate(scenario.resumes, 1):
            label = f"resumes[{number}]"
            if result.status != "suspended":
                parts.append(Part(label, result, [f"nothing to resume: the run ended {result.status}"]))
                break
            with Host.for_scenario(scenario) as host:
                result = resume(
                    checkpoint,
                    host,
                    set_values=step.set,
                    max_tokens=step.max_tokens,
                    budget=step.budget,
                    hitl=step.hitl,
                    untrusted_flow=untrusted_flow,
                )
            parts.append(Part(label, result, compare(step.expect, result)))
    return parts
