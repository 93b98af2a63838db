"""Static checks of a machine (SPEC section 3), each at the span of the node at fault.

Every finding is collected, none stops the others; the list comes back sorted
by position. Structural problems that make a model impossible (two faces, no
output, syntax) are reported by the front end when the file is loaded.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from pathlib import Path

from mklang.effects import tainted_effects
from mklang.errors import Diagnostic, LoadError, Severity, did_you_mean
from mklang.model import Call, Gate, Machine, Moved, Node, Produce, Span, State, ToolUse
from mklang.version import __version__
from mklang.vocabulary import (
    END,
    FAN_OUT_KEYS,
    PLACEHOLDER,
    STATE_NAME,
    UNCLOSED_PLACEHOLDER,
    lookup,
    root_key,
    version_refusal,
)

CONSEQUENCES = frozenset({"no-path-to-end", "budget-infeasible"})  # reported after what causes them


class _Findings:
    def __init__(self, machine: Machine):
        self.machine = machine
        self.file = machine.span.file if machine.span is not None and machine.span.file else machine.path
        self.found: list[Diagnostic] = []

    def add(self, where: Span | None, severity: Severity, code: str, message: str) -> None:
        span = where or Span()
        self.found.append(
            Diagnostic(self.file, span.line, span.col, span.end_line, span.end_col, severity, code, message)
        )

    def error(self, where: Span | None, code: str, message: str) -> None:
        self.add(where, "error", code, message)

    def warning(self, where: Span | None, code: str, message: str) -> None:
        self.add(where, "warning", code, message)


def _at(node: Node, field: str | None = None) -> Span | None:
    """The span of a field's statement, else of the node."""
    return (node.field_spans.get(field) if field else None) or node.span


def _head(node: Node) -> Span | None:
    """The first line of a node (a state's `state x {`), for a caret that stays short."""
    span = node.span
    if span is None or span.line == span.end_line:
        return span
    return Span(file=span.file, line=span.line, col=span.col, end_line=span.line, end_col=span.col + 5)


def step_cost(state: State) -> int:
    """Steps a state costs per visit: a fan-out of `sample N` costs N, everything else 1."""
    return max(1, state.sample or 1) if state.over is None else 1


def shortest_steps(machine: Machine) -> int | None:
    """Fewest steps from the entry to END (Dijkstra over state costs), None when END is out of reach."""
    states = {state.name: state for state in machine.states}
    if machine.entry not in states:
        return None
    queue = [(step_cost(states[machine.entry]), machine.entry)]
    done: set[str] = set()
    while queue:
        cost, name = heapq.heappop(queue)
        if name in done:
            continue
        done.add(name)
        for target in (target for gate in states[name].gates for target in gate.targets):
            if target == END:
                return cost
            if target in states and target not in done:
                heapq.heappush(queue, (cost + step_cost(states[target]), target))
    return None


def _reachable(machine: Machine) -> set[str]:
    states = {state.name: state for state in machine.states}
    seen, todo = set(), [machine.entry]
    while todo:
        name = todo.pop()
        if name in seen or name not in states:
            continue
        seen.add(name)
        todo += [target for gate in states[name].gates for target in gate.targets]
    return seen


def _reaching_end(machine: Machine) -> set[str]:
    """The states from which some path leads to END."""
    sources: dict[str, set[str]] = {}
    for state in machine.states:
        for target in (target for gate in state.gates for target in gate.targets):
            sources.setdefault(target, set()).add(state.name)
    found, todo = set(), [END]
    while todo:
        for source in sources.get(todo.pop(), ()):
            if source not in found:
                found.add(source)
                todo.append(source)
    return found


def _transitions(gate: Gate) -> list[tuple[str, Span | None]]:
    """Each target a gate names, with the span to report it at: the gate's, each choice's, its timeout's."""
    found = [(gate.target, gate.span)] if gate.target is not None else []
    found += [(choice.target, choice.span or gate.span) for choice in gate.choices if choice.target is not None]
    if gate.timeout is not None and gate.timeout.target is not None:
        found.append((gate.timeout.target, gate.timeout.span or gate.span))
    return found


