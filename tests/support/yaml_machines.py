"""YAML machines for the YAML front end and its fuzzing: one that uses every construct, the values a
careless or hostile author might put anywhere in one, and a random edit of a machine's data."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

from hypothesis import strategies as st

# Every construct of the YAML front end, in its original layout.
EVERYTHING = """\
mklang: 0.4
machine: everything
entry: classify
budget: 40
default_tier: fast
result: draft
context:
  ticket: {body: "hi", amount: 42}
  chunks: [a, b]
tools:
  - {name: search_kb, description: "Look up KB facts."}
hooks:
  - name: amount_ok
    description: True when amount <= 100.
states:
  classify:
    tier: balanced
    structure: One word.
    prompt: |
      Classify: {{ticket.body}}
    execution: Be brief.
    reason: true
    parse: json
    output: category
    max_visits: 3
    gates:
      - {when: "billing", hook: amount_ok, then: ok, to: lookup}
      - {when: "needs repair", repair: 2, to: classify}
      - {when: otherwise, then: ok, to: lookup}
  lookup:
    tool: search_kb
    input: {query: "{{ticket.body}}"}
    output: kb
    gates:
      - {when: "no facts", escalate: true, to: fan, ask: "Handle manually?", reply_to: manual.answer}
      - {when: otherwise, to: fan}
  fan:
    over: "{{chunks}}"
    call: summarize_doc
    input: {text: "{{item}}"}
    output: summaries
    accumulate: true
    gates:
      - {when: otherwise, to: vote}
  vote:
    sample: 3
    structure: A list.
    prompt: Vote on {{summaries}}
    parse: list
    output: draft
    gates:
      - {when: "good", to: END}
      - {when: otherwise, fail: true}
"""

# The field names of a machine, where an edit is most likely to reach a check.
FIELD_NAMES = ["machine", "entry", "budget", "states", "gates", "when", "hook", "then", "to", "repair", "fail",
               "escalate", "ask", "reply_to", "name", "output", "prompt", "structure", "tool", "call", "input",
               "over", "sample", "parse", "context", "tools", "hooks"]  # fmt: skip


@functools.cache  # one strategy for every draw: building one is slower than drawing from it
def yaml_values(max_leaves: int) -> st.SearchStrategy[Any]:
    """Values a careless or hostile author might put anywhere: YAML timestamps, binary, text that
    reads as YAML syntax or as a template, and maps keyed by field names."""
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-3, 10**20),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=12),
        st.sampled_from(["END", "otherwise", "ok", "repair", "fail", "escalate", "json", "list", "fast", "a.b"]),
        st.sampled_from(["2024-01-01", "{{x}}", "!!set {a}", "[1"]),
        st.sampled_from(FIELD_NAMES),
        st.dates(),
        st.datetimes(),
        st.binary(max_size=4),
    )
    keys = st.one_of(st.sampled_from(FIELD_NAMES), st.text(max_size=5))
    return st.recursive(
        scalars,
        lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(keys, inner, max_size=5)),
        max_leaves=max_leaves,
    )


def _paths(data: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    children = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in children:
        yield from _paths(value, (*prefix, key))


# The names EVERYTHING declares and refers to: a text replaced by one of them often still refers to something.
NAMES = ["classify", "lookup", "fan", "vote", "END", "search_kb", "amount_ok", "summarize_doc", "draft", "category"]


def _alike(value: Any) -> st.SearchStrategy[Any]:
    """Another value of `value`'s kind (a flag, a count, a name or text): an edit an author makes,
    which leaves the machine well-formed often enough for the formatter's round trip to be tried."""
    if isinstance(value, bool):
        return st.booleans()
    if isinstance(value, int):
        return st.integers(0, 50)
    if isinstance(value, str):
        return st.one_of(st.sampled_from(NAMES), st.text(min_size=1, max_size=12))
    return yaml_values(6)


def _at(data: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        data = data[key]
    return data


# What `mutate` may do: a hostile edit does any of them, an author's edit keeps each value's kind.
HOSTILE = ("replace", "alike", "delete", "add")
AUTHORED = ("alike",)


def mutate(draw: Callable[[st.SearchStrategy[Any]], Any], data: Any, actions: tuple[str, ...] = HOSTILE) -> None:
    """Replace (with anything, or with a value alike), delete or add one value somewhere in the machine's data."""
    paths = list(_paths(data))[1:]
    if actions == AUTHORED:  # an author edits a name, a text or a number, not the shape
        paths = [path for path in paths if isinstance(_at(data, path), (str, int))] or paths
    path = draw(st.sampled_from(paths))
    parent = _at(data, path[:-1])
    action = draw(st.sampled_from(actions))
    if action == "replace":
        parent[path[-1]] = draw(yaml_values(6))
    elif action == "alike":
        parent[path[-1]] = draw(_alike(parent[path[-1]]))
    elif action == "delete":
        del parent[path[-1]]
    elif isinstance(parent, dict):
        parent[draw(st.sampled_from(FIELD_NAMES))] = draw(yaml_values(6))
    else:
        parent.append(draw(yaml_values(6)))
