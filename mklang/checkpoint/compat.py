"""Does a checkpoint's frame chain fit the machines loaded now? (ADR 0014)

`--force` accepts a machine file whose hash changed; it never accepts a
chain the engine could not continue. Every frame must be well-formed and
sit at a state the machine has; its visits and repair counters must name
states and repair gates the machine has; every frame but the innermost must
be paused at a plain call state (fan-out branches never suspend) whose
target is the next frame's machine. `first_misfit` says what does not fit,
in one line, before any provider is set up.
"""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter, ValidationError

from mklang.checkpoint.envelope import EnteredFrame
from mklang.engine.frame import Frame, repair_budgets
from mklang.engine.trace import SegmentReader
from mklang.errors import CheckpointError
from mklang.model import Call, Machine, State
from mklang.vocabulary import END

_RECORDED_FRAME: TypeAdapter[EnteredFrame] = TypeAdapter(EnteredFrame)


def frame_shape_error(frame: Any) -> str | None:
    """Why a recorded frame is malformed, or None."""
    if not isinstance(frame, dict):
        return f"a frame must be a JSON object, not {type(frame).__name__}"
    try:
        _RECORDED_FRAME.validate_python(frame)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        return f"field {where}: {first['msg']}"
    if frame["path"] is None:
        return "field path: names no machine file to run"
    return None


def rebuild(frame: dict[str, Any], machine: Machine, where: str, read: SegmentReader | None = None) -> Frame:
    """A `Frame` from a recorded one already checked by `frame_shape_error`; `read` reads its trace segments."""
    try:
        return Frame.from_json(frame, machine, read)
    except (KeyError, TypeError, ValueError, AttributeError) as error:  # a shape the model does not pin
        raise CheckpointError(f"{where}: malformed frame: {type(error).__name__}: {error}") from None


def first_misfit(chain: list[Frame]) -> str | None:
    """The first frame that does not fit its machine, described in one line; None if all fit."""
    found = misfit_at(chain)
    if found is None:
        return None
    number, problem = found
    frame = chain[number - 1]
    return f"frame {number} ({frame.machine.name} at {frame.state}): {problem}"


def misfit_at(chain: list[Frame]) -> tuple[int, str] | None:
    """The first frame (numbered from 1) that does not fit its machine, and why."""
    for depth, frame in enumerate(chain):
        below = chain[depth + 1] if depth + 1 < len(chain) else None
        problem = _misfit(frame, below)
        if problem is not None:
            return depth + 1, problem
    return None


def _misfit(frame: Frame, below: Frame | None) -> str | None:
    machine = frame.machine
    states = {state.name: state for state in machine.states}
    where = f"in {machine.path or machine.name}"
    if frame.state == END:  # the level finished; its parent completes the call on resume
        return None if below is None else f"a sub-machine frame follows a level that reached {END}"
    if frame.state not in states:
        return f"state '{frame.state}' no longer exists {where}"
    stale = sorted(set(frame.visits) - set(states))
    if stale:
        return f"visits state '{stale[0]}', which no longer exists {where}"
    return _repair_misfit(frame, where) or _position_misfit(states[frame.state], frame, below, where)


def _repair_misfit(frame: Frame, where: str) -> str | None:
    """Repair counters: exactly one per repair gate of the machine, within its budget."""
    budgets = repair_budgets(frame.machine)
    for (name, index), left in sorted(frame.repair_left.items()):
        if (name, index) not in budgets:
            return f"repair counter of gate {index} of '{name}', which is not a repair gate {where}"
        if not 0 <= left <= budgets[(name, index)]:
            return f"repair counter {left} of gate {index} of '{name}' is outside 0..{budgets[(name, index)]}"
    missing = sorted(set(budgets) - set(frame.repair_left))
    if missing:
        return f"no repair counter for gate {missing[0][1]} of '{missing[0][0]}' {where}"
    return None


def _position_misfit(state: State, frame: Frame, below: Frame | None, where: str) -> str | None:
    """Kept fan-out branches belong to a fan-out state; a deeper frame hangs off a plain call to its machine."""
    if frame.branches and not state.fans_out:
        return f"holds finished fan-out branches, but '{state.name}' does not fan out {where}"
    if state.sample is not None and any(not 0 <= index < state.sample for index in frame.branches):
        return f"holds a fan-out branch outside the {state.sample} samples of '{state.name}'"
    if below is None:
        return None
    if not isinstance(state.face, Call):
        return f"a sub-machine frame follows, but '{state.name}' is not a call state {where}"
    if state.fans_out:
        return f"a sub-machine frame follows, but '{state.name}' fans out (fan-out branches never suspend)"
    if below.machine.name != state.face.machine:
        return f"calls '{state.face.machine}', but the next frame runs '{below.machine.name}'"
    return None
