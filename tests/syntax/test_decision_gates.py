"""Human decisions in the language (SPEC section 8): `.mk` and YAML read into one model,
`fmt` prints it back, and `check` holds choices, deadlines and `show` to their rules."""

from __future__ import annotations

import pytest

from mklang.checker import check, shortest_steps
from mklang.errors import MkSyntaxError
from mklang.model import Choice, Timeout
from mklang.syntax import format_machine, parse
from mklang.syntax.yaml_front import parse_yaml

DECISION = """\
mklang 0.5
machine review
entry draft
budget 10

state draft {
  structure "An announcement."
  prompt "Write it."
  output announcement
  otherwise escalate ask "Publish this announcement?" show announcement reply_to approval {
    choice "approve" -> publish
    choice "revise" -> draft
    choice "reject" fail
    within 48h -> expired
  }
}

state publish {
  structure "A URL."
  prompt "Publish {{announcement}}."
  output published
  otherwise -> END
}

state expired {
  structure "A note."
  prompt "Say it expired."
  output note
  otherwise -> END
}
"""

YAML = """\
mklang: "0.5"
machine: review
entry: draft
budget: 10
states:
  draft:
    structure: An announcement.
    prompt: Write it.
    output: announcement
    gates:
      - when: otherwise
        then: escalate
        ask: Publish this announcement?
        show: announcement
        reply_to: approval
        choices: {approve: publish, revise: draft, reject: fail}
        within: 48h
        on_timeout: expired
  publish:
    structure: A URL.
    prompt: "Publish {{announcement}}."
    output: published
    gates: [{when: otherwise, to: END}]
  expired:
    structure: A note.
    prompt: Say it expired.
    output: note
    gates: [{when: otherwise, to: END}]
"""


def codes(text: str) -> list[tuple[str, int]]:
    return [(d.code, d.line) for d in check(parse(text, "m.mk")) if d.severity == "error"]


def test_a_decision_reads_into_choices_a_deadline_and_what_it_shows():
    gate = parse(DECISION).states[0].gates[0]
    assert (gate.policy, gate.target, gate.ask, gate.show, gate.reply_to) == (
        "escalate",
        None,
        "Publish this announcement?",
        "announcement",
        "approval",
    )
    assert gate.choices == [
        Choice(label="approve", target="publish"),
        Choice(label="revise", target="draft"),
        Choice(label="reject", target=None),
    ]
    assert gate.timeout == Timeout(within="48h", target="expired") and gate.timeout.seconds == 48 * 3600
    assert gate.targets == ["publish", "draft", "expired"]
    assert (gate.choices[0].span.line, gate.timeout.span.line) == (11, 14)


def test_yaml_reads_into_the_same_model_and_fmt_prints_it_as_mk():
    machine = parse_yaml(YAML, "m.mkl")
    assert machine == parse(DECISION)
    assert format_machine(machine) == format_machine(parse(DECISION))
    assert check(machine) == []


def test_fmt_prints_the_decision_block_and_reads_it_back():
    machine = parse(DECISION)
    text = format_machine(machine)
    assert '  otherwise escalate ask "Publish this announcement?" show announcement reply_to approval {\n' in text
    assert '    choice "reject" fail\n    within 48h -> expired\n  }\n' in text
    assert parse(text) == machine and format_machine(parse(text)) == text


def test_a_well_formed_decision_checks_clean_and_its_targets_count_as_paths():
    machine = parse(DECISION, "m.mk")
    assert check(machine) == []
    assert shortest_steps(machine) == 2  # draft, then publish (a choice) or expired (the deadline)


@pytest.mark.parametrize(
    ("block", "expected"),
    [
        ('    choice "approve" -> nowhere\n', [("unknown-target", 11), ("no-path-to-end", 3)]),
        ('    choice "approve" -> publish\n    within 1h -> ghost\n', [("unknown-target", 12)]),
        ('    choice "approve" -> publish\n    choice "approve" -> draft\n', [("duplicate-choice", 12)]),
        ('    choice "" -> publish\n', [("invalid-choice", 11)]),
        ('    choice "approve" -> publish\n    within 0s -> publish\n', [("invalid-value", 12)]),
        ('    choice "approve" -> publish\n    within 1h -> loop\n', [("timeout-no-end", 12)]),
        ("    within 1h -> publish\n", [("no-choices", 10)]),
        ("", [("no-choices", 10), ("no-path-to-end", 3)]),
    ],
)
def test_check_holds_each_decision_to_its_rules(block, expected):
    text = DECISION.replace(
        DECISION[DECISION.index('    choice "approve"') : DECISION.index("  }\n}\n\nstate publish")], block
    )
    text += 'state loop {\n  structure "s"\n  prompt "p"\n  output o\n  otherwise -> loop\n}\n'
    assert codes(text) == expected


def test_show_without_choices_is_an_error():
    text = DECISION.replace(
        DECISION[DECISION.index("  otherwise escalate ask") : DECISION.index("}\n\nstate publish")],
        '  otherwise escalate -> publish ask "Go?" show announcement\n',
    )
    assert codes(text) == [("no-choices", 10)]


def test_two_deadlines_and_a_bad_duration_are_syntax_errors():
    with pytest.raises(MkSyntaxError) as raised:
        parse(DECISION.replace("    within 48h -> expired\n", "    within 48h -> expired\n    within 1d fail\n"))
    assert [(d.code, d.line) for d in raised.value.diagnostics] == [("duplicate-field", 15)]
    with pytest.raises(MkSyntaxError) as raised:
        parse(DECISION.replace("within 48h", "within 48"))
    assert raised.value.diagnostics[0].line == 14


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("        within: 48h\n", "        within: 48\n"), "within must be a duration like 48h"),
        (("        on_timeout: expired\n", ""), 'a deadline needs both "within: <duration>" and "on_timeout'),
        (("        then: escalate\n", "        then: escalate\n        to: publish\n"), 'a gate with choices has no "to"'),
        (("        then: escalate\n", "        then: repair\n        repair: 2\n"), "it cannot also repair"),
        (("        choices: {approve: publish, revise: draft, reject: fail}\n", "        choices: [approve]\n"),
         "choices must map each answer"),
    ],
)  # fmt: skip
def test_yaml_decisions_are_checked_as_they_load(change, message):
    with pytest.raises(MkSyntaxError) as raised:
        parse_yaml(YAML.replace(*change), "m.mkl")
    assert message in raised.value.diagnostics[0].message


def test_the_language_server_completes_and_describes_a_decision():
    from mklang.lsp.analysis import Document, describe_state

    document = Document(DECISION)
    inside = document.completions((11, 4))  # the start of a line inside the decision's block
    assert [completion.label for completion in inside] == ["choice", "within"]
    machine = parse(DECISION)
    hover = describe_state(machine.states[0], machine)
    assert '  - choice "approve" → `publish`' in hover and '  - choice "reject" · fail' in hover
    assert "  - within 48h → `expired`" in hover


def test_cost_bounds_follow_every_choice_and_the_deadline(tmp_path):
    from support.commands import cli

    path = tmp_path / "m.mk"
    path.write_text(DECISION)
    done = cli("check", "--cost", str(path))
    assert done.returncode == 0 and "model calls  min 2, max" in done.stdout + done.stderr, done.stdout + done.stderr
