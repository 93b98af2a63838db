"""The effect surface of control-flow taint (SPEC section 4, ADR 0021).

Only `tool` states act on the world, so the effect surface is the set of
tools a machine uses, split into read-only and effectful. A tool is
read-only when the host says so (a callable carrying `read_only = True`, set
by `mklang.read_only`, in a plugin's TOOLS, an entry point or the Python API;
or the host config's `[tools] read_only` list), else when the machine's
declaration says `read_only`. The host's word wins either way: it implements
the tool. Anything unclassified is effectful: silence is no safety claim.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from mklang.errors import MklangError, UsageError
from mklang.model import Call, Gate, Machine, State, ToolUse, called_machines
from mklang.vocabulary import END, FLOW_POLICIES, FlowPolicy

# The read-only built-ins of mklang 1.x: its YAML machines cannot declare a tool
# read-only, so the YAML front end classifies these names as 1.x did.
LEGACY_READ_ONLY = frozenset({"calc", "search", "search_kb", "list_files", "read_file"})

ToolFunction = TypeVar("ToolFunction", bound=Callable[..., Any])


def read_only(tool: ToolFunction) -> ToolFunction:
    """Mark a host tool as read-only: it observes the world without changing it."""
    tool.read_only = True  # type: ignore[attr-defined]
    return tool


def host_read_only(tool: Callable[..., Any] | None) -> bool | None:
    """What the host says of `tool`: True, False, or None when it says nothing."""
    said = getattr(tool, "read_only", None)
    return None if said is None else bool(said)


def declared_read_only(machine: Machine, tool: str) -> bool:
    return any(declaration.name == tool and declaration.read_only for declaration in machine.tools)


def check_policy(policy: str) -> FlowPolicy:
    """The policy, when it is one of FLOW_POLICIES; else a usage error naming both."""
    if policy not in FLOW_POLICIES:
        raise UsageError(f"untrusted-flow policy must be {' or '.join(FLOW_POLICIES)}, not {policy!r}")
    return policy


def reaches_tool(
    machine: Machine, load: Callable[[str, str | None], Machine], counts: Callable[[Machine, str], bool]
) -> bool:
    """Whether `machine` has a tool state `counts(machine, tool)` accepts, itself or through
    the machines it calls. Reachability, not feasibility: a call result is external when
    the sub-machine could have read a tool. A machine that does not load counts as reaching one."""
    unloaded: list[str] = []

    def load_or_note(name: str, path: str | None) -> Machine | None:
        try:
            return load(name, path)
        except MklangError:  # a machine that does not load is no proof of innocence
            unloaded.append(name)
            return None

    found = any(
        isinstance(state.face, ToolUse) and counts(current, state.face.tool)
        for current in called_machines(machine, load_or_note)
        for state in current.states
    )
    return found or bool(unloaded)


Loader = Callable[[str, str | None], Machine]


def _confirms(gate: Gate) -> bool:
    """A hook or an escalation on the way confirms a decision (the `check` rule)."""
    return gate.hook is not None or gate.policy == "escalate"


def _judged_gates(state: State) -> list[Gate]:
    """The gates of `state` a judge may choose: prose gates, and `otherwise` after them (the judge
    answered none of the above). Escalations are confirmations themselves."""
    judged = [gate for gate in state.gates if gate.via == "llm"]
    if judged:
        judged += [gate for gate in state.gates if gate.when is None]
    return [gate for gate in judged if gate.policy != "escalate" and gate.target not in (None, END)]


def tainted_effects(machine: Machine, load: Loader) -> list[tuple[State, str, list[str]]]:
    """Each state of `machine` where a decision a judge made could reach an effectful tool with
    no hook or escalation on the way, itself or through the machines it calls, as
    (state, tool, path): the path from the judged decision to the tool (`machine:state`
    inside a call). Static: tools count as effectful unless the machine declares them read_only."""
    starts: dict[str, list[str]] = {}
    for state in machine.states:
        for gate in _judged_gates(state):
            starts.setdefault(str(gate.target), [state.name, str(gate.target)])
    paths = _unconfirmed_paths(machine, starts)
    found = []
    for state in machine.states:
        if state.name in paths:
            effect = _effect_at(machine, state, load, frozenset({_key(machine)}))
            if effect is not None:
                tool, inside = effect
                found.append((state, tool, paths[state.name] + inside))
    return found


def _effect_at(machine: Machine, state: State, load: Loader, seen: frozenset[str]) -> tuple[str, list[str]] | None:
    """The effectful tool a tainted decision arriving at `state` runs, and the path inside the
    called machines to it; None when there is none."""
    face = state.face
    if isinstance(face, ToolUse):
        return None if declared_read_only(machine, face.tool) else (face.tool, [])
    if not isinstance(face, Call):
        return None
    try:
        child = load(face.machine, machine.path)
    except MklangError:  # `check` reports a call it cannot resolve
        return None
    if _key(child) in seen:
        return None
    paths = _unconfirmed_paths(child, {child.entry: [child.entry]})
    for inner in child.states:
        if inner.name in paths:
            effect = _effect_at(child, inner, load, seen | {_key(child)})
            if effect is not None:
                return effect[0], [f"{child.name}:{name}" for name in paths[inner.name]] + effect[1]
    return None


def _unconfirmed_paths(machine: Machine, starts: dict[str, list[str]]) -> dict[str, list[str]]:
    """The shortest path to each state reachable from `starts` (state -> path to it) without
    passing a hook or an escalation."""
    states = {state.name: state for state in machine.states}
    paths: dict[str, list[str]] = {}
    queue = deque(sorted(starts.items(), key=lambda item: len(item[1])))
    while queue:
        name, path = queue.popleft()
        if name in paths or name not in states:
            continue
        paths[name] = path
        for gate in states[name].gates:
            if not _confirms(gate) and gate.target not in (None, END) and gate.target not in paths:
                queue.append((gate.target, [*path, gate.target]))
    return paths


def _key(machine: Machine) -> str:
    return machine.path or f"<{machine.name}>"
