"""`mklang check`: every SPEC section 3 rule, positions, call resolution and the CLI contract."""

from __future__ import annotations

import json

import pytest
from conformance.harness import mk, run_mk
from support import ROOT
from typer.testing import CliRunner

from mklang.checker import CONSEQUENCES, check, check_file, shortest_steps
from mklang.cli.app import app
from mklang.cli.syntax_cmds import check_command  # noqa: F401 - registers the command
from mklang.errors import LoadError
from mklang.syntax import load_file, parse
from mklang.syntax.resolve import find_machine

MACHINE_FILES = sorted(ROOT.glob("examples/**/*.mk")) + sorted(ROOT.glob("machines/*.mk"))


def machine_text(states: str, header: str = "machine m\nentry a\nbudget 10\n") -> str:
    return header + states


def produce(name: str, gates: str, extra: str = "") -> str:
    return f'state {name} {{\n  structure "s"\n  prompt "p"\n{extra}  output {name}_out\n{gates}}}\n'


def codes(text: str, tmp_path=None) -> list[tuple[str, str, int]]:
    machine = parse(text, "m.mk")
    if tmp_path is not None:
        machine.path = str(tmp_path / "m.mk")
    return [(d.severity, d.code, d.line) for d in check(machine)]


CLEAN = machine_text(produce("a", "  otherwise -> END\n"))


def test_a_clean_machine_has_no_findings():
    assert codes(CLEAN) == []


RULE_CASES = [
        (machine_text(produce("b", "  otherwise -> END\n")), [("error", "unknown-entry", 2)]),
        (machine_text(produce("a", "  otherwise -> nowhere\n")), [("error", "unknown-target", 8), ("error", "no-path-to-end", 2)]),
        (machine_text(produce("a", "  otherwise -> END\n", "  sample 3\n  over xs\n"), "machine m\nentry a\nbudget 10\ncontext { xs: [] }\n"), [("error", "sample-with-over", 8)]),
        (machine_text(produce("a", "  otherwise -> END\n", "  sample 1\n")), [("error", "sample-too-small", 7)]),
        (machine_text(produce("a", "")), [("error", "no-gates", 4), ("error", "no-path-to-end", 2)]),
        (machine_text(produce("a", "  otherwise -> END\n") + produce("a", "  otherwise -> END\n")), [("error", "duplicate-state", 10)]),
        (machine_text(produce("a", "  otherwise -> a\n")), [("error", "no-path-to-end", 2)]),
        (machine_text(produce("a", "  otherwise -> END\n", "  sample 4\n"), "machine m\nentry a\nbudget 3\n"), [("error", "budget-infeasible", 3)]),
        (machine_text(produce("a", "  otherwise -> END\n") + produce("b", "  otherwise -> END\n")), [("warning", "unreachable-state", 10)]),
        (machine_text(produce("a", '  when "w" -> END\n')), [("warning", "no-catch-all", 4)]),
        (machine_text(produce("a", '  when "w" -> END\n  otherwise repair 2 -> a\n')), [("warning", "repair-only-otherwise", 9)]),
        (machine_text(produce("a", '  otherwise -> END\n  when "w" -> END\n')), [("warning", "dead-gate", 9)]),
        (machine_text(produce("a", '  when "w" hook h -> END\n  otherwise -> END\n')), [("warning", "undeclared-hook", 8)]),
        (machine_text("state a {\n  tool t\n  output o\n  otherwise -> END\n}\n"), [("warning", "undeclared-tool", 5)]),
        (machine_text(produce("a", '  when "w" repair 3 -> a\n  otherwise -> END\n', "  max_visits 3\n")), [("warning", "max-visits-under-repair", 7)]),
        (machine_text(produce("a", "  otherwise -> END\n").replace('"p"', '"{{ghost.name}} {{a_out}}"')), [("warning", "unwritten-context-key", 6)]),
        (machine_text(produce("a", "  otherwise -> END\n", "  over missing\n")), [("warning", "over-unbounded", 7), ("warning", "unwritten-context-key", 7)]),
        (machine_text(produce("a", "  otherwise -> END\n", "  over xs\n"), "machine m\nentry a\nbudget 10\ncontext { xs: [] }\n"), [("warning", "over-unbounded", 8)]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "expected"), RULE_CASES, ids=[f"{i}-{case[1][0][1]}" for i, case in enumerate(RULE_CASES)]
)
def test_each_rule_reports_its_code_at_the_node(text, expected):
    # By position, except that a consequence (no path to END) follows its causes.
    assert codes(text) == sorted(expected, key=lambda e: (e[1] in CONSEQUENCES, e[2], e[1]))