def _texts(state: State) -> list[tuple[str, str]]:
    """(text, field) of every text of a state that `{{path}}` placeholders are rendered in."""
    face = state.face
    if isinstance(face, Produce):
        return [(face.prompt, "prompt")]
    if isinstance(face, (Call, ToolUse)) and face.input:
        field = "call" if isinstance(face, Call) else "tool"
        return [(value, field) for value in _strings(face.input)]
    return []


def reads(state: State) -> list[tuple[str, str]]:
    """(top-level context key, field) of every `{{path}}` and `over` path a state reads."""
    keys = [(root_key(match.group(1)), field) for text, field in _texts(state) for match in PLACEHOLDER.finditer(text)]
    if state.over:
        keys.append((root_key(state.over), "over"))
    return keys


def _strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        return [text for item in value for text in _strings(item)]
    return []


def check(machine: Machine, provided: Iterable[str] = ()) -> list[Diagnostic]:
    """Every SPEC section 3 finding about `machine`, sorted by position.

    `provided` names the context keys a run's host gives (`--set`, `--input`,
    a scenario's input): they count as written.
    """
    out = _Findings(machine)
    refusal = None if machine.version is None else version_refusal(machine.version)
    if refusal:
        out.error(_at(machine, "version"), "unsupported-version", f"this is mklang {__version__}: {refusal}")
    names: dict[str, State] = {}
    for state in machine.states:
        if state.name in names:
            first = names[state.name].span
            where = f" (first at line {first.line})" if first else ""
            out.error(_head(state), "duplicate-state", f'state "{state.name}" is defined twice{where}')
        else:
            names[state.name] = state
    if machine.entry not in names:
        out.error(
            _at(machine, "entry"),
            "unknown-entry",
            f'the entry state "{machine.entry}" is not defined{did_you_mean(machine.entry, names)}',
        )

    _check_moved(out, machine, names)
    tools = {decl.name for decl in machine.tools}
    hooks = {decl.name for decl in machine.hooks}
    written = set(machine.context) | set(provided) | {state.output for state in machine.states}
    written |= {
        gate.effective_reply_to.split(".")[0] for s in machine.states for gate in s.gates if gate.policy == "escalate"
    }
    near = Path(machine.path).parent if machine.path else Path.cwd()

    ends = _reaching_end(machine)
    for state in machine.states:
        _check_state(out, machine, state, names, tools, hooks, written, near)
        for gate in state.gates:
            _check_decision(out, gate, names, ends)

    _check_effects(out, machine)
    reachable = _reachable(machine)
    for state in machine.states:
        if machine.entry in names and state.name not in reachable:
            out.warning(_head(state), "unreachable-state", f'state "{state.name}" cannot be reached from the entry')

    if machine.entry in names:
        fewest = shortest_steps(machine)
        if fewest is None:
            unknown = any(d.code == "unknown-target" for d in out.found)
            cause = " (a gate above names a state that does not exist)" if unknown else ""
            out.error(_at(machine, "entry"), "no-path-to-end", f'no path leads from "{machine.entry}" to END{cause}')
        elif machine.budget < fewest:
            out.error(
                _at(machine, "budget"),
                "budget-infeasible",
                f"budget {machine.budget} is below the shortest path to END ({fewest} steps)",
            )
    if machine.result is not None and machine.result.split(".")[0] not in written:
        out.warning(_at(machine, "result"), "unwritten-context-key", f'nothing writes "{machine.result}", the result')
    # By position, except that findings which follow from others come after their causes.
    return sorted(out.found, key=lambda d: (d.code in CONSEQUENCES, d.line, d.col, d.code))


