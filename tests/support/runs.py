"""Machines and comparisons shared by the tests of runs."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conformance.harness import write_machines

import mklang.syntax
import mklang.syntax.yaml_front
from mklang.engine import RunResult
from mklang.engine.decisions import steady as steady
from mklang.engine.events import Event, StateEntered
from mklang.model import Machine
from mklang.runs import start
from mklang.scenarios import Scenario
from mklang.session import Host

# A machine that calls `child`, whose gate asks a hook the host must supply: what preflight checks
# in the machines a run calls.
CALLS_CHILD = """\
machine parent
entry ask
budget 5

state ask {
  call child
  output answer
  otherwise -> END
}
"""
HOOKED_CHILD = """\
machine child
entry think
budget 3

hook plausible "True when the answer is plausible."

state think {
  structure "One line."
  prompt "Think."
  output thought
  when "always" hook plausible -> END
  otherwise -> END
}
"""


# Two generative states in a row: a then b then END.
TWO_STATES = """
    machine m
    entry a
    budget 5
    state a {
      structure "s"
      prompt "p"
      output x
      otherwise -> b
    }
    state b {
      structure "s"
      prompt "p"
      output y
      otherwise -> END
    }
"""


# Two generative states whose first one's gate is judged: a ("first") then, if "good", b ("second")
# then END; otherwise the run fails at a.
JUDGED_TWO_STATES = """
    machine m
    entry a
    budget 5
    state a {
      structure "s"
      prompt "first"
      output x
      when "good" -> b
      otherwise fail
    }
    state b {
      structure "s"
      prompt "second"
      output y
      otherwise -> END
    }
"""

# A machine `child` of two generative states, a then b then END, that both output o; its step
# budget is formatted in.
CHILD = """
    machine child
    entry a
    budget {budget}
    state a {{
      structure "s"
      prompt "a"
      output o
      otherwise -> b
    }}
    state b {{
      structure "s"
      prompt "b"
      output o
      otherwise -> END
    }}
"""

# A project: root.mk, whose state b calls sub.mk (two states) with the x root.mk produced.
ROOT_MK = """
    machine root
    entry a
    budget {budget}
    context {{ topic: "tides" }}
    state a {{
      structure "s"
      prompt "p {{{{topic}}}}"
      output x
      otherwise -> b
    }}
    state b {{
      call sub {{ q: "{{{{x}}}}" }}
      output y
      otherwise -> END
    }}
"""

SUB_MK = """
    machine sub
    entry s1
    budget {budget}
    context { q: "" }
    state s1 {
      structure "s"
      prompt "{{q}}"
      output z
      otherwise -> s2
    }
    state s2 {
      structure "s"
      prompt "again {{z}}"
      output w
      otherwise -> END
    }
"""


def project(folder: Path, root_budget: int = 1, sub_budget: int = 3) -> Machine:
    """root.mk and sub.mk in `folder`; root.mk loaded."""
    folder.mkdir(parents=True, exist_ok=True)
    return write_machines(folder, ROOT_MK.format(budget=root_budget), SUB_MK.replace("{budget}", str(sub_budget)))


def run_scenario(machine: Machine, scenario: Scenario, host: Host | None = None, **options: Any) -> RunResult:
    """The first part of a scenario, run in memory through the run service as `mklang.run` would;
    `host` replaces the scenario's own (to count its calls), `options` go to `runs.start`."""
    with host or Host.for_scenario(scenario) as used:
        return start(machine, {}, used, suspendable=scenario.durable, **options)


def outcome(result: Any, fields: tuple[str, ...] = ("status", "result", "context", "trace", "usage")) -> dict[str, Any]:
    """The comparable, JSON-shaped part of a `RunResult`."""
    data = result.to_json()
    return json.loads(json.dumps({key: data[key] for key in fields}))


# What a resumed run must share with the uninterrupted one.
RESUMED_LIKE = ("status", "error", "at", "result", "context", "trace", "usage")


def compared(result: Any) -> dict[str, Any]:
    """The fields of `result` a resumed run must share with the uninterrupted one."""
    return outcome(result, RESUMED_LIKE)


class LoopTops:
    """An event sink that calls `act(event)` at each loop-top outside fan-out branches: each
    `state.entered` there, emitted just after the journal recorded the loop-top (a crash
    raised from `act` leaves the checkpoint as a crash at that loop-top would)."""

    def __init__(self, act: Callable[[StateEntered], Any]):
        self.act = act

    def emit(self, event: Event) -> None:
        if isinstance(event, StateEntered) and not event.in_branch:
            self.act(event)


class InterruptAt(LoopTops):
    """An event sink that requests an interrupt at the n-th loop-top it sees."""

    def __init__(self, control: Any, n: int):
        super().__init__(self.count)
        self.control, self.n, self.seen = control, n, 0

    def count(self, event: StateEntered) -> None:
        self.seen += 1
        if self.seen == self.n:
            self.control.interrupted.set()


@pytest.fixture
def machines_parsed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Within a test, each machine text is parsed once: a test that starts and resumes a run hundreds
    of times loads the same files at each resume, and a third of its CPU went to parsing them
    again. Reading each file, hashing it, building the run's machine tree and checking it still
    happen at every load; a text that does not parse raises each time (nothing is remembered)."""
    monkeypatch.setattr(mklang.syntax, "parse", functools.cache(mklang.syntax.parse))
    monkeypatch.setattr(mklang.syntax.yaml_front, "parse_yaml", functools.cache(mklang.syntax.yaml_front.parse_yaml))
