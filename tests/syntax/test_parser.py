"""The `.mk` parser: grammar build, syntax coverage, spans, comments and fuzzing."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import ROOT

from mklang.errors import LoadError, MkSyntaxError
from mklang.model import Call, Produce, ToolUse
from mklang.syntax import format_machine, load_file, parse
from mklang.syntax import grammar as grammar_module

MACHINE_FILES = sorted(ROOT.glob("examples/**/*.mk")) + sorted(ROOT.glob("machines/*.mk"))

HEADER = "machine m\nentry a\nbudget 5\n"


def one_state(body: str, extra: str = "") -> str:
    return f"{HEADER}{extra}state a {{\n{body}\n  otherwise -> END\n}}\n"


def test_grammar_builds_in_strict_mode():
    parser = grammar_module.build_lark(strict=True)
    assert parser.parse(one_state('  prompt "p"\n  structure "s"\n  output o')).data == "start"


def test_committed_standalone_parser_matches_the_grammar():
    from mklang.syntax import _parser

    assert grammar_module.grammar_sha256() == _parser.GRAMMAR_SHA256, (
        "grammar/mklang.lark changed: run `python -m mklang.syntax.grammar`"
    )


SPEC_EXAMPLE = '''\
# triage.mk: route a support ticket
mklang 0.4
machine triage
entry classify
budget 25
tier fast
result draft

context {
  ticket: { body: "<the customer ticket>", amount: 42 }
  notes: []
}

tool search_kb "Look up KB facts. Input: {query}."
hook amount_ok "True when amount <= 100."

state classify {
  structure "One word: bug, billing or other."
  prompt """
    Classify this ticket: {{ticket.body}}
    """
  output category
  when "the category is billing" hook amount_ok -> draft
  when "the category is bug" -> lookup
  otherwise -> draft
}

state lookup {
  tool search_kb { query: "{{ticket.body}}" }
  output kb
  when "no facts" escalate -> draft ask "Handle manually?" reply_to manual.answer
  otherwise -> draft
}

state draft {
  structure "A courteous reply."
  prompt "Reply to {{ticket.body}} using only {{kb}}."
  tier reasoning
  reason
  parse json
  accumulate
  max_visits 4
  output draft
  when "the reply resolves the request" -> END
  when "the reply has gaps" repair 2 -> draft
  otherwise fail
}

state per_chunk {   # summarize_doc.mk sits beside this file
  over chunks
  call summarize_doc { text: "{{item}}" }
  output summaries
  otherwise -> draft
}

state vote {
  sample 3
  execution "Think step by step."
  structure "x"
  prompt "y"
  output votes
  otherwise -> END
}
'''


def test_spec_example_parses_into_the_model():
    m = parse(SPEC_EXAMPLE, "triage.mk")
    assert (m.name, m.version, m.entry, m.budget, m.tier, m.result) == (
        "triage",
        "0.4",
        "classify",
        25,
        "fast",
        "draft",
    )
    assert m.context == {"ticket": {"body": "<the customer ticket>", "amount": 42}, "notes": []}
    assert [(d.name, d.description) for d in m.tools] == [("search_kb", "Look up KB facts. Input: {query}.")]
    assert [d.name for d in m.hooks] == ["amount_ok"]
    classify, lookup, draft, per_chunk, vote = m.states
    assert isinstance(classify.face, Produce) and classify.face.prompt == "Classify this ticket: {{ticket.body}}"
    assert [(g.when, g.hook, g.policy, g.target) for g in classify.gates] == [
        ("the category is billing", "amount_ok", "ok", "draft"),
        ("the category is bug", None, "ok", "lookup"),
        (None, None, "ok", "draft"),
    ]
    assert isinstance(lookup.face, ToolUse) and lookup.face.input == {"query": "{{ticket.body}}"}
    escalate = lookup.gates[0]
    assert (escalate.policy, escalate.target, escalate.ask, escalate.reply_to) == (
        "escalate", "draft", "Handle manually?", "manual.answer",
    )  # fmt: skip
    assert (draft.tier, draft.face.reason, draft.face.parse, draft.accumulate, draft.max_visits) == (
        "reasoning", True, "json", True, 4,
    )  # fmt: skip
    assert [(g.policy, g.repair, g.target) for g in draft.gates[1:]] == [("repair", 2, "draft"), ("fail", None, None)]
    assert isinstance(per_chunk.face, Call) and per_chunk.over == "chunks"
    assert (vote.sample, vote.face.execution) == (3, "Think step by step.")


def test_statements_in_any_order_give_the_same_state():
    first = parse(one_state('  prompt "p"\n  structure "s"\n  tier fast\n  output o'))
    second = parse(one_state('  output o\n  tier fast\n  structure "s"\n  prompt "p"'))
    assert first == second


@pytest.mark.parametrize(
    ("literal", "value"),
    [
        (r'"tab\tquote\" \u00e9 slash\/"', 'tab\tquote" é slash/'),
        ('"""\n    line one\n      indented\n    """', "line one\n  indented"),
        ('"""\n    a\n\n    b\n    """', "a\n\nb"),
        ('"""one line"""', "one line"),
        ('"""\n    keeps a final newline\n\n    """', "keeps a final newline\n"),
    ],
)
def test_strings(literal, value):
    assert parse(one_state(f'  prompt {literal}\n  structure "s"\n  output o')).states[0].face.prompt == value


def test_values_take_bare_keys_commas_newlines_and_trailing_separators():
    source = (
        HEADER
        + 'context {\n  a: 1, "b c": [1, 2.5, -3e2,],\n  d: { e: true, f: null, g: false, },\n  h: []\n  i: {}\n}\n'
    )
    source += 'state a {\n  tool t {\n    q: "x"\n    r: [\n      "y"\n    ]\n  }\n  output o\n  otherwise -> END\n}\n'
    m = parse(source)
    assert m.context == {"a": 1, "b c": [1, 2.5, -300.0], "d": {"e": True, "f": None, "g": False}, "h": [], "i": {}}
    assert m.states[0].face.input == {"q": "x", "r": ["y"]}


def test_keywords_can_name_states_and_keys():
    source = HEADER.replace("entry a", "entry output") + (
        'context { state: 1, when: 2 }\nstate output {\n  prompt "p"\n  structure "s"\n  output prompt\n  otherwise -> output\n}\n'
    )
    m = parse(source)
    assert m.states[0].name == "output" and m.states[0].output == "prompt"
    assert m.context == {"state": 1, "when": 2} and m.states[0].gates[0].target == "output"


def test_nodes_and_fields_carry_spans():
    m = parse(SPEC_EXAMPLE, "triage.mk")
    classify = m.states[0]
    assert (classify.span.file, classify.span.line, classify.span.col, classify.span.end_line) == (
        "triage.mk",
        17,
        1,
        26,
    )
    assert (classify.gates[1].span.line, classify.gates[1].span.col) == (24, 3)
    assert classify.field_spans["prompt"].line == 19 and classify.field_spans["prompt"].end_line == 21
    assert m.field_spans["budget"].line == 5 and m.tools[0].span.line == 14


def test_comments_are_attached_to_the_statements_they_precede():
    source = (
        "# top\n"
        + HEADER
        + (
            "# about a\nstate a {  # on the line\n  # before output\n  output o\n"
            '  prompt "p"\n  structure "s"\n  otherwise -> END  # done\n  # closing\n}\n# tail\n'
        )
    )
    m = parse(source)
    state = m.states[0]
    assert m.field_comments["name"].before == ["# top"]
    assert state.comments == ["# about a"] and state.line_comment == "# on the line"
    assert state.field_comments["output"].before == ["# before output"]
    assert state.gates[0].line_comment == "# done"
    assert state.trailing_comments == ["# closing"] and m.trailing_comments == ["# tail"]


def test_missing_newline_at_end_of_file_and_crlf_are_accepted():
    text = one_state('  prompt "p"\n  structure "s"\n  output o').rstrip("\n")
    assert parse(text) == parse(text.replace("\n", "\r\n"))


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ('  prompt "p"\n  call m\n  output o', "two-faces"),
        ("  output o", "no-face"),
        ('  prompt "p"\n  output o', "missing-field"),
        ('  prompt "p"\n  structure "s"', "no-output"),
        ('  prompt "p"\n  structure "s"\n  output o\n  output p', "duplicate-field"),
        ('  prompt "p"\n  structure "s"\n  output o\n  tier huge', "invalid-value"),
        ('  prompt "p"\n  structure "s"\n  output o.b', "invalid-name"),
        ('  prompt "p"\n  structure "s"\n  output o\n  sample 2.5', "invalid-number"),
        ('  prompt "bad \\q escape"\n  structure "s"\n  output o', "invalid-string"),
    ],
)
def test_impossible_states_are_diagnostics(body, code):
    with pytest.raises(MkSyntaxError) as caught:
        parse(one_state(body), "x.mk")
    assert [d.code for d in caught.value.diagnostics] == [code]
    assert caught.value.diagnostics[0].line >= 4


def test_missing_header_lines_are_all_reported():
    with pytest.raises(MkSyntaxError) as caught:
        parse("state a {\n  output o\n  tool t\n  otherwise -> END\n}\n")
    assert [d.message for d in caught.value.diagnostics] == [
        "the file has no `machine <name>` line",
        "the file has no `entry <state>` line",
        "the file has no `budget <steps>` line",
    ]


def test_load_file_sets_the_absolute_path_and_reports_unreadable_files(tmp_path):
    path = tmp_path / "m.mk"
    path.write_text(one_state('  prompt "p"\n  structure "s"\n  output o'))
    assert load_file(path).path == str(path.resolve())
    with pytest.raises(LoadError) as caught:
        load_file(tmp_path / "missing.mk")
    assert caught.value.diagnostics[0].code == "unreadable"


FRAGMENTS = st.sampled_from(
    ["machine", "entry", "budget", "state", "{", "}", "[", "]", ":", ",", "->", "when", "otherwise", "repair",
     "escalate", "ask", "fail", "prompt", "output", "call", "tool", "sample", '"x"', '"""', "#", "\n", " ", "1",
     "-2.5", "END", "a.b", "'", "@", "\t", "true", "context", "hook", "reply_to", "\\", '"\\u12"']
)  # fmt: skip


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.text(max_size=200), st.lists(FRAGMENTS, max_size=60).map(" ".join)))
def test_arbitrary_text_yields_a_machine_or_a_diagnostic(text):
    try:
        machine = parse(text, "fuzz.mk")
    except LoadError as error:
        assert error.diagnostics and all(d.line >= 1 and d.col >= 1 and d.message for d in error.diagnostics)
    else:
        assert parse(format_machine(machine)) == machine


