"""What the CLI prints for people and for programs: whole lines off a terminal, one error
document when piped, and ends of runs that say which budget ran out and how far."""

from __future__ import annotations

import json

import pytest
from support.commands import cli, mklang
from support.examples import EXAMPLES

GROW = """machine grow
entry write
budget 100

state write {
  structure "a line"
  prompt "more"
  output lines
  when "enough lines" -> END
  otherwise -> write
}
"""
# Each call charges 604 tokens; no gate ever fires but `otherwise`.
SCRIPT = 'scenarios:\n  - name: s\n    llm: {produce: ["x"], tokens: [500, 104], judge: ["none"]}\n'


@pytest.fixture
def grow(tmp_path):
    (tmp_path / "grow.mk").write_text(GROW)
    (tmp_path / "s.yaml").write_text(SCRIPT)
    return tmp_path


def test_text_output_off_a_terminal_is_not_cut_at_80_columns():
    triage = EXAMPLES / "triage"
    args = ["--script", str(triage / "scenarios.yaml"), "--scenario", "small-refund-answered-directly"]
    done = mklang("run", str(triage / "triage.mk"), *args, "--format", "text")  # stdout is a pipe
    assert done.returncode == 0, done.stderr
    (line,) = [line for line in done.stdout.splitlines() if "draft ─ok→ END" in line]
    assert line.endswith("judged over outside data") and len(line) > 80


@pytest.mark.parametrize(
    ("caps", "reason", "detail"),
    [
        (["--max-tokens", "1000"], "cost-exhausted", "tokens 1,208 of 1,000"),
        ([], "budget-exhausted", "steps 100 of 100"),
    ],
)
def test_a_halted_run_names_the_budget_that_ran_out_and_how_far(grow, caps, reason, detail):
    args = ["run", "grow.mk", "--script", "s.yaml", "--scenario", "s", *caps]
    piped = cli(*args, "--format", "json", cwd=grow)
    document = json.loads(piped.stdout)
    assert (piped.returncode, document["status"]) == (1, "halted")
    assert (document["error"], document["detail"]) == (reason, detail)
    shown = cli(*args, "--format", "text", cwd=grow)
    assert shown.stdout.splitlines()[0] == f"halted  {reason}: {detail}  at write"


def test_a_time_budget_says_how_long_the_run_took_against_it(grow):
    args = ["run", "grow.mk", "--script", "s.yaml", "--scenario", "s", "--max-time", "0.001", "--format", "json"]
    document = json.loads(cli(*args, cwd=grow).stdout)
    assert document["error"] == "time-exhausted"
    spent, limit = document["detail"].removeprefix("time ").split(" of ")
    assert limit == "0.001s" and float(spent.removesuffix("s")) >= 0.001


def test_a_suspended_run_keeps_the_detail_in_its_checkpoint(grow):
    args = ["run", "grow.mk", "--script", "s.yaml", "--scenario", "s", "--max-tokens", "1000"]
    suspended = json.loads(cli(*args, "--checkpoint", "cp.json", "--format", "json", cwd=grow).stdout)
    assert (suspended["reason"], suspended["detail"]) == ("cost-exhausted", "tokens 1,208 of 1,000")
    shown = cli("show", "cp.json", "--format", "text", cwd=grow)
    assert shown.stdout.splitlines()[0] == "suspended  cost-exhausted: tokens 1,208 of 1,000  at write"
