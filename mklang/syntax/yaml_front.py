"""YAML machine documents in the original mklang layout (SPEC section 2, last bullet).

The document is composed into YAML nodes (which carry line marks), each entry
becomes the same statement `Clause` the `.mk` grammar produces, and the
`.mk` builder assembles the machine, so both syntaxes obey one set of rules
and diagnostics point at YAML lines.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from mklang.effects import LEGACY_READ_ONLY
from mklang.errors import Diagnostic, MkSyntaxError
from mklang.model import (
    Call,
    Choice,
    Declaration,
    Gate,
    Machine,
    Moved,
    Policy,
    Span,
    Timeout,
    ToolDeclaration,
    ToolUse,
)
from mklang.syntax.build import Builder, Clause
from mklang.syntax.lexemes import Lexeme, scan_at
from mklang.vocabulary import LANGUAGE_VERSION, PARSE_MODES, PLACEHOLDER, TIERS, VERSION_NUMBER, duration_seconds

# YAML key -> `.mk` statement, where they differ.
TOP_KEYS = {"mklang": "version", "machine": "name", "entry": "entry", "budget": "budget", "default_tier": "tier",
            "result": "result", "context": "context"}  # fmt: skip
STATE_KEYS = ("prompt", "structure", "execution", "reason", "parse", "call", "tool", "input", "tier", "output",
              "accumulate", "sample", "over", "max_visits", "gates")  # fmt: skip
GATE_KEYS = ("when", "hook", "then", "to", "ask", "reply_to", "repair", "escalate", "fail", "show", "choices",
             "within", "on_timeout")  # fmt: skip
DECISION_KEYS = ("choices", "within", "on_timeout")  # a human decision (language 0.5)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*\Z")


class _Reader:
    """Walks the YAML nodes; the `.mk` builder checks and assembles."""

    def __init__(self, file: str | None):
        import yaml

        self.file = file
        self.builder = Builder(file)
        self.constructor = yaml.constructor.SafeConstructor()
        self.yaml = yaml

    def span(self, node) -> Span:
        start, end = node.start_mark, node.end_mark
        return Span(
            file=self.file, line=start.line + 1, col=start.column + 1, end_line=end.line + 1, end_col=end.column + 1
        )

    def entry_span(self, key_node, value_node) -> Span:
        """A `key: value` entry, from its key to the end of its value's last scalar: a block
        collection ends where the next key starts, past the blank lines and comments before it."""
        node = value_node
        while isinstance(node, self.yaml.CollectionNode) and not node.flow_style and node.value:
            last = node.value[-1]
            node = last[1] if isinstance(last, tuple) else last
        end = self.span(node)
        if end.end_col == 1 and end.end_line > end.line:  # a block scalar ends at the next line's start
            end = replace(end, end_line=end.end_line - 1)
        return replace(self.span(key_node), end_line=end.end_line, end_col=end.end_col)

    def error(self, node, code: str, message: str) -> None:
        self.builder.report(self.span(node), code, message)

    def value(self, node) -> Any:
        return self.constructor.construct_document(node)

    def data(self, node, what: str) -> Any:
        """A JSON-like value (context, input maps); dates, sets and other YAML types are refused."""
        value = self.value(node)
        if not _is_json(value):
            self.error(
                node,
                "invalid-value",
                f"{what} must hold JSON values only (text, numbers, true/false, null, lists, maps)",
            )
            return {}
        return value

    def mapping(self, node, what: str, allowed) -> list[tuple[str, Any, Any]]:
        """(key, key node, value node) of a mapping; unknown keys are reported."""
        if not isinstance(node, self.yaml.MappingNode):
            self.error(node, "invalid-value", f"{what} must be a mapping")
            return []
        entries = []
        for key_node, value_node in node.value:
            key = str(self.value(key_node))
            if key in allowed:
                entries.append((key, key_node, value_node))
            else:
                self.error(key_node, "unknown-field", f'{what} has no field "{key}"')
        return entries

    def text(self, node, what: str) -> str:
        value = self.value(node)
        if not isinstance(value, str):
            self.error(node, "invalid-value", f"{what} must be text")
            return ""
        return value

    # -- document ------------------------------------------------------------

    def machine(self, root) -> Machine | None:
        items = []
        allowed = (*TOP_KEYS, "tools", "hooks", "moved", "states")
        for key, key_node, node in self.mapping(root, "the machine", allowed):
            span = self.entry_span(key_node, node)
            if key in ("tools", "hooks"):
                items += [Clause(key, decl, decl.span or span) for decl in self.declarations(node, key)]
            elif key == "states":
                items += self.states(node)
            elif key == "moved":
                items += self.moved(node)
            else:
                items.append(Clause(TOP_KEYS[key], self.top_value(TOP_KEYS[key], node), span))
        items += _legacy_declarations(items)
        return self.builder.assemble_machine(items)

    def top_value(self, field: str, node) -> Any:
        value = self.value(node)
        span = self.span(node)
        if field == "budget":
            return self.builder.whole_number(value, "budget", span)
        if field == "tier":
            return self.builder.one_of(value, TIERS, "default_tier", span)
        if field == "context":
            value = self.data(node, "context")
            if not isinstance(value, dict):
                self.error(node, "invalid-value", "context must be a mapping")
                return {}
            return value
        if field == "version":
            number = VERSION_NUMBER.match(str(value))
            if number is None:
                self.error(
                    node, "invalid-value", f'mklang must be a version number like {LANGUAGE_VERSION}, not "{value}"'
                )
                return str(value)
            return str(value).removesuffix(number[3] or "")
        return self.name(
            node,
            {"name": "a machine name", "entry": "a state name"}.get(field, "a context path"),
            dotted=field == "result",
        )

    def name(self, node, what: str, dotted: bool = False) -> str:
        """A name (or, when `dotted`, a context path) written as a YAML scalar."""
        value = self.value(node)
        if not isinstance(value, str) or not _NAME.match(value):
            self.error(node, "invalid-name", f"{what} must be a name of letters, digits and _, not {value!r}")
            return "_"
        return value if dotted else self.builder.plain_name(value, what, self.span(node))

    def declarations(self, node, key: str) -> list[Declaration]:
        """`tools` or `hooks`: a list of {name, description}; a tool may add `read_only`,
        which defaults to mklang 1.x's classification of its built-ins (LEGACY_READ_ONLY)."""
        if not isinstance(node, self.yaml.SequenceNode):
            self.error(node, "invalid-value", f"{key} must be a list of {{name, description}}")
            return []
        allowed = ("name", "description", "read_only") if key == "tools" else ("name", "description")
        found: list[Declaration] = []
        for entry in node.value:
            fields = {k: v for k, _, v in self.mapping(entry, f"a {key[:-1]}", allowed)}
            if "name" not in fields:
                self.error(entry, "missing-field", f"a {key[:-1]} needs a name")
                continue
            description = self.text(fields["description"], "a description") if "description" in fields else ""
            name = self.name(fields["name"], f"a {key[:-1]} name")
            if key == "hooks":
                found.append(Declaration(name=name, description=description, span=self.span(entry)))
                continue
            read_only = name in LEGACY_READ_ONLY
            if "read_only" in fields:
                read_only = self.value(fields["read_only"])
                if not isinstance(read_only, bool):
                    self.error(fields["read_only"], "invalid-value", "read_only must be true or false")
            found.append(
                ToolDeclaration(name=name, description=description, read_only=read_only is True, span=self.span(entry))
            )
        return found

    def moved(self, node) -> list[Clause]:
        """`moved: {old: new}`: the `.mk` file's `moved "old" -> "new"` lines, one per entry."""
        if not isinstance(node, self.yaml.MappingNode):
            self.error(node, "invalid-value", "moved must be a mapping of old state names to new ones")
            return []
        found = []
        for key_node, value_node in node.value:
            span = self.entry_span(key_node, value_node)
            old, new = self.text(key_node, "a moved state's old name"), self.text(value_node, "its new name")
            found.append(Clause("moved", Moved(old=old, new=new, span=span), span))
        return found

    def states(self, node) -> list[Clause]:
        """`states` as a mapping name -> state, or as a list of states with a `name`."""
        if isinstance(node, self.yaml.MappingNode):
            pairs = [(self.value(k), k, v) for k, v in node.value]
        elif isinstance(node, self.yaml.SequenceNode):
            pairs = []
            for entry in node.value:
                if not isinstance(entry, self.yaml.MappingNode):
                    self.error(entry, "invalid-value", "a state must be a mapping")
                    continue
                name_node = next((v for k, v in entry.value if self.value(k) == "name"), None)
                if name_node is None:
                    self.error(entry, "missing-field", "a state needs a name")
                    continue
                entry.value = [(k, v) for k, v in entry.value if self.value(k) != "name"]
                pairs.append((self.value(name_node), name_node, entry))
        else:
            self.error(node, "invalid-value", "states must be a mapping of name to state")
            return []
        return [self.state(self.name(name_node, "a state name"), name_node, body) for _, name_node, body in pairs]

    def state(self, name: str, name_node, node) -> Clause:
        items, inputs, faces = [], None, []
        for key, key_node, value_node in self.mapping(node, f'state "{name}"', STATE_KEYS):
            span = self.span(key_node)
            value = self.value(value_node)
            if key == "gates":
                items += self.gates(value_node)
            elif key == "input":
                inputs = self.data(value_node, "input")
                if not isinstance(inputs, dict):
                    self.error(value_node, "invalid-value", "input must be a mapping")
                    inputs = None
            elif key in ("call", "tool"):
                faces.append((key, self.name(value_node, f"a {'machine' if key == 'call' else 'tool'} name"), span))
            elif key in ("sample", "max_visits"):
                items.append(Clause(key, self.builder.whole_number(value, key, span), span))
            elif key in ("reason", "accumulate"):
                if value:
                    items.append(Clause(key, True, span))
            elif key == "over":
                match = PLACEHOLDER.fullmatch(value.strip()) if isinstance(value, str) else None
                path = match.group(1) if match else value
                if not isinstance(path, str) or not _NAME.match(path):
                    self.error(
                        value_node,
                        "invalid-name",
                        f'over must name a context list, as "{{{{list}}}}" or list, not {value!r}',
                    )
                items.append(Clause(key, path if isinstance(path, str) else "_", span))
            elif key in ("tier", "parse"):
                allowed = TIERS if key == "tier" else PARSE_MODES
                items.append(Clause(key, self.builder.one_of(value, allowed, key, span), span))
            elif key == "output":
                items.append(Clause(key, self.name(value_node, "an output key"), span))
            else:
                items.append(Clause(key, self.text(value_node, key), span))
        for key, value, span in faces:  # the `input` map applies to whichever face there is
            face = (Call(machine=str(value), input=inputs, span=span) if key == "call"
                    else ToolUse(tool=str(value), input=inputs, span=span))  # fmt: skip
            items.append(Clause(key, face, span))
        name_span, body = self.span(name_node), self.span(node)
        span = Span(
            file=self.file, line=name_span.line, col=name_span.col, end_line=body.end_line, end_col=body.end_col
        )
        return self.builder.assemble_state(name, name_span, span, items)

    def gates(self, node) -> list[Clause]:
        if not isinstance(node, self.yaml.SequenceNode):
            self.error(node, "invalid-value", "gates must be a list")
            return []
        return [
            Clause("gate", gate, gate.span or self.span(node))
            for gate in map(self.gate, node.value)
            if gate is not None
        ]

    def gate(self, node) -> Gate | None:
        nodes = {key: value for key, _, value in self.mapping(node, "a gate", GATE_KEYS)}
        fields = {key: self.value(value) for key, value in nodes.items()}
        when = None if fields.get("when") in (None, "otherwise") else self.text(nodes["when"], "when")
        then = fields.get("then", "ok")
        policy: Policy = "ok"
        repair = None
        if fields.get("fail") or then == "fail":
            policy = "fail"
        elif fields.get("escalate") or then == "escalate":
            policy = "escalate"
        elif "repair" in fields or then == "repair" or isinstance(then, dict):
            policy = "repair"
            budget = fields.get("repair", then.get("repair") if isinstance(then, dict) else None)
            repair = self.builder.whole_number(budget, "repair", self.span(node))
        elif then != "ok":
            self.error(node, "invalid-value", f'a gate\'s "then" must be ok, repair, escalate or fail, not "{then}"')
        if "hook" in nodes and when is None:  # `.mk` has no hook gate without its condition text
            self.error(node, "missing-field", 'a gate with a "hook" needs a "when" that says what the hook checks')
            return None
        decision = {key: nodes[key] for key in DECISION_KEYS if key in nodes}
        if decision:
            return self.decision(node, nodes, when, policy, decision)
        if policy != "fail" and "to" not in nodes:
            self.error(node, "missing-field", 'this gate needs a target: "to: <state>" or "to: END"')
            return None
        escalate = policy == "escalate"
        return Gate(
            when=when,
            hook=self.name(nodes["hook"], "a hook name") if "hook" in nodes else None,
            policy=policy,
            target=None if policy == "fail" else self.name(nodes["to"], "a state name"),
            repair=repair,
            ask=self.text(nodes["ask"], "ask") if escalate and "ask" in nodes else None,
            reply_to=self.name(nodes["reply_to"], "reply_to", dotted=True)
            if escalate and "reply_to" in nodes
            else None,
            show=self.name(nodes["show"], "show", dotted=True) if escalate and "show" in nodes else None,
            span=self.span(node),
        )

    def decision(self, node, nodes: dict, when: str | None, policy: Policy, decision: dict) -> Gate | None:
        """A human decision: `choices: {label: state | fail}`, `within: 48h`, `on_timeout: state | fail`."""
        if policy not in ("ok", "escalate"):
            self.error(node, "invalid-value", f"a gate with choices escalates to a human; it cannot also {policy}")
            return None
        if "to" in nodes:
            self.error(nodes["to"], "invalid-value", 'a gate with choices has no "to": each choice names its state')
            return None
        choices = []
        if "choices" in decision:
            if not isinstance(decision["choices"], self.yaml.MappingNode):
                self.error(decision["choices"], "invalid-value", "choices must map each answer to its state or fail")
                return None
            for key_node, value_node in decision["choices"].value:
                label = self.text(key_node, "a choice")
                choices.append(Choice(label=label, target=self.target(value_node), span=self.span(key_node)))
        timeout = None
        if "within" in decision or "on_timeout" in decision:
            if "within" not in decision or "on_timeout" not in decision:
                self.error(
                    node, "missing-field", 'a deadline needs both "within: <duration>" and "on_timeout: <state>"'
                )
                return None
            within = self.value(decision["within"])
            if not isinstance(within, str) or duration_seconds(within) is None:
                self.error(
                    decision["within"],
                    "invalid-value",
                    f"within must be a duration like 48h (s, m, h, d), not {within!r}",
                )
                return None
            timeout = Timeout(
                within=within, target=self.target(decision["on_timeout"]), span=self.span(decision["within"])
            )
        return Gate(
            when=when,
            hook=self.name(nodes["hook"], "a hook name") if "hook" in nodes else None,
            policy="escalate",
            ask=self.text(nodes["ask"], "ask") if "ask" in nodes else None,
            show=self.name(nodes["show"], "show", dotted=True) if "show" in nodes else None,
            reply_to=self.name(nodes["reply_to"], "reply_to", dotted=True) if "reply_to" in nodes else None,
            choices=choices,
            timeout=timeout,
            span=self.span(node),
        )

    def target(self, node) -> str | None:
        """A state name, END, or `fail` (None)."""
        return None if self.value(node) == "fail" else self.name(node, "a state name")


