"""What a step costs the engine, counted in Python calls: a count does not move with the machine's
load as a timing does, so a step that grows shows here, in CI, when it grows (bench/step.py times it).

The count is the difference between a 200-step and a 100-step run of a one-state loop, over 100:
the start and end of a run cancel out (the least of three such counts, rounded). It is made in a
fresh interpreter: in the suite's worker, what an earlier test left behind (a hook, a cached
registry, garbage) would be counted with the step, one call more or less depending on the order. The ceilings are the counts measured; a change that adds
calls to a step either earns them (raise the ceiling, say why in the commit) or finds them again.
"""

from __future__ import annotations

import gc
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from mklang.engine import events, run
from mklang.providers.base import NONE, Produced, Usage, Verdict
from mklang.syntax import parse

# Python calls a step makes, counted on CPython 3.11 (3.12 inlines comprehensions: fewer).
PLAIN_CEILING = 30
JUDGED_CEILING = 54
OBSERVED_PLAIN_CEILING = 53
GATES = {"plain": "otherwise -> s", "judged": 'when "it is done" -> END\n  otherwise -> s'}


class Instant:
    """Answers at once: "ok", and the judge picks none of its conditions (`otherwise`)."""

    def produce(self, system: str, user: str, tier: str, reason: bool) -> Produced:
        return Produced("ok", None, Usage(10, 2))

    def judge(self, conditions: list[str], output: Any, reasoning: str | None, context: Any, tier: str) -> Verdict:
        return Verdict(NONE, Usage(10, 1))


class Kept:
    """An observer that keeps the events it is told of."""

    def __init__(self) -> None:
        self.events: list[events.Event] = []

    def emit(self, event: events.Event) -> None:
        self.events.append(event)


def counted(work: Callable[[], object], count: Callable[[FrameType], bool]) -> int:
    """How many Python calls `work` makes in this thread for which `count(frame)` holds."""
    calls = 0

    def profile(frame: FrameType, event: str, arg: object) -> None:
        nonlocal calls
        if event == "call" and count(frame):
            calls += 1

    gc.collect()  # garbage an earlier test left (a connection's `__del__`) is not this work's calls
    gc.disable()
    sys.setprofile(profile)
    try:
        work()
    finally:
        sys.setprofile(None)
        gc.enable()
    return calls


def per_step(gate: str, count: Callable[[FrameType], bool], observed: bool = False) -> int:
    """The calls one more step of a loop with `gate` makes, counted by `count`: the least of three
    counts, rounded, as a few calls now and then are not the step's (a garbage collector's callback)."""
    return round(min(marginal(gate, count, observed) for _ in range(3)))


def marginal(gate: str, count: Callable[[FrameType], bool], observed: bool) -> float:
    """The calls of a 200-step run less those of a 100-step one, over 100."""
    totals = []
    for steps in (100, 200):
        machine = parse(
            f'machine loop\nentry s\nbudget {steps}\nstate s {{\n  structure "a word"\n  prompt "go"\n  output o\n  {gate}\n}}\n'
        )

        def once(machine: Any = machine, steps: int = steps) -> None:
            result = run(machine, provider=Instant(), observer=Kept() if observed else None)
            assert len(result.trace) == steps, result.error

        totals.append(counted(once, count))
    return (totals[1] - totals[0]) / 100


def every_call(frame: FrameType) -> bool:
    return True


def an_event_made(frame: FrameType) -> bool:
    return frame.f_code.co_name == "__init__" and isinstance(frame.f_locals.get("self"), events.Event)


def fresh(kind: str, count: str, observed: bool = False) -> int:
    """`per_step` of the loop `kind`, counting with the function named `count`, in a new interpreter."""
    here = Path(__file__).parent
    code = (
        f"import sys; sys.path.insert(0, {str(here)!r}); import {Path(__file__).stem} as t; "
        f"print(t.per_step(t.GATES[{kind!r}], t.{count}, {observed}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


@pytest.mark.parametrize(("kind", "ceiling"), [("plain", PLAIN_CEILING), ("judged", JUDGED_CEILING)])
def test_a_step_makes_no_more_python_calls_than_it_did(kind: str, ceiling: int) -> None:
    calls = fresh(kind, "every_call")
    assert calls <= ceiling, f"a {kind} step makes {calls} Python calls, more than the {ceiling} it made"


def test_an_observed_step_makes_no_more_python_calls_than_it_did() -> None:
    calls = fresh("plain", "every_call", observed=True)
    assert calls <= OBSERVED_PLAIN_CEILING, f"an observed step makes {calls} Python calls"


@pytest.mark.parametrize("kind", ["plain", "judged"])
def test_no_event_is_made_when_nothing_observes_the_run(kind: str) -> None:
    assert fresh(kind, "an_event_made") == 0
    assert fresh(kind, "an_event_made", observed=True) == (4 if kind == "plain" else 6)
