"""The YAML front end: the original layout loads into the same model, with YAML positions."""

from __future__ import annotations

import pytest

from mklang.errors import MkSyntaxError
from mklang.model import Call, Produce, ToolUse
from mklang.syntax import format_machine, load_file, parse
from mklang.syntax.yaml_front import parse_yaml

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


def test_every_construct_converts_to_mk_and_back_to_the_same_model(tmp_path):
    path = tmp_path / "everything.mkl"
    path.write_text(EVERYTHING)
    machine = load_file(path)
    assert (machine.name, machine.version, machine.tier, machine.result) == ("everything", "0.4", "fast", "draft")
    assert [d.name for d in machine.tools] == ["search_kb"] and machine.hooks[
        0
    ].description == "True when amount <= 100."
    classify, lookup, fan, vote = machine.states
    assert isinstance(classify.face, Produce) and classify.face.prompt == "Classify: {{ticket.body}}\n"
    assert (classify.face.reason, classify.face.parse, classify.max_visits) == (True, "json", 3)
    assert [(g.policy, g.repair, g.hook) for g in classify.gates] == [
        ("ok", None, "amount_ok"),
        ("repair", 2, None),
        ("ok", None, None),
    ]
    assert isinstance(lookup.face, ToolUse) and lookup.gates[0].reply_to == "manual.answer"
    assert isinstance(fan.face, Call) and (fan.over, fan.accumulate, fan.face.input) == (
        "chunks",
        True,
        {"text": "{{item}}"},
    )
    assert (vote.sample, vote.gates[1].policy) == (3, "fail")
    as_mk = format_machine(machine)
    assert parse(as_mk) == machine
    assert format_machine(parse(as_mk)) == as_mk


def test_states_may_be_a_list_with_names():
    listed = parse_yaml(
        "machine: m\nentry: a\nbudget: 3\nstates:\n  - name: a\n    tool: t\n    output: o\n    gates: [{to: END}]\n"
    )
    mapped = parse_yaml("machine: m\nentry: a\nbudget: 3\nstates:\n  a: {tool: t, output: o, gates: [{to: END}]}\n")
    assert listed == mapped


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("machine: m\nentry: a\nbudget: [1\n", [(4, 1, "syntax")]),
        (
            "machine: m\nentry: a\nbudget: 3\nstates:\n  a:\n    tool: t\n    call: c\n    output: o\n    gates: [{to: END}]\n",
            [(7, 5, "two-faces")],
        ),
        (
            "machine: m\nentry: a\nbudget: 3\nstates:\n  a:\n    tool: t\n    outptu: o\n    gates: [{to: END}]\n",
            [(5, 3, "no-output"), (7, 5, "unknown-field")],
        ),
        ("machine: m\nentry: a\nbudget: lots\nstates: {}\n", [(3, 9, "invalid-number")]),
        (
            "machine: m\nentry: a\nbudget: 3\nstates:\n  a:\n    tool: t\n    output: o\n    gates:\n      - {when: x}\n",
            [(9, 9, "missing-field")],
        ),
        ("", [(1, 1, "syntax")]),
    ],
    ids=["yaml-syntax", "two-faces", "unknown-field", "budget", "gate-target", "empty"],
)
def test_diagnostics_point_at_yaml_lines(text, expected):
    with pytest.raises(MkSyntaxError) as caught:
        parse_yaml(text, "m.mkl")
    assert [(d.line, d.col, d.code) for d in caught.value.diagnostics] == expected


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mklang.errors import LoadError  # noqa: E402

yaml_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.text(max_size=8),
    st.sampled_from(["2024-01-01", "{{x}}", "otherwise", "END", "!!set {a}", "[1", "a.b"]),
)
yaml_trees = st.recursive(
    yaml_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(
            st.one_of(
                st.sampled_from(
                    [
                        "machine",
                        "entry",
                        "budget",
                        "states",
                        "gates",
                        "to",
                        "when",
                        "tool",
                        "call",
                        "input",
                        "output",
                        "context",
                        "tools",
                        "hooks",
                        "name",
                        "repair",
                        "then",
                        "over",
                        "sample",
                    ]
                ),
                st.text(max_size=4),
            ),
            inner,
            max_size=5,
        ),
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.text(max_size=120), yaml_trees.map(lambda tree: __import__("yaml").safe_dump(tree))))
def test_arbitrary_yaml_yields_a_machine_or_a_diagnostic(text):
    try:
        machine = parse_yaml(text, "fuzz.mkl")
    except LoadError as error:
        assert error.diagnostics
    else:
        assert parse(format_machine(machine)) == machine
