"""What the language server knows about one `.mk` document, free of any LSP type.

Meaning comes from the front end: `mklang.syntax.parse` and
`mklang.checker.check` give the machine and its diagnostics, and
`format_machine` the canonical text. Positions come from the highlighting
lexer (`mklang.highlight.MkLexer`), which tokenizes any text, even text that
does not parse yet, so navigation and completion keep working while the
author types. The machine of the last version that parsed is kept for
completion and hover in the meantime.

Positions here are 0-based (line, column) pairs counted in code points; the
server converts them to the client's units.
"""

from __future__ import annotations

import bisect
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pygments.token import Comment, Name, Punctuation, String, Whitespace

from mklang.effects import declared_read_only
from mklang.errors import Diagnostic, LoadError
from mklang.graph import condition_text, face_text, fan_out_text, policy_text
from mklang.highlight import MkLexer
from mklang.model import Machine, State, ToolUse
from mklang.vocabulary import (
    DECISION_KEYWORDS,
    DECLARATION_KEYWORDS,
    END,
    FAN_OUT_KEYS,
    HEADER_KEYWORDS,
    OPEN_PLACEHOLDER,
    STATE_KEYWORDS,
)

Pos = tuple[int, int]
Range = tuple[Pos, Pos]


@dataclass(frozen=True)
class Symbol:
    """A name the navigation features care about, where it sits in the text."""

    role: str  # state | state-ref | machine | placeholder
    name: str
    range: Range


@dataclass(frozen=True)
class Completion:
    label: str
    kind: str  # state | keyword | key
    detail: str = ""


def span_range(line: int, col: int, end_line: int, end_col: int) -> Range:
    """A 1-based, end-exclusive source span as a 0-based range."""
    return (line - 1, col - 1), (end_line - 1, end_col - 1)


def diagnose(text: str, path: str | None) -> tuple[Machine | None, list[Diagnostic]]:
    """Parse and check `text`; a syntax error gives no machine and its diagnostics."""
    from mklang.checker import check
    from mklang.syntax import parse

    try:
        machine = parse(text, filename=path)
    except LoadError as error:
        return None, list(error.diagnostics)
    machine.path = path
    found = check(machine)
    return machine, [d for d in found if d.file in (None, path)]


