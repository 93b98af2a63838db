"""One exception root, one subclass per stage, and the diagnostic record.

Exceptions hold data only; `mklang.syntax.diagnostics` renders them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from mklang.providers.base import Usage

Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class Diagnostic:
    """One finding about a machine file, positioned at a 1-based line and column."""

    file: str | None
    line: int
    col: int
    end_line: int
    end_col: int
    severity: Severity
    code: str
    message: str

    def to_json(self) -> dict:
        return asdict(self)


class MklangError(Exception):
    """Root of every error mklang raises on purpose."""


class LoadError(MklangError):
    """A machine could not be loaded: it carries the diagnostics that say why."""

    def __init__(self, diagnostics: list[Diagnostic]):
        self.diagnostics = diagnostics
        first = diagnostics[0]
        super().__init__(f"{first.file}:{first.line}:{first.col}: {first.message}")


class MkSyntaxError(LoadError):
    """The text is not valid `.mk` (or YAML machine) syntax."""


class UsageError(MklangError):
    """The host asked for something that cannot be done (bad option, missing file)."""


class CheckpointError(MklangError):
    """A checkpoint cannot be read, verified or resumed."""


class RunBusy(CheckpointError):
    """Another process holds the run's lock: it is still going there."""


class JournalCut(CheckpointError):
    """A run's journal holds fewer bytes than its store counted as committed to it (ADR 0052):
    recovering from what is left would pay the lost lines' calls again. `journal` is what is left."""

    def __init__(self, where: str, journal: bytes, committed: int):
        super().__init__(
            f"{where}: the journal holds {len(journal)} bytes, fewer than the {committed} committed to it: it was "
            "cut short after the run stopped (a truncated copy, or lines removed); recovering from it would pay "
            "its calls again, so it is refused"
        )
        self.journal = journal


class DecisionRefused(CheckpointError):
    """An answer to a human decision (or its deadline) that may not apply: nothing was changed."""


class ProviderError(MklangError):
    """A model provider failed after its retries; the run halts `provider-error`.

    `usage` is what the failed call was still paid for (a server that answered
    with malformed token counts, or an empty answer): the run's spend includes it.
    """

    suspends_as = "provider-error"  # the reason a run that can suspend suspends with

    def __init__(self, message: str, usage: Usage | None = None):
        super().__init__(message)
        self.usage = usage


class CallWithheld(ProviderError):
    """A model call the run's host did not make (nothing was paid for it): the level ends for
    `suspends_as` as at a loop-top, suspending when it can; a fan-out branch stops, cutting the fan-out."""


class PoolExhausted(CallWithheld):
    """A model call's worst case does not fit in what is left of the run's budget pool: the call is
    not made, and the run suspends (`pool-exhausted`) until the pool is topped up."""

    suspends_as = "pool-exhausted"


class PoolWaitInterrupted(CallWithheld):
    """An interrupt came while a model call waited for room in its budget pool: the call is not made,
    and the run suspends `interrupted`, as it would at its next loop-top."""

    suspends_as = "interrupted"


def did_you_mean(name: str, known: Iterable[object]) -> str:
    """`; did you mean "x"?` for the closest of `known`, or nothing: every typo hint reads the same."""
    import difflib

    close = difflib.get_close_matches(name, [str(k) for k in known], n=1)
    return f'; did you mean "{close[0]}"?' if close else ""


def redacted(text: str) -> str:
    """`text` with the password of every URI in it hidden: `user:***@host`, `password=***`."""
    text = re.sub(r"(://[^/@\s:]*:)[^/@\s]*@", r"\1***@", text)
    return re.sub(r"((?:[?&]|%26)password(?:=|%3D))[^&#\s]*", r"\1***", text, flags=re.IGNORECASE)


def first_line(error: BaseException) -> str:
    """The first line of an error, as a run's reason: a URI in it keeps its password."""
    text = redacted(str(error)).strip()
    return text.splitlines()[0] if text else type(error).__name__
