"""Where the console hears that runs changed, for its pages' live updates (server-sent events).

Pages subscribe to a `RunChanges` source and are told which runs changed. Today's source polls the
store: the summaries it updated since the last look (`RunQuery.since`), so one short query per
interval finds them in any store. A source fed by the engine's run events can take its place
without the pages knowing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from mklang.errors import MklangError
from mklang.stores import RunQuery, RunStore, summaries_of

WATCHED = 200  # the most runs told apart at one look; more changes at once: "everything"
OVERLAP = 2.0  # seconds each look reaches back before the last: a write stamped just before it still counts


@dataclass(frozen=True)
class Change:
    """Runs that changed; `everything` when the source cannot say which (many, or a run removed)."""

    runs: frozenset[str] = frozenset()
    everything: bool = False

    def to_json(self) -> str:
        return json.dumps({"runs": sorted(self.runs), "everything": self.everything})


class RunChanges(Protocol):
    """A source of changes that any number of pages follow."""

    def follow(self, quiet: float) -> AsyncIterator[Change | None]:
        """The changes from now on, until the follower stops; None after `quiet` seconds without one
        (a stream sends something now and then, or a proxy closes it)."""
        ...


class StorePoller:
    """A `RunChanges` source that looks at the store's run summaries every `interval` seconds."""

    def __init__(self, store: RunStore, interval: float):
        self.store = store
        self.interval = interval
        self._followers: set[asyncio.Queue[Change | None]] = set()  # None: the stream ends
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the server's, where the followers wait

    async def follow(self, quiet: float) -> AsyncIterator[Change | None]:
        queue: asyncio.Queue[Change | None] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._followers.add(queue)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._poll())
        try:
            while True:
                try:
                    change = await asyncio.wait_for(queue.get(), quiet)
                except TimeoutError:
                    yield None
                    continue
                if change is None:
                    return
                yield change
        finally:
            self._followers.discard(queue)

    def tell(self, change: Change) -> None:
        """Pass on a change known without looking (a run the console itself resumed), from any
        thread: the followers' queues are touched on the server's event loop only."""
        loop = self._loop
        if loop is None:  # nobody follows yet
            return
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self._tell(change)
        elif not loop.is_closed():
            loop.call_soon_threadsafe(self._tell, change)

    def _tell(self, change: Change) -> None:
        for queue in self._followers:
            queue.put_nowait(change)

    def close(self) -> None:
        """End every follower's stream, so a stopping server has no open request to wait for
        (called on the event loop's thread)."""
        for queue in self._followers:
            queue.put_nowait(None)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _poll(self) -> None:
        """Look while anyone follows; a store that cannot be read now is looked at again next time."""
        seen: dict[str, float | None] = {}  # run -> its summary's `updated`, for runs written lately
        since: float | None = None  # None: the first look, which only notes what is there
        while self._followers:
            looked = time.time()
            query = RunQuery(since=looked - OVERLAP if since is None else since, limit=WATCHED + 1)
            try:
                written = await asyncio.to_thread(summaries_of, self.store, query)
            except MklangError:
                await asyncio.sleep(self.interval)
                continue
            now = {summary.run: summary.updated for summary in written}
            changed = frozenset(run for run, updated in now.items() if seen.get(run) != updated)
            if since is not None:
                if len(written) > WATCHED:
                    self._tell(Change(everything=True))
                elif changed:
                    self._tell(Change(changed))
            seen, since = now, looked - OVERLAP
            await asyncio.sleep(self.interval)
