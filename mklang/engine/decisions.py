"""Human decisions (SPEC section 8): the question a choice gate parks on, and what an answer
to it, or its deadline, may change.

A question is a record: a random id, the labels a human may answer with, the
sha256 of the value it `show`s (canonical JSON), when it was asked and its
deadline. It travels in the frame it parks (so under the envelope's
signature) together with the step that asked it, which the decision completes
(`Frame.decide`). `refusal` is the one rule that says whether a decision may
be applied to a frame; a refused one changes nothing. The run service checks
it with the run's lock held, after reading the run, so of two answers (or an
answer and a sweep) the one that locks first is the one that applies.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, Protocol, TypedDict

from mklang.engine.records import HumanAsk, TraceStep
from mklang.model import Gate, Machine
from mklang.vocabulary import lookup

DECISION_NEEDED = "human-decision-needed"  # the halt of a decision no human can answer (no checkpoint)
Decider = Literal["human", "deadline"]


class Decision(TypedDict, total=False):
    """What decides a question: a human's choice (and note), or its deadline passing."""

    question: str | None  # the id it answers; None: the question pending
    choice: str | None  # a label of the question; None when the deadline decides
    note: str | None  # free text from the human: untrusted data
    by: Decider
    at: str  # when it was decided (ISO 8601, UTC)
    digest: str | None  # the sha256 of the value the human was shown (the console's card); None: not given


@dataclass(frozen=True)
class Answer:
    """A human's answer to the decision a run waits on (`mklang.resume(cp, reply=Answer(...))`,
    `mklang resume --answer`): one of its choices, an optional note (untrusted data), and the
    question it answers (None: the one pending)."""

    choice: str
    note: str | None = None
    question: str | None = None

    def decision(self) -> Decision:
        return {"choice": self.choice, "note": self.note, "question": self.question, "by": "human"}


def now() -> float:
    """The wall clock decisions are timed by (seconds since the epoch)."""
    return time.time()