def test_declared_hooks_tools_and_written_keys_are_quiet():
    text = machine_text(
        'state a {\n  tool t { q: "{{seed}} {{human.reply}}" }\n  output o\n'
        '  when "w" hook h -> b\n  when "x" escalate -> b\n  otherwise -> END\n}\n'
        + produce("b", "  otherwise -> END\n", "  over xs\n").replace('"p"', '"{{item}} {{index}} {{o}}"'),
        'machine m\nentry a\nbudget 10\ncontext { seed: 1, xs: [1, 2] }\ntool t "does"\nhook h "decides"\n',
    )
    assert codes(text) == []


def test_over_warns_unless_the_author_wrote_the_list():
    """A declared bound is a non-empty literal list in `context` that no state or reply overwrites."""
    head = "machine m\nentry a\nbudget 10\ncontext {{ xs: {xs} }}\n"
    fan = produce("b", "  otherwise -> END\n", "  over xs\n").replace('"p"', '"{{item}}"')
    written = produce("a", "  otherwise -> b\n").replace("output a_out", "output xs")
    quiet = machine_text(produce("a", "  otherwise -> b\n") + fan, head.format(xs="[1, 2]"))
    assert codes(quiet) == []
    overwritten = machine_text(written + fan, head.format(xs="[1, 2]"))
    assert codes(overwritten) == [("warning", "over-unbounded", 14)]
    (found,) = [d for d in check(parse(overwritten, "m.mk")) if d.code == "over-unbounded"]
    assert "budget (10)" in found.message and "--max-tokens" in found.message


def test_all_findings_are_collected_and_sorted_by_position():
    text = machine_text(
        produce("a", '  when "w" -> nowhere\n') + produce("c", "", "  sample 1\n"), "machine m\nentry a\nbudget 1\n"
    )
    found = check(parse(text, "m.mk"))
    order = [(d.code in CONSEQUENCES, d.line, d.code) for d in found]
    assert order == sorted(order)
    assert {d.code for d in found} >= {
        "unknown-target",
        "no-catch-all",
        "sample-too-small",
        "no-gates",
        "unreachable-state",
        "no-path-to-end",
    }
    assert all(d.file == "m.mk" for d in found)


def test_shortest_path_counts_fan_out_as_sample_size():
    text = machine_text(
        produce("a", '  when "w" -> b\n  otherwise -> c\n')
        + produce("b", "  otherwise -> END\n", "  sample 5\n")
        + produce("c", "  otherwise -> d\n", "  over a_out\n")
        + produce("d", "  otherwise -> END\n")
    )
    assert shortest_steps(parse(text)) == 3  # a, c (over: 1), d beats a, b (sample 5)


def test_shortest_path_passes_a_state_two_paths_reached_first():
    text = machine_text(
        produce("a", '  when "w" -> b\n  otherwise -> c\n')
        + produce("b", "  otherwise -> d\n")
        + produce("c", "  otherwise -> d\n")
        + produce("d", "  otherwise -> e\n")
        + produce("e", "  otherwise -> END\n")
    )
    assert shortest_steps(parse(text)) == 4  # d is queued twice, via b and via c; the search goes on past it


def test_call_targets_resolve_beside_the_machine_then_machines_dir(tmp_path, monkeypatch):
    (tmp_path / "helper.mk").write_text(CLEAN)
    (tmp_path / "lib" / "machines").mkdir(parents=True)
    (tmp_path / "lib" / "machines" / "shared.mk").write_text(CLEAN)
    monkeypatch.chdir(tmp_path / "lib")
    assert find_machine("helper", tmp_path) == (tmp_path / "helper.mk").resolve()
    assert find_machine("shared", tmp_path) == (tmp_path / "lib" / "machines" / "shared.mk").resolve()
    assert find_machine("chain_of_thought", tmp_path) is not None  # the standard library
    assert find_machine("no_such_machine", tmp_path) is None
    caller = tmp_path / "caller.mk"
    caller.write_text(machine_text("state a {\n  call helper\n  output o\n  otherwise -> b\n}\n"
                                   "state b {\n  call absent\n  output p\n  otherwise -> END\n}\n"))  # fmt: skip
    assert [(d.code, d.line) for d in check_file(caller)] == [("unknown-machine", 10)]


def test_check_file_returns_load_diagnostics(tmp_path):
    path = tmp_path / "bad.mk"
    path.write_text("machine m\nentry a\nbudget 1\nstate a {\n  otherwise ->\n}\n")
    assert [(d.code, d.line, d.col) for d in check_file(path)] == [("syntax", 5, 15)]


