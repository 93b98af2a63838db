"""The loop-top state of one run level, and the one rule that advances it.

A `Frame` is everything a run level keeps between states (SPEC section 7:
machine, state, context, steps, token totals, feedback, repair budgets,
visits, taint, trace), control-flow taint included: the keys holding data from
outside the run (`external`) and whether a judge reading such data chose the
transitions since the last confirmation (`decision_tainted`). `Frame.apply` is the only code that moves a frame from
one loop-top to the next, from a step record; the live engine and crash
recovery both go through it, so a replayed journal cannot drift from a run.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mklang.engine import decisions
from mklang.engine.interpolate import assign
from mklang.engine.records import HumanAsk, StepRecord, TraceStep
from mklang.engine.trace import Segment, SegmentReader, Trace
from mklang.model import Machine, State
from mklang.providers.base import Usage
from mklang.vocabulary import lookup, root_key


def step_output(step: TraceStep) -> Any:
    """The value a trace step deposited: its output, or the list of branch outputs."""
    if "branches" in step:
        return [branch["output"] for branch in step["branches"]]
    return step.get("output")


def deposit_into(context: dict[str, Any], state: State, value: Any, *, copy_maps: bool = False) -> list[Any] | None:
    """Write `state`'s output `value` into `context` (SPEC: `output`, `accumulate`).

    An accumulating deposit onto a list appends in place (a long run must not
    copy its list every step) and returns that list; any other deposit
    returns None. `copy_maps` copies the maps on the output's path instead of
    writing into them (see `assign`).
    """
    key = state.output
    if state.accumulate:
        current = lookup(context, key)
        if isinstance(current, list):
            current.append(value)
            return current
        value = [value] if current is None else [current, value]
    assign(context, key, value, copy_maps=copy_maps)
    return None


def repair_budgets(machine: Machine) -> dict[tuple[str, int], int]:
    """The repairs each repair gate of `machine` allows, by (state, gate index): a fresh level's `repair_left`."""
    return {
        (state.name, index): gate.repair or 0
        for state in machine.states
        for index, gate in enumerate(state.gates)
        if gate.policy == "repair"
    }


