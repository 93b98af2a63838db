"""The public functions of `mklang`, which reads them from here when first used (so that
`import mklang` stays cheap): see docs/api.md. They import the heavy parts of the package
only when called.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, Unpack, overload

from mklang.errors import Diagnostic
from mklang.vocabulary import FlowPolicy

if TYPE_CHECKING:
    from mklang.effects import ToolFunction
    from mklang.engine import Control, RunResult
    from mklang.engine.decisions import Answer
    from mklang.engine.events import EventSink
    from mklang.model import Machine
    from mklang.providers.base import Provider
    from mklang.runs import Outcome, RunRequest
    from mklang.session import Host

StrPath = str | os.PathLike[str]


def load(path: StrPath) -> Machine:
    """Load a `.mk` (or YAML `.mkl`/`.yaml`) machine file and check it.

    Raises `LoadError` (its `diagnostics` say why) when the file cannot be
    read or parsed, or when the static checks find an error.
    """
    from mklang.checker import require_runnable
    from mklang.syntax import load_file

    return require_runnable(load_file(path))


def check(machine: Machine | StrPath) -> list[Diagnostic]:
    """Every finding of the static checks (SPEC section 3) about a machine or a machine file,
    errors and warnings sorted by position; a file that cannot be loaded yields why. Never raises
    for what it finds: `mklang check` exits 2 when any finding is an error."""
    from mklang.checker import check as check_machine
    from mklang.checker import check_file
    from mklang.model import Machine

    return check_machine(machine) if isinstance(machine, Machine) else check_file(machine)


class Answering(TypedDict, total=False):
    """Who answers a run's model calls, tools and hooks: the host keywords of `run`, `resume` and
    `batch` (docs/api.md), each a setting of `mklang.host.settings` or a callable map."""

    provider: Provider | str | None
    model: str | None
    config: StrPath | None
    script: StrPath | None
    scenario: str | None
    replay: StrPath | None
    pool: str | None
    plugins: Sequence[str] | None
    mcp: Sequence[str] | None
    tools: Mapping[str, Callable[..., Any]] | None
    hooks: Mapping[str, Callable[..., Any]] | None


class Bounds(TypedDict, total=False):
    """How a run goes, whoever answers it: its budgets, calls in flight, the untrusted-flow
    policy and the observer of its events (the keywords all three functions share besides)."""

    untrusted_flow: FlowPolicy | None
    max_tokens: int | None
    max_cost: float | None
    max_time: float | None
    concurrency: int | None
    observer: EventSink | None


class BatchOptions(Answering, Bounds, total=False):
    """The keywords `batch` shares with `run` and `resume`."""


class RunKeywords(Answering, Bounds, total=False):
    """The keywords of `run`, which `resume` takes too: a run that persists records a cassette,
    keeps a checkpoint, may replace what is there and may wait for a human."""

    record: StrPath | None
    checkpoint: StrPath | None
    replace: bool
    hitl: bool | None


def run(
    machine: Machine | StrPath, context: Mapping[str, Any] | None = None, **options: Unpack[RunKeywords]
) -> RunResult:
    """Run `machine` (a `Machine` or a file) from its entry with `context` and return how it ended.

    The keywords are those of `mklang run` (docs/api.md). Without `checkpoint`
    a budget halts the run; with it the run persists there and suspends instead.
    """
    _require_keywords(run, options, RunKeywords.__optional_keys__)
    return _started(machine, context, options, None)


async def arun(
    machine: Machine | StrPath, context: Mapping[str, Any] | None = None, **options: Unpack[RunKeywords]
) -> RunResult:
    """`run`, awaited: the run goes on outside the event loop, which its model calls never block.

    Cancelling the awaiting task stops the run at its next loop-top: with a `checkpoint` it is
    suspended there (`reason` "interrupted"), to be continued by `aresume`; the cancellation is
    raised once the checkpoint is written."""
    from mklang.runs.lanes import in_lane

    _require_keywords(arun, options, RunKeywords.__optional_keys__)
    return await in_lane(lambda control: _started(machine, context, options, control))


def _started(
    machine: Machine | StrPath, context: Mapping[str, Any] | None, options: RunKeywords, control: Control | None
) -> RunResult:
    """The run `run` and `arun` make; `control` is how `arun` interrupts it."""
    from mklang.runs import build_host, start

    loaded = _runnable(machine)
    with build_host(_request(options)) as host:
        return start(loaded, dict(context or {}), host, control=control, **_run_settings(options))


def resume(
    source: StrPath,
    *,
    reply: Mapping[str, Any] | Answer | None = None,
    force: bool = False,
    trust: bool = False,
    allow_rollback: bool = False,
    machine: StrPath | None = None,
    budget: int | None = None,
    **options: Unpack[RunKeywords],
) -> RunResult:
    """Continue a suspended, interrupted or crashed run from its checkpoint (a file or `STORE-URI#RUN`).

    `reply` maps dotted context paths to values, as `mklang resume --set`
    does: the answer to a parked question goes under its `reply_to`. A run
    parked on a human decision is answered with an `Answer` instead, as
    `mklang resume --answer` does (refused with `DecisionRefused`, nothing
    changed, unless it is one of the choices of the question pending). With
    no provider, script or replay given, a checkpoint signed with your key
    is answered as the run was. The other keywords are those of `mklang resume`.
    """
    from mklang import runs

    _require_keywords(resume, options, RunKeywords.__optional_keys__)
    request = _resumed(source, reply, force, trust, allow_rollback, machine, budget, options)
    return runs.resume(request, observer=options.get("observer"))


async def aresume(
    source: StrPath,
    *,
    reply: Mapping[str, Any] | Answer | None = None,
    force: bool = False,
    trust: bool = False,
    allow_rollback: bool = False,
    machine: StrPath | None = None,
    budget: int | None = None,
    **options: Unpack[RunKeywords],
) -> RunResult:
    """`resume`, awaited as `arun` is, and cancelled as it is: the run suspends again, interrupted."""
    from mklang import runs
    from mklang.runs.lanes import in_lane

    _require_keywords(aresume, options, RunKeywords.__optional_keys__)
    request = _resumed(source, reply, force, trust, allow_rollback, machine, budget, options)
    return await in_lane(lambda control: runs.resume(request, observer=options.get("observer"), control=control))


def _resumed(
    source: StrPath,
    reply: Mapping[str, Any] | Answer | None,
    force: bool,
    trust: bool,
    allow_rollback: bool,
    machine: StrPath | None,
    budget: int | None,
    options: RunKeywords,
) -> RunRequest:
    """The request `resume` and `aresume` continue a run with."""
    from mklang.engine.decisions import Answer

    return _request(
        options,
        source=_where(source),
        reply=dict(reply) if reply is not None and not isinstance(reply, Answer) else {},
        decision=reply.decision() if isinstance(reply, Answer) else None,
        budget=budget,
        force=force,
        machine_path=None if machine is None else os.fspath(machine),
        trust=trust,
        allow_rollback=allow_rollback,
    )


def batch(
    machine: Machine | StrPath,
    inputs: StrPath | Iterable[Mapping[str, Any]],
    *,
    store: StrPath,
    out: StrPath | None = None,
    hitl: bool = False,
    batch_max_tokens: int | None = None,
    batch_max_cost: float | None = None,
    **options: Unpack[BatchOptions],
) -> list[Outcome]:
    """Run `machine` once per input, each a durable run in `store`; one `Outcome` per input, in order.

    `inputs` is a JSON Lines file or context maps (an `id` key names a run,
    else the hash of the input); `store` a folder or a store URI. Calling it
    again with the same inputs resumes the batch. `max_*` bound each run,
    `batch_max_*` the whole batch; `concurrency` runs are in flight at once (default 32).
    `observer` is told of every run's events, each carrying the run's name.
    The keywords are those of `mklang batch`.
    """
    from contextlib import AbstractContextManager, ExitStack, nullcontext

    from mklang import batching
    from mklang.runs import build_host
    from mklang.stores import open_note_store
    from mklang.vocabulary import DEFAULT_BATCH_CONCURRENCY

    _require_keywords(batch, options, BatchOptions.__optional_keys__)
    loaded = _runnable(machine)
    if isinstance(inputs, (str, os.PathLike)):
        items = batching.read_inputs(os.fspath(inputs))
    else:
        items = batching.items_of((dict(data), f"input {number}") for number, data in enumerate(inputs, 1))

    # A dollar limit, the run's or else the batch's, is refused when a model has no price.
    max_cost = options.get("max_cost")
    dollars = _request(
        options,
        max_cost=max_cost if max_cost is not None else batch_max_cost,
        priced_for="max_cost" if max_cost is not None else "batch_max_cost",
    )

    def host() -> AbstractContextManager[Host]:
        return build_host(dollars)

    with ExitStack() as stack:
        # A provider is shared by every run (it is thread-safe); a scripted host keeps a state per run.
        shared = None if options.get("script") is not None else stack.enter_context(host())
        opened = open_note_store(os.fspath(store), "a batch")
        stack.callback(opened.close)
        runner = batching.Batch(
            loaded,
            opened,
            os.fspath(store),
            host if shared is None else lambda: nullcontext(shared),
            max_tokens=options.get("max_tokens"),
            max_cost=max_cost,
            max_time=options.get("max_time"),
            untrusted_flow=options.get("untrusted_flow"),
            ceilings=batching.Ceilings(batch_max_tokens, batch_max_cost),
            hitl=hitl,
            observer=options.get("observer"),
        )
        concurrency = options.get("concurrency")
        outcomes = runner.run(items, DEFAULT_BATCH_CONCURRENCY if concurrency is None else concurrency)
    if out is not None:
        batching.write_results(os.fspath(out), outcomes)
    return outcomes


def read_only(tool: ToolFunction) -> ToolFunction:
    """Mark a host tool as read-only (it observes the world, it changes nothing), so that a
    decision a judge made over outside data may reach it (SPEC section 4, "Control-flow taint")."""
    from mklang.effects import read_only as mark

    return mark(tool)


@overload
def _where(place: StrPath) -> str | Path: ...
@overload
def _where(place: None) -> None: ...
def _where(place: StrPath | None) -> str | Path | None:
    """A checkpoint as given: text may name a run in a store (`URI#RUN`), a path object is a file."""
    return place if place is None or isinstance(place, str) else Path(place)


def _runnable(machine: Machine | StrPath) -> Machine:
    """A machine given as a file is loaded; either way it must pass its static checks."""
    from mklang.checker import require_runnable
    from mklang.model import Machine

    return require_runnable(machine) if isinstance(machine, Machine) else load(machine)


def _require_keywords(function: Callable[..., Any], options: Mapping[str, Any], declared: frozenset[str]) -> None:
    """A keyword the function does not declare is a `TypeError` at the call, as for any Python function."""
    unknown = sorted(set(options) - declared)
    if unknown:
        raise TypeError(f"{function.__name__}() got an unexpected keyword argument '{unknown[0]}'")


def _run_settings(options: Mapping[str, Any]) -> dict[str, Any]:
    """What of `options` `runs.start` takes (the rest builds the host): the bounds, and where
    and how the run persists."""
    settings: dict[str, Any] = {name: value for name, value in options.items() if name not in _HOST_KEYWORDS}
    settings["checkpoint"] = _where(options.get("checkpoint"))
    return settings


_HOST_KEYWORDS = Answering.__optional_keys__ | {"record"}  # what builds the host (`runs.build_host`)


def _request(options: Mapping[str, Any], **asked: Any) -> RunRequest:
    """The `runs.RunRequest` of a call: its keywords, and its refusals in their words (`max_cost=`).

    A provider given by name is a host setting; a provider object is used as it is (left open: it
    is the caller's)."""
    from mklang.host.settings import CHOSEN
    from mklang.runs import KEYWORDS, RunRequest

    provider = options.get("provider")
    own = provider is not None and not isinstance(provider, str)  # a provider object, not a name
    hosting = {setting.name: options.get(setting.name) for setting in CHOSEN}
    if own:
        hosting["provider"] = None
    settings = {name: value for name, value in _run_settings(options).items() if name != "observer"}
    return RunRequest(
        **{**settings, **asked},
        hosting=hosting,
        provider=provider if own else None,
        tools=options.get("tools"),
        hooks=options.get("hooks"),
        words=KEYWORDS,
    )
