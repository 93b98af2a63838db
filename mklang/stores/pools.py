"""Budget pools: caps on dollars, tokens, calls in flight and call rates, shared by every run that
draws from them, kept as rows of a store (ADR 0067).

A pool's row holds its caps, what its runs have spent, what their calls in
flight have reserved (each call's worst case), how many calls are in flight,
its rate buckets and until when a provider asked it to pause. Each call in
flight holds a row of its own (a hold: its reservation and its lease, keyed
by the call's idempotency key), so what a call reserved is settled, or
charged when its lease expires, exactly once. A run that suspended on the
pool is a row of `mklang_pool_waits` until it is driven again: the pool's
waiting runs are those rows whose run is still suspended `pool-exhausted`.
The statements are in `mklang.stores.sql`; this module holds the values and
their checks, so a row tampered with is refused wherever it is read.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from mklang.errors import CheckpointError, UsageError

POOL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
POOL_NAME_RULE = "1 to 64 ASCII letters, digits, '.', '_' or '-', starting with a letter or digit"
# The largest numbers a pool's row may hold: a recorded spend's limits (`providers.base`).
MAX_RECORDED_TOKENS = 10**15
MAX_RECORDED_COST = 1e12
COST_SLACK = 1e-9  # USD: float sums of many calls (as `engine.runtime.Caps`)
# The columns of a pool's row, in the order `Pool` takes them.
POOL_COLUMNS = (
    "name, max_cost, max_tokens, concurrency, rpm, tpm, spent_cost, spent_tokens, reserved_cost, "
    "reserved_tokens, in_flight, paused_until, "
    "(SELECT COUNT(*) FROM mklang_pool_waits w JOIN mklang_runs r ON r.run = w.run WHERE w.pool = mklang_pools.name "
    "AND r.status = 'suspended' AND r.reason = 'pool-exhausted')"
)


def pool_name(text: str) -> str:
    """`text` when it is a valid pool name, else a one-line UsageError."""
    if POOL_NAME.fullmatch(text):
        return text
    raise UsageError(f"pool name {text[:40]!r} is not valid: a pool name is {POOL_NAME_RULE}")


@dataclass(frozen=True)
class Caps:
    """What a pool allows (None: no cap of that kind)."""

    max_cost: float | None = None
    max_tokens: int | None = None
    concurrency: int | None = None
    rpm: int | None = None
    tpm: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_tokens", "concurrency", "rpm", "tpm"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not value > 0):
                raise UsageError(f"pool --{name.replace('_', '-')} must be a whole number above 0, got {value!r}")
        cost = self.max_cost
        if cost is not None and (not math.isfinite(cost) or not 0 <= cost <= MAX_RECORDED_COST):
            raise UsageError(f"pool --max-cost must be a dollar amount from 0 to {MAX_RECORDED_COST:g}, got {cost!r}")

    @property
    def any(self) -> bool:
        return any(getattr(self, name) is not None for name in ("max_cost", "max_tokens", "concurrency", "rpm", "tpm"))


@dataclass(frozen=True)
class Pool:
    """A pool as its row says, checked (`from_row`): what it allows, has spent, holds and waits on."""

    name: str
    caps: Caps
    spent_cost: float
    spent_tokens: int
    reserved_cost: float
    reserved_tokens: int
    in_flight: int
    paused_until: float
    waiting: int  # runs suspended `pool-exhausted` on it, not yet resumed (`PoolStore.note_waiting`)

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> Pool:
        """The pool a row of `POOL_COLUMNS` holds; a `CheckpointError` naming the value when a number is
        not one a pool can hold (negative, not finite, absurd): a row tampered with is never drawn from."""
        name, max_cost, max_tokens, concurrency, rpm, tpm, *counts = row
        try:
            caps = Caps(_cost(max_cost), _count(max_tokens), _count(concurrency), _count(rpm), _count(tpm))
        except UsageError as error:
            raise _malformed(name, str(error)) from None
        spent_cost, spent_tokens, reserved_cost, reserved_tokens, in_flight, paused_until, waiting = counts
        values = {
            "spent_cost": spent_cost,
            "reserved_cost": reserved_cost,
            "paused_until": paused_until,
        }
        for field, value in values.items():
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise CheckpointError(
                    f"pool {name}: its row is malformed ({field} {value!r}): refusing to draw from it"
                )
        if spent_cost > MAX_RECORDED_COST or reserved_cost > MAX_RECORDED_COST:
            raise _malformed(name, "dollars past any cap")
        counted = {"spent_tokens": spent_tokens, "reserved_tokens": reserved_tokens, "in_flight": in_flight}
        for field, value in {**counted, "waiting": waiting}.items():
            if not isinstance(value, int) or not 0 <= value <= MAX_RECORDED_TOKENS:
                raise CheckpointError(
                    f"pool {name}: its row is malformed ({field} {value!r}): refusing to draw from it"
                )
        return cls(
            str(name),
            caps,
            float(spent_cost),
            spent_tokens,
            float(reserved_cost),
            reserved_tokens,
            in_flight,
            float(paused_until),
            waiting,
        )

    def fits(self, cost: float, tokens: int) -> bool:
        """Whether a call of this worst case could fit once the calls in flight settle (they may settle
        for less than they reserved); False: it can never fit until the pool is topped up."""
        caps = self.caps
        if caps.max_cost is not None and self.spent_cost + cost > caps.max_cost + COST_SLACK:
            return False
        return caps.max_tokens is None or self.spent_tokens + tokens <= caps.max_tokens

    def line(self) -> str:
        """The pool in one line: caps, spent, reserved, in flight, waiting runs."""
        caps = self.caps
        parts = [
            f"spent {_money(self.spent_cost)}" + (f" of {_money(caps.max_cost)}" if caps.max_cost is not None else ""),
            f"reserved {_money(self.reserved_cost)}",
            f"tokens {self.spent_tokens:,}"
            + (f" of {caps.max_tokens:,}" if caps.max_tokens is not None else "")
            + f" (+{self.reserved_tokens:,} reserved)",
            f"in flight {self.in_flight}" + (f" of {caps.concurrency}" if caps.concurrency is not None else ""),
        ]
        parts += [f"{name} {value}" for name, value in (("rpm", caps.rpm), ("tpm", caps.tpm)) if value is not None]
        parts.append(f"waiting {self.waiting}")
        return f"{self.name}: " + ", ".join(parts)

    def to_json(self) -> dict[str, Any]:
        caps = self.caps
        return {
            "name": self.name,
            "max_cost": caps.max_cost,
            "max_tokens": caps.max_tokens,
            "concurrency": caps.concurrency,
            "rpm": caps.rpm,
            "tpm": caps.tpm,
            "spent": {"cost_usd": self.spent_cost, "tokens": self.spent_tokens},
            "reserved": {"cost_usd": self.reserved_cost, "tokens": self.reserved_tokens},
            "in_flight": self.in_flight,
            "paused_until": self.paused_until or None,
            "waiting": self.waiting,
        }


def _money(value: float) -> str:
    return f"${value:,.4f}"


def _malformed(name: object, what: str) -> CheckpointError:
    return CheckpointError(f"pool {name}: its row is malformed ({what}): refusing to draw from it")


def _cost(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UsageError(f"max_cost {value!r} is not a number")
    return float(value)


def _count(value: Any) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise UsageError(f"{value!r} is not a whole number")


@dataclass(frozen=True)
class Hold:
    """What one call in flight reserves: its worst case, held until it settles or its lease expires."""

    pool: str
    key: str  # the call's idempotency key (run id / call key): one hold per call
    run: str  # the run name, for who waits and who holds
    cost: float
    tokens: int
    expires: float  # epoch seconds: a lease not settled by then is charged in full
