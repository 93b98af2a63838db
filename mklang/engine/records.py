"""The shapes of what a run writes down: trace steps (SPEC section 6) and the
step records `Frame.apply` advances a frame by (journaled as they are).

TypedDicts, so at run time they are the plain dicts that go to JSON unchanged.
"""

from __future__ import annotations

from typing import Any, Required, TypedDict


class StepDetails(TypedDict, total=False):
    """What a step holds besides where it went: its output and how the gate was chosen."""

    output: Any
    branches: list[dict[str, Any]]  # a fan-out: each branch's output, usage and extras, in input order
    reasoning: str
    sub_trace: list[TraceStep]  # a call: the sub-run's trace
    judge_fallback: bool
    judge_none: int
    judge_parse: str
    decision_tainted: bool  # a judge reading external data chose this transition
    decision: dict[str, Any]  # a human decision took this transition: question, choice, by, at
    untrusted_control_flow: bool  # a tainted decision reached this effectful tool state


class TraceStep(StepDetails, total=False):
    """One step of a trace; keys in this order: where it went, the details, the usage."""

    step: Required[int]
    state: Required[str]
    policy: Required[str]  # ok, repair, escalate, or the halt that ends the run
    to: Required[str | None]
    gate: Required[str | None]
    gate_via: Required[str | None]
    usage: Required[dict[str, Any]]


class HumanAsk(TypedDict, total=False):
    """The question a HITL escalation suspends on, and where the reply goes; a human
    decision's (language 0.5, `mklang.engine.decisions`) also has the rest."""

    ask: Required[str | None]
    reply_to: Required[str | None]
    question: str  # its random id
    gate: int  # the index of the gate that asks it
    choices: list[str]  # the labels a human may answer with
    show: str | None  # the context path of what it approves
    digest: str | None  # the sha256 of that value as canonical JSON when it was asked
    asked_at: str  # ISO 8601, UTC
    deadline: str | None  # ISO 8601, UTC; None: it waits for ever
    step: TraceStep  # the step that asked it, completed by the decision


class StepRecord(TypedDict, total=False):
    """One `Frame.apply`: the trace step and what else the step changes in the frame."""

    step: Required[TraceStep]
    charge: Required[int]  # steps spent (a fan-out spends one per branch)
    feedback: Required[str | None]  # the repair feedback pending after the step
    gate: int | None  # the index of the gate that fired
    repair: int  # the repair gate whose budget the step spends
    halt: str | None  # the halt the step ends its level with
    ask: HumanAsk
    external: bool  # the step's output holds data from outside the run
