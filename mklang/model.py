"""Typed model of a machine (SPEC sections 1-2).

Every node carries a source `span` and the `comments` that precede it; both
are presentation, not meaning, so they are left out of equality and of
`model_dump()`: `parse(fmt(m)) == m` compares what the machine does.
Invalid combinations are unrepresentable: a state has exactly one `face`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

Tier = Literal["fast", "balanced", "reasoning"]
TIERS: tuple[str, ...] = ("fast", "balanced", "reasoning")
Policy = Literal["ok", "repair", "escalate", "fail"]
END = "END"
DEFAULT_REPLY_TO = "human.reply"
LANGUAGE_VERSION = "0.4"


class Span(BaseModel):
    """Where a node came from: 1-based line and column, end inclusive-exclusive."""

    model_config = ConfigDict(frozen=True, defer_build=True)

    file: str | None = None
    line: int = 1
    col: int = 1
    end_line: int = 1
    end_col: int = 1


class FieldComments(BaseModel):
    """Comments around a one-line statement that sets a field (`entry x`, `output y`)."""

    model_config = ConfigDict(defer_build=True)

    before: list[str] = Field(default_factory=list)  # own-line comments above it
    after: str | None = None  # the comment at the end of its line


class Node(BaseModel):
    """Base of every model node; span and comments never take part in equality.

    Schemas are built on first validation (`defer_build`), not at import: the
    front end builds nodes with `model_construct`, so `mklang check` never pays
    for pydantic's schema generation.
    """

    model_config = ConfigDict(extra="forbid", defer_build=True)

    # Fields that describe presentation, not meaning: skipped by equality.
    _presentation: ClassVar[frozenset[str]] = frozenset(
        {"span", "comments", "line_comment", "trailing_comments", "field_spans", "field_comments"}
    )

    span: Span | None = Field(default=None, exclude=True, repr=False)
    comments: list[str] = Field(default_factory=list, exclude=True, repr=False)
    # The comment at the end of the node's first line (`state x {  # why`).
    line_comment: str | None = Field(default=None, exclude=True, repr=False)
    # Comments after the node's last child (before a state's `}`, at the end of a file).
    trailing_comments: list[str] = Field(default_factory=list, exclude=True, repr=False)
    # Where each field was set, by field name (`budget`, `sample`, `prompt`...).
    field_spans: dict[str, Span] = Field(default_factory=dict, exclude=True, repr=False)
    field_comments: dict[str, FieldComments] = Field(default_factory=dict, exclude=True, repr=False)

    def __eq__(self, other: object) -> bool:
        if type(self) is not type(other):
            return NotImplemented
        return all(
            getattr(self, name) == getattr(other, name)
            for name in type(self).model_fields
            if name not in self._presentation
        )

    __hash__ = None  # type: ignore[assignment]


class Gate(Node):
    """A condition plus a policy. `when is None` means the catch-all `otherwise`."""

    when: str | None = None
    hook: str | None = None
    policy: Policy = "ok"
    target: str | None = None  # None only for `fail`
    repair: int | None = None  # the repair budget N of `repair N`
    ask: str | None = None
    reply_to: str | None = None  # None means DEFAULT_REPLY_TO

    @property
    def label(self) -> str:
        """The text the trace records as `gate`."""
        return "otherwise" if self.when is None else self.when

    @property
    def via(self) -> str:
        """How this gate is decided: `hook`, `llm` or `otherwise`."""
        if self.when is None:
            return "otherwise"
        return "hook" if self.hook else "llm"

    @property
    def effective_reply_to(self) -> str:
        return self.reply_to or DEFAULT_REPLY_TO


class Produce(Node):
    """Generative face: an LLM writes the output."""

    kind: Literal["produce"] = "produce"
    prompt: str
    structure: str
    execution: str | None = None
    reason: bool = False
    parse: Literal["list", "json"] | None = None


class Call(Node):
    """Call face: a sub-machine produces the output."""

    kind: Literal["call"] = "call"
    machine: str
    input: dict[str, Any] | None = None


class ToolUse(Node):
    """Tool face: a host callable produces the output."""

    kind: Literal["tool"] = "tool"
    tool: str
    input: dict[str, Any] | None = None


Face = Union[Produce, Call, ToolUse]


class State(Node):
    name: str
    face: Face = Field(discriminator="kind")
    tier: Tier | None = None
    output: str
    accumulate: bool = False
    sample: int | None = None  # N >= 2; exclusive with `over`
    over: str | None = None  # a context path naming a list
    max_visits: int | None = None
    gates: list[Gate]

    @property
    def fans_out(self) -> bool:
        return self.sample is not None or self.over is not None


class Declaration(Node):
    """A declared tool or hook: its name and what it does."""

    name: str
    description: str = ""


class Machine(Node):
    name: str
    version: str | None = None  # the `mklang 0.4` line, when present
    entry: str
    budget: int
    tier: Tier = "balanced"
    result: str | None = None
    context: dict[str, Any] = Field(default_factory=dict)
    tools: list[Declaration] = Field(default_factory=list)
    hooks: list[Declaration] = Field(default_factory=list)
    states: list[State]
    # Where the machine was loaded from; set by the loader, not part of meaning.
    path: str | None = Field(default=None, exclude=True, repr=False)

    _presentation: ClassVar[frozenset[str]] = Node._presentation | {"path"}

    def state(self, name: str) -> State | None:
        """The state called `name`, or None."""
        for state in self.states:
            if state.name == name:
                return state
        return None
