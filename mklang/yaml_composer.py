"""Reading YAML within the limits of `mklang.limits` (imported only when YAML is read)."""

from __future__ import annotations

from typing import Any

import yaml

from mklang.limits import MAX_DEPTH, MAX_YAML_ALIAS_VALUES, MAX_YAML_ALIASES


class LimitError(yaml.MarkedYAMLError):
    """A document over one of the limits (not a syntax error)."""


class LimitedComposer(yaml.composer.Composer, yaml.resolver.Resolver):
    """PyYAML's composer fed by a parser's events, counting depth, aliases and what they expand to.

    Only values reached through aliases are counted: the document's own values
    grow with its text, which the file size limit bounds, while aliases can
    multiply them (a bomb). A big machine written out in full is not refused.
    """

    def __init__(self, parser: Any):
        yaml.composer.Composer.__init__(self)
        yaml.resolver.Resolver.__init__(self)
        self._parser = parser
        self._open: list[tuple[str | None, int]] = []  # (anchor, expanded size so far) of open collections
        self._sizes: dict[str, int] = {}  # expanded size of each closed anchor
        self._aliases = 0
        self._alias_values = 0  # values that aliases add once expanded

    def check_event(self, *choices: Any) -> bool:
        return bool(self._parser.check_event(*choices))

    def peek_event(self) -> Any:
        return self._parser.peek_event()

    def get_event(self) -> Any:
        event = self._parser.get_event()
        self._count(event)
        return event

    def _count(self, event: Any) -> None:
        if isinstance(event, yaml.events.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_YAML_ALIASES:
                self._refuse(event, f"the document has more than {MAX_YAML_ALIASES} aliases")
            if any(anchor == event.anchor for anchor, _ in self._open):
                self._refuse(event, f"the alias *{event.anchor} refers to a value that contains it")
            size = self._sizes.get(event.anchor, 1)
            self._alias_values += size
            if self._alias_values > MAX_YAML_ALIAS_VALUES:
                self._refuse(
                    event, f"the document grows by more than {MAX_YAML_ALIAS_VALUES} values once aliases are expanded"
                )
            self._add(size)
        elif isinstance(event, yaml.events.ScalarEvent):
            self._add(1)
            if event.anchor:
                self._sizes[event.anchor] = 1
        elif isinstance(event, yaml.events.CollectionStartEvent):
            if len(self._open) >= MAX_DEPTH:
                self._refuse(event, f"the document nests values more than {MAX_DEPTH} levels deep")
            self._open.append((event.anchor, 1))
        elif isinstance(event, yaml.events.CollectionEndEvent):
            anchor, size = self._open.pop()
            if anchor:
                self._sizes[anchor] = size
            self._add(size)

    def _add(self, size: int) -> None:
        """Count `size` expanded values into the enclosing collection, whose anchor an alias may name."""
        if self._open:
            anchor, open_size = self._open[-1]
            self._open[-1] = (anchor, open_size + size)

    def _refuse(self, event: Any, problem: str) -> None:
        raise LimitError(problem=problem, problem_mark=event.start_mark)


def compose(parser: Any) -> Any:
    """The single document's node tree (None when empty); the parser is disposed of."""
    try:
        return LimitedComposer(parser).get_single_node()
    finally:
        parser.dispose()


def compose_yaml(text: str) -> Any:
    """The node tree of a one-document YAML text (None when empty), within the limits.

    Parsing uses libyaml when PyYAML has it (same marks as the pure-Python
    parser, which still words syntax errors, so messages do not depend on the
    install); the limits are checked event by event, before the composer
    recurses or an alias is followed, so no document can exhaust the stack
    or memory. Errors are `yaml.MarkedYAMLError`s with a position.
    """
    fast = getattr(yaml, "CSafeLoader", None)
    if fast is None:
        return compose(yaml.SafeLoader(text))
    try:
        return compose(fast(text))
    except LimitError:
        raise
    except yaml.YAMLError:  # the pure-Python parser words syntax errors as they always were
        return compose(yaml.SafeLoader(text))


def error_line(path: object, what: str, error: yaml.YAMLError) -> str:
    """A YAML error as one line: `path:line:col: <what> is not valid YAML: <problem>`."""
    mark = getattr(error, "problem_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
    return f"{where}: {what} is not valid YAML: {getattr(error, 'problem', None) or error}"


def load_yaml(text: str) -> Any:
    """The data of a one-document YAML text with the safe types, within the limits."""
    node = compose_yaml(text)
    return None if node is None else yaml.constructor.SafeConstructor().construct_document(node)
