"""The calls of one step: idempotency keys stable across a crash and a resume, and their spend.

A key is `<scope>:<step>.<part>.<n>`. The scope names the run level: `r` for
the root, the key prefix of the calling state plus `/` below it. The step is
the step's number in that level's trace. The part is `0` for the face's
calls, `<i>of<count>` for branch i (from 1) of a fan-out of `count` branches
(`providers.base.branch_part`), `g` for the judge's batches and `h` for the
hooks, numbered by gate. `n` counts the calls of the part. So a key names
the branch of every fan-out a call is made in.
"""

from __future__ import annotations

import threading

from mklang.providers.base import NO_SPEND, Usage


class Calls:
    """Hands out the idempotency keys of one step branch's model and tool calls, and
    tallies what the branch has cost so far: its calls, its sub-run, its kept fan-out
    branches. A branch's tally adds up into the step's (`sub`), so a level that stops
    mid-step knows what the step had paid without any signal carrying it. A part of a
    branch (`part`: its gates) keys its own calls but keeps no tally of its own: it pays
    into its branch's. A step's own calls (`next`) are its face's, part `0`, so the face
    is given the step's tally itself; `stem` is what its keys (and a sub-run's scope)
    start with."""

    __slots__ = ("_lock", "count", "paid", "parent", "payee", "prefix", "stem")

    def __init__(self, prefix: str, parent: Calls | None = None, *, tallies: bool = True):
        self.prefix = prefix
        self.stem = prefix if parent is not None else f"{prefix}.0"  # a step's own calls are its face's
        self.count = 0
        self.paid: Usage = NO_SPEND
        self.parent = parent
        self.payee: Calls | None = self if tallies else parent  # the first tally `pay` adds to
        self._lock: threading.Lock = parent._lock if parent is not None else threading.Lock()

    def next(self) -> str:
        self.count += 1
        return f"{self.stem}.{self.count}"

    def sub(self, name: str) -> Calls:
        """The calls of a fan-out branch of this step, with a tally of their own."""
        return Calls(f"{self.prefix}.{name}", self)

    def part(self, name: str) -> Calls:
        """The calls of a part of this branch (its gates), paid into its tally."""
        return Calls(f"{self.prefix}.{name}", self, tallies=False)

    def pay(self, usage: Usage) -> None:
        """Add `usage` to this branch's tally and to those it adds up into (fan-out branches pay
        from threads of their own)."""
        with self._lock:
            calls = self.payee
            while calls is not None:
                calls.paid = usage if calls.paid is NO_SPEND else calls.paid + usage  # no call for a first spend
                calls = calls.parent