@dataclass
class Frame:
    machine: Machine
    state: str
    context: dict[str, Any]
    tainted: set[str]
    budget: int
    steps: int = 0
    usage: Usage = field(default_factory=Usage)
    feedback: str | None = None
    repair_left: dict[tuple[str, int], int] = field(default_factory=dict)
    visits: dict[str, int] = field(default_factory=dict)
    trace: Trace = field(default_factory=Trace)
    last_output: Any = None
    # Finished branches of the fan-out a budget cut short at this loop-top, by index:
    # resume launches only the others (SPEC section 4, "Budgets across fan-out").
    branches: dict[int, dict[str, Any]] = field(default_factory=dict)
    # How the level ended, kept in the frame so that a recovered run completes it
    # instead of running its last state again: the halt, or the human question it waits on.
    halted: str | None = None
    ask: HumanAsk | None = None  # the question a HITL escalation waits on
    # Control-flow taint (SPEC section 4): top-level keys holding data from outside the
    # run (a subset of `tainted`), and whether a judge reading such data chose the way
    # here since the last hook or human reply confirmed it.
    external: set[str] = field(default_factory=set)
    decision_tainted: bool = False

    @property
    def spent(self) -> Usage:
        """What this level has paid for: its steps, plus the kept branches of a cut fan-out."""
        return sum((Usage.from_json(branch["usage"]) for branch in self.branches.values()), self.usage)

    @classmethod
    def start(
        cls,
        machine: Machine,
        inputs: dict[str, Any] | None = None,
        tainted: set[str] | None = None,
        external: set[str] | None = None,
        decision_tainted: bool = False,
    ) -> Frame:
        """A fresh run: the machine's context defaults overlaid with `inputs`.

        `inputs` maps dotted paths (or top-level keys) to values; by default
        every input is tainted and external (host inputs). A sub-run passes
        which inputs are, and its caller's tainted decision.
        """
        given = {root_key(p) for p in inputs or {}}
        context = copy.deepcopy(machine.context)
        for path, value in (inputs or {}).items():
            assign(context, path, value)
        return cls(
            machine=machine,
            state=machine.entry,
            context=context,
            tainted=set(tainted if tainted is not None else given),
            budget=machine.budget,
            repair_left=repair_budgets(machine),
            external=set(external if external is not None else given),
            decision_tainted=decision_tainted,
        )

    def apply(self, state: State, record: StepRecord, usage: Usage | None = None) -> None:
        """Advance from this loop-top past `state`, as the step `record` says. `usage` is the
        step's spend when the caller holds it (the live engine, which recorded it); else it is
        read from the record, as a journal line holds it, and checked."""
        step = record["step"]
        name = state.name
        self.visits[name] = self.visits.get(name, 0) + 1
        self.steps += record["charge"]
        self.usage = self.usage + (usage if usage is not None else Usage.from_json(step["usage"]))
        if "output" in step or "branches" in step:  # the output joins the context, tainted (SPEC section 4)
            value = step_output(step) if "branches" in step else step["output"]
            deposit_into(self.context, state, value)
            key = state.output_key
            self.tainted.add(key)
            if record.get("external", True):
                self.external.add(key)
            self.last_output = value
        if step.get("decision_tainted"):
            self.decision_tainted = True
        elif step.get("gate_via") == "hook":  # trusted code chose this transition
            self.decision_tainted = False
        repaired = record.get("repair")
        if repaired is not None:
            self.repair_left[(name, repaired)] -= 1
        self.feedback = record.get("feedback")
        if self.branches:
            self.branches = {}
        asked = record.get("ask")
        if asked is not None and "choices" in asked:  # a human decision: the step waits for it
            self.ask = decisions.parked(asked, step, self.context)
            return
        self.trace.tail.append(step)
        target = step.get("to")
        if target is not None:
            self.state = target
        self.halted = record.get("halt")
        self.ask = record.get("ask")

    def decide(self, decision: decisions.Decision) -> None:
        """Apply a decision to the question this level waits on (`decisions.refusal` allowed
        it): the step that asked takes the chosen transition, or the deadline's, and the
        answer is set at the question's `reply_to`. A human's choice confirms the way (it
        clears a tainted decision, as a hook does); their note is untrusted data."""
        asked = self.ask
        assert asked is not None and decisions.is_decision(asked), "a decision answers a pending question"
        gate = decisions.asking_gate(self.machine, self.state, asked)
        assert gate is not None, "a decision allowed answers a decision of the frame's machine"
        target = decisions.target(gate, decision)
        step: TraceStep = {**asked["step"], "to": target, "decision": decisions.recorded(decision, asked)}
        if decision.get("by") == "human":
            step.pop("decision_tainted", None)
            self.decision_tainted = False
        reply_to = str(asked["reply_to"])
        assign(self.context, reply_to, decisions.reply(decision))
        if decision.get("note") is not None:
            self.tainted.add(root_key(reply_to))
            self.external.add(root_key(reply_to))
        self.ask = None
        if target is None:
            step["policy"] = "fail"
            self.halted = "gate-fail"
        else:
            self.state = target
        self.trace.append(step)

    def stop(self, error: str, usage: Usage) -> None:
        """End the level with a halt that came before its step in flight was made;
        `usage` is what that step had already paid for."""
        self.usage = self.usage + usage
        self.halted = error

    def inject(self, path: str, value: Any) -> None:
        """A value set on resume: host data, tainted and external. Setting the `reply_to`
        of the question the level waits on (or a path above it) answers it, and a human
        answering that very question confirms the decision that led to it."""
        assign(self.context, path, value)
        key = root_key(path)
        self.tainted.add(key)
        self.external.add(key)
        if self.ask is None or decisions.is_decision(self.ask):  # a decision is answered, never set
            return
        pending = str(self.ask.get("reply_to"))
        if pending == path or pending.startswith(path + "."):
            self.ask = None
            self.decision_tainted = False

    def result(self) -> Any:
        """SPEC: `context[result]` when the machine names one, else the last deposit."""
        if self.machine.result:
            return lookup(self.context, self.machine.result)
        return self.last_output

    # --- serialization (checkpoint envelopes and journals) ---------------

    def to_json(self, trace: dict[str, Any] | None = None) -> dict[str, Any]:
        """The frame as JSON data, its whole trace as a list; or, given `trace`, those fields in its
        place (a checkpoint's sealed segments and tail, `mklang.checkpoint.segments`), in field order."""
        return {
            "machine": self.machine.name,
            "path": self.machine.path,
            "state": self.state,
            "context": self.context,
            "tainted": sorted(self.tainted),
            "steps": self.steps,
            "budget": self.budget,
            "usage": self.usage.to_json(),
            "feedback": self.feedback,
            "repair_left": [(s, i, n) for (s, i), n in sorted(self.repair_left.items())],
            "visits": dict(sorted(self.visits.items())),
            **(trace if trace is not None else {"trace": list(self.trace)}),
            "last_output": self.last_output,
            "halted": self.halted,
            "ask": self.ask,
            "external": sorted(self.external),
            "decision_tainted": self.decision_tainted,
            **(
                {"branches": [(index, branch) for index, branch in sorted(self.branches.items())]}
                if self.branches
                else {}
            ),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], machine: Machine, read: SegmentReader | None = None) -> Frame:
        """The frame `data` records, running `machine`; `read` reads the trace segments it names."""
        segments = [Segment(str(name), int(steps)) for name, steps in data.get("segments", [])]
        return cls(
            machine=machine,
            state=data["state"],
            context=data["context"],
            tainted=set(data.get("tainted", [])),
            budget=int(data["budget"]),
            steps=int(data["steps"]),
            usage=Usage.from_json(data.get("usage")),
            feedback=data.get("feedback"),
            repair_left={(s, int(i)): int(n) for s, i, n in data.get("repair_left", [])},
            visits={k: int(v) for k, v in data.get("visits", {}).items()},
            trace=Trace(data.get("trace", []), segments, read),
            last_output=data.get("last_output"),
            halted=data.get("halted"),
            ask=data.get("ask"),
            branches={int(index): branch for index, branch in data.get("branches", [])},
            # A frame written before control-flow taint was recorded resumes as if every
            # key came from outside and a judge had chosen the way (conservative).
            external=set(data["external"] if "external" in data else [*data["context"], *data.get("tainted", [])]),
            decision_tainted=bool(data.get("decision_tainted", True)),
        )
