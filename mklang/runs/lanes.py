"""Runs awaited in an event loop (`mklang.arun`, `mklang.aresume`): each runs on a lane, a thread
of one bounded pool the whole process shares, and the loop only awaits its end (ADR 0063).

The engine is synchronous: a run's model calls wait on their sockets in its lane, never in the
loop. The lanes are started together by a thread of their own, so the loop never waits for a
thread to start (which kept a busy loop late by hundreds of milliseconds). Cancelling the
awaiting task sets the run's interrupt flag and waits for the run to stop at its next loop-top,
its checkpoint written.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from mklang.engine.runtime import Control

_T = TypeVar("_T")
_Work = tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]", Callable[[], Any]]


def _lane_count() -> int:
    """`MKLANG_LANES`, else 64: the runs that go on at once in a process; more await a free lane."""
    given = os.environ.get("MKLANG_LANES", "")
    return int(given) if given.isdigit() and int(given) > 0 else 64


class Lanes:
    """A fixed number of threads serving one queue of runs, started together by a thread of their
    own when the first run is queued; each tells the run's loop of its end."""

    def __init__(self, count: int):
        self.count = count
        self._queue: queue.SimpleQueue[_Work] = queue.SimpleQueue()
        self._guard = threading.Lock()
        self._started = False

    def submit(self, call: Callable[[], _T]) -> asyncio.Future[_T]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[_T] = loop.create_future()
        self._queue.put((loop, future, call))
        with self._guard:
            starting, self._started = not self._started, True
        if starting:
            threading.Thread(target=self._start, name="mklang-lanes", daemon=True).start()
        return future

    def _start(self) -> None:
        for number in range(self.count):
            threading.Thread(target=self._serve, name=f"mklang-lane-{number}", daemon=True).start()

    def _serve(self) -> None:
        while True:
            loop, future, call = self._queue.get()
            try:
                outcome: tuple[Any, BaseException | None] = (call(), None)
            except BaseException as error:  # the awaiting task raises it
                outcome = (None, error)
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody awaits the run any more
                loop.call_soon_threadsafe(_settle, future, *outcome)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


LANES = Lanes(_lane_count())


async def in_lane(work: Callable[[Control], _T]) -> _T:
    """`work(control)` on a lane, in a copy of the caller's context, awaited. When the awaiting
    task is cancelled, `control` is interrupted and the cancellation is raised once `work` has
    ended: a run that persists is then suspended (`interrupted`) in its checkpoint."""
    control = Control()
    context = contextvars.copy_context()
    running = LANES.submit(lambda: context.run(work, control))
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        control.interrupted.set()
        running.add_done_callback(_retrieved)
        await asyncio.wait([running])
        raise


def _retrieved(ended: asyncio.Future[Any]) -> None:
    """A cancelled caller is told of no failure of its run: the checkpoint says how it ended."""
    if not ended.cancelled():
        ended.exception()
