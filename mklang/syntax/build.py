"""Parse tree to model: one method per grammar rule, named like the rule.

Rules return small `Clause`s (a statement with its span); `start` and `state`
assemble them into the model. Problems that make a model impossible (a
missing `entry`, a state with two faces, `budget 2.5`) are collected as
diagnostics and raised together as one `MkSyntaxError`; every other rule of
SPEC section 3 belongs to `mklang.checker`.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from mklang.errors import Diagnostic, MkSyntaxError
from mklang.limits import MAX_DEPTH, json_depth
from mklang.model import (
    Call,
    Choice,
    Declaration,
    Gate,
    Machine,
    Moved,
    Produce,
    Span,
    State,
    Timeout,
    ToolDeclaration,
    ToolUse,
)
from mklang.syntax._parser import Token
from mklang.syntax.grammar import standalone_parser
from mklang.syntax.text import decode_block, decode_string, either
from mklang.vocabulary import PARSE_MODES, TIERS

PRODUCE_FIELDS = ("structure", "execution", "prompt", "reason", "parse")
FACE_WORDS = {"produce": "a prompt", "call": "a call", "tool": "a tool"}


@dataclass
class Clause:
    """One statement of the file or of a state body."""

    key: str
    value: Any
    span: Span


def _token_span(token: Token, file: str | None) -> Span:
    return Span(file=file, line=token.line, col=token.column, end_line=token.end_line, end_col=token.end_column)


# Value-bearing keywords; every other string terminal is a keyword or bracket
# that only marks a position.
_VALUE_WORDS = frozenset({"END", "TRUE", "FALSE", "NULL"})


@functools.cache
def _silent_terminals() -> frozenset[str]:
    """Keyword and bracket terminals: kept in the tree for positions, not passed to methods."""
    return frozenset(t.name for t in standalone_parser().terminals if t.pattern.type == "str") - _VALUE_WORDS


class Builder:
    """Turns one parse tree into a `Machine`; collects what makes that impossible.

    A plain recursive walk: each tree node calls the method named like its
    rule with its meta and transformed children; each token goes through the
    method named like its terminal, if there is one. (Lark's `Transformer`
    with `v_args` cost more than the rest of the builder together.)
    """

    def __init__(self, file: str | None):
        self.file = file
        self.diagnostics: list[Diagnostic] = []
        self._first: Token | None = None
        self._last: Token | None = None

    def transform(self, node):
        if isinstance(node, Token):
            if self._first is None:
                self._first = node
            self._last = node
            cast = getattr(self, node.type, None)
            return node if cast is None else cast(node)
        if node is None:
            return None
        outer, self._first = self._first, None
        values = [self.transform(child) for child in node.children]
        meta = (self._first, self._last)  # the node's first and last token: its extent
        self._first = outer if outer is not None else self._first
        silent = _silent_terminals()
        args = [
            v
            for v, child in zip(values, node.children, strict=False)
            if not (isinstance(child, Token) and child.type in silent)
        ]
        return getattr(self, node.data)(meta, *args)

    # -- helpers (public: the YAML front end checks its values with them too) --

    def _span(self, meta) -> Span:
        first, last = meta
        return Span(file=self.file, line=first.line, col=first.column, end_line=last.end_line, end_col=last.end_column)

    def report(self, span: Span, code: str, message: str) -> None:
        self.diagnostics.append(
            Diagnostic(self.file, span.line, span.col, span.end_line, span.end_col, "error", code, message)
        )

    def _where(self, token: Token, span: Span | None) -> Span:
        return span if span is not None else _token_span(token, self.file)

    def plain_name(self, token, what: str, span: Span | None = None) -> str:
        """A name that must not be a dotted path (states, keys, tools...)."""
        if "." in str(token):
            self.report(self._where(token, span), "invalid-name", f'{what} "{token}" cannot contain "."')
        return str(token)

    def whole_number(self, token, what: str, span: Span | None = None) -> int:
        if not str(token).isdigit():
            self.report(self._where(token, span), "invalid-number", f'{what} must be a whole number, not "{token}"')
            return 0
        return int(token)

    def one_of(self, token, allowed: tuple[str, ...], what: str, span: Span | None = None) -> str | None:
        if token not in allowed:
            self.report(self._where(token, span), "invalid-value", f'{what} must be {either(allowed)}, not "{token}"')
            return None
        return str(token)

    def _fields(self, items: list[Clause], owner: str) -> dict[str, Clause]:
        """One item per key; a repeated key is reported at its second occurrence."""
        fields: dict[str, Clause] = {}
        for item in items:
            if item.key in fields:
                first = fields[item.key].span.line
                self.report(item.span, "duplicate-field", f'{owner} sets "{item.key}" twice (first at line {first})')
            else:
                fields[item.key] = item
        return fields

    # -- terminals -----------------------------------------------------------

    def STRING(self, token: Token) -> str:
        try:
            return decode_string(token)
        except ValueError:
            self.report(_token_span(token, self.file), "invalid-string", "invalid escape sequence in string")
            return ""

    def TRIPLE_STRING(self, token: Token) -> str:
        return decode_block(token)

    def TRUE(self, _token: Token) -> bool:
        return True

    def FALSE(self, _token: Token) -> bool:
        return False

    def NULL(self, _token: Token) -> None:
        return None

    # -- values --------------------------------------------------------------

    def map(self, _meta, *pairs) -> dict[str, Any]:
        return dict(pairs)

    def pair(self, _meta, key, value) -> tuple[str, Any]:
        return str(key), _number(value)

    def list(self, _meta, *values) -> list[Any]:
        return [_number(value) for value in values]

    # -- header lines --------------------------------------------------------

    def version(self, meta, number) -> Clause:
        return Clause("version", str(number), self._span(meta))

    def machine_name(self, meta, name) -> Clause:
        return Clause("name", self.plain_name(name, "a machine name"), self._span(meta))

    def entry(self, meta, name) -> Clause:
        return Clause("entry", self.plain_name(name, "a state name"), self._span(meta))

    def budget(self, meta, number) -> Clause:
        return Clause("budget", self.whole_number(number, "budget"), self._span(meta))

    def tier(self, meta, name) -> Clause:
        return Clause("tier", self.one_of(name, TIERS, "tier"), self._span(meta))

    def result(self, meta, name) -> Clause:
        return Clause("result", str(name), self._span(meta))

    def context(self, meta, value) -> Clause:
        return Clause("context", value, self._span(meta))

    def tool_decl(self, meta, name, read_only, description) -> Clause:
        span = self._span(meta)
        node = ToolDeclaration(
            name=self.plain_name(name, "a tool name"),
            description=description or "",
            read_only=bool(read_only),
            span=span,
        )
        return Clause("tools", node, span)

    def read_only(self, meta) -> bool:
        return True

    def hook_decl(self, meta, name, description) -> Clause:
        span = self._span(meta)
        node = Declaration(name=self.plain_name(name, "a hook name"), description=description or "", span=span)
        return Clause("hooks", node, span)

    def moved(self, meta, old, new) -> Clause:
        span = self._span(meta)
        return Clause("moved", Moved(old=old, new=new, span=span), span)

    # -- state statements ----------------------------------------------------

    def prompt(self, meta, text) -> Clause:
        return Clause("prompt", text, self._span(meta))

    def structure(self, meta, text) -> Clause:
        return Clause("structure", text, self._span(meta))

    def execution(self, meta, text) -> Clause:
        return Clause("execution", text, self._span(meta))

    def reason(self, meta) -> Clause:
        return Clause("reason", True, self._span(meta))

    def parse(self, meta, mode) -> Clause:
        return Clause("parse", self.one_of(mode, PARSE_MODES, "parse"), self._span(meta))

    def call(self, meta, name, inputs) -> Clause:
        span = self._span(meta)
        face = Call(machine=self.plain_name(name, "a machine name"), input=inputs, span=span)
        return Clause("call", face, span)

    def tool_use(self, meta, name, inputs) -> Clause:
        span = self._span(meta)
        return Clause("tool", ToolUse(tool=self.plain_name(name, "a tool name"), input=inputs, span=span), span)

    def output(self, meta, name) -> Clause:
        return Clause("output", self.plain_name(name, "an output key"), self._span(meta))

    def accumulate(self, meta) -> Clause:
        return Clause("accumulate", True, self._span(meta))

    def sample(self, meta, number) -> Clause:
        return Clause("sample", self.whole_number(number, "sample"), self._span(meta))

    def over(self, meta, path) -> Clause:
        return Clause("over", str(path), self._span(meta))

    def max_visits(self, meta, number) -> Clause:
        return Clause("max_visits", self.whole_number(number, "max_visits"), self._span(meta))

    # -- gates ---------------------------------------------------------------

    def gate(self, meta, condition: dict, policy: dict) -> Clause:
        span = self._span(meta)
        return Clause("gate", Gate(**condition, **policy, span=span), span)

    def when(self, _meta, text, hook) -> dict:
        return {"when": text, "hook": hook}

    def hook(self, _meta, name) -> str:
        return self.plain_name(name, "a hook name")

    def otherwise(self, _meta) -> dict:
        return {"when": None, "hook": None}

    def ok(self, _meta, target) -> dict:
        return {"policy": "ok", "target": self.plain_name(target, "a state name")}

    def repair(self, _meta, number, target) -> dict:
        return {
            "policy": "repair",
            "repair": self.whole_number(number, "a repair budget"),
            "target": self.plain_name(target, "a state name"),
        }

    def escalate(self, _meta, target, ask, show, reply_to) -> dict:
        return {
            "policy": "escalate",
            "target": self.plain_name(target, "a state name"),
            "ask": ask,
            "show": show,
            "reply_to": reply_to,
        }

    def decide(self, _meta, ask, show, reply_to, *decisions: Clause) -> dict:
        return {"policy": "escalate", "target": None, "ask": ask, "show": show, "reply_to": reply_to,
                **self.decisions(decisions)}  # fmt: skip

    def decisions(self, items) -> dict:
        """The choices and the one timeout of a human decision (shared with the YAML front end)."""
        timeouts = [item for item in items if item.key == "within"]
        for extra in timeouts[1:]:
            first = timeouts[0].span.line
            self.report(extra.span, "duplicate-field", f"a decision has one deadline (first at line {first})")
        return {
            "choices": [item.value for item in items if item.key == "choice"],
            "timeout": timeouts[0].value if timeouts else None,
        }

    def choice(self, meta, label, policy: dict) -> Clause:
        span = self._span(meta)
        return Clause("choice", Choice(label=label, target=policy["target"], span=span), span)

    def within(self, meta, duration, policy: dict) -> Clause:
        span = self._span(meta)
        return Clause("within", Timeout(within=str(duration), target=policy["target"], span=span), span)

    def ask(self, _meta, text) -> str:
        return text

    def show(self, _meta, path) -> str:
        return str(path)

    def reply_to(self, _meta, path) -> str:
        return str(path)

    def fail(self, _meta) -> dict:
        return {"policy": "fail", "target": None}

    # -- assembly ------------------------------------------------------------

    def state(self, meta, name, *items: Clause) -> Clause:
        return self.assemble_state(
            self.plain_name(name, "a state name"), _token_span(name, self.file), self._span(meta), items
        )

    def assemble_state(self, state_name: str, name_span: Span, span: Span, items) -> Clause:
        """A state from its statements (shared with the YAML front end)."""
        owner = f'state "{state_name}"'
        gates = [item.value for item in items if item.key == "gate"]
        fields = self._fields([item for item in items if item.key != "gate"], owner)
        face = self._face(fields, owner, name_span)
        if "output" not in fields:
            self.report(span, "no-output", f"{owner} has no output: add `output <key>`")
        if face is None or "output" not in fields:
            return Clause("state", None, span)
        node = State(
            name=state_name,
            face=face,
            gates=gates,
            span=span,
            field_spans={key: item.span for key, item in fields.items()},
            **{
                key: fields[key].value
                for key in ("tier", "output", "accumulate", "sample", "over", "max_visits")
                if key in fields
            },
        )
        return Clause("state", node, span)

    def _face(self, fields: dict[str, Clause], owner: str, name_span: Span):
        """The one face of a state, or None after reporting why there is not exactly one."""
        kinds: dict[str, Clause] = {}
        for key, item in fields.items():
            kind = "produce" if key in PRODUCE_FIELDS else key if key in ("call", "tool") else None
            if kind and kind not in kinds:
                kinds[kind] = item
        if not kinds:
            self.report(
                name_span, "no-face", f"{owner} has no face: give it a prompt and a structure, a call, or a tool"
            )
            return None
        if len(kinds) > 1:
            (first, _), (second, item) = list(kinds.items())[:2]
            self.report(
                item.span,
                "two-faces",
                f"{owner} has both {FACE_WORDS[first]} and {FACE_WORDS[second]}: a state has exactly one face",
            )
            return None
        kind, item = next(iter(kinds.items()))
        if kind != "produce":
            return item.value
        missing = [key for key in ("prompt", "structure") if key not in fields]
        for key in missing:
            self.report(
                item.span, "missing-field", f"{owner} has no {key}: a generative state needs a prompt and a structure"
            )
        if missing:
            return None
        values = {key: fields[key].value for key in PRODUCE_FIELDS if key in fields}
        return Produce(**values, span=item.span)

    def start(self, _meta, *items: Clause) -> Machine | None:
        return self.assemble_machine(items)

    def assemble_machine(self, items) -> Machine | None:
        """The machine from its top-level statements (shared with the YAML front end)."""
        declarations: dict[str, list[Clause]] = {"tools": [], "hooks": [], "moved": [], "state": []}
        singles: list[Clause] = []
        for item in items:
            (declarations.get(item.key, singles)).append(item)
        fields = self._fields(singles, "the machine")
        for key, word in (("name", "machine <name>"), ("entry", "entry <state>"), ("budget", "budget <steps>")):
            if key not in fields:
                self.diagnostics.append(
                    Diagnostic(self.file, 1, 1, 1, 1, "error", "missing-field", f"the file has no `{word}` line")
                )
        states = [item.value for item in declarations["state"] if item.value is not None]
        context = fields.get("context")
        if context is not None and json_depth(context.value) > MAX_DEPTH:  # it would reach every checkpoint
            self.report(context.span, "invalid-value", f"context values nest more than {MAX_DEPTH} levels deep")
        if self.diagnostics:
            return None
        return Machine(
            tools=[item.value for item in declarations["tools"]],
            hooks=[item.value for item in declarations["hooks"]],
            moved=[item.value for item in declarations["moved"]],
            states=states,
            span=Span(file=self.file),
            field_spans={key: item.span for key, item in fields.items()},
            **{key: item.value for key, item in fields.items()},
        )


def _number(value: Any) -> Any:
    """A NUMBER token inside a value becomes an int or a float, as in JSON."""
    if isinstance(value, Token) and value.type == "NUMBER":
        return json.loads(value)
    return value


def build(tree, file: str | None) -> Machine:
    """The machine of a parse tree; raises MkSyntaxError with every problem found."""
    builder = Builder(file)
    machine = builder.transform(tree)
    if builder.diagnostics:
        raise MkSyntaxError(sorted(builder.diagnostics, key=lambda d: (d.line, d.col)))
    return machine
