"""The canonical `.mk` text of a machine (`mklang fmt`).

One order and one layout: the header lines (`tier` only when the file says
it or it is not the default), the context, the declarations (tools, hooks,
then `moved` renames), then the states
separated by blank lines; inside a state: tier, sample or over, the face, accumulate, output,
max_visits, then the gates in their order. Comments come back where
`comments.attach` put them. `parse(format_machine(m)) == m` for every machine.
"""

from __future__ import annotations

import json
from typing import Any

from mklang.model import Call, FieldComments, Gate, Machine, Node, Produce, State, ToolUse
from mklang.syntax.text import encode_key, encode_string, encode_text

INDENT = "  "
WIDTH = 88  # an input map longer than this goes one entry per line


def value_text(value: Any) -> str:
    """A JSON-like value on one line: `{ a: 1, b: [true, null] }`."""
    if isinstance(value, dict):
        if not value:
            return "{}"
        return "{ " + ", ".join(f"{encode_key(k)}: {value_text(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list):
        return "[" + ", ".join(value_text(v) for v in value) + "]"
    if isinstance(value, str):
        return encode_string(value)
    return json.dumps(value)


def _block_map(value: dict, indent: str) -> str:
    """A map one entry per line, for the context and long input maps."""
    if not value:
        return "{}"
    lines = [f"{indent}{INDENT}{encode_key(k)}: {value_text(v)}" for k, v in value.items()]
    return "{\n" + "\n".join(lines) + f"\n{indent}}}"


class _Out:
    """Lines being written, with the comments of each statement."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def comments(self, indent: str, comments: list[str]) -> None:
        self.lines += [indent + comment for comment in comments]

    def statement(self, indent: str, text: str, before: list[str], after: str | None) -> None:
        self.comments(indent, before)
        if after:  # at the end of the statement's first line, as it was written
            first, newline, rest = text.partition("\n")
            text = f"{first}  {after}{newline}{rest}"
        self.lines.append(indent + text)

    def field(self, node: Node, key: str, indent: str, text: str) -> None:
        notes = node.field_comments.get(key) or FieldComments()
        self.statement(indent, text, notes.before, notes.after)

    def node(self, node: Node, indent: str, text: str) -> None:
        self.statement(indent, text, node.comments, node.line_comment)

    def blank(self) -> None:
        if self.lines and self.lines[-1]:
            self.lines.append("")


def _to(target: str | None) -> str:
    """`-> target`, or `fail` for no target."""
    return "fail" if target is None else f"-> {target}"


def _decision_block(gate: Gate, indent: str) -> str:
    """` {`, the choices and the deadline of a human decision one per line, then `}`."""
    inner = indent + INDENT
    lines = [f"{inner}choice {encode_string(choice.label)} {_to(choice.target)}" for choice in gate.choices]
    if gate.timeout is not None:
        lines.append(f"{inner}within {gate.timeout.within} {_to(gate.timeout.target)}")
    return " {\n" + "\n".join(lines) + f"\n{indent}}}"


def _gate_text(gate: Gate, indent: str) -> str:
    words = ["otherwise"] if gate.when is None else ["when", encode_string(gate.when)]
    if gate.hook:
        words += ["hook", gate.hook]
    if gate.policy == "fail":
        words.append("fail")
    elif gate.policy == "repair":
        words += ["repair", str(gate.repair), "->", str(gate.target)]
    elif gate.policy == "escalate":
        words.append("escalate")
        if gate.target is not None:
            words += ["->", gate.target]
        if gate.ask is not None:
            words += ["ask", encode_string(gate.ask)]
        if gate.show is not None:
            words += ["show", gate.show]
        if gate.reply_to is not None:
            words += ["reply_to", gate.reply_to]
        if gate.target is None:  # a human decision: its block, even when empty (`check` refuses that)
            return " ".join(words) + _decision_block(gate, indent)
    else:
        words += ["->", str(gate.target)]
    return " ".join(words)


def _input_text(keyword: str, name: str, inputs: dict | None, indent: str) -> str:
    text = f"{keyword} {name}"
    if inputs is None:
        return text
    inline = f"{text} {value_text(inputs)}"
    return inline if len(indent) + len(inline) <= WIDTH else f"{text} {_block_map(inputs, indent)}"


def _state(out: _Out, state: State) -> None:
    inner = INDENT
    out.node(state, "", f"state {state.name} {{")
    face = state.face
    lines: list[tuple[str, str]] = []
    if state.tier is not None:
        lines.append(("tier", f"tier {state.tier}"))
    if state.sample is not None:
        lines.append(("sample", f"sample {state.sample}"))
    if state.over is not None:
        lines.append(("over", f"over {state.over}"))
    if isinstance(face, Produce):
        if face.reason:
            lines.append(("reason", "reason"))
        lines.append(("structure", f"structure {encode_text(face.structure, inner)}"))
        if face.execution is not None:
            lines.append(("execution", f"execution {encode_text(face.execution, inner)}"))
        lines.append(("prompt", f"prompt {encode_text(face.prompt, inner)}"))
        if face.parse is not None:
            lines.append(("parse", f"parse {face.parse}"))
    elif isinstance(face, Call):
        lines.append(("call", _input_text("call", face.machine, face.input, inner)))
    elif isinstance(face, ToolUse):
        lines.append(("tool", _input_text("tool", face.tool, face.input, inner)))
    if state.accumulate:
        lines.append(("accumulate", "accumulate"))
    lines.append(("output", f"output {state.output}"))
    if state.max_visits is not None:
        lines.append(("max_visits", f"max_visits {state.max_visits}"))
    for key, text in lines:
        out.field(state, key, inner, text)
    for gate in state.gates:
        out.node(gate, inner, _gate_text(gate, inner))
    out.comments(inner, state.trailing_comments)
    out.lines.append("}")


def format_machine(machine: Machine) -> str:
    out = _Out()
    header = []
    if machine.version is not None:
        header.append(("version", f"mklang {machine.version}"))
    header += [
        ("name", f"machine {machine.name}"),
        ("entry", f"entry {machine.entry}"),
        ("budget", f"budget {machine.budget}"),
    ]
    if machine.tier != "balanced" or "tier" in machine.field_spans or "tier" in machine.field_comments:
        header.append(("tier", f"tier {machine.tier}"))
    if machine.result is not None:
        header.append(("result", f"result {machine.result}"))
    for key, text in header:
        out.field(machine, key, "", text)
    if machine.context or "context" in machine.field_comments:
        out.blank()
        out.field(machine, "context", "", f"context {_block_map(machine.context, '')}")
    if machine.tools or machine.hooks or machine.moved:
        out.blank()
    for keyword, declarations in (("tool", machine.tools), ("hook", machine.hooks)):
        for declaration in declarations:
            description = f" {encode_string(declaration.description)}" if declaration.description else ""
            read_only = " read_only" if getattr(declaration, "read_only", False) else ""
            out.node(declaration, "", f"{keyword} {declaration.name}{read_only}{description}")
    for moved in machine.moved:
        out.node(moved, "", f"moved {encode_string(moved.old)} -> {encode_string(moved.new)}")
    for state in machine.states:
        out.blank()
        _state(out, state)
    if machine.trailing_comments:
        out.blank()
        out.comments("", machine.trailing_comments)
    return "\n".join(out.lines) + "\n"
