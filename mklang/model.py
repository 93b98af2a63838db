"""Typed model of a machine (SPEC sections 1-2).

Every node carries a source `span` and the comments around it; both are
presentation, not meaning, so they are left out of equality:
`parse(fmt(m)) == m` compares what the machine does. Invalid combinations
are unrepresentable: a state has exactly one `face`.

The nodes are standard-library dataclasses, keyword-only: loading a machine
is on the start-up path of every command, and pydantic's import alone costs
more than the whole `mklang check` budget (ADR 0010). The front ends check
every value they put into a node.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Self

if TYPE_CHECKING:
    from pydantic import TypeAdapter

from mklang.vocabulary import Tier, root_key

Policy = Literal["ok", "repair", "escalate", "fail"]
DEFAULT_REPLY_TO = "human.reply"


@dataclass(frozen=True, kw_only=True)
class Span:
    """Where a node came from: 1-based line and column, end inclusive-exclusive."""

    file: str | None = None
    line: int = 1
    col: int = 1
    end_line: int = 1
    end_col: int = 1


@dataclass(kw_only=True)
class FieldComments:
    """Comments around a one-line statement that sets a field (`entry x`, `output y`)."""

    before: list[str] = field(default_factory=list)  # own-line comments above it
    after: str | None = None  # the comment at the end of its line


@dataclass(kw_only=True, eq=False)
class Node:
    """Base of every model node; span and comments never take part in equality."""

    # Fields that describe presentation, not meaning: skipped by equality.
    _presentation: ClassVar[frozenset[str]] = frozenset(
        {"span", "comments", "line_comment", "trailing_comments", "field_spans", "field_comments"}
    )

    span: Span | None = field(default=None, repr=False)
    comments: list[str] = field(default_factory=list, repr=False)
    # The comment at the end of the node's first line (`state x {  # why`).
    line_comment: str | None = field(default=None, repr=False)
    # Comments after the node's last child (before a state's `}`, at the end of a file).
    trailing_comments: list[str] = field(default_factory=list, repr=False)
    # Where each field was set, by field name (`budget`, `sample`, `prompt`...).
    field_spans: dict[str, Span] = field(default_factory=dict, repr=False)
    field_comments: dict[str, FieldComments] = field(default_factory=dict, repr=False)

    def __eq__(self, other: object) -> bool:
        if type(self) is not type(other):
            return NotImplemented
        return all(getattr(self, name) == getattr(other, name) for name in _meaning(type(self)))

    __hash__ = None  # type: ignore[assignment]

    def replace(self, **changes: Any) -> Self:
        """A copy with some fields changed (the nodes inside are shared)."""
        return replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        """The meaning of the node as plain JSON data (no spans, no comments)."""
        return {name: _plain(getattr(self, name)) for name in _meaning(type(self))}


_MEANING: dict[type[Node], tuple[str, ...]] = {}


def _meaning(cls: type[Node]) -> tuple[str, ...]:
    """The fields of `cls` that take part in equality, in declaration order."""
    names = _MEANING.get(cls)
    if names is None:
        names = _MEANING[cls] = tuple(f.name for f in fields(cls) if f.name not in cls._presentation)
    return names


def _plain(value: Any) -> Any:
    if isinstance(value, Node):
        return value.to_json()
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


@dataclass(kw_only=True, eq=False)
class Choice(Node):
    """One answer a human may give to a decision, and the transition it takes
    (`choice "approve" -> publish`; `target is None` means `fail`)."""

    label: str
    target: str | None = None


@dataclass(kw_only=True, eq=False)
class Timeout(Node):
    """The deadline of a human decision and the transition taken once it passes
    (`within 48h -> expired`; `target is None` means `fail`)."""

    within: str  # a duration as written: `90s`, `30m`, `48h`, `2d`
    target: str | None = None

    @property
    def seconds(self) -> int:
        from mklang.vocabulary import duration_seconds

        return duration_seconds(self.within) or 0


@dataclass(kw_only=True, eq=False)
class Gate(Node):
    """A condition plus a policy. `when is None` means the catch-all `otherwise`.

    An escalation with `choices` is a human decision (language 0.5): it has no
    `target` of its own, the human's choice (or its `timeout`) takes the transition.
    """

    when: str | None = None
    hook: str | None = None
    policy: Policy = "ok"
    target: str | None = None  # None only for `fail` and a human decision
    repair: int | None = None  # the repair budget N of `repair N`
    ask: str | None = None
    reply_to: str | None = None  # None means DEFAULT_REPLY_TO
    show: str | None = None  # the context path a human decision approves
    choices: list[Choice] = field(default_factory=list)
    timeout: Timeout | None = None

    @property
    def decides(self) -> bool:
        """A human decision: the transition is the answer to a question, not the gate's own."""
        return bool(self.choices)

    @property
    def targets(self) -> list[str]:
        """Every state (or END) this gate may go to: its target, its choices' and its timeout's."""
        found = [self.target] if self.target is not None else []
        found += [choice.target for choice in self.choices if choice.target is not None]
        if self.timeout is not None and self.timeout.target is not None:
            found.append(self.timeout.target)
        return list(dict.fromkeys(found))

    @cached_property
    def label(self) -> str:
        """The text the trace records as `gate` (kept once read, as `via`: the engine reads both
        every step, and a node is not changed once built; `replace` makes a new one)."""
        return "otherwise" if self.when is None else self.when

    @cached_property
    def via(self) -> str:
        """How this gate is decided: `hook`, `llm` or `otherwise`."""
        if self.when is None:
            return "otherwise"
        return "hook" if self.hook else "llm"

    @property
    def effective_reply_to(self) -> str:
        return self.reply_to or DEFAULT_REPLY_TO


