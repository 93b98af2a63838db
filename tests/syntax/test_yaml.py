"""The YAML front end: the original layout loads into the same model, with YAML positions."""

from __future__ import annotations

import pytest
from support.yaml_machines import EVERYTHING, yaml_values

from mklang.errors import MkSyntaxError
from mklang.model import Call, Produce, ToolUse
from mklang.syntax import format_machine, load_file, parse
from mklang.syntax.yaml_front import parse_yaml


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


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.text(max_size=120), yaml_values(20).map(lambda tree: __import__("yaml").safe_dump(tree))))
def test_arbitrary_yaml_yields_a_machine_or_a_diagnostic(text):
    try:
        machine = parse_yaml(text, "fuzz.mkl")
    except LoadError as error:
        assert error.diagnostics
    else:
        assert parse(format_machine(machine)) == machine
