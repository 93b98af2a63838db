"""Does a parked run fit a new version of its machines, and under which renames? (ADR 0061)

A run parked on a question (or a budget) holds frames that name states of
the machines it started with. `classify` compares each frame rebuilt on the
machines it ran (`old`) with the same frame, its state names renamed, rebuilt
on the new version (`new`): the new frame must fit its machine as a resume
requires (`compat.misfit_at`), and the state it stands at must keep its kind,
its output key and its gates' policies (the frame's repair counters and the
trace's gate indexes refer to them), a decision it waits on its choices, and every context key the state reads
must be in the frame's context. Prompts, conditions, targets and whatever
the frame does not stand at may change freely.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from mklang.checker import reads
from mklang.checkpoint.compat import misfit_at
from mklang.engine.frame import Frame
from mklang.errors import UsageError
from mklang.model import State
from mklang.vocabulary import END, STATE_NAME

Kind = Literal["compatible", "migratable", "incompatible"]


@dataclass(frozen=True)
class Verdict:
    """What a run is to a new machine version: `kind`, and for an incompatible one the frame
    (from 1, the root's) and why."""

    kind: Kind
    frame: int | None = None
    reason: str | None = None

    @property
    def movable(self) -> bool:
        return self.kind != "incompatible"

    def text(self) -> str:
        return self.kind if self.reason is None else f"incompatible at frame {self.frame}: {self.reason}"


def parse_map(items: list[str] | None) -> dict[str, str]:
    """`--map old=new` pairs of state names; a malformed or doubled one is a usage error."""
    renames: dict[str, str] = {}
    for item in items or []:
        old, sep, new = item.partition("=")
        if not sep or not STATE_NAME.fullmatch(old) or not STATE_NAME.fullmatch(new):
            raise UsageError(f"--map expects OLD=NEW state names, got {item!r}")
        if old in renames:
            raise UsageError(f"--map renames state '{old}' twice")
        renames[old] = new
    return renames


def renamed(record: dict[str, Any], renames: dict[str, str]) -> dict[str, Any]:
    """A recorded frame with its state names renamed: where it stands, its visits and its repair
    counters (its trace is history and keeps the names it ran under)."""

    def name(state: str) -> str:
        return renames.get(state, state)

    return {
        **record,
        "state": name(record["state"]),
        "visits": {name(state): count for state, count in record["visits"].items()},
        "repair_left": [(name(state), index, left) for state, index, left in record["repair_left"]],
    }


def classify(old: list[Frame], new: list[Frame], renames_used: bool) -> Verdict:
    """Compatible, migratable (compatible once renamed), or incompatible at the first frame that is not."""
    if len(old) != len(new):
        return Verdict("incompatible", 1, "the new machines rebuild a different number of frames")
    found = misfit_at(new)
    for depth, (before, after) in enumerate(zip(old, new, strict=True), start=1):
        problem = found[1] if found is not None and found[0] == depth else _changed(before, after)
        if problem is not None:
            return Verdict("incompatible", depth, f"{after.machine.name} at {after.state}: {problem}")
    return Verdict("migratable" if renames_used else "compatible")


def _changed(before: Frame, after: Frame) -> str | None:
    """Why the state `after` stands at no longer continues what `before` stood at, or None."""
    if before.state == END or after.state == END:
        return None
    was = next(state for state in before.machine.states if state.name == before.state)
    now = next(state for state in after.machine.states if state.name == after.state)
    if was.face.kind != now.face.kind:
        return f"the state was a {was.face.kind} state and is now a {now.face.kind} state"
    if was.output != now.output:
        return f"the state's output key changed from '{was.output}' to '{now.output}'"
    if [gate.policy for gate in was.gates] != [gate.policy for gate in now.gates]:
        return "the state's gates changed their policies or their number"
    waiting = _decision_misfit(after.ask or {}, now)
    if waiting is not None:
        return waiting
    pending = str(after.ask.get("reply_to") or "").split(".")[0] if after.ask else ""
    for key, field in reads(now):
        if key not in after.context and key != pending:
            return f"its {field} reads '{key}', which the run's context does not hold"
    return None


def _decision_misfit(ask: Mapping[str, Any], state: State) -> str | None:
    """A pending human decision is answered by the gate it names: it must still offer the same choices."""
    index, choices = ask.get("gate"), ask.get("choices")
    if not isinstance(index, int) or not choices:
        return None
    offered = [choice.label for choice in state.gates[index].choices] if index < len(state.gates) else []
    if offered != list(choices):
        now = ", ".join(offered) or "none"
        return f"the decision it waits on (gate {index}) offered {', '.join(choices)} and now offers {now}"
    return None