@pytest.mark.parametrize("path", MACHINE_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_example_and_library_machine_parses(path):
    machine = load_file(path)
    assert machine.states and machine.path == str(path.resolve())


# --- negative numbers: budget, repair, max_visits -----------------------------

NEGATIVE_MK = """\
machine m
entry a
budget -3
state a {
  structure "s"
  prompt "p"
  output o
  max_visits -1
  when "bad" repair -2 -> a
  otherwise -> END
}
"""

NEGATIVE_YAML = """\
mklang: "0.4"
machine: m
entry: a
budget: -3
states:
  a:
    structure: s
    prompt: p
    output: o
    max_visits: -1
    gates:
      - when: bad
        then: {repair: -2}
        to: a
      - when: otherwise
        then: ok
        to: END
"""


@pytest.mark.parametrize(("name", "text"), [("m.mk", NEGATIVE_MK), ("m.yaml", NEGATIVE_YAML)])
def test_negative_budget_repair_and_max_visits_are_load_errors(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(LoadError) as caught:
        load_file(path)
    found = {(d.code, d.message, d.line) for d in caught.value.diagnostics}
    what = {message.split(" must")[0]: (code, line) for code, message, line in found}
    assert {code for code, _, _ in found} == {"invalid-number"}
    assert set(what) == {"budget", "max_visits", "a repair budget" if name.endswith(".mk") else "repair"}
    assert what["budget"][1] == 4 if name.endswith(".yaml") else 3
    assert all('not "-' in message for _, message, _ in found)