@dataclass(kw_only=True, eq=False)
class Produce(Node):
    """Generative face: an LLM writes the output."""

    kind: Literal["produce"] = "produce"
    prompt: str
    structure: str
    execution: str | None = None
    reason: bool = False
    parse: Literal["list", "json"] | None = None


@dataclass(kw_only=True, eq=False)
class Call(Node):
    """Call face: a sub-machine produces the output."""

    kind: Literal["call"] = "call"
    machine: str
    input: dict[str, Any] | None = None


@dataclass(kw_only=True, eq=False)
class ToolUse(Node):
    """Tool face: a host callable produces the output."""

    kind: Literal["tool"] = "tool"
    tool: str
    input: dict[str, Any] | None = None


Face = Produce | Call | ToolUse


@dataclass(kw_only=True, eq=False)
class State(Node):
    name: str
    face: Face
    tier: Tier | None = None
    output: str
    accumulate: bool = False
    sample: int | None = None  # N >= 2; exclusive with `over`
    over: str | None = None  # a context path naming a list
    max_visits: int | None = None
    gates: list[Gate]

    @cached_property
    def fans_out(self) -> bool:
        """Kept once read, as `Gate.via` is."""
        return self.sample is not None or self.over is not None

    @cached_property
    def output_key(self) -> str:
        """The context key the output goes into (`vocabulary.root_key`), kept once read: a step reads it."""
        return root_key(self.output)


@dataclass(kw_only=True, eq=False)
class Declaration(Node):
    """A declared tool or hook: its name and what it does."""

    name: str
    description: str = ""


@dataclass(kw_only=True, eq=False)
class ToolDeclaration(Declaration):
    """A declared tool; `read_only` says it observes the world without changing it, so
    a tainted decision may reach it (SPEC section 4, "Control-flow taint")."""

    read_only: bool = False


@dataclass(kw_only=True, eq=False)
class Moved(Node):
    """`moved "old" -> "new"`: state `old` of an earlier version is `new` now, so a run parked
    at `old` migrates to this version without a `--map` (ADR 0061)."""

    old: str
    new: str


@dataclass(kw_only=True, eq=False)
class Machine(Node):
    name: str
    version: str | None = None  # the `mklang 0.5` line, when present
    entry: str
    budget: int
    tier: Tier = "balanced"
    result: str | None = None
    context: dict[str, Any] = field(default_factory=dict)
    tools: list[ToolDeclaration] = field(default_factory=list)
    hooks: list[Declaration] = field(default_factory=list)
    moved: list[Moved] = field(default_factory=list)
    states: list[State]
    # Where the machine was loaded from; set by the loader, not part of meaning.
    path: str | None = field(default=None, repr=False)

    _presentation: ClassVar[frozenset[str]] = Node._presentation | {"path"}

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> Machine:
        """Build a machine from plain data (the shape of `to_json`), validated by pydantic.

        Raises `mklang.errors.LoadError` naming the first invalid field.
        """
        from pydantic import TypeAdapter, ValidationError

        from mklang.errors import Diagnostic, LoadError

        global _ADAPTER
        if _ADAPTER is None:
            _ADAPTER = TypeAdapter(cls)
        try:
            return _ADAPTER.validate_python(data)
        except ValidationError as error:
            first = error.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            raise LoadError(
                [Diagnostic(None, 1, 1, 1, 1, "error", "invalid-machine", f"{where}: {first['msg']}")]
            ) from None

    def renames(self) -> dict[str, str]:
        """The states of earlier versions this one declares `moved`: old name to new."""
        return {moved.old: moved.new for moved in self.moved}

    def state(self, name: str) -> State | None:
        """The state called `name`, or None."""
        for state in self.states:
            if state.name == name:
                return state
        return None


def called_machines(root: Machine, load: Callable[[str, str | None], Machine | None]) -> Iterator[Machine]:
    """`root` and every machine it calls, directly or not, each once; a call `load` answers
    None for is passed over (the caller decides what a machine that does not load means)."""
    seen: set[str] = set()
    todo = [root]
    while todo:
        machine = todo.pop()
        key = machine.path or f"<{machine.name}>"
        if key in seen:
            continue
        seen.add(key)
        yield machine
        for state in machine.states:
            if isinstance(state.face, Call) and (called := load(state.face.machine, machine.path)) is not None:
                todo.append(called)


_ADAPTER: TypeAdapter[Machine] | None = None  # pydantic's validator of Machine, built on first use
