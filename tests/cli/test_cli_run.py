"""`mklang run` and `mklang test` as CI scripts see them: real processes, exit codes, streams."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import yaml
from support import ROOT
from support.commands import cli, refused

MACHINE = """\
machine greet
entry hello
budget 5

state hello {
  structure "One line."
  prompt "Greet {{name}}."
  output greeting
  when "the greeting is polite" -> END
  otherwise fail
}
"""

SCRIPT = {
    "scenarios": [
        {
            "name": "polite",
            "input": {"name": "Ada"},
            "llm": {"produce": {"<data-": "Hello, Ada.", "Greet": "unfenced"}, "judge": [0], "tokens": [3, 2]},
            "expect": {
                "status": "done",
                "result": "Hello, Ada.",
                "trace": [{"state": "hello", "policy": "ok", "to": "END"}],
            },
        },
        {
            "name": "rude",
            "input": {"name": "Bob"},
            "llm": {"produce": ["Go away."], "judge": ["none"]},
            "expect": {"status": "halted", "error": "gate-fail", "at": "hello"},
        },
    ]
}


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "greet.mk").write_text(MACHINE, encoding="utf-8")
    (tmp_path / "greet.yaml").write_text(yaml.safe_dump(SCRIPT, sort_keys=False), encoding="utf-8")
    return tmp_path


def run_json(project: Path, *args: str) -> tuple[int, dict]:
    done = cli("run", "greet.mk", "--format", "json", *args, cwd=project)
    return done.returncode, json.loads(done.stdout)


def test_a_finished_run_exits_0_with_one_json_document(project):
    code, data = run_json(project, "--script", "greet.yaml", "--scenario", "polite")
    assert code == 0
    # The shape, plus `calls`: the model and tool calls this process paid for.
    assert list(data) == ["status", "error", "at", "result", "context", "trace", "usage", "calls"]
    assert data["calls"] == {"judge": 1, "produce": 1}
    assert (data["status"], data["error"], data["at"], data["result"]) == ("done", None, None, "Hello, Ada.")
    assert data["context"] == {"name": "Ada", "greeting": "Hello, Ada."}
    assert data["usage"]["input_tokens"] == 3 and data["usage"]["output_tokens"] == 2
    assert [(s["step"], s["state"], s["policy"], s["to"]) for s in data["trace"]] == [(1, "hello", "ok", "END")]


def test_a_halted_run_exits_1_and_names_the_error_and_state(project):
    code, data = run_json(project, "--script", "greet.yaml", "--scenario", "rude")
    assert code == 1
    assert (data["status"], data["error"], data["at"], data["result"]) == ("halted", "gate-fail", "hello", None)
    assert data["trace"][-1]["to"] is None


def test_set_values_parse_as_json_else_text_win_over_input_and_are_untrusted(project):
    (project / "in.json").write_text('{"name": "Lin", "extra": {"k": true}}', encoding="utf-8")
    code, data = run_json(
        project,
        "--script",
        "greet.yaml",
        "--scenario",
        "polite",
        "--input",
        "in.json",
        "--set",
        "name=Grace",
        "--set",
        "n=3",
        "--set",
        "opts.deep=[1, 2]",
    )
    assert code == 0
    context = data["context"]
    assert (context["name"], context["n"], context["opts"], context["extra"]) == (
        "Grace",
        3,
        {"deep": [1, 2]},
        {"k": True},
    )
    assert data["result"] == "Hello, Ada."  # the scripted answer for a fenced prompt


@pytest.mark.parametrize(
    "args, needle",
    [
        (["run", "missing.mk"], "missing.mk"),
        (["run", "greet.mk", "--set", "no-equals-sign"], "--set"),
        (["run", "greet.mk", "--script", "greet.yaml", "--scenario", "nope"], "nope"),
    ],
)
def test_usage_errors_exit_2_with_one_error_printed_once(project, args, needle):
    done = cli(*args, cwd=project)
    document = json.loads(done.stdout)  # piped output is JSON: the one document is the error, stderr is quiet
    assert (document["status"], document["exit_code"]) == ("error", 2) and needle in document["error"]
    assert done.returncode == 2 and done.stderr == "", done.stderr
    text = cli(*args, "--format", "text", cwd=project)
    assert needle in refused(text) and text.stdout == ""


def test_a_syntax_error_exits_2_naming_file_line_and_column(project):
    (project / "broken.mk").write_text("machine broken\nentry a\nbudget 5\nstate a {\n  output\n}\n", encoding="utf-8")
    done = cli("run", "broken.mk", cwd=project)
    assert done.returncode == 2 and json.loads(done.stdout)["diagnostics"][0]["line"] == 5 and done.stderr == ""
    text = cli("run", "broken.mk", "--format", "text", cwd=project)
    assert text.returncode == 2 and text.stdout == "" and text.stderr.splitlines()[0].startswith("broken.mk:5:")


def test_all_scenarios_passing_exit_0(project):
    done = cli("test", "greet.mk", "--script", "greet.yaml", cwd=project)
    assert done.returncode == 0, done.stdout
    assert "PASS polite" in done.stdout and "PASS rude" in done.stdout
    assert "2 passed, 0 failed" in done.stdout


def test_a_wrong_expectation_fails_with_a_readable_diff_and_exit_1(project):
    script = json.loads(json.dumps(SCRIPT))
    script["scenarios"][0]["expect"]["result"] = "Hi there."
    script["scenarios"][0]["expect"]["trace"][0]["to"] = "elsewhere"
    (project / "wrong.yaml").write_text(yaml.safe_dump(script), encoding="utf-8")
    done = cli("test", "greet.mk", "--script", "wrong.yaml", cwd=project)
    assert done.returncode == 1
    assert "FAIL polite" in done.stdout and "PASS rude" in done.stdout
    assert 'result: expected "Hi there.", got "Hello, Ada."' in done.stdout
    assert 'trace[1].to: expected "elsewhere", got "END"' in done.stdout
    assert "1 passed, 1 failed" in done.stdout


def test_test_json_output_lists_every_scenario(project):
    script = json.loads(json.dumps(SCRIPT))
    script["scenarios"][1]["expect"]["at"] = "somewhere"
    (project / "wrong.yaml").write_text(yaml.safe_dump(script), encoding="utf-8")
    done = cli("test", "greet.mk", "--script", "wrong.yaml", "--format", "json", cwd=project)
    assert done.returncode == 1
    polite, rude = json.loads(done.stdout)
    assert polite == {
        "name": "polite",
        "passed": True,
        "problems": [],
        "status": "done",
        "error": None,
        "reason": None,
        "at": None,
        "ended": "the run ended done",
        "parts": [{"part": "run", "status": "done", "error": None, "reason": None, "at": None}],
    }
    assert rude["passed"] is False
    assert rude["problems"] == ['at: expected "somewhere", got "hello"']
    assert (rude["status"], rude["error"], rude["at"]) == ("halted", "gate-fail", "hello")
    assert rude["ended"] == "the run ended halted: gate-fail at hello"


@pytest.mark.parametrize(
    "text",
    [
        "scenarios: [",  # not YAML
        "scenarios:\n  - name: a\n    expect: {colour: red}\n",  # unknown expect key
    ],
)
def test_a_bad_script_file_exits_2_with_one_line(project, text):
    (project / "bad.yaml").write_text(text, encoding="utf-8")
    done = cli("test", "greet.mk", "--script", "bad.yaml", "--format", "text", cwd=project)
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "bad.yaml" in lines[0]


def test_a_conformance_case_passes_through_mklang_test(tmp_path):
    """The conformance files are scenario scripts plus a source: `mklang test` agrees with the runner."""
    cases = yaml.safe_load((ROOT / "tests" / "conformance" / "gates.yaml").read_text())["cases"]
    case = next(c for c in cases if c["name"] == "a-hook-between-prose-gates-splits-the-batch")
    (tmp_path / "m.mk").write_text(textwrap.dedent(case["source"]), encoding="utf-8")
    scenario = {k: v for k, v in case.items() if k not in {"source", "machines", "calls"}}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump({"scenarios": [scenario]}), encoding="utf-8")
    done = cli("test", "m.mk", "--script", "s.yaml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout
    assert f"PASS {case['name']}" in done.stdout