@pytest.mark.parametrize("path", MACHINE_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_examples_and_library_check_clean(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    # Fan-outs over run-time lists keep their true over-unbounded warning (ADR 0012).
    assert [d for d in check(load_file(path)) if d.code != "over-unbounded"] == []


def test_cli_exit_codes_streams_and_json(tmp_path):
    good = tmp_path / "good.mk"
    good.write_text(machine_text(produce("a", '  when "w" -> END\n')))
    bad = tmp_path / "sub" / "bad.mk"
    bad.parent.mkdir()
    bad.write_text(machine_text(produce("a", "  otherwise -> nowhere\n")))
    runner = CliRunner()
    warned = runner.invoke(app, ["check", str(good)])
    assert warned.exit_code == 0 and warned.stdout == ""
    assert "good.mk:4:1: warning:" in warned.stderr and "0 errors, 1 warning in 1 file" in warned.stderr
    failed = runner.invoke(app, ["check", str(tmp_path)])
    assert failed.exit_code == 2 and "2 errors, 1 warning in 2 files" in failed.stderr
    as_json = runner.invoke(app, ["check", "--format", "json", str(good), str(bad)])
    records = json.loads(as_json.stdout)
    assert as_json.exit_code == 2 and as_json.stderr == ""
    assert [(r["file"], r["line"], r["col"], r["severity"], r["code"]) for r in records] == [
        (str(good), 4, 1, "warning", "no-catch-all"),
        (str(bad), 8, 3, "error", "unknown-target"),  # the cause first
        (str(bad), 2, 1, "error", "no-path-to-end"),
    ]
    assert set(records[0]) == {"file", "line", "col", "end_line", "end_col", "severity", "code", "message"}


# Where each rule's caret goes (line, col, end line, end col) and what it says, case by case.
RULE_FINDINGS = [
    [(2, 1, 2, 8, 'the entry state "a" is not defined')],
    [(8, 3, 8, 23, '"nowhere" is not a state (or END)'), (2, 1, 2, 8, 'no path leads from "a" to END (a gate above names a state that does not exist)')],
    [(8, 3, 8, 11, 'state "a" has both sample and over: choose one')],
    [(7, 3, 7, 11, 'sample must be at least 2, not 1')],
    [(4, 1, 4, 6, 'state "a" has no gates: add at least `otherwise -> <state>`'), (2, 1, 2, 8, 'no path leads from "a" to END')],
    [(10, 1, 10, 6, 'state "a" is defined twice (first at line 4)')],
    [(2, 1, 2, 8, 'no path leads from "a" to END')],
    [(3, 1, 3, 9, 'budget 3 is below the shortest path to END (4 steps)')],
    [(10, 1, 10, 6, 'state "b" cannot be reached from the entry')],
    [(4, 1, 4, 6, 'state "a" has no `otherwise` gate: the run halts when no condition holds')],
    [(9, 3, 9, 26, 'the only `otherwise` is a repair gate: once its budget is spent, nothing catches')],
    [(9, 3, 9, 18, 'this gate comes after `otherwise` and never fires')],
    [(8, 3, 8, 25, 'hook "h" is not declared: add `hook h "<what it decides>"`')],
    [(5, 3, 5, 9, 'tool "t" is not declared: add `tool t "<what it does>"`')],
    [(7, 3, 7, 15, "max_visits 3 is at or under the state's repair budget (3): repairs cannot all run")],
    [(6, 3, 6, 36, 'state "a" reads "ghost", which nothing writes')],
    [(7, 3, 7, 15, 'state "a" fans out over "missing", a list whose length is set at run time (no declared bound): the step budget (10) is its only limit, one step per item, and a longer list stops the run here (budget-exhausted); cap the run\'s spend with --max-tokens or --max-cost'), (7, 3, 7, 15, 'state "a" reads "missing", which nothing writes')],
    [(8, 3, 8, 10, 'state "a" fans out over "xs", a list whose length is set at run time (no declared bound): the step budget (10) is its only limit, one step per item, and a longer list stops the run here (budget-exhausted); cap the run\'s spend with --max-tokens or --max-cost')],
]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "findings"),
    [(case[0], found) for case, found in zip(RULE_CASES, RULE_FINDINGS, strict=True)],
    ids=[f"{i}-{case[1][0][1]}" for i, case in enumerate(RULE_CASES)],
)
def test_each_rule_marks_its_statement_and_says_what_is_wrong(text, findings):
    found = check(parse(text, "m.mk"))
    assert [(d.line, d.col, d.end_line, d.end_col, d.message) for d in found] == findings
    assert {d.file for d in found} == {"m.mk"}


