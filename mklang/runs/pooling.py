"""A run's model calls drawn from a budget pool of its store (`--pool NAME`, ADR 0067).

`pooled` wraps the run's provider: before each model call it reserves the
call's worst case (the provider's `worst_case`: every prompt byte a token plus
the answer cap, priced) with one conditional statement in the store, waits
while the pool's calls in flight, rate buckets or a provider's `Retry-After`
leave no room, and settles what the call actually cost once it returns. A
worst case that cannot fit however the calls in flight settle raises
`PoolExhausted`, which suspends the run at the loop-top of its step
(`pool-exhausted`): the step's calls already paid are journaled, and replayed
when the run is resumed after `mklang pool topup`.

The provider is wrapped, not the engine: a run without a pool pays nothing for
pools, and replayed calls never reach a provider, so they never reserve.
A call is settled before its answer is journaled, so what a killed process
held is a call whose answer no journal kept: it is charged in full (the
provider may have billed it) when its run is opened again (`recover`), or
by any run of the pool once its lease expires, whichever comes first; a
hold is charged or settled once, as the statement that does it removes it.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from mklang.errors import CheckpointError, PoolExhausted, PoolWaitInterrupted, ProviderError, UsageError
from mklang.providers.base import Usage, call_key, seconds_left, throttling
from mklang.runs.request import on_stderr
from mklang.stores import PoolStore, RunStore
from mklang.stores.pools import COST_SLACK, Hold, Pool

LEASE_SECONDS = 300.0  # a hold not settled by then is charged in full: longer than any call's retries
POLL_SECONDS = 0.05  # how often a call waiting for room in its pool asks again (jittered)
Answer = TypeVar("Answer")


def lease_seconds() -> float:
    """How long a hold lasts unsettled: `MKLANG_POOL_LEASE` seconds, else `LEASE_SECONDS`."""
    text = os.environ.get("MKLANG_POOL_LEASE")
    if text is None:
        return LEASE_SECONDS
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < 10**7:
        raise UsageError(f"MKLANG_POOL_LEASE must be a number of seconds above 0, got {text!r}")
    return seconds


def pool_store(store: RunStore, pool: str) -> PoolStore:
    """`store` when it keeps the pool `pool`, else a one-line refusal saying why `--pool` cannot take effect."""
    if not isinstance(store, PoolStore):
        raise UsageError(
            f"--pool {pool}: the run's store ({type(store).__name__}) has no budget pools: "
            "pools live in a SQLite or PostgreSQL store (--checkpoint sqlite:///runs.db#RUN, --store postgresql://...)"
        )
    if store.pool(pool) is None:
        raise UsageError(f"--pool {pool}: no such pool in the run's store: `mklang pool create {pool} --store ...`")
    return store


def require_pool(store: RunStore, settings: Mapping[str, Any]) -> None:
    """Refuse at its start a command hosting many runs (batch, worker, serve) whose `--pool` no run
    could draw from, rather than each of its runs."""
    pool = settings.get("pool")
    if pool is not None:
        pool_store(store, pool)


class PooledProvider:
    """A provider whose model calls draw from a pool: reserve, call, settle (module docstring)."""

    def __init__(self, inner: Any, store: PoolStore, pool: str, run: str, interrupted: threading.Event):
        if not callable(getattr(inner, "worst_case", None)):
            raise UsageError(
                f"--pool {pool}: the run's model cannot bound what a call costs (a scripted, replayed or recorded "
                "model): a pool needs a configured provider with prices"
            )
        self._inner, self._store, self._pool, self._run = inner, store, pool, run
        self._interrupted = interrupted  # the run's interrupt (`Control.interrupted`): a wait ends on it
        self._lease = lease_seconds()

    def __getattr__(self, name: str) -> Any:  # route_of, close, ...: the provider's own
        return getattr(self._inner, name)

    def produce(self, system: str, user: str, tier: str, reason: bool) -> Any:
        worst = self._inner.worst_case(system, user, tier, reason)
        return self._drawn(worst, tier, lambda: self._inner.produce(system, user, tier, reason))

    def judge(
        self, conditions: list[str], output: Any, reasoning: str | None, context: dict[str, Any], tier: str
    ) -> Any:
        worst = self._inner.worst_judge(conditions, output, reasoning, context, tier)
        return self._drawn(worst, tier, lambda: self._inner.judge(conditions, output, reasoning, context, tier))

    def _drawn(self, worst: Usage | None, tier: str, call: Callable[[], Answer]) -> Answer:
        """`call()` under a hold of its worst case, settled with what it cost."""
        key = call_key()
        if worst is None or key is None:
            raise ProviderError(
                f"pool {self._pool}: tier {tier} has no bound on a call's cost (no price, or no max_tokens "
                "for its provider): a pool cannot reserve for it"
            )
        self._reserve(key, worst)
        try:
            with throttling(self._pause):
                answer = call()
        except ProviderError as error:  # a failed call may still have been paid for
            paid = error.usage or Usage()
            self._store.settle(self._pool, key, paid.cost_usd, paid.tokens)
            raise
        except BaseException:  # interrupted mid-call: it may have been billed, so it is charged in full
            self._store.charge_held(self._pool, time.time(), key)
            raise
        usage: Usage = getattr(answer, "usage", None) or Usage()
        self._store.settle(self._pool, key, usage.cost_usd, usage.tokens)
        if usage.cost_usd > worst.cost_usd + COST_SLACK or usage.tokens > worst.tokens:
            on_stderr(
                f"warning: pool {self._pool}: a call of tier {tier} cost ${usage.cost_usd:,.4f} "
                f"({usage.tokens:,} tokens), more than its worst case ${worst.cost_usd:,.4f} "
                f"({worst.tokens:,} tokens): the pool counts no more than its cap, and the provider's bill may "
                "be past it (an answer cap not kept, or prices wrong)"
            )
        return answer

    def _reserve(self, key: str, worst: Usage) -> None:
        """Hold `worst` in the pool, waiting while calls in flight, buckets or a pause leave no room;
        `PoolExhausted` when it cannot fit until the pool is topped up."""
        while True:
            now = time.time()
            hold = Hold(self._pool, key, self._run, worst.cost_usd, worst.tokens, now + self._lease)
            if self._store.reserve(hold, now):
                return
            pool = self._current()
            if self._store.charge_held(self._pool, now):  # leases of killed processes: room again
                continue
            if not pool.fits(worst.cost_usd, worst.tokens):
                self._store.note_waiting(self._run, self._pool)
                raise PoolExhausted(f"pool {self._pool}: {exhausted(pool, worst)}")
            pause = max(pool.paused_until - now, POLL_SECONDS * random.uniform(0.5, 1.5))
            left = seconds_left()
            if left is not None and pause >= left:
                raise ProviderError(f"pool {self._pool}: no room for a call before the --max-time deadline")
            if self._interrupted.wait(min(pause, 1.0)):
                raise PoolWaitInterrupted(f"pool {self._pool}: interrupted while waiting for room for a call")

    def _current(self) -> Pool:
        """The pool's row; a row gone or malformed exhausts the run (it waits for the pool to be mended)."""
        try:
            pool = self._store.pool(self._pool)
        except CheckpointError as error:
            raise PoolExhausted(str(error)) from None
        if pool is None:
            raise PoolExhausted(f"pool {self._pool} was removed from the run's store")
        return pool

    def _pause(self, seconds: float) -> None:
        """A server's 429 asked to wait: every run of the pool waits as long (`throttling`)."""
        self._store.pause(self._pool, time.time() + seconds)