def stamp(seconds: float) -> str:
    """`seconds` since the epoch as ISO 8601 in UTC, to the millisecond."""
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def seconds_of(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def digest(value: Any) -> str:
    """The sha256 of `value` as canonical JSON (sorted keys, no spaces): what an answer approves."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def question(gate: Gate, index: int, asked: float) -> HumanAsk:
    """The question gate number `index` asks at `asked`; `Frame.apply` adds the digest of what it
    shows, once the step's output is deposited, and the step itself."""
    return {
        "ask": gate.ask,
        "reply_to": gate.effective_reply_to,
        "question": secrets.token_hex(8),
        "gate": index,
        "choices": [choice.label for choice in gate.choices],
        "show": gate.show,
        "asked_at": stamp(asked),
        "deadline": stamp(asked + gate.timeout.seconds) if gate.timeout is not None else None,
    }


def parked(asked: HumanAsk, step: TraceStep, context: dict[str, Any]) -> HumanAsk:
    """The question as its frame keeps it: with the digest of the value it shows and the step
    that waits for the answer."""
    shown = asked.get("show")
    return {**asked, "digest": digest(lookup(context, shown)) if shown else None, "step": step}


def public(asked: HumanAsk | dict[str, Any] | None) -> dict[str, Any] | None:
    """A pending decision as `mklang run`, `mklang show` and the API tell it (None when the run
    waits on none): its id, the choices, the context path of what it shows, when it was
    asked and its deadline."""
    if asked is None or "choices" not in asked:
        return None
    keys = ("question", "choices", "show", "asked_at", "deadline")
    return {key: asked.get(key) for key in keys}


def answer_hint(asked: dict[str, Any]) -> str:
    """The options that answer a pending decision: `--answer a|b|c`."""
    return f"--answer <{'|'.join(asked.get('choices') or [])}>"


def due(asked: HumanAsk, at: float) -> bool:
    """Whether the deadline of a pending decision has passed at `at`: it is its deadline's to decide."""
    deadline = asked.get("deadline") if is_decision(asked) else None
    return deadline is not None and at >= seconds_of(deadline)


def is_decision(asked: HumanAsk | None) -> bool:
    """Whether a pending question is a human decision (else a free-text HITL reply)."""
    return asked is not None and "choices" in asked


def asking_gate(machine: Machine, state: str, asked: HumanAsk) -> Gate | None:
    """The gate of `machine` that asked `asked` at `state`, when it is a decision; None when the
    record names no such gate (it was edited): a run's machine, hash-verified, says what the
    choices are and where they go, never the record alone."""
    found = machine.state(state)
    index = asked.get("gate")
    if found is None or not isinstance(index, int) or not 0 <= index < len(found.gates):
        return None
    gate = found.gates[index]
    return gate if gate.decides else None


class Waiting(Protocol):
    """What `refusal` reads of a run level (a `Frame`): the question it waits on, where, and its trace."""

    @property
    def ask(self) -> HumanAsk | None: ...
    @property
    def machine(self) -> Machine: ...
    @property
    def state(self) -> str: ...
    @property
    def trace(self) -> Sequence[TraceStep]: ...


def refusal(frame: Waiting, decision: Decision, context: dict[str, Any], at: float) -> str | None:
    """Why `decision` may not be applied to `frame`, with `context` as the answer would leave it
    (values set with it included); the frame's trace tells an answered question from one never
    asked. None when it may."""
    asked, trace = frame.ask, frame.trace
    named = decision.get("question")
    if asked is None or not is_decision(asked):
        if named is not None:
            return f"question {named} {_history(named, trace)}; the run waits on no decision"
        return "the run waits on no decision" + ("" if asked is None else " (it waits for a --set reply)")
    if named is not None and named != asked["question"]:
        return f"question {named} {_history(named, trace)}; the run waits on question {asked['question']}"
    gate = asking_gate(frame.machine, frame.state, asked)
    if gate is None:
        return f"question {asked['question']} names no decision of state {frame.state!r} of its machine"
    deadline = asked.get("deadline")
    if decision.get("by") == "deadline":
        if deadline is None:
            return f"question {asked['question']} has no deadline"
        return None if due(asked, at) else f"question {asked['question']} is not due until {deadline}"
    if due(asked, at):
        return (
            f"question {asked['question']} timed out at {deadline}: its deadline takes the run on "
            "(`mklang runs sweep`), no answer can"
        )
    choices = [choice.label for choice in gate.choices]
    if decision.get("choice") not in choices:
        return f"{decision.get('choice')!r} is not a choice of question {asked['question']}: {', '.join(choices)}"
    shown = gate.show
    seen = decision.get("digest")
    if seen is not None and seen != asked.get("digest"):
        return (
            f"the answer to question {asked['question']} was made on a value that is not the one it shows: "
            "look at the question again"
        )
    if shown and digest(lookup(context, shown)) != asked.get("digest"):
        return (
            f"{shown} is not what question {asked['question']} showed: it changed since it was asked, "
            "and an answer approves only what was shown"
        )
    return None


def _history(named: str, trace: Sequence[TraceStep]) -> str:
    """What became of question `named`, from the trace: answered, timed out, or never asked."""
    for step in reversed(trace):
        decided = step.get("decision")
        if decided and decided.get("question") == named:
            if decided.get("by") == "deadline":
                return f"timed out at {decided.get('at')}"
            return f"was answered already ({decided.get('choice')!r} at {decided.get('at')})"
    return "was never asked by this run"


def steady(trace: Sequence[TraceStep] | Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """`trace` with what each run draws afresh in place of its values: a decision's random
    question id and the times it was decided and due. Two runs of one scenario compare equal
    on it (`mklang verify-resume`, the suite's golden runs)."""
    drawn = {"question": "Q", "at": "T", "deadline": "D"}
    return [
        {**step, "decision": {key: drawn.get(key, value) for key, value in step["decision"].items()}}
        if "decision" in step
        else dict(step)
        for step in trace
    ]


def recorded(decision: Decision, asked: HumanAsk) -> dict[str, Any]:
    """What the trace keeps of a decision: the question, the choice, who decided and when, and a
    deadline's time (the note stays in the context, as data)."""
    kept: dict[str, Any] = {key: decision[key] for key in ("question", "choice", "by", "at") if key in decision}
    if decision.get("by") == "deadline":
        kept.update(choice=None, deadline=asked.get("deadline"))
    return kept


def reply(decision: Decision) -> dict[str, Any]:
    """The value set at the question's `reply_to`: the label chosen and the human's note, or
    that the deadline passed."""
    if decision.get("by") == "deadline":
        return {"choice": None, "timed_out": True}
    value: dict[str, Any] = {"choice": decision.get("choice")}
    if decision.get("note") is not None:
        value["note"] = decision["note"]
    return value


def target(gate: Gate, decision: Decision) -> str | None:
    """Where a decision takes the run: the chosen label's state, or the deadline's (None: fail)."""
    if decision.get("by") == "deadline":
        return gate.timeout.target if gate.timeout is not None else None
    return next(choice.target for choice in gate.choices if choice.label == decision.get("choice"))
