"""What every level of one run shares (`Runtime`), and the ports it reaches the host through.

Kept apart from the run loop (`runner`) so that gate selection and the loop
both depend on these types without depending on each other.
"""

from __future__ import annotations

import contextvars
import functools
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from mklang import faults
from mklang.effects import FlowPolicy, declared_read_only, host_read_only, reaches_tool
from mklang.engine import events
from mklang.engine.events import Event, EventSink
from mklang.engine.frame import Frame
from mklang.engine.keys import Calls
from mklang.engine.records import StepRecord
from mklang.errors import ProviderError
from mklang.host.registry import Registry
from mklang.limits import COST_SLACK
from mklang.model import Machine, State
from mklang.providers.base import Deltas, Provider, Usage, make_call
from mklang.vocabulary import DEFAULT_RUN_CONCURRENCY


class Control:
    """Signals from outside the run: an interrupt request, a wall-clock deadline, and a
    shared ceiling (a batch's): told the run's live spend after every call and at every
    budget check, it answers True once the ceiling is reached; `ceiling_detail` then says
    which of its caps and how far, for the run's detail."""

    def __init__(self, deadline: float | None = None):
        self.interrupted = threading.Event()
        self.deadline = deadline
        self.max_time: float | None = None  # the seconds the deadline was set to, for messages
        self.ceiling: Callable[[Usage], bool] | None = None
        self.ceiling_detail: Callable[[], str | None] | None = None

    def past_deadline(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline


@dataclass
class Caps:
    """The host's token and dollar budgets of the whole run (None: no ceiling)."""

    tokens: int | None = None
    cost: float | None = None

    def reached(self, usage: Usage) -> bool:
        """Whether `usage` has reached a cap, so the run may start nothing more."""
        # Dollars are float sums: ten calls of $0.01 make 0.0999...; a nano-dollar of slack
        # keeps such a sum from letting one more call through a $0.10 cap.
        return (self.tokens is not None and usage.tokens >= self.tokens) or (
            self.cost is not None and usage.cost_usd >= self.cost - COST_SLACK
        )

    def overrun(self, usage: Usage) -> str | None:
        """Which cap `usage` reached and by how much, in words: `tokens 1,204 of 1,000`."""
        if self.tokens is not None and usage.tokens >= self.tokens:
            return f"tokens {usage.tokens:,} of {self.tokens:,}"
        if self.cost is not None and usage.cost_usd >= self.cost - COST_SLACK:
            return f"dollars ${usage.cost_usd:,.4f} of ${self.cost:,.4f}"
        return None


class Workers:
    """The run's one concurrency limit: at most `limit` threads work for it, the caller included.

    A fan-out lends a pooled thread to its branches only while a slot is free and runs
    them on its own thread anyway, so nested fan-outs (inside calls or branches) never
    wait for each other's slots or for the pool. Each thread makes one model or tool
    call at a time, so calls in flight never exceed `limit` either.
    """

    def __init__(self, limit: int):
        self._spare = threading.Semaphore(limit - 1)

    def reserve(self) -> bool:
        """Take a free slot for a thread to `lend`; False when every slot is taken."""
        return self._spare.acquire(blocking=False)

    def lend(self, task: Callable[[], Any]) -> None:
        """Run `task` on a pooled thread in a slot `reserve` took, freed once `task` ends. The
        thread runs in a copy of the caller's context, so a branch's events keep the path of
        the state that fanned out."""
        BRANCH_THREADS.run(functools.partial(contextvars.copy_context().run, task), self._spare.release)


class ThreadPool:
    """Threads reused by the branches of every fan-out of the process.

    It never refuses nor queues work behind busy threads: a task goes to an idle
    thread, else to a new one, so it starts at once and a branch that fans out
    again cannot wait on a full pool. `Workers` bounds the threads a run keeps
    busy; a thread idle for `idle_seconds` ends.
    """

    def __init__(self, idle_seconds: float):
        self._idle_seconds = idle_seconds
        self._guard = threading.Lock()
        self._quiet = threading.Condition(self._guard)  # notified when no task is queued or running
        self._tasks: queue.SimpleQueue[tuple[Callable[[], Any], Callable[[], Any], Any]] = queue.SimpleQueue()
        self._idle = 0  # threads free to take a task queued from now on
        self._busy = 0  # tasks queued or running

    def run(self, task: Callable[[], Any], then: Callable[[], Any]) -> None:
        """Run `task`, then `then`, on a thread of the pool (`then` once the thread is free again).

        Returns once a thread has taken the task, as `Thread.start` returns once the
        thread runs: a branch handed over has begun before its fan-out decides on the next
        launch."""
        taken = threading.Lock()
        taken.acquire()
        with self._guard:
            self._tasks.put((task, then, taken))
            self._busy += 1
            idle = self._idle > 0
            if idle:
                self._idle -= 1
        if not idle:
            threading.Thread(target=self._serve, name="mklang-branch", daemon=True).start()
        taken.acquire()

    def _serve(self) -> None:
        while True:
            try:
                task, then, taken = self._tasks.get(timeout=self._idle_seconds)
            except queue.Empty:
                with self._guard:  # no task was queued for this thread: it may end
                    if self._tasks.empty():
                        self._idle -= 1
                        return
                continue
            taken.release()
            try:
                task()
            finally:
                with self._guard:  # free before `then` frees its slot: the slot's next task finds it
                    self._idle += 1
                    self._busy -= 1
                    if not self._busy:
                        self._quiet.notify_all()
                then()

    def wait_quiet(self) -> None:
        """Return once no task is queued or running: every branch handed over has ended (a
        process stopping its runs, or a crash test letting the crashed run's threads stop
        as SIGKILL would, waits here rather than on threads the pool keeps idle)."""
        with self._guard:
            while self._busy:
                self._quiet.wait()


BRANCH_THREADS = ThreadPool(idle_seconds=5.0)


class Journal(Protocol):
    """The engine's persistence port: what a run reports as it goes, and the paid
    answers that a resumed run replays (of calls that completed before a crash, or
    in fan-out branches that a suspension stopped mid-way)."""

    def loop_top(self, chain: list[Frame]) -> None: ...

    def enter(self, depth: int, frame: Frame) -> None: ...

    def step(self, depth: int, record: StepRecord) -> None: ...

    def replay(self, key: str, kind: str) -> Any: ...

    def record(self, key: str, kind: str, value: Any) -> None: ...

    def fold(self, prefix: str) -> None: ...

    def unreplayed(self) -> Usage: ...

    def halt(self, depth: int, error: str, usage: Usage) -> None: ...


class AnswerWatch(Protocol):
    """Who watches a run's answers as they stream, outside its events (`runs.live.LiveAnswers`)."""

    def deltas(self, key: str) -> Deltas | None:
        """What takes produce call `key`'s answer as it streams; None when nobody watches now."""

    def ended(self, key: str) -> None:
        """Produce call `key` given `deltas` ended, answered or not."""


@dataclass
class Runtime:
    """Everything shared by all levels of one run."""

    provider: Provider
    tools: Registry
    hooks: Registry
    load_machine: Callable[[str, str | None], Machine]
    concurrency: int = DEFAULT_RUN_CONCURRENCY
    caps: Caps = field(default_factory=Caps)
    spent: Usage = field(default_factory=Usage)  # the whole run's spend, every level and branch, live
    hitl: bool = False
    control: Control = field(default_factory=Control)
    journal: Journal | None = None  # None: nothing is persisted, every call is live (no `--checkpoint`)
    observer: EventSink | None = None  # told of every event of the run (`emit`), e.g. a live view
    trace_content: bool = False  # events carry prompts, outputs and tool arguments (ADR 0032)
    stream_deltas: bool = False  # the observer asks for produce answers as they stream (ADR 0060)
    delta_text: bool = False  # and for their text: it traces content, or shows the answer (`stream_text`)
    answers: AnswerWatch | None = None  # where a page watching the run reads its answers as they stream
    run_id: str = ""  # prefixes the idempotency keys hosts see, so two runs never share one
    untrusted_flow: FlowPolicy = "report"  # what a tainted decision reaching an effectful tool does
    read_only_tools: frozenset[str] = frozenset()  # the host config's read-only tools
    live_calls: Counter[str] = field(default_factory=Counter)  # calls this process paid for, by kind
    _states: dict[int, dict[str, State]] = field(default_factory=dict)
    _touches_tools: dict[int, bool] = field(default_factory=dict)
    _count_lock: threading.Lock = field(default_factory=threading.Lock)
    _emit_lock: threading.Lock = field(default_factory=threading.Lock)
    _emitted: int = 0
    workers: Workers = field(init=False)

    def __post_init__(self) -> None:
        self.workers = Workers(self.concurrency)

    def emit(self, event: Event) -> None:
        """Tell the observer of `event`, its envelope filled in: the run id, the next sequence
        number, the time and the path of the code emitting it. Events are emitted one at a
        time, so the observer sees them in sequence order."""
        if self.observer is None:
            return
        with self._emit_lock:
            self._emitted += 1
            # Made for this call, the event is no one else's yet: stamped in place rather than copied.
            event.run_id, event.seq, event.time, event.path = self.run_id, self._emitted, time.time(), events.PATH.get()
            self.observer.emit(event)

    def call(self, calls: Calls, kind: str, live: Callable[[], Any], about: Callable[[], events.CallAbout]) -> Any:
        """Every model and tool call goes through here, under the next key of `calls`: the
        journal answers it when an earlier process paid for it; otherwise `live()` runs (the
        host sees its idempotency key as `providers.base.call_key()`), is counted and is
        journaled. Either way its spend joins the run's live total, which every budget check
        reads, and the tally of `calls`; `about()` says what the call's events tell of it,
        asked only when an observer is told of them."""
        key = calls.next()
        told = about() if self.observer is not None else None  # an event nobody is told of is not built
        if told is not None:
            self.emit(told.started(key, self.trace_content))
            began = time.monotonic()
        journal = self.journal
        value = journal.replay(key, kind) if journal is not None else None
        replayed = value is not None
        if not replayed:
            with self._count_lock:
                self.live_calls[kind] += 1
            if faults.watcher is not None:  # a crash point costs no call unless one is watched
                faults.reach("call.before")
            answers = self.answers if kind == "produce" else None
            shown = answers.deltas(key) if answers is not None else None
            try:
                streams = kind == "produce" and (self.stream_deltas or shown is not None)
                deltas = self._deltas(told, key, shown) if streams else None
                value = make_call(self.idempotency_key(key), self.control.deadline, deltas, live)
            except Exception as error:
                usage = error.usage if isinstance(error, ProviderError) else None
                if told is not None:
                    self.emit(told.failed(key, error, usage, time.monotonic() - began))
                if isinstance(error, ProviderError):  # a failed call may still have been paid for
                    self._charge(calls, error.usage)
                raise
            finally:
                if answers is not None and shown is not None:
                    answers.ended(key)
            if faults.watcher is not None:
                faults.reach("call.returned")
            if journal is not None:
                journal.record(key, kind, value)
        if told is not None:
            self.emit(told.finished(key, value, replayed, time.monotonic() - began, self.trace_content))
        self._charge(calls, getattr(value, "usage", None))
        return value

    def _deltas(self, told: events.CallAbout | None, key: str, shown: Deltas | None) -> Deltas | None:
        """What tells the observer of a produce call's answer as it streams (`model.delta`), and
        the page watching the run (`shown`), when there is one."""
        if not isinstance(told, events.ModelAbout) or not self.stream_deltas:
            return shown
        about, content = told, self.delta_text

        def tell(offset: int, text: str) -> None:
            faults.reach("call.delta")
            self.emit(about.delta(key, offset, text, content))
            if shown is not None:
                shown(offset, text)

        return tell

    def idempotency_key(self, key: str) -> str:
        """What a host sees of a call's key (`engine.keys`): `<run id>/<key>`, unique across runs."""
        return f"{self.run_id}/{key}"

    def route(self, tier: str) -> tuple[str | None, str | None]:
        """The provider and model a tier's calls go to, when the provider can say (`route_of`)."""
        route_of = getattr(self.provider, "route_of", None)
        return route_of(tier) if route_of is not None else (None, None)

    def _charge(self, calls: Calls, usage: Usage | None) -> None:
        """Add a call's spend to the run's live total and to the tally of its step."""
        if usage is None:
            return
        calls.pay(usage)
        with self._count_lock:
            self.spent = spent = self.spent + usage
        if self.control.ceiling is not None:  # a shared ceiling learns of the spend as soon as it is paid
            self.control.ceiling(spent)

    def spent_so_far(self) -> Usage:
        """The run's spend: its live total (what its frames recorded when it started, then
        every call made or replayed since, branches stopped mid-way included) and what
        earlier processes paid for that it has not replayed."""
        return self.spent if self.journal is None else self.spent + self.journal.unreplayed()

    def effectful(self, machine: Machine, tool: str) -> bool:
        """Whether running `tool` may change the world: the host's word (the callable's mark,
        else its config), else the machine's declaration; unclassified tools are effectful."""
        said = host_read_only(self.tools.get(tool))
        if said is None and tool in self.read_only_tools:
            said = True
        return not (said if said is not None else declared_read_only(machine, tool))

    def touches_tools(self, machine: Machine) -> bool:
        """Whether `machine`, or a machine it calls, has a tool state: its result is then external."""
        known = self._touches_tools.get(id(machine))
        if known is None:
            known = self._touches_tools[id(machine)] = reaches_tool(machine, self.load_machine, lambda _m, _t: True)
        return known

    def states(self, machine: Machine) -> dict[str, State]:
        index = self._states.get(id(machine))
        if index is None:
            index = self._states[id(machine)] = {s.name: s for s in machine.states}
        return index


class Level:
    """One run level in flight: its frame plus where it sits in the run."""

    __slots__ = ("branch", "chain", "depth", "frame", "scope", "suspendable")

    def __init__(self, frame: Frame, depth: int, suspendable: bool, branch: bool, scope: str, chain: list[Frame]):
        self.frame = frame
        self.depth = depth
        self.suspendable = suspendable and not branch  # fan-out branches never suspend
        self.branch = branch
        self.scope = scope
        self.chain = [*chain, frame]  # root..this level, for durable loop-tops
