"""`mklang verify-resume`: an author's own check of resume parity, and what it catches."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from support import ROOT
from support.commands import cli

from mklang.checkpoint.journal import StoreJournal
from mklang.scenarios import load_script
from mklang.syntax import load_file
from mklang.verification import verify

FETCH = """machine fetch
entry pull
budget 4
tool pull_feed "Fetch the latest items. Input: {topic}."
state pull {
  tool pull_feed { topic: "news" }
  output items
  otherwise -> sum
}
state sum {
  structure "One line."
  prompt "Summarize {{items}}."
  output summary
  otherwise -> END
}
"""
# A host tool whose answer changes each time it is called: not idempotent.
COUNTER = """
calls = []


def pull_feed(input):
    calls.append(input)
    return f"feed read {len(calls)} times"


TOOLS = {"pull_feed": pull_feed}
"""


def _fetch(tmp_path: Path) -> Path:
    (tmp_path / "fetch.mk").write_text(FETCH)
    (tmp_path / "counter.py").write_text(COUNTER)
    script = {"scenarios": [{"name": "summarized", "llm": {"produce": ["the news"], "tokens": [10, 2]}}]}
    (tmp_path / "fetch.yaml").write_text(yaml.safe_dump(script))
    return tmp_path


def test_verify_resume_passes_on_the_approval_example_and_says_what_it_tried():
    checked = cli("verify-resume", "approval.mk", "--script", "scenarios.yaml", cwd=ROOT / "examples" / "approval")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    lines = checked.stdout.splitlines()
    assert len(lines) == len(load_script(ROOT / "examples/approval/scenarios.yaml"))
    assert lines[0].startswith("ask-then-publish: resumed like the uninterrupted run after ")
    as_json = cli(
        "verify-resume",
        "approval.mk",
        "--script",
        "scenarios.yaml",
        "--scenario",
        "revised-then-published",
        "--format",
        "json",
        cwd=ROOT / "examples" / "approval",
    )
    (report,) = json.loads(as_json.stdout)
    assert report["scenario"] == "revised-then-published" and report["divergence"] is None
    assert report["suspensions"] >= 2 and report["crashes"] >= 10


def test_verify_resume_fails_naming_the_step_of_a_tool_that_is_not_idempotent(tmp_path):
    folder = _fetch(tmp_path)
    plain = cli("verify-resume", "fetch.mk", "--script", "fetch.yaml", cwd=folder)
    assert plain.returncode == 0, plain.stdout  # the script answers the tool by its idempotency key
    failed = cli("verify-resume", "fetch.mk", "--script", "fetch.yaml", "--plugin", "counter.py", cwd=folder)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert failed.stdout == (
        "summarized: run twice, uninterrupted: step 1 (pull) differs: output: feed read 1 times | feed read 2 times"
        " (0 suspensions and 0 crashes tried)\n"
    )


def test_verify_resume_catches_a_paid_answer_that_is_paid_again(monkeypatch):
    machine = load_file(ROOT / "machines/chain_of_thought.mk")
    scenario = load_script(ROOT / "machines/chain_of_thought.scenarios.yaml")[0]
    assert verify(machine, scenario).divergence is None
    monkeypatch.setattr(StoreJournal, "replay", lambda self, key, kind: None)  # a journal that forgets its answers
    found = verify(machine, scenario).divergence
    assert found is not None and "calls answered where the uninterrupted run needed" in found.what, found


def test_verify_resume_refuses_a_scenario_the_script_does_not_have(tmp_path):
    folder = _fetch(tmp_path)
    refused = cli("verify-resume", "fetch.mk", "--script", "fetch.yaml", "--scenario", "nope", cwd=folder)
    assert refused.returncode == 2 and "no scenarios named ['nope']" in refused.stderr