@dataclass
class Document:
    """One version of a document: its machine (or the last that parsed), diagnostics and symbols."""

    text: str
    path: str | None = None
    previous: Machine | None = None
    machine: Machine | None = field(init=False)
    diagnostics: list[Diagnostic] = field(init=False)

    def __post_init__(self) -> None:
        self.machine, self.diagnostics = diagnose(self.text, self.path)
        self._starts = [0] + [m.end() for m in re.finditer("\n", self.text)]
        self._tokens = list(MkLexer().get_tokens_unprocessed(self.text))
        self.symbols = self._symbols()

    @property
    def model(self) -> Machine | None:
        """The machine that explains this text: this version's, or the last one that parsed."""
        return self.machine or self.previous

    # ------------------------------------------------------------ positions

    def position(self, offset: int) -> Pos:
        line = bisect.bisect_right(self._starts, offset) - 1
        return line, offset - self._starts[line]

    def offset(self, pos: Pos) -> int:
        line = min(pos[0], len(self._starts) - 1)
        return self._starts[line] + pos[1]

    def line_prefix(self, pos: Pos) -> str:
        return self.text[self.offset((pos[0], 0)) : self.offset(pos)]

    def end(self) -> Pos:
        return self.position(len(self.text))

    # ------------------------------------------------------------ symbols

    def _significant(self):
        return [(o, t, v) for o, t, v in self._tokens if t not in Whitespace and t not in Comment and v.strip()]

    def _symbols(self) -> list[Symbol]:
        """Declared states, state references (`entry`, `->`), called machines and `{{paths}}`."""
        found = []
        previous = ""
        for offset, kind, value in self._significant():
            role, name = None, value
            if kind in Name.Class:
                role = "state" if previous == "state" else "state-ref"
            elif kind in Name.Namespace and previous == "call":
                role = "machine"
            elif kind in String.Interpol:
                role, name = "placeholder", value[2:-2].strip()
            if role:
                found.append(Symbol(role, name, (self.position(offset), self.position(offset + len(value)))))
            previous = value
        return found

    def symbol_at(self, pos: Pos) -> Symbol | None:
        for symbol in self.symbols:
            (start, end) = symbol.range
            if start <= pos <= end:
                return symbol
        return None

    def state_symbols(self, name: str, roles=("state", "state-ref")) -> list[Symbol]:
        return [s for s in self.symbols if s.role in roles and s.name == name]

    # ------------------------------------------------------------ features

    def definition(self, pos: Pos) -> tuple[str | None, Range] | None:
        """Where the name at `pos` is defined: (None, range) in this file, or (path, range)."""
        symbol = self.symbol_at(pos)
        if symbol is None:
            return None
        if symbol.role in ("state", "state-ref"):
            declared = self.state_symbols(symbol.name, ("state",))
            return (None, declared[0].range) if declared else None
        if symbol.role == "machine":
            found = self.resolve_machine(symbol.name)
            return (str(found), ((0, 0), (0, 0))) if found else None
        return None

    def resolve_machine(self, name: str) -> Path | None:
        from mklang.syntax.resolve import find_machine

        near = Path(self.path).parent if self.path else Path.cwd()
        return find_machine(name, near)

    def references(self, pos: Pos, include_declaration: bool = True) -> list[Range]:
        symbol = self.symbol_at(pos)
        if symbol is None or symbol.role not in ("state", "state-ref"):
            return []
        roles = ("state", "state-ref") if include_declaration else ("state-ref",)
        return [s.range for s in self.state_symbols(symbol.name, roles)]

    def completions(self, pos: Pos) -> list[Completion]:
        prefix = self.line_prefix(pos)
        model = self.model
        if re.search(r"->\s*\w*$", prefix):
            names = (
                [s.name for s in model.states] if model else sorted({s.name for s in self.symbols if s.role == "state"})
            )
            return [Completion(name, "state", self._state_detail(name)) for name in names] + [
                Completion(END, "state", "finish the run")
            ]
        if OPEN_PLACEHOLDER.search(prefix):
            return [Completion(path, "key", detail) for path, detail in context_keys(model).items()]
        if re.fullmatch(r"\s*tool\s+\w+\s+\w*", prefix) and self._block_at(self.offset(pos)) is None:
            return [Completion(word, "keyword", "the tool changes nothing") for word in DECLARATION_KEYWORDS]
        if re.fullmatch(r"\s*\w*", prefix):
            block = self._block_at(self.offset(pos))
            if block == "state":
                return [Completion(word, "keyword") for word in STATE_KEYWORDS]
            if block == "decision":
                return [Completion(word, "keyword", "an answer, or the deadline") for word in DECISION_KEYWORDS]
            if block is None:
                return [Completion(word, "keyword") for word in HEADER_KEYWORDS]
        return []

    def _block_at(self, offset: int) -> str | None:
        """The innermost open brace before `offset`: `state`, `decision` (the choices of an
        escalation), `map`, or None at the top level."""
        stack: list[str] = []
        recent: list[str] = []
        escalates = -1  # the line of the last `escalate`
        for start, kind, value in self._significant():
            if start >= offset:
                break
            line = self.position(start)[0]
            if value == "escalate":
                escalates = line
            if kind in Punctuation and value == "{":
                if recent[-2:-1] == ["state"]:
                    stack.append("state")
                else:
                    stack.append("decision" if stack[-1:] == ["state"] and escalates == line else "map")
            elif kind in Punctuation and value == "}" and stack:
                stack.pop()
            recent.append(value)
        return stack[-1] if stack else None

    def hover(self, pos: Pos) -> tuple[str, Range] | None:
        """Markdown about the state, target, machine or `{{path}}` at `pos`."""
        symbol = self.symbol_at(pos)
        model = self.model
        if symbol is None or model is None:
            return None
        if symbol.role in ("state", "state-ref"):
            state = model.state(symbol.name)
            text = describe_state(state, model) if state else f"`{symbol.name}` is not a state of `{model.name}`."
        elif symbol.role == "machine":
            found = self.resolve_machine(symbol.name)
            text = f"machine `{symbol.name}`: " + (f"`{found}`" if found else "not found")
        else:
            text = describe_key(model, symbol.name)
        return text, symbol.range

    def formatted(self) -> str | None:
        """The canonical text, or None when this version does not parse."""
        if self.machine is None:
            return None
        from mklang.syntax import format_machine

        return format_machine(self.machine)

    def outline(self) -> list[tuple[str, str, Range, Range]]:
        """(name, detail, whole range, name range) of every declared state."""
        out = []
        for symbol in self.symbols:
            if symbol.role != "state":
                continue
            state = self.machine.state(symbol.name) if self.machine else None
            span = state.span if state is not None and state.span is not None else None
            whole = span_range(span.line, span.col, span.end_line, span.end_col) if span else symbol.range
            out.append((symbol.name, face_text(state) if state else "", whole, symbol.range))
        return out

    def _state_detail(self, name: str) -> str:
        state = self.model.state(name) if self.model else None
        return face_text(state) if state else ""