OVER_B = produce("b", "  otherwise -> END\n", "  over xs\n").replace('"p"', '"{{item}}"')
MORE_CASES = {
    "unsupported-version": (
        "mklang 9.9\n" + CLEAN,
        [("error", "unsupported-version", 1, 1, 1, 11, "it runs language version 0.5 and earlier, not the newer 9.9")],
    ),
    "unwritten-result": (
        machine_text(produce("a", "  otherwise -> END\n"), "machine m\nentry a\nbudget 10\nresult ghost\n"),
        [("warning", "unwritten-context-key", 4, 1, 4, 13, 'nothing writes "ghost", the result')],
    ),
    "written-dotted-result": (
        machine_text(produce("a", "  otherwise -> END\n"), "machine m\nentry a\nbudget 10\nresult a_out.x\n"),
        [],
    ),
    "unclosed-placeholder": (
        machine_text(produce("a", "  otherwise -> END\n").replace('"p"', '"{{oops"')),
        [
            (
                "warning",
                "unclosed-placeholder",
                6,
                3,
                6,
                18,
                'state "a" opens a placeholder with "{{" but never closes it with "}}": it is sent as written',
            )
        ],
    ),
    "unknown-machine": (
        machine_text("state a {\n  call nowhere\n  output o\n  otherwise -> END\n}\n"),
        [("error", "unknown-machine", 5, 3, 5, 15, 'no machine "nowhere" found for the call')],
    ),
    "nested-tool-input": (
        machine_text(
            'state a {\n  tool t { q: { deep: ["{{ghost}}", 1] } }\n  output o\n  otherwise -> END\n}\n',
            'machine m\nentry a\nbudget 10\ntool t "does"\n',
        ),
        [("warning", "unwritten-context-key", 6, 3, 6, 43, 'state "a" reads "ghost", which nothing writes')],
    ),
    "call-input-at-its-call": (
        machine_text('state a {\n  call sub { q: "{{ghost}}" }\n  output o\n  otherwise -> END\n}\n'),
        [
            ("error", "unknown-machine", 5, 3, 5, 30, 'no machine "sub" found for the call'),
            ("warning", "unwritten-context-key", 5, 3, 5, 30, 'state "a" reads "ghost", which nothing writes'),
        ],
    ),
    "a-reply-is-written": (
        machine_text(
            produce("a", '  otherwise escalate -> b ask "?" reply_to answer\n')
            + produce("b", "  otherwise -> END\n").replace('"p"', '"{{answer.text}}"')
        ),
        [],
    ),
    "a-key-read-twice-warns-once": (
        machine_text(produce("a", "  otherwise -> END\n").replace('"p"', '"{{ghost}} and {{ghost.x}}"')),
        [("warning", "unwritten-context-key", 6, 3, 6, 37, 'state "a" reads "ghost", which nothing writes')],
    ),
    "list-a-reply-overwrites": (
        machine_text(
            produce("a", '  otherwise escalate -> b ask "?" reply_to xs\n') + OVER_B,
            "machine m\nentry a\nbudget 10\ncontext { xs: [1, 2] }\n",
        ),
        [("warning", "over-unbounded", 14, 3, 14, 10, 'state "b" fans out over "xs", a list whose length is set')],
    ),
}


@pytest.mark.parametrize(("text", "expected"), MORE_CASES.values(), ids=MORE_CASES.keys())
def test_versions_results_placeholders_calls_and_replies_are_checked(text, expected):
    found = [(d.severity, d.code, d.line, d.col, d.end_line, d.end_col, d.message) for d in check(parse(text, "m.mk"))]
    assert [finding[:6] for finding in found] == [finding[:6] for finding in expected]
    for finding, (*_, message) in zip(found, expected, strict=True):
        assert message in finding[6]


def test_only_errors_keep_a_machine_from_running():
    from mklang.checker import require_runnable

    warned = parse(machine_text(produce("a", '  when "w" -> END\n')), "m.mk")
    assert require_runnable(warned) is warned
    broken = parse(machine_text(produce("a", '  when "w" -> nowhere\n')), "m.mk")
    with pytest.raises(LoadError) as caught:
        require_runnable(broken)
    assert [d.code for d in caught.value.diagnostics] == ["unknown-target", "no-path-to-end"]


# --- check: a budget exactly the shortest path --------------------------------


def _chain(budget: int, first: str = "") -> str:
    return f"""
        machine m
        entry a
        budget {budget}
        context {{ xs: [1] }}
        state a {{
          {first}
          structure "s"
          prompt "p"
          output o
          otherwise -> b
        }}
        state b {{
          structure "s"
          prompt "p"
          output o
          otherwise -> END
        }}
    """


@pytest.mark.parametrize(("first", "shortest"), [("", 2), ("sample 3", 4), ("over xs", 2)])
def test_a_budget_equal_to_the_shortest_path_is_feasible_and_one_less_is_not(first, shortest):
    assert [d.code for d in check(mk(_chain(shortest, first)))] == []
    [found] = check(mk(_chain(shortest - 1, first)))
    assert found.code == "budget-infeasible"
    assert found.message == f"budget {shortest - 1} is below the shortest path to END ({shortest} steps)"


def test_a_run_at_a_budget_equal_to_the_shortest_path_finishes():
    result = run_mk(_chain(4, "sample 3"), llm={"produce": ["x"]})
    assert result.status == "done" and [step["state"] for step in result.trace] == ["a", "b"]