def _legacy_declarations(items: list[Clause]) -> list[Clause]:
    """A declaration `read_only` for each of 1.x's read-only built-ins a state uses undeclared:
    the machine keeps the classification 1.x gave it, in `.mk` too once converted."""
    declared = {item.value.name for item in items if item.key == "tools"}
    added: dict[str, Clause] = {}
    for item in items:
        if item.key != "state" or item.value is None:
            continue
        face = item.value.face
        if isinstance(face, ToolUse) and face.tool in LEGACY_READ_ONLY and face.tool not in declared | set(added):
            added[face.tool] = Clause("tools", ToolDeclaration(name=face.tool, read_only=True), item.span)
    return list(added.values())


def _is_json(value: Any) -> bool:
    if value is None or isinstance(value, (str, bool, int)):
        return True
    if isinstance(value, float):
        return value == value and value not in (float("inf"), float("-inf"))
    if isinstance(value, list):
        return all(_is_json(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(key, str) and _is_json(item) for key, item in value.items())
    return False


def parse_yaml(text: str, filename: str | None = None) -> Machine:
    """A YAML machine document as a `Machine`; raises MkSyntaxError with YAML positions."""
    import yaml

    from mklang.yaml_composer import compose_yaml

    try:
        root = compose_yaml(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        problem = getattr(error, "problem", None) or "not a valid YAML document"
        raise MkSyntaxError(
            [Diagnostic(filename, line, col, line, col + 1, "error", "syntax", f"YAML: {problem}")]
        ) from None
    if root is None:
        raise MkSyntaxError([Diagnostic(filename, 1, 1, 1, 1, "error", "syntax", "the YAML document is empty")])
    reader = _Reader(filename)
    try:
        machine = reader.machine(root)
    except yaml.YAMLError as error:  # a tag the safe constructor refuses
        mark = getattr(error, "problem_mark", None) or root.start_mark
        raise MkSyntaxError(
            [
                Diagnostic(
                    filename,
                    mark.line + 1,
                    mark.column + 1,
                    mark.line + 1,
                    mark.column + 2,
                    "error",
                    "syntax",
                    f"YAML: {getattr(error, 'problem', error)}",
                )
            ]
        ) from None
    if reader.builder.diagnostics:
        raise MkSyntaxError(sorted(reader.builder.diagnostics, key=lambda d: (d.line, d.col)))
    assert machine is not None, "the builder returns no machine only with diagnostics"
    from mklang.syntax.comments import attach

    attach(machine, yaml_comments(text))  # `fmt` keeps them, as it keeps a .mk file's
    return machine


_COMMENT = re.compile(r"#[^\n]*")
_COMMENT_START = re.compile(r"(?:^|(?<=[ \t\n]))#")


def yaml_comments(text: str) -> list[Lexeme]:
    """The comments of a YAML text. They lie between its tokens (a scalar token, block
    scalars included, holds any `#` that is part of a value), where a `#` begins a comment
    at a line's start or after a space."""
    import yaml

    found: list[re.Match[str]] = []
    reached = 0
    for token in [*yaml.scan(text, Loader=yaml.SafeLoader), None]:
        start, end = (token.start_mark.index, token.end_mark.index) if token is not None else (len(text), len(text))
        for mark in _COMMENT_START.finditer(text, reached, max(start, reached)):
            comment = _COMMENT.match(text, mark.start())
            if comment is not None and (not found or comment.start() >= found[-1].end()):
                found.append(comment)
        reached = max(reached, end)
    return scan_at(text, found)