def context_keys(machine: Machine | None) -> dict[str, str]:
    """Every context path a `{{placeholder}}` may read, with what provides it."""
    keys: dict[str, str] = {}
    if machine is None:
        return keys

    def walk(prefix: str, value: Any) -> None:
        keys.setdefault(prefix, "initial context")
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}.{key}", inner)

    for key, value in machine.context.items():
        walk(key, value)
    for state in machine.states:
        keys.setdefault(state.output, f"output of state {state.name}")
        for gate in state.gates:
            if gate.policy == "escalate":
                keys.setdefault(gate.effective_reply_to, f"reply to the escalation in {state.name}")
    keys.update((key, detail) for key, detail in FAN_OUT_KEYS.items() if key not in keys)
    return keys


def writers(machine: Machine, path: str) -> list[str]:
    """Sentences naming what writes the top-level key of `path`."""
    key = path.split(".")[0]
    found = []
    if key in machine.context:
        found.append(f"initial `context`: `{json.dumps(machine.context[key], ensure_ascii=False)}`")
    for state in machine.states:
        if state.output == key:
            mode = "appends to" if state.accumulate else "writes"
            found.append(f"state `{state.name}` {mode} it (`output {key}`)")
        for gate in state.gates:
            if gate.policy == "escalate" and gate.effective_reply_to.split(".")[0] == key:
                found.append(
                    f"the human reply to the escalation in `{state.name}` (`reply_to {gate.effective_reply_to}`)"
                )
    if not found and key in FAN_OUT_KEYS:
        found.append(f"fan-out: {FAN_OUT_KEYS[key]}")
    return found


def describe_key(machine: Machine, path: str) -> str:
    found = writers(machine, path)
    if not found:
        return f"`{{{{{path}}}}}`: nothing writes `{path.split('.')[0]}`; it renders as empty text."
    return f"`{{{{{path}}}}}` is written by:\n\n" + "\n".join(f"- {line}" for line in found)


def describe_state(state: State, machine: Machine) -> str:
    facts = [face_text(state)]
    if isinstance(state.face, ToolUse):  # control-flow taint: does a tainted decision reaching it count?
        facts[0] += " (read-only)" if declared_read_only(machine, state.face.tool) else " (effectful)"
    facts.append(f"output `{state.output}`" + (" (accumulate)" if state.accumulate else ""))
    facts += [text for text in (fan_out_text(state),) if text]
    facts += [f"tier {state.tier}"] if state.tier else []
    facts += [f"max_visits {state.max_visits}"] if state.max_visits else []
    lines = [f"**state `{state.name}`**: " + ", ".join(facts), "", _worst_case(state, machine), ""]
    for gate in state.gates:
        policy = policy_text(gate)
        target = "" if gate.target is None else f" → `{gate.target}`"
        lines.append(f"- {condition_text(gate)}" + (f" · {policy}" if policy else "") + target)
        for choice in gate.choices:  # a human decision: each answer and where it goes
            lines.append(f'  - choice "{choice.label}"' + _to(choice.target))
        if gate.timeout is not None:
            lines.append(f"  - within {gate.timeout.within}" + _to(gate.timeout.target))
    return "\n".join(lines)


def _worst_case(state: State, machine: Machine) -> str:
    """What one visit can cost, from the static bounds of `mklang check --cost`."""
    from mklang.costs import visit_calls
    from mklang.errors import MklangError
    from mklang.syntax.machines import MachineLoader

    loader = MachineLoader()

    def load(name: str, near: str | None) -> Machine | None:
        try:
            return loader(name, near)
        except MklangError:
            return None

    least, most = visit_calls(machine, state, load)
    width = " (a list's length: at most the step budget)" if state.over is not None else ""
    fewest = "" if least is None else f"at least {least:,.0f}, "
    return f"model calls a visit: {fewest}at most {most:,.0f}{width}"


def _to(target: str | None) -> str:
    return " · fail" if target is None else f" → `{target}`"
