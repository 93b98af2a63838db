"""A suspension says which budget ran out, what was spent against it, and the exact
command that continues it; `mklang show` says the same. `error` is null (the
reason is in `reason`)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from support.commands import cli
from support.examples import HITL

TWO_STEPS = """\
machine two
entry hello
budget 5

state hello {
  structure "One line."
  prompt "Greet."
  output greeting
  otherwise -> bye
}

state bye {
  structure "One line."
  prompt "Say goodbye."
  output farewell
  otherwise -> END
}
"""

SCRIPT = "scenarios:\n  - name: a\n    llm: {produce: [hi, bye], tokens: [30, 20]}\n"


def project(tmp_path: Path) -> Path:
    (tmp_path / "two.mk").write_text(TWO_STEPS, encoding="utf-8")
    (tmp_path / "s.yaml").write_text(SCRIPT, encoding="utf-8")
    return tmp_path


def suspend(folder: Path, *args: str) -> dict:
    done = cli("run", "two.mk", "--script", "s.yaml", "--checkpoint", "cp.json", *args, "--format", "json", cwd=folder)
    assert done.returncode == 3, done.stderr
    return json.loads(done.stdout)


def continue_as_told(folder: Path, command: str) -> dict:
    program, *args = shlex.split(command)
    assert program == "mklang"
    done = cli(*args, "--format", "json", cwd=folder)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_token_budget_suspension_names_the_budget_the_spend_and_the_command(tmp_path):
    folder = project(tmp_path)
    result = suspend(folder, "--max-tokens", "10")
    assert (result["status"], result["error"], result["reason"]) == ("suspended", None, "cost-exhausted")
    assert result["ran_out"] == "the token budget of 10 ran out: 50 tokens spent"
    assert result["continue_with"] == "mklang resume cp.json --max-tokens 100"
    shown = json.loads(cli("show", "cp.json", "--format", "json", cwd=folder).stdout)
    assert (shown["ran_out"], shown["continue_with"]) == (result["ran_out"], result["continue_with"])
    text = cli("show", "cp.json", "--summary", "--format", "text", cwd=folder).stdout
    assert "the token budget of 10 ran out: 50 tokens spent" in text
    assert "continue with: mklang resume cp.json --max-tokens 100" in text
    assert continue_as_told(folder, result["continue_with"])["context"]["farewell"] == "bye"


def test_a_step_budget_suspension_says_so_on_stderr_too(tmp_path):
    folder = project(tmp_path)
    (folder / "s.yaml").write_text(SCRIPT + "    run: {budget: 1}\n", encoding="utf-8")
    done = cli("run", "two.mk", "--script", "s.yaml", "--checkpoint", "cp.json", "--format", "text", cwd=folder)
    assert done.returncode == 3
    assert "the step budget of 1 (machine two) ran out: 1 step taken" in done.stderr
    assert "continue with: mklang resume cp.json --budget 2" in done.stderr
    assert continue_as_told(folder, "mklang resume cp.json --budget 2")["status"] == "done"


def test_a_human_question_says_how_to_reply(tmp_path):
    approval = HITL / "approval"
    done = cli(
        "run",
        str(approval / "approval.mk"),
        "--script",
        str(approval / "scenarios.yaml"),
        "--scenario",
        "ask-then-publish",
        "--checkpoint",
        "cp.json",
        "--format",
        "json",
        cwd=tmp_path,
    )
    result = json.loads(done.stdout)
    assert (result["error"], result["reason"], result["ran_out"]) == (None, "escalated", None)
    assert result["continue_with"] == "mklang resume cp.json --set approval.answer=<reply>"
