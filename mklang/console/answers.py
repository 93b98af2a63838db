"""Replies from the inbox: each resumes its run as `mklang resume STORE#RUN --set PATH=REPLY` does,
or, to a run parked on a human decision, as `mklang resume STORE#RUN --answer CHOICE --note NOTE
--question ID` does, bound besides to the digest of the value the card showed.

Every reply goes through the same `runs.resume`, under the run's lock, so the run takes it as
untrusted data and a decision is checked by `decisions.refusal` against the signed envelope (the
card it was made on is display only). The host that answers the resumed run is the one `mklang
serve` was started with (its --script, --provider, --plugin ...), filled in from the run's own
record as a resume fills it in. A fork from a run's page (`mklang fork STORE#RUN --at STEP --store
STORE#NAME --set ...`) goes the same way, through `forking.fork`, with the same host, and so does
a raised budget (`mklang resume STORE#RUN --budget N --max-tokens N ...`), checked under the lock by
`driving.require_raise`. The run goes on in a thread of the console; the answer's verdict
(taken, or the one line that refused it) is known once the lock is held and the run read, so
the page that sent it can say so, and the run page follows the rest.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict

from mklang.engine.events import Event
from mklang.errors import MklangError, first_line, redacted
from mklang.stores import RunStore

if TYPE_CHECKING:
    from mklang import runs
    from mklang.engine.decisions import Decision
    from mklang.session import Host


CAPS = ("max_tokens", "max_cost", "max_time")  # the run's caps a raise may set, beside `budget`


class Raised(TypedDict, total=False):
    """Budgets a run page raises, as `RunRequest` takes them (new totals)."""

    budget: int
    max_tokens: int
    max_cost: float
    max_time: float


@dataclass
class Delivery:
    """One reply on its way: `verdict` is set once it was taken (None) or refused (the line why)."""

    run: str
    decided: threading.Event = field(default_factory=threading.Event)
    verdict: str | None = None


class Replies:
    """Delivers replies and remembers, per run, why the last one could not resume it and what its
    resume told."""

    def __init__(self, store: RunStore, uri: str, hosting: Mapping[str, Any], on_change: Callable[[str], None]):
        self.store = store
        self.uri = uri
        self.hosting = hosting  # the host settings chosen (`host.settings.given`)
        self.on_change = on_change
        self.failures: dict[str, str] = {}
        self.notes: dict[str, list[str]] = {}
        self._threads: list[threading.Thread] = []

    def reply(self, run: str, reply_to: str, reply: str) -> Delivery:
        """Resume `run` with `reply` set at `reply_to`, in the background; JSON nested too deep to be
        a value raises NestingError here."""
        from mklang.limits import parse_value

        return self._deliver(run, {reply_to: parse_value(reply)}, None)

    def answer(self, run: str, decision: Decision) -> Delivery:
        """Resume `run` with `decision`, in the background; refused, changing nothing, unless the run
        still waits on that question, showing that value, when its lock is held."""
        return self._deliver(run, {}, decision)

    def raise_budget(self, run: str, raised: Raised) -> Delivery:
        """Resume `run` with the budgets `raised` (new totals, as `mklang resume --budget
        --max-tokens --max-cost --max-time` takes them), in the background, recorded as the
        console's `raise-budget` action; refused, changing nothing, unless the run is parked on a
        budget and one of them is above its own when its lock is held."""
        return self._deliver(run, {}, None, raised)

    def _deliver(
        self, run: str, values: dict[str, object], decision: Decision | None, raised: Raised | None = None
    ) -> Delivery:
        return self._in_background(run, "reply", self._resume, values, decision, raised)

    def _in_background(self, run: str, kind: str, work: Callable[..., None], *args: object) -> Delivery:
        """Start `work(delivery, *args)` on a thread of its own for the store's run `run`, its
        earlier failure and notes forgotten, and return the delivery it decides."""
        self.failures.pop(run, None)
        self.notes[run] = []
        delivery = Delivery(run)
        thread = threading.Thread(target=work, args=(delivery, *args), name=f"mklang-{kind}-{run}", daemon=True)
        self._threads.append(thread)
        thread.start()
        return delivery

    def _resume(
        self, delivery: Delivery, values: dict[str, object], decision: Decision | None, raised: Raised | None
    ) -> None:
        from mklang import runs
        from mklang.runs.driving import decided, require_raise

        run = delivery.run
        request = runs.RunRequest(
            source=runs.location(self.store, self.uri, run),
            reply=values,
            decision=decision,
            hosting=self.hosting,
            budget=(raised or {}).get("budget"),
            max_tokens=(raised or {}).get("max_tokens"),
            max_cost=(raised or {}).get("max_cost"),
            max_time=(raised or {}).get("max_time"),
            raised_by="console" if raised is not None else None,
        )
        with ExitStack() as hosts:

            def host_for(resumable: runs.Resumable) -> Host:
                # Under the lock: refused here, nothing is changed.
                if raised is not None:
                    require_raise(resumable, request.budget, {name: getattr(request, name) for name in CAPS})
                decided(resumable, values, decision)
                delivery.decided.set()
                return hosts.enter_context(runs.build_host(request, resumable, self.notes[run].append))

            try:
                runs.resume(request, host_for, observer=_Progress(run, self.on_change), tell=self.notes[run].append)
            except MklangError as error:
                self.failures[run] = redacted(first_line(error))  # a store URI's password is not shown
                if not delivery.decided.is_set():
                    delivery.verdict = self.failures[run]
            finally:
                delivery.decided.set()
                self.on_change(run)

    def fork(self, run: str, at: tuple[int, ...], name: str, values: dict[str, object]) -> Delivery:
        """Fork `run` at the step `at` into the store's run `name`, `values` set there, in the
        background; decided once its prefix replayed this run's (its live part begins: `name` is in
        the store) or it was refused."""
        return self._in_background(name, "fork", self._fork, run, at, values)

    def _fork(self, delivery: Delivery, run: str, at: tuple[int, ...], values: dict[str, object]) -> None:
        from mklang import runs
        from mklang.forking import fork, read_source

        name = delivery.run
        request = runs.RunRequest(
            checkpoint=runs.location(self.store, self.uri, name), reply=values, hosting=self.hosting
        )
        try:
            source = read_source(runs.location(self.store, self.uri, run))
            fork(source, at, request, observer=_Begun(delivery, self.on_change), tell=self.notes[name].append)
        except MklangError as error:
            self.failures[name] = redacted(first_line(error))
            if not delivery.decided.is_set():
                delivery.verdict = self.failures[name]
        finally:
            delivery.decided.set()
            self.on_change(name)

    def wait(self, timeout: float | None = None) -> None:
        """Let the runs in flight reach their end (or their next stop) before the console exits."""
        for thread in self._threads:
            thread.join(timeout)


class _Progress:
    """An event sink of a run the console resumed: its pages follow each state it enters and its
    stop as they happen, not when the store is next looked at."""

    SHOWN = frozenset({"state.entered", "run.suspended", "run.halted", "run.finished"})

    def __init__(self, run: str, on_change: Callable[[str], None]):
        self.run = run
        self.on_change = on_change

    def emit(self, event: Event) -> None:
        if event.kind in self.SHOWN:
            self.on_change(self.run)


class _Begun(_Progress):
    """The event sink of a fork's live part: its first event says the prefix replayed, so the
    fork is in the store and its page can be shown."""

    def __init__(self, delivery: Delivery, on_change: Callable[[str], None]):
        super().__init__(delivery.run, on_change)
        self.delivery = delivery

    def emit(self, event: Event) -> None:
        self.delivery.decided.set()
        super().emit(event)
