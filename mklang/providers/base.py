"""The provider protocol of SPEC section 5 and the values it returns.

Plain dataclasses, not pydantic: they are created on every model call in the
engine's hot loop. They are frozen, but their `__init__` fills the instance's dict
itself: the one a frozen dataclass is given calls `object.__setattr__` for each
field, which makes a `Usage` cost about three times a plain object (ADR 0056).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol, TypeVar, overload

MAX_RECORDED_TOKENS = 10**15  # tokens in any spend a file records: far above any run's
MAX_RECORDED_COST = 1e12  # dollars, likewise
_T = TypeVar("_T")
NONE: Final = "none"  # the judge's "none of the above"
UNPARSEABLE: Final = "unparseable"  # the judge's answer could not be read


@dataclass(frozen=True, init=False)
class Usage:
    """Tokens (and dollars, when the model has a price) spent by one or more calls."""

    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0

    def __init__(self, input_tokens: int = 0, output_tokens: int = 0, cost_usd: float = 0.0):
        kept = self.__dict__
        kept["input_tokens"], kept["output_tokens"], kept["cost_usd"] = input_tokens, output_tokens, cost_usd

    def __add__(self, other: Usage) -> Usage:
        # Nothing spent plus a spend is that spend (a value: it is shared, not copied).
        if self is NO_SPEND:
            return other
        if other is NO_SPEND:
            return self
        return Usage(
            self.input_tokens + other.input_tokens,
            self.output_tokens + other.output_tokens,
            self.cost_usd + other.cost_usd,
        )

    @property
    def tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def to_json(self) -> dict[str, Any]:
        return {
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cost_usd": self.cost_usd,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> Usage:
        """Spend as a file records it; `ValueError` unless every number is finite and from 0 to
        the limits of `mklang.limits` (a file's spend decides when budgets stop a run)."""
        data = data or {}
        tokens = [data.get(key, 0) for key in ("input_tokens", "output_tokens")]
        cost = data.get("cost_usd", 0.0)
        for name, value in zip(("input_tokens", "output_tokens"), tokens, strict=True):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_RECORDED_TOKENS:
                raise ValueError(f"usage {name} is {value!r}, not a count from 0 to {MAX_RECORDED_TOKENS:,}")
        if isinstance(cost, bool) or not isinstance(cost, int | float) or not 0 <= cost <= MAX_RECORDED_COST:
            raise ValueError(f"usage cost_usd is {cost!r}, not an amount from 0 to {MAX_RECORDED_COST:,.0f}")
        return cls(tokens[0], tokens[1], float(cost))


NO_SPEND: Final = Usage()  # the spend of nothing, shared: a tally starts at it every step


@dataclass(frozen=True, init=False)
class Produced:
    """What `produce` returns: the answer, the private reasoning, the spend."""

    text: str
    reasoning: str | None
    usage: Usage

    def __init__(self, text: str, reasoning: str | None, usage: Usage):
        kept = self.__dict__
        kept["text"], kept["reasoning"], kept["usage"] = text, reasoning, usage


Choice = int | Literal["none", "unparseable"]


@dataclass(frozen=True, init=False)
class Verdict:
    """What `judge` returns: a 0-based index into the batch, NONE or UNPARSEABLE.

    `parsed_by` says how the answer was read (`strict`, `bare`, `last`), for the trace.
    """

    choice: Choice
    usage: Usage
    parsed_by: str | None = None

    def __init__(self, choice: Choice, usage: Usage, parsed_by: str | None = None):
        kept = self.__dict__
        kept["choice"], kept["usage"], kept["parsed_by"] = choice, usage, parsed_by


class Provider(Protocol):
    """Answers the two kinds of model call the engine makes.

    Both methods must be safe to call from several threads at once (fan-out
    branches run concurrently). Failures raise `mklang.errors.ProviderError`.
    """

    def produce(self, system: str, user: str, tier: str, reason: bool) -> Produced: ...

    def judge(
        self,
        conditions: list[str],
        output: Any,
        reasoning: str | None,
        context: dict[str, Any],
        tier: str,
    ) -> Verdict: ...


# The run's wall-clock deadline, for the calls made while it is set. The engine
# sets it around every provider call (in whichever thread makes it), so an
# HTTP client can shorten its timeouts and give up retrying when `--max-time`
# would pass, instead of waiting out a full timeout on a hanging server.
_deadline: ContextVar[float | None] = ContextVar("mklang_deadline", default=None)


class _Bound:
    """Each variable holds its value inside, and what it held before after. A class rather
    than a generator `contextmanager`: the engine enters one around every call."""

    __slots__ = ("_bindings", "_tokens")

    def __init__(self, *bindings: tuple[ContextVar[Any], Any]):
        self._bindings = bindings
        self._tokens: list[Token[Any]] = []

    def __enter__(self) -> None:
        for variable, value in self._bindings:
            self._tokens.append(variable.set(value))

    def __exit__(self, *_: object) -> None:
        for variable, _value in reversed(self._bindings):
            variable.reset(self._tokens.pop())


def deadline(when: float | None) -> AbstractContextManager[None]:
    """Calls inside must finish by `when`, a `time.monotonic()` value (None: no deadline)."""
    return _Bound((_deadline, when))


def seconds_left() -> float | None:
    """Seconds until the current deadline (negative once passed), or None without one."""
    when = _deadline.get()
    return None if when is None else when - time.monotonic()


# The idempotency key of the model, tool or hook call in flight, `<run id>/<key>`
# (`mklang.engine.keys`): the engine sets it around every call, in whichever thread makes
# it, so a host can tell calls apart by it (a scripted host answers a fan-out's branches
# by the branch the key names). A tool declaring `idempotency_key` is given the same key.
_call_key: ContextVar[str | None] = ContextVar("mklang_call_key", default=None)
# The branch part of a key: branch i (from 1) of a fan-out of n branches, `<i>of<n>`.
_BRANCH = re.compile(r"\.(\d+)of(\d+)(?=[./]|$)")
_LAST_BRANCH = re.compile(r".*\.(\d+)of(\d+)(?=[./]|$)", re.S)  # the innermost: `.*` takes all it can


def calling(key: str) -> AbstractContextManager[None]:
    """The calls inside are the one call whose idempotency key is `key`."""
    return _Bound((_call_key, key))


# Where the answer of the produce call in flight goes as it arrives, when an observer of the run
# asks for it (`events.wants_deltas`): called with each piece of text and the length of the
# answer before it (0 again when a retried call streams its answer anew). Set by the engine
# around that call only; a provider that can stream reads it (`delta_consumer`) and, with
# none, asks for its answer whole (ADR 0060).
Deltas = Callable[[int, str], None]
_deltas: ContextVar[Deltas | None] = ContextVar("mklang_deltas", default=None)


def make_call(key: str, when: float | None, deltas: Deltas | None, live: Callable[[], _T]) -> _T:
    """`live()` as the one call whose idempotency key is `key`, to finish by `when`: the engine's
    every model and tool call. `deltas`, when given, consumes the answer as it is streamed. The
    variables are set here rather than by entering `calling` and `deadline`: the engine makes
    this call every step."""
    when_set, key_set = _deadline.set(when), _call_key.set(key)
    deltas_set = _deltas.set(deltas) if deltas is not None else None
    try:
        return live()
    finally:
        if deltas_set is not None:
            _deltas.reset(deltas_set)
        _call_key.reset(key_set)
        _deadline.reset(when_set)


def delta_consumer() -> Deltas | None:
    """What consumes the answer of the call in flight as it arrives, or None: nothing does."""
    return _deltas.get()


_throttle: ContextVar[Callable[[float], None] | None] = ContextVar("mklang_throttle", default=None)


def throttling(told: Callable[[float], None]) -> AbstractContextManager[None]:
    """While entered, a server's request to wait (a 429's `Retry-After`) is told to `told` (its seconds),
    so every run sharing a budget pool waits with the one the server slowed (ADR 0067)."""
    return _Bound((_throttle, told))


def throttled(seconds: float) -> None:
    """A server asked the call in flight to wait `seconds` before trying again."""
    told = _throttle.get()
    if told is not None:
        told(seconds)


def call_key() -> str | None:
    """The idempotency key of the call in flight, or None outside a call."""
    return _call_key.get()


def branch_part(index: int, count: int) -> str:
    """The part of a key that names branch `index` (from 0) of a fan-out of `count` branches:
    a key names its branch and how many branches share it."""
    return f"{index + 1}of{count}"


def branch_of(key: str) -> tuple[str, int, int] | None:
    """The innermost fan-out a call key lies in: (the fan-out's step prefix, the branch index
    from 0, the number of branches), or None for a call made outside every fan-out."""
    found = _LAST_BRANCH.match(key)
    if found is None:
        return None
    return key[: found.start(1) - 1], int(found.group(1)) - 1, int(found.group(2))


def earlier_key(key: str) -> str:
    """`key` as mklang wrote it before keys named a fan-out's branch count (`r:3.2.1` for
    `r:3.2of4.1`): the journals and checkpoints of runs it left unfinished hold such keys."""
    return _BRANCH.sub(lambda found: f".{found.group(1)}", key)


def encode_answer(kind: str, value: Any) -> Any:
    """A provider or tool answer as JSON data: the one codec of journals and cassettes."""
    if kind == "produce":
        return {"text": value.text, "reasoning": value.reasoning, "usage": value.usage.to_json()}
    if kind == "judge":
        return {"choice": value.choice, "parsed_by": value.parsed_by, "usage": value.usage.to_json()}
    return value


@overload
def decode_answer(kind: Literal["produce"], data: Any) -> Produced: ...
@overload
def decode_answer(kind: Literal["judge"], data: Any) -> Verdict: ...
@overload
def decode_answer(kind: str, data: Any) -> Any: ...
def decode_answer(kind: str, data: Any) -> Any:
    """The answer `encode_answer` wrote: `Produced`, `Verdict`, or a tool's text as is."""
    if kind == "produce":
        return Produced(data["text"], data.get("reasoning"), Usage.from_json(data.get("usage")))
    if kind == "judge":
        return Verdict(data["choice"], Usage.from_json(data.get("usage")), data.get("parsed_by"))
    return data