def _check_moved(out, machine: Machine, names: dict[str, State]) -> None:
    """A rename names a state that is gone and one that is here, once per old name (ADR 0061)."""
    seen: dict[str, Moved] = {}
    for moved in machine.moved:
        if moved.old in seen:
            first = seen[moved.old].span
            where = f" (first at line {first.line})" if first else ""
            out.error(moved.span, "duplicate-moved", f'state "{moved.old}" is moved twice{where}')
        seen.setdefault(moved.old, moved)
        if not STATE_NAME.fullmatch(moved.old):
            out.error(moved.span, "invalid-name", f'"{moved.old}" is not a state name')
        elif moved.old in names:
            out.error(moved.span, "moved-state-exists", f'"{moved.old}" is moved but is still a state of this machine')
        if moved.new not in names:
            hint = did_you_mean(moved.new, names)
            out.error(moved.span, "unknown-target", f'"{moved.new}" is not a state of this machine{hint}')


def _check_state(out, machine, state, names, tools, hooks, written, near) -> None:
    owner = f'state "{state.name}"'
    if state.sample is not None and state.over is not None:
        out.error(_at(state, "sample"), "sample-with-over", f"{owner} has both sample and over: choose one")
    if state.sample is not None and state.sample < 2:
        out.error(_at(state, "sample"), "sample-too-small", f"sample must be at least 2, not {state.sample}")
    if not state.gates:
        out.error(_head(state), "no-gates", f"{owner} has no gates: add at least `otherwise -> <state>`")
    face = state.face
    if isinstance(face, Call):
        from mklang.syntax.resolve import find_machine

        if find_machine(face.machine, near) is None:
            out.error(_at(state, "call"), "unknown-machine", f'no machine "{face.machine}" found for the call')
    if isinstance(face, ToolUse) and face.tool not in tools:
        out.warning(
            _at(state, "tool"),
            "undeclared-tool",
            f'tool "{face.tool}" is not declared: add `tool {face.tool} "<what it does>"`',
        )

    catch_all = None
    for gate in state.gates:
        if catch_all is not None:
            out.warning(gate.span, "dead-gate", "this gate comes after `otherwise` and never fires")
        for target, where in _transitions(gate):
            if target != END and target not in names:
                hint = did_you_mean(target, names)
                out.error(where, "unknown-target", f'"{target}" is not a state (or END){hint}')
        if gate.hook and gate.hook not in hooks:
            out.warning(
                gate.span,
                "undeclared-hook",
                f'hook "{gate.hook}" is not declared: add `hook {gate.hook} "<what it decides>"`',
            )
        if gate.when is None and catch_all is None:
            catch_all = gate
    if state.gates and catch_all is None:
        out.warning(
            _head(state), "no-catch-all", f"{owner} has no `otherwise` gate: the run halts when no condition holds"
        )
    elif catch_all is not None and catch_all.policy == "repair":
        out.warning(
            catch_all.span,
            "repair-only-otherwise",
            "the only `otherwise` is a repair gate: once its budget is spent, nothing catches",
        )

    repairs = sum(gate.repair or 0 for gate in state.gates if gate.policy == "repair")
    if state.max_visits is not None and repairs and state.max_visits <= repairs:
        out.warning(
            _at(state, "max_visits"),
            "max-visits-under-repair",
            f"max_visits {state.max_visits} is at or under the state's repair budget ({repairs}): "
            "repairs cannot all run",
        )
    for text, field in _texts(state):
        if UNCLOSED_PLACEHOLDER.search(text):
            out.warning(
                _at(state, field),
                "unclosed-placeholder",
                f'{owner} opens a placeholder with "{{{{" but never closes it with "}}}}": it is sent as written',
            )
    if state.over is not None and state.sample is None and not _declared_list(machine, state.over):
        out.warning(
            _at(state, "over"),
            "over-unbounded",
            f'{owner} fans out over "{state.over}", a list whose length is set at run time (no declared bound): '
            f"the step budget ({machine.budget}) is its only limit, one step per item, and a longer list stops "
            "the run here (budget-exhausted); cap the run's spend with --max-tokens or --max-cost",
        )
    fan_out = state.sample is not None or state.over is not None
    warned: set[str] = set()  # once per key and state
    for key, field in reads(state):
        if key not in written and not (fan_out and key in FAN_OUT_KEYS) and key not in warned:
            out.warning(_at(state, field), "unwritten-context-key", f'{owner} reads "{key}", which nothing writes')
            warned.add(key)


