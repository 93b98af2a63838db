"""When a store wrote a run: what a listing of runs sorts and pages by, without reading envelopes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stamp:
    """When a store wrote a run's envelope first and last, in seconds since the epoch (0: before stores
    kept the time); `started` is None where the store cannot tell (the file store)."""

    run: str
    started: float | None
    updated: float
