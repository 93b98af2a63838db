"""A run to start or continue, as one frozen value: `RunRequest`, and the words its errors use.

Every surface (the command line, the Python API, the console, batches,
workers, the scenario player) says what it wants as a `RunRequest`: which
checkpoint to continue and the reply it gets, its budgets and policy, where
it persists, how its checkpoint is let through, and the host settings that
answer it. `hosting.build_host` makes the host from it, `resuming.resume`
continues it. What is handed to a run as it goes (the interrupt flag, the
observer of its events, a lock already held) is not part of the request.

A refusal names a setting as the caller gave it (`Words`): `--max-cost` on
the command line, `max_cost=` in Python. What the user should know as a run
is opened and continued goes to the caller's `Tell` (`on_stderr` unless it
says otherwise: the console, whose runs go on in its threads, keeps them).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple

from mklang.host.settings import BY_NAME, RUN_NAMES, given
from mklang.terminal import printable

if TYPE_CHECKING:
    from mklang.checkpoint.envelope import Envelope
    from mklang.engine.decisions import Decision
    from mklang.stores import Location

__all__ = ["FLAGS", "KEYWORDS", "RunRequest", "Tell", "Words", "on_stderr"]

Tell = Callable[[str], None]  # told one line the user should know of a run


def on_stderr(line: str) -> None:
    """Tell a line on stderr, as every mklang message starts."""
    print(f"mklang: {printable(line)}", file=sys.stderr)


class Words(NamedTuple):
    """How a caller names a setting: as a command-line flag (`--max-cost`, `--plugin`) or a keyword (`max_cost=`)."""

    flags: bool

    def __call__(self, name: str) -> str:
        if not self.flags:
            return f"{name}="
        setting = BY_NAME.get(name)
        return setting.option if setting is not None else "--" + name.replace("_", "-")

    def given(self, name: str, value: str | None = None) -> str:
        """A setting given, as the caller writes it: `--machine PATH` or `machine=PATH`; a switch
        (no `value`) `--force` or `force=True`."""
        if self.flags:
            return self(name) if value is None else f"{self(name)} {value}"
        return f"{name}={'True' if value is None else value}"

    @property
    def caller(self) -> str:
        """Where the caller gives its settings."""
        return "your command line" if self.flags else "your call"

    def listed(self, *names: str) -> str:
        """`--a, --b or --c`, as a refusal lists settings."""
        said = [self(name) for name in names]
        return said[0] if len(said) == 1 else f"{', '.join(said[:-1])} or {said[-1]}"


FLAGS = Words(flags=True)  # the command line's, and the default
KEYWORDS = Words(flags=False)  # the Python API's


def _hosting() -> Mapping[str, Any]:
    return MappingProxyType(given())


@dataclass(frozen=True, kw_only=True)
class RunRequest:
    """A run to start or continue, as its caller asks for it.

    `source`: the checkpoint to continue (a file, `STORE-URI#RUN`, a `Location`, or an `Envelope`
    first saved at `checkpoint`); `reply` the values set before it continues (`--set`), `decision`
    the answer to the human decision it waits on (`--answer`, or its deadline), `budget` a new step
    budget of its innermost level; `raised_by` the operator raising its budgets from outside the run
    (`console`), which the run records among its `actions`. The bounds (None: the checkpoint's, else
    the scenario's, else the default) are new totals for a continued run. `checkpoint` is where the
    run persists (default: where it was read from); `replace` lets it replace an unfinished run
    there. `force`, `machine_path`, `trust`, `allow_rollback` and `kept_texts` are how its
    checkpoint is let through (`opening.OpenOptions`). `hosting` holds the host settings chosen
    (`host.settings.given`, None: not chosen), `provider` a provider object the caller keeps,
    `tools` and `hooks` its callables; a dollar limit is given as `priced_for` (`max_cost`, or a
    batch's `batch_max_cost`). `words` is how the caller names settings, in what is refused.
    """

    source: str | Path | Location | Envelope | None = None
    reply: Mapping[str, Any] = field(default_factory=dict)
    decision: Decision | None = None
    budget: int | None = None
    raised_by: str | None = None
    max_tokens: int | None = None
    max_cost: float | None = None
    max_time: float | None = None
    concurrency: int | None = None
    hitl: bool | None = None
    untrusted_flow: str | None = None
    checkpoint: str | Path | Location | None = None
    replace: bool = False
    force: bool = False
    machine_path: str | None = None
    trust: bool = False
    allow_rollback: bool = False
    kept_texts: bool = False
    hosting: Mapping[str, Any] = field(default_factory=_hosting)
    provider: Any = None
    tools: Mapping[str, Callable[..., Any]] | None = None
    hooks: Mapping[str, Callable[..., Any]] | None = None
    priced_for: str = "max_cost"
    words: Words = FLAGS

    def __post_init__(self) -> None:
        object.__setattr__(self, "hosting", MappingProxyType(given(**self.hosting)))
        object.__setattr__(self, "reply", MappingProxyType(dict(self.reply)))

    def opening(self) -> dict[str, Any]:
        """How its checkpoint is let through, and how its refusals name that, as `opening.open_run` takes them."""
        return {
            "force": self.force,
            "machine_path": self.machine_path,
            "trust": self.trust,
            "allow_rollback": self.allow_rollback,
            "kept_texts": self.kept_texts,
            "words": self.words,
        }

    def bounds(self) -> dict[str, Any]:
        """Its budgets, calls in flight, human gates and untrusted-flow policy, by name (None: not given)."""
        return {name: getattr(self, name) for name in RUN_NAMES}