def _check_decision(out: _Findings, gate: Gate, names: dict[str, State], ends: set[str]) -> None:
    """A human decision (SPEC section 8): labelled choices, once each; a deadline whose
    transition can still finish the run; `show` and `within` only with choices."""
    if gate.policy == "escalate" and not gate.choices:
        parts = [word for word, given in (("show", gate.show), ("within", gate.timeout)) if given is not None]
        if parts or gate.target is None:
            need = " and ".join(f"`{part}`" for part in parts) + (" need" if len(parts) > 1 else " needs")
            out.error(
                gate.span,
                "no-choices",
                f'{need if parts else "a human decision needs"} choices: add `choice "<answer>" -> <state>`',
            )
    seen: set[str] = set()
    for choice in gate.choices:
        if not choice.label.strip():
            out.error(choice.span or gate.span, "invalid-choice", "a choice needs a label a human can answer with")
        elif choice.label in seen:
            out.error(choice.span or gate.span, "duplicate-choice", f'the choice "{choice.label}" is given twice')
        seen.add(choice.label)
    timeout = gate.timeout
    if (
        timeout is not None
        and timeout.target not in (None, END)
        and timeout.target in names
        and timeout.target not in ends
    ):
        out.error(
            timeout.span or gate.span,
            "timeout-no-end",
            f'the deadline leads to "{timeout.target}", from which no path reaches END',
        )
    if timeout is not None and timeout.seconds <= 0:
        out.error(timeout.span or gate.span, "invalid-value", "a deadline must be longer than 0s")


def _check_effects(out: _Findings, machine: Machine) -> None:
    """Control-flow taint (SPEC section 4): an effectful tool a judged decision reaches unconfirmed."""
    from mklang.syntax.machines import MachineLoader

    for state, tool, path in tainted_effects(machine, MachineLoader()):
        face = state.face
        runs = f'calls "{face.machine}", which runs' if isinstance(face, Call) else "runs"
        out.warning(
            _at(state, "call" if isinstance(face, Call) else "tool"),
            "untrusted-control-flow",
            f'state "{state.name}" {runs} the effectful tool "{tool}" after a judged decision, with no hook or '
            f"escalation on the way ({' -> '.join(path)}): a judge misled by outside data could trigger it; "
            f"confirm with a hook gate, or declare the tool read_only if it changes nothing",
        )


def _declared_list(machine: Machine, path: str) -> bool:
    """True when the author wrote the list an `over` reads: a non-empty literal in `context`
    that no state output or human reply overwrites (ADR 0012)."""
    writers = {root_key(state.output) for state in machine.states}
    writers |= {root_key(g.effective_reply_to) for s in machine.states for g in s.gates if g.policy == "escalate"}
    value = lookup(machine.context, path)
    return isinstance(value, list) and bool(value) and root_key(path) not in writers


def check_file(path) -> list[Diagnostic]:
    """Load and check one file; a file that cannot be loaded yields its load diagnostics."""
    from mklang.syntax import load_file

    try:
        machine = load_file(path)
    except LoadError as error:
        return error.diagnostics
    return check(machine)


def require_runnable(machine: Machine) -> Machine:
    """The machine, when static checks find no error; else LoadError with the errors.

    Running a machine that `mklang check` rejects would fail mid-run (or worse,
    after paying for model calls); every way to run one checks it first.
    """
    errors = [d for d in check(machine) if d.severity == "error"]
    if errors:
        raise LoadError(errors)
    return machine