def exhausted(pool: Pool, worst: Usage) -> str:
    """Why a call's worst case does not fit, in words: `a call's worst case $0.0140 past $0.9900 of $1.0000`."""
    caps = pool.caps
    if caps.max_cost is not None and pool.spent_cost + worst.cost_usd > caps.max_cost:
        spent = f"spent ${pool.spent_cost:,.4f} of ${caps.max_cost:,.4f}"
        return f"a call's worst case ${worst.cost_usd:,.4f} past {spent}"
    return (
        f"a call's worst case of {worst.tokens:,} tokens past spent {pool.spent_tokens:,} of {caps.max_tokens or 0:,}"
    )


def recover(store: PoolStore, pool: str, run: str) -> int:
    """Charge in full what an earlier process of the run held in the pool when it died (its calls may
    have been billed, and their answers were not journaled: a hold is settled before its answer is),
    so the resumed calls reserve afresh; how many holds. A hold is charged once: a charged hold is gone."""
    now = time.time()
    return sum(store.charge_held(pool, now, key) for key in store.held(pool, run))


def pooled(provider: Any, store: RunStore, pool: str, run: str, interrupted: threading.Event) -> Any:
    """`provider` drawing from `pool` of `store` for the run `run`, what its earlier processes held
    charged; a call waiting for room gives up when `interrupted` is set."""
    pools = pool_store(store, pool)
    wrapped = PooledProvider(provider, pools, pool, run, interrupted)
    recover(pools, pool, run)
    pools.note_waiting(run, None)  # driven again: it waits on no pool until it suspends on one
    return wrapped
