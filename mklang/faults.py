"""Injected crash points: a test facility that kills the process at a named moment.

`MKLANG_KILL_AT=POINT:N` makes the N-th time the process reaches POINT
send itself SIGKILL (`*:N`: the N-th point of any kind), so crash tests
stop a real run exactly where they mean to instead of relying on timing.
Points (README, "Crash safety"):

- `journal.gen`, `journal.enter`, `journal.step`, `journal.halt`,
  `journal.call`: just after a journal line of that kind reached the OS;
- `envelope.temp`: an envelope's temporary file is written, not yet
  renamed; `envelope`: the envelope is in place;
- `segment`: a trace segment is durable in the store, and no envelope
  names it yet;
- `call.before`: a model or tool call is about to start; `call.returned`:
  it returned, its answer not yet journaled (`journal.call` follows);
  `call.delta`: a piece of a streamed answer arrived, before its observer is
  told of it (ADR 0060).

A call *in flight* is the moment a provider or tool has started the work
and the engine has not heard back; test servers and tools reach it by
calling `reach("call.inflight")` themselves.

(`journal.gen.temp` is the journal's temporary file before its rename.)

Unset, `reach` costs one comparison; the engine's step skips even the call while
`watcher` is None. Tests inside one process use `arm`
with an action of their own (raising an exception that nothing catches),
or `watch` to count the points a run reaches.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

ENV = "MKLANG_KILL_AT"


def _sigkill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class Trap:
    """Fires `action` at the `count`-th time `point` is reached, and at every point after it."""

    def __init__(self, point: str, count: int, action: Callable[[], None]):
        self.point, self.count, self.action = point, count, action
        self.fired = False
        self._lock = threading.Lock()

    def reach(self, point: str) -> None:
        with self._lock:
            if not self.fired and self.point in (point, "*"):
                self.count -= 1
                self.fired = self.count == 0
            fire = self.fired
        if fire:  # once dead, nothing else happens: other threads stop at their next point too
            self.action()


watcher: Callable[[str], None] | None = None  # told of every point reached; set only by `watch`


def reach(point: str) -> None:
    """Mark a crash point; kills (or runs the armed action) when it is the chosen one."""
    if watcher is not None:
        watcher(point)


def arm(point: str, count: int, action: Callable[[], None] = _sigkill) -> None:
    """Fire `action` at the `count`-th time `point` is reached (count >= 1)."""
    watch(Trap(point, count, action).reach)


def watch(hook: Callable[[str], None] | None) -> None:
    """Call `hook` with every point reached (None: stop)."""
    global watcher
    watcher = hook


def disarm() -> None:
    watch(None)


def _from_environment() -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    point, _, count = spec.rpartition(":")
    if not point or not count.isdigit() or int(count) < 1:
        raise SystemExit(f"mklang: {ENV} expects POINT:N (N >= 1), got {spec!r}")
    arm(point, int(count))


_from_environment()
