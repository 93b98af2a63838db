"""Replies from the inbox: each resumes its run as `mklang resume STORE#RUN --set PATH=REPLY` does,
or, to a run parked on a human decision, as `mklang resume STORE#RUN --answer REPLY` does.

The reply is parsed as `--set` parses a value and goes through the same `runs.resume`, so the run
takes it as untrusted data. The host that answers the resumed run is the one `mklang serve` was
started with (its --script, --provider, --plugin ...), filled in from the run's own record as a
resume fills it in. The run goes on in a thread of the console; the run page follows it, and shows
what the resume had to tell (a note, settings of the checkpoint ignored) where the terminal would.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from mklang.engine.events import Event
from mklang.errors import first_line
from mklang.stores import RunStore

if TYPE_CHECKING:
    from mklang.engine.decisions import Decision


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

    def deliver(self, run: str, reply_to: str, reply: str, decides: bool = False) -> None:
        """Resume `run` with `reply` set at `reply_to`, in the background; JSON nested too deep to be
        a value raises NestingError here. To a run the inbox showed parked on a human decision
        (`decides`) the reply is the answer, a choice, checked as `--answer` is under the run's lock."""
        from mklang.limits import parse_value

        decision: Decision | None = {"choice": reply.strip(), "by": "human"} if decides else None
        values = {} if decides else {reply_to: parse_value(reply)}
        self.failures.pop(run, None)
        self.notes[run] = []
        thread = threading.Thread(
            target=self._resume, args=(run, values, decision), name=f"mklang-reply-{run}", daemon=True
        )
        self._threads.append(thread)
        thread.start()

    def _resume(self, run: str, values: dict[str, object], decision: Decision | None) -> None:
        from mklang import runs
        from mklang.errors import MklangError

        where = runs.location(self.store, self.uri, run)
        request = runs.RunRequest(source=where, reply=values, decision=decision, hosting=self.hosting)
        try:
            runs.resume(request, observer=_Progress(run, self.on_change), tell=self.notes[run].append)
        except MklangError as error:
            self.failures[run] = first_line(error)
        finally:
            self.on_change(run)

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
