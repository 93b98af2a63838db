"""A run level's trace: the steps sealed into segments a store keeps, then the steps since.

A long run's trace is most of what it writes. A checkpoint keeps it as
immutable segments named by their sha256 (`mklang.checkpoint.segments`,
ADR 0040) and records only their names and step counts, so a resume knows
how many steps a level has made without reading a single one. `Trace` is
that view: its length and `append` never read a segment; iterating,
indexing or comparing it reads the segments it needs once (`read`, which
checks each one) and keeps them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple, overload

from mklang.engine.records import TraceStep


class Segment(NamedTuple):
    """A sealed run of trace steps: the sha256 of its bytes in the store, and how many steps it holds."""

    name: str
    steps: int


SegmentReader = Callable[[Segment], list[TraceStep]]


def _unreadable(segment: Segment) -> list[TraceStep]:
    raise LookupError(f"trace segment {segment.name} has no store to read it from")


class Trace(Sequence[TraceStep]):
    """The steps of one level in order: sealed segments (read when first needed), then the tail.

    `tail` (the steps after the last sealed segment, the list itself) and `sealed_steps` (how
    many steps the segments hold) are attributes, not properties: the engine reads its length
    and appends to its tail every step, without a call into Python."""

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by its steps

    def __init__(
        self, steps: Iterable[TraceStep] = (), segments: Iterable[Segment] = (), read: SegmentReader | None = None
    ):
        self._sealed: list[tuple[Segment, list[TraceStep] | None]] = [(segment, None) for segment in segments]
        self.sealed_steps = sum(segment.steps for segment, _ in self._sealed)
        self.tail: list[TraceStep] = list(steps)
        self._read = read or _unreadable

    @property
    def segments(self) -> list[Segment]:
        """The sealed segments, oldest first."""
        return [segment for segment, _ in self._sealed]

    def seal(self, segment: Segment) -> None:
        """The tail is now kept as `segment` (its steps stay in memory); a new tail starts."""
        assert segment.steps == len(self.tail), "a segment seals the whole tail"
        self._sealed.append((segment, self.tail))
        self.sealed_steps += segment.steps
        self.tail = []

    def append(self, step: TraceStep) -> None:
        self.tail.append(step)

    def extend(self, steps: Iterable[TraceStep]) -> None:
        self.tail.extend(steps)

    def __len__(self) -> int:
        return self.sealed_steps + len(self.tail)

    def _steps_of(self, index: int) -> list[TraceStep]:
        segment, steps = self._sealed[index]
        if steps is None:
            steps = self._read(segment)
            self._sealed[index] = (segment, steps)
        return steps

    def __iter__(self) -> Iterator[TraceStep]:
        for index in range(len(self._sealed)):
            yield from self._steps_of(index)
        yield from self.tail

    def last(self, count: int) -> list[TraceStep]:
        """The last `count` steps, reading only the segments they lie in."""
        found = self.tail[-count:] if count > 0 else []
        index = len(self._sealed)
        while len(found) < count and index > 0:
            index -= 1
            found = self._steps_of(index)[-(count - len(found)) :] + found
        return found

    @overload
    def __getitem__(self, index: int) -> TraceStep: ...

    @overload
    def __getitem__(self, index: slice) -> list[TraceStep]: ...

    def __getitem__(self, index: int | slice) -> TraceStep | list[TraceStep]:
        if isinstance(index, int) and -len(self.tail) <= index < 0:
            return self.tail[index]
        return list(self)[index]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Trace | list):
            return list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"Trace({list(self)!r})"
