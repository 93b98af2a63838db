"""`mklang run --checkpoint`, `resume` and `show` as scripts see them: real processes, real files.

Exit codes (0 done, 1 halt, 2 unusable input or checkpoint, 3 suspended),
one JSON document on stdout with `--format json`, never a traceback, and the
resume options: raised budgets, unchanged budgets, `--set`, `--force`,
`--machine`, `--checkpoint`.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
from support import ROOT
from support.checkpoints import frame_record
from support.commands import cli, refused
from support.crashes import Crash, dead_run
from support.examples import HITL
from support.runs import LoopTops

from mklang.checkpoint.envelope import Envelope, MachineRef, load, save
from mklang.checkpoint.signing import checkpoint_key, sign
from mklang.errors import CheckpointError, MklangError
from mklang.providers.base import Usage
from mklang.session import Host
from mklang.stores import locate
from mklang.syntax import load_file

EXAMPLES = ROOT / "examples"

# Five drafts are needed; `budget` is filled in per folder.
LOOP = """\
machine loop
entry draft
budget {budget}
context {{
  topic: "rivers"
}}

state draft {{
  structure "One line."
  prompt "Draft attempt about {{{{topic}}}}."
  output text
  when "the draft is good" -> END
  when "the draft needs another try" -> draft
  otherwise fail
}}
"""

SCRIPT = """\
scenarios:
  - name: finishes
    llm: {produce: [one, two, three, four, five], judge: [1, 1, 1, 1, 0], tokens: [3, 2]}
  - name: gives-up
    llm: {produce: [one, two, three, four, five], judge: [1, 1, 1, 1, none], tokens: [3, 2]}
"""

COMPARED = ("status", "error", "at", "result", "context", "trace", "usage")


def as_json(*args: str, cwd: Path) -> tuple[int, dict]:
    """Run with `--format json`; stdout must be exactly one JSON document."""
    done = cli(*args, "--format", "json", cwd=cwd)
    return done.returncode, json.loads(done.stdout)


def error_line(done: subprocess.CompletedProcess) -> str:
    """A failure is exit 2, one error document on stdout (piped means JSON) and one line on stderr."""
    line = refused(done)
    document = json.loads(done.stdout)
    assert document["status"] == "error" and document["exit_code"] == 2
    return line


def comparable(data: dict) -> dict:
    return {key: data[key] for key in COMPARED}


@pytest.fixture
def loop(tmp_path: Path) -> Path:
    """`tight/loop.mk` (budget 3: suspends) and `roomy/loop.mk` (budget 10: the reference)."""
    for folder, budget in (("tight", 3), ("roomy", 10)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "loop.mk").write_text(LOOP.format(budget=budget), encoding="utf-8")
    (tmp_path / "loop.yaml").write_text(SCRIPT, encoding="utf-8")
    return tmp_path


def run_loop(cwd: Path, folder: str, scenario: str, *options: str) -> tuple[int, dict]:
    return as_json("run", f"{folder}/loop.mk", "--script", "loop.yaml", "--scenario", scenario, *options, cwd=cwd)


@pytest.fixture
def approval(tmp_path: Path) -> Path:
    """A copy of the free-text approval flow (tests/support/hitl), so tests can move and edit it."""
    shutil.copytree(HITL / "approval", tmp_path / "approval")
    return tmp_path


def run_approval(cwd: Path, *options: str) -> tuple[int, dict]:
    """`mklang run` of the approval example's ask-then-publish scenario with `options`: its exit code and JSON."""
    scenario = ("--script", "approval/scenarios.yaml", "--scenario", "ask-then-publish")
    return as_json("run", "approval/approval.mk", *scenario, *options, cwd=cwd)


def suspend_approval(cwd: Path, checkpoint: str = "cp.json") -> dict:
    code, data = run_approval(cwd, "--hitl", "--checkpoint", checkpoint)
    assert code == 3
    return data


# --- exit codes -----------------------------------------------------------


@pytest.mark.parametrize(
    ("folder", "options", "code", "status", "error"),
    [
        ("tight", [], 1, "halted", "budget-exhausted"),  # without a checkpoint a budget halts
        ("tight", ["--checkpoint", "cp.json"], 3, "suspended", "budget-exhausted"),
        ("roomy", ["--checkpoint", "cp.json", "--max-tokens", "7"], 3, "suspended", "cost-exhausted"),
    ],
    ids=["budget-halts", "budget-suspends", "tokens-suspend"],
)
def test_run_exit_codes_match_the_status(loop, folder, options, code, status, error):
    returned, data = run_loop(loop, folder, "finishes", *options)
    why = data["reason"] if status == "suspended" else data["error"]
    assert (returned, data["status"], why) == (code, status, error)
    assert (loop / "cp.json").exists() == (status == "suspended")
    if status == "suspended":  # a suspension is no error: its reason says why it stopped
        assert data["error"] is None and data["frames"] == [{"machine": "loop", "state": "draft"}]
        assert load(loop / "cp.json").status == "suspended"


def test_no_hitl_on_the_command_line_wins_over_the_scenario(approval):
    code, data = run_approval(approval, "--no-hitl", "--checkpoint", "cp.json")
    assert (code, data["status"]) == (0, "done")  # the escalation is an ordinary transition


def test_resume_exits_1_when_the_resumed_run_halts(loop):
    assert run_loop(loop, "tight", "gives-up", "--checkpoint", "cp.json")[0] == 3
    code, data = as_json("resume", "cp.json", "--budget", "10", cwd=loop)
    assert (code, data["status"], data["error"], data["at"]) == (1, "halted", "gate-fail", "draft")
    assert load(loop / "cp.json").status == "halted"


# --- resuming ---------------------------------------------------------------


def test_raising_the_step_budget_completes_as_the_uninterrupted_run(loop):
    code, reference = run_loop(loop, "roomy", "finishes")
    assert (code, reference["status"]) == (0, "done")
    code, first = run_loop(loop, "tight", "finishes", "--checkpoint", "cp.json")
    assert (code, len(first["trace"])) == (3, 3)
    code, resumed = as_json("resume", "cp.json", "--budget", "10", cwd=loop)
    assert code == 0
    assert comparable(resumed) == comparable(reference)
    # The resumed process paid only for the two drafts the suspended one had not made.
    assert resumed["calls"] == {"judge": 2, "produce": 2}
    assert first["calls"] == {"judge": 3, "produce": 3}


def test_raising_the_token_budget_completes_as_the_uninterrupted_run(loop):
    code, reference = run_loop(loop, "roomy", "finishes")
    assert code == 0
    code, first = run_loop(loop, "roomy", "finishes", "--checkpoint", "cp.json", "--max-tokens", "7")
    assert (code, first["reason"], len(first["trace"])) == (3, "cost-exhausted", 2)
    # A new total that is still too small: it goes two steps further and suspends again.
    code, again = as_json("resume", "cp.json", "--max-tokens", "17", cwd=loop)
    assert (code, again["reason"], len(again["trace"])) == (3, "cost-exhausted", 4)
    code, resumed = as_json("resume", "cp.json", "--max-tokens", "100", cwd=loop)
    assert code == 0
    assert comparable(resumed) == comparable(reference)
    assert resumed["usage"]["input_tokens"] == 15  # the spend before each suspension counts once
    assert (first["calls"]["produce"], again["calls"]["produce"], resumed["calls"]["produce"]) == (2, 2, 1)


def test_unchanged_budgets_re_suspend_at_the_same_place_with_identical_frames(loop):
    code, first = run_loop(loop, "tight", "finishes", "--checkpoint", "cp.json")
    assert code == 3
    frames = load(loop / "cp.json").frames
    code, again = as_json("resume", "cp.json", cwd=loop)
    assert code == 3
    assert comparable(again) == comparable(first)
    assert again["calls"] == {}  # nothing was paid for
    assert load(loop / "cp.json").frames == frames


def test_the_readme_approval_flow_run_show_resume(approval):
    data = suspend_approval(approval)
    assert (data["status"], data["reason"], data["at"]) == ("suspended", "escalated", "decide")
    assert data["ask"] == "Publish this announcement? Answer yes, or say what to change."
    assert data["reply_to"] == "approval.answer"
    shown = cli("show", "cp.json", "--format", "text", cwd=approval)
    assert shown.returncode == 0
    assert "Publish this announcement? Answer yes, or say what to change." in shown.stdout
    assert "--set approval.answer=" in shown.stdout
    code, summary = as_json("show", "cp.json", cwd=approval)
    assert (code, summary["status"], summary["reason"], summary["reply_to"]) == (
        0,
        "suspended",
        "escalated",
        "approval.answer",
    )
    assert [(f["machine"], f["state"]) for f in summary["frames"]] == [("approval", "decide")]
    code, done = as_json(
        "resume",
        "cp.json",
        "--set",
        "approval.answer=yes",
        "--script",
        "approval/scenarios.yaml",
        "--scenario",
        "ask-then-publish",
        cwd=approval,
    )
    assert code == 0
    assert done["result"] == "https://status.example.com/posts/118"
    assert done["context"]["approval"]["answer"] == "yes"
    assert [step["state"] for step in done["trace"]] == ["draft", "decide", "publish"]


def test_host_files_recorded_from_a_folder_below_the_checkpoint_resolve_at_every_snapshot(approval):
    """The scenario script is named relative to the checkpoint's folder once, however many
    snapshots rewrite the envelope, whatever folder the run was started from."""
    code, data = as_json(
        "run", "approval.mk", "--script", "scenarios.yaml", "--scenario", "ask-then-publish", "--hitl",
        "--checkpoint", "../cp.json", cwd=approval / "approval",
    )  # fmt: skip
    assert (code, data["reason"]) == (3, "escalated")
    assert load(approval / "cp.json").host.script == "approval/scenarios.yaml"
    code, done = as_json("resume", "cp.json", "--set", "approval.answer=yes", cwd=approval)
    assert (code, done["result"]) == (0, "https://status.example.com/posts/118")


def test_editing_a_sub_machine_refuses_the_resume_naming_it_and_force_accepts(tmp_path):
    shutil.copytree(EXAMPLES / "nested", tmp_path / "nested")
    _, reference = as_json(
        "run",
        "nested/brief.mk",
        "--script",
        "nested/scenarios.yaml",
        "--scenario",
        "two-sections-one-corrected",
        cwd=tmp_path,
    )
    code, first = as_json(
        "run",
        "nested/brief.mk",
        "--script",
        "nested/scenarios.yaml",
        "--scenario",
        "two-sections-one-corrected",
        "--checkpoint",
        "cp.json",
        "--max-tokens",
        "300",
        cwd=tmp_path,
    )
    assert code == 3
    assert first["frames"] == [{"machine": "brief", "state": "add_section"}, {"machine": "section", "state": "check"}]
    sub = tmp_path / "nested" / "fact_check.mk"
    assert "fact_check.mk" in load(tmp_path / "cp.json").machines  # loaded by the run, so its hash is recorded
    sub.write_text(sub.read_text(encoding="utf-8") + "# reviewed\n", encoding="utf-8")
    # Hashes are verified before any provider is set up (this one has no API key).
    line = error_line(
        cli("resume", "cp.json", "--max-tokens", "100000", "--provider", "openai", "--model", "m", cwd=tmp_path)
    )
    assert "fact_check.mk" in line and "changed" in line and "--force" in line
    assert load(tmp_path / "cp.json").status == "suspended"  # the refusal leaves the checkpoint as it was
    code, resumed = as_json("resume", "cp.json", "--max-tokens", "100000", "--force", cwd=tmp_path)
    assert code == 0
    assert comparable(resumed) == comparable(reference)


def test_a_moved_root_machine_resumes_from_the_kept_text_or_with_the_machine_option(approval):
    suspend_approval(approval)
    (approval / "moved").mkdir()
    shutil.move(approval / "approval" / "approval.mk", approval / "moved" / "approval.mk")
    checked = cli("resume", "cp.json", "--check", cwd=approval)
    assert checked.returncode == 0, checked.stderr  # the store keeps the text the checkpoint signed
    assert "approval.mk is missing; running the machine texts the store keeps" in checked.stderr
    code, done = as_json(
        "resume", "cp.json", "--set", "approval.answer=yes", "--machine", "moved/approval.mk", cwd=approval
    )
    assert (code, done["status"]) == (0, "done")


FAN = """\
machine fan
entry split
budget 4

state split {
  structure "A JSON list of topics."
  prompt "List ten topics."
  parse list
  output topics
  otherwise -> review
}

state review {
  over topics
  structure "One line."
  prompt "Review {{item}}."
  output reviews
  otherwise -> END
}
"""

FAN_SCRIPT = """\
scenarios:
  - name: ten
    llm: {produce: ['["a","b","c","d","e","f","g","h","i","j"]', fine]}
"""


def suspended_fan(folder: Path, machine: str = FAN, script: str = FAN_SCRIPT) -> subprocess.CompletedProcess[str]:
    """`mklang run` of the fan-out machine, suspended (into cp.json) on its step budget: what it printed."""
    (folder / "fan.mk").write_text(machine, encoding="utf-8")
    (folder / "fan.yaml").write_text(script, encoding="utf-8")
    run = cli("run", "fan.mk", "--script", "fan.yaml", "--checkpoint", "cp.json", cwd=folder)
    assert run.returncode == 3, run.stderr
    return run


def test_the_suggested_budget_gets_past_the_fan_out_ahead_in_one_resume(tmp_path):
    run = suspended_fan(tmp_path)
    command = run.stderr.strip().splitlines()[-1].partition("continue with: ")[2]
    assert command == "mklang resume cp.json --budget 11"  # 1 step taken, 10 branches ahead
    code, done = as_json(*shlex.split(command)[1:], cwd=tmp_path)
    assert (code, done["status"], len(done["context"]["reviews"])) == (0, "done", 10)


@pytest.mark.parametrize(
    ("ahead", "topics", "suggested"),
    [
        ("over topics", "[]", "--budget 2"),  # no branch: the state is one step
        ("over topics", '["a", "b", "c"]', "--budget 4"),  # a step a branch
        ("sample 3", '["a"]', "--budget 4"),  # a step a sample
    ],
)
def test_the_suggested_budget_covers_the_steps_of_the_state_ahead(tmp_path, ahead, topics, suggested):
    script = FAN_SCRIPT.replace('\'["a","b","c","d","e","f","g","h","i","j"]\'', repr(topics))
    run = suspended_fan(
        tmp_path,
        FAN.replace("  over topics\n", f"  {ahead}\n"),
        script + "    run: {budget: 1}\n",  # a step, then the state ahead
    )
    last = run.stderr.strip().splitlines()[-1]
    assert last == f"checkpoint: cp.json; continue with: mklang resume cp.json {suggested}"


def test_show_suggests_the_budget_past_the_fan_out_even_with_the_machine_edited_and_the_run_held(tmp_path):
    from mklang.runs.inspection import describe

    suspended_fan(tmp_path)
    with open(tmp_path / "fan.mk", "a", encoding="utf-8") as edited:
        edited.write("# edited after the run stopped\n")
    shown = while_held(tmp_path / "cp.json", describe)  # a resume has just begun elsewhere
    assert shown["continue_with"] == f"mklang resume {tmp_path / 'cp.json'} --budget 11"  # 1 step taken, 10 ahead


def test_resume_with_checkpoint_writes_the_re_suspension_elsewhere(loop):
    run_loop(loop, "tight", "finishes", "--checkpoint", "cp.json")
    original = (loop / "cp.json").read_bytes()
    code, _again = as_json("resume", "cp.json", "--checkpoint", "other.json", cwd=loop)
    assert code == 3
    assert (loop / "cp.json").read_bytes() == original
    assert load(loop / "other.json").status == "suspended"
    assert load(loop / "other.json").frames == load(loop / "cp.json").frames
    code, done = as_json("resume", "other.json", "--budget", "10", cwd=loop)
    assert (code, done["status"]) == (0, "done")
    assert (loop / "cp.json").read_bytes() == original
    assert load(loop / "cp.json").status == "suspended"  # still resumable from where it was


@pytest.mark.parametrize(
    ("scenario", "code", "reason"),
    [
        ("finishes", 0, "already finished"),
        ("gives-up", 1, "halted (gate-fail)"),
    ],
)
def test_a_finished_checkpoint_refuses_to_resume(loop, scenario, code, reason):
    assert run_loop(loop, "roomy", scenario, "--checkpoint", "cp.json")[0] == code
    line = error_line(cli("resume", "cp.json", cwd=loop))
    assert reason in line and "cannot be resumed" in line


def test_a_malformed_resume_option_is_a_usage_error(loop):
    run_loop(loop, "tight", "finishes", "--checkpoint", "cp.json")
    line = error_line(cli("resume", "cp.json", "--set", "no-equals-sign", cwd=loop))
    assert "--set" in line
    assert load(loop / "cp.json").status == "suspended"


def test_a_checkpoint_path_in_a_missing_folder_exits_2_with_one_line(loop):
    line = error_line(
        cli(
            "run",
            "roomy/loop.mk",
            "--script",
            "loop.yaml",
            "--scenario",
            "finishes",
            "--checkpoint",
            "missing/cp.json",
            cwd=loop,
        )
    )
    assert "missing/cp.json" in line and "internal error" not in line


# --- bad checkpoints -------------------------------------------------------


VALID = {
    "format": 1,
    "mklang_version": "0",
    "run_id": "r",
    "status": "suspended",
    "machine": {"name": "loop", "path": None, "sha256": None},
    "frames": [],
}


def signed_json(document: dict) -> str:
    """A hand-written checkpoint signed with this suite's key, so only its content is judged."""
    return json.dumps({**document, "signature": sign(document, checkpoint_key())[1]})


# What each bad checkpoint holds; a signed one is signed when its test runs, with the key the test sees.
BAD = {
    "missing": (None, "no such checkpoint"),
    "empty": ("", "empty"),
    "truncated": (json.dumps(VALID)[:40], "not valid JSON"),
    "not-json": ("checkpoint? what checkpoint?", "not valid JSON"),
    "array": ("[1, 2, 3]", "expected a JSON object"),
    "format-99": (json.dumps({**VALID, "format": 99}), "format 99"),
    "missing-fields": (json.dumps({"format": 1}), "mklang_version"),
    "no-frames": (lambda: signed_json(VALID), "no frames"),
}


def _bad_cases(command: str, names: list[str]):
    return [pytest.param(command, *BAD[name], id=f"{command}-{name}") for name in names]


@pytest.mark.parametrize(
    ("command", "content", "needle"),
    _bad_cases("resume", list(BAD)) + _bad_cases("show", ["missing", "truncated", "array"]),
)
def test_a_bad_checkpoint_exits_2_with_one_clear_line(tmp_path, command, content, needle):
    if content is not None:
        (tmp_path / "cp.json").write_text(content() if callable(content) else content, encoding="utf-8")
    line = error_line(cli(command, "cp.json", cwd=tmp_path))
    assert line.startswith("mklang: error: cp.json: ") and needle in line


def test_the_checkpoint_file_is_owner_only_even_when_it_existed(loop):
    checkpoint = loop / "cp.json"
    checkpoint.write_text("{}", encoding="utf-8")
    checkpoint.chmod(0o644)
    assert run_loop(loop, "tight", "finishes", "--checkpoint", "cp.json", "--replace")[0] == 3
    assert stat.S_IMODE(checkpoint.stat().st_mode) == 0o600
    as_json("resume", "cp.json", "--checkpoint", "other.json", cwd=loop)
    assert stat.S_IMODE((loop / "other.json").stat().st_mode) == 0o600


# --- what `mklang show` says about a checkpoint (`mklang.runs.inspection`) ---------


def _checkpoint(**fields: Any) -> Envelope:
    defaults: dict[str, Any] = {"mklang_version": "test", "run_id": "r", "status": "suspended", "frames": []}
    return Envelope(machine=MachineRef(name="m", path=None, sha256=None), **{**defaults, **fields})


def _suspended(tmp_path: Path, **fields: Any) -> Path:
    folder = tmp_path / "my runs"
    folder.mkdir(exist_ok=True)
    path = folder / "cp.json"
    save(path, _checkpoint(**fields))
    return path


def test_show_reports_each_level_its_spend_against_the_budgets_and_the_last_steps(tmp_path):
    from mklang.checkpoint.envelope import Budgets, HostSettings
    from mklang.runs.inspection import describe

    trace = [{"state": f"s{n}"} for n in range(7)]
    path = _suspended(
        tmp_path,
        reason="time-exhausted",
        detail="the clock ran out",
        at="child:work",
        frames=[frame_record("root", "call", 4, 10, trace=trace), frame_record("child", "work", 5, 3)],
        budgets=Budgets(max_tokens=100, max_cost=0.5, max_time=30),
        usage={"input_tokens": 30, "output_tokens": 10, "cost_usd": 0.25},
        ask="Go on?",
        reply_to="answer",
        host=HostSettings(script="s.yaml", scenario="a", position={"calls": 3}, model=None, plugins=[], extra={}),
    )
    summary = describe(path, last=3)
    assert summary == {
        "path": str(path),
        "status": "suspended",
        "reason": "time-exhausted",
        "detail": "the clock ran out",
        "error": None,
        "at": "child:work",
        "run_id": "r",
        "machine": {"name": "m", "path": None, "sha256": None},
        "frames": [
            {"machine": "root", "state": "call", "steps": 4, "budget": 10, "remaining": 6},
            {"machine": "child", "state": "work", "steps": 5, "budget": 3, "remaining": 0},
        ],
        "tokens": {"spent": 40, "budget": 100, "remaining": 60},
        "cost_usd": {"spent": 0.25, "budget": 0.5, "remaining": 0.25},
        "max_time": 30,
        "last_steps": trace[-3:],
        "ask": "Go on?",
        "reply_to": "answer",
        "resumable": True,
        "signature": {"seal": "signed", "text": "signed with your checkpoint key"},
        "host": {"script": str(path.parent / "s.yaml"), "scenario": "a"},  # recorded beside the checkpoint
        "lineage": [],  # made by no fork
        "actions": [],  # no operator acted on it
        "ran_out": "the time budget of 30s ran out",
        "continue_with": f"mklang resume '{path}' --max-time 30s",
    }
    assert describe(path)["last_steps"] == trace[-5:]  # five by default
    assert describe(path, last=0)["last_steps"] == []


def test_show_counts_a_budget_overspent_as_nothing_remaining(tmp_path):
    from mklang.checkpoint.envelope import Budgets
    from mklang.runs.inspection import describe

    path = _suspended(
        tmp_path,
        reason="cost-exhausted",
        frames=[frame_record("m", "a", 0, 0)],
        budgets=Budgets(max_tokens=5, max_cost=0.1),
        usage={"input_tokens": 6, "output_tokens": 1, "cost_usd": 0.3},
    )
    summary = describe(path)
    assert (summary["tokens"]["remaining"], summary["cost_usd"]["remaining"]) == (0, 0)
    assert summary["frames"][0]["remaining"] == 0
    assert summary["ran_out"] == "the token budget of 5 ran out: 7 tokens spent"


def test_show_asks_the_question_of_the_innermost_level_and_a_halted_run_is_not_resumable(tmp_path):
    from mklang.runs.inspection import describe

    asked = {"ask": "Which one?", "reply_to": "pick"}
    path = _suspended(
        tmp_path,
        reason="escalated",
        frames=[frame_record("root", "a", 1, 5), frame_record("child", "b", 1, 5, ask=asked)],
        ask="an older question",
        reply_to="pick",
    )
    summary = describe(path)
    assert (summary["ask"], summary["reply_to"]) == ("Which one?", "pick")
    assert (summary["ran_out"], summary["continue_with"]) == (None, f"mklang resume '{path}' --set pick=<reply>")
    save(path, _checkpoint(status="halted", error="gate-fail", frames=[frame_record("root", "a", 1, 5)]))
    halted = describe(path)
    assert (halted["resumable"], halted["error"], halted["ask"], halted["reply_to"]) == (False, "gate-fail", None, None)
    assert "continue_with" not in halted and "interrupted" not in halted
    save(path, _checkpoint(status="done"))
    assert describe(path)["resumable"] is False


def while_held(path: Path, read: Any) -> Any:
    """What `read` tells of the run at `path` while this process holds its lock, as a running one does."""
    location = locate(path)
    lock = location.store.lock(location.run)
    try:
        return read(path)
    finally:
        lock.release()


def test_show_replays_the_journal_of_a_run_that_died_or_still_runs(tmp_path):
    from support import ROOT

    from mklang.runs import start as start_run
    from mklang.runs.inspection import describe
    from mklang.scenarios import load_script

    machine = load_file(ROOT / "examples" / "nested" / "brief.mk")
    scenario = load_script(ROOT / "examples" / "nested" / "scenarios.yaml")[0]
    tops = iter(range(4))

    def crash_at_the_fifth_loop_top(event: Any) -> None:
        if next(tops, None) is None:
            raise Crash

    path = tmp_path / "cp.json"
    with pytest.raises(Crash):
        start_run(
            machine, None, Host.for_scenario(scenario), checkpoint=path, observer=LoopTops(crash_at_the_fifth_loop_top)
        )
    assert [(f["machine"], f["steps"]) for f in load(path).frames] == [("brief", 0)]  # the snapshot lags behind
    summary = describe(path)
    assert [(f["machine"], f["state"], f["steps"], f["remaining"]) for f in summary["frames"]] == [
        ("brief", "add_section", 0, 10),
        ("section", "check", 1, 5),
        ("fact_check", "review", 1, 3),
    ]
    assert summary["tokens"]["spent"] == 140  # what every level spent, from the journal
    assert (summary["status"], summary["resumable"]) == ("running", True)
    assert "running_pid" not in summary
    assert summary["interrupted"] == (
        "the run was interrupted at fact_check:review (2 journaled step(s) past the last snapshot); "
        f"`mklang resume {path}` continues from there"
    )
    held = while_held(path, describe)
    assert (held["running_pid"], held["resumable"]) == (os.getpid(), False)
    assert held["interrupted"] == f"the run is still going in process {os.getpid()}, last durable at fact_check:review"


_SPENT = Usage(100, 20, 0.6)


@pytest.mark.parametrize(
    ("reason", "innermost", "usage", "budgets", "reply_to", "expected"),
    [
        (
            "budget-exhausted",
            {"machine": "child", "steps": 3, "budget": 3},
            _SPENT,
            {},
            None,
            ("the step budget of 3 (machine child) ran out: 3 steps taken", "--budget 6"),
        ),
        (
            "budget-exhausted",
            {"steps": 2, "budget": 5},
            _SPENT,
            {},
            None,
            ("the step budget of 5 ran out: 2 steps taken", "--budget 7"),
        ),
        (
            "budget-exhausted",
            {"steps": 1, "budget": 1},
            _SPENT,
            {},
            None,
            ("the step budget of 1 ran out: 1 step taken", "--budget 2"),
        ),
        ("budget-exhausted", {}, _SPENT, {}, None, ("the step budget of 0 ran out: 0 steps taken", "--budget 1")),
        (
            "cost-exhausted",
            {},
            _SPENT,
            {"max_tokens": 120, "max_cost": 0.5},
            None,
            ("the token budget of 120 ran out: 120 tokens spent", "--max-tokens 240"),
        ),
        (
            "cost-exhausted",
            {},
            _SPENT,
            {"max_tokens": 50},
            None,
            ("the token budget of 50 ran out: 120 tokens spent", "--max-tokens 240"),
        ),
        (
            "cost-exhausted",
            {},
            Usage(),
            {"max_tokens": 0},
            None,
            ("the token budget of 0 ran out: 0 tokens spent", "--max-tokens 1000"),
        ),
        (
            "cost-exhausted",
            {},
            _SPENT,
            {"max_tokens": 121, "max_cost": 0.5},
            None,
            ("the dollar budget of $0.5 ran out: $0.6000 spent", "--max-cost 1.2"),
        ),
        (
            "cost-exhausted",
            {},
            Usage(1, 0, 0.2),
            {"max_cost": 0.75},
            None,
            ("the dollar budget of $0.75 ran out: $0.2000 spent", "--max-cost 0.95"),
        ),
        (
            "cost-exhausted",
            {},
            Usage(),
            {"max_cost": 0.0},
            None,
            ("the dollar budget of $0 ran out: $0.0000 spent", "--max-cost 1"),
        ),
        ("cost-exhausted", {}, _SPENT, {"max_tokens": 121}, None, (None, "")),
        ("time-exhausted", {}, _SPENT, {"max_time": 1.5}, None, ("the time budget of 1.5s ran out", "--max-time 1.5s")),
        ("time-exhausted", {}, _SPENT, {}, None, (None, "")),
        ("escalated", {}, _SPENT, {}, "a.b", (None, "--set a.b=<reply>")),
        ("escalated", {}, _SPENT, {}, None, (None, "")),
        ("interrupted", {}, _SPENT, {"max_tokens": 1, "max_cost": 0.1, "max_time": 1}, "a", (None, "")),
        (None, {}, _SPENT, {}, None, (None, "")),
    ],
)
def test_show_says_which_budget_ran_out_and_the_command_that_continues(
    reason, innermost, usage, budgets, reply_to, expected
):
    from mklang.checkpoint.envelope import Budgets
    from mklang.runs.inspection import how_to_continue

    ran_out, flags = expected
    command = "mklang resume 'my runs/cp.json'" + (f" {flags}" if flags else "")
    assert how_to_continue("my runs/cp.json", reason, innermost, usage, Budgets(**budgets), reply_to) == (
        ran_out,
        command,
    )


def test_show_says_which_step_budget_ran_out_even_with_no_level_recorded(tmp_path):
    from mklang.runs.inspection import describe

    path = _suspended(
        tmp_path, reason="budget-exhausted", frames=[frame_record("m", "a", 1, 5), frame_record("child", "b", 3, 3)]
    )
    assert describe(path)["ran_out"] == "the step budget of 3 (machine child) ran out: 3 steps taken"
    save(path, _checkpoint(reason="budget-exhausted"))
    assert describe(path)["ran_out"] == "the step budget of 0 ran out: 0 steps taken"


def test_show_reads_a_dead_run_whose_machine_changed_since(tmp_path):
    from mklang.runs.inspection import describe

    path = dead_run(tmp_path, "nested", "brief.mk", 5)
    with open(tmp_path / "nested" / "brief.mk", "a", encoding="utf-8") as edited:
        edited.write("# edited after the run died\n")
    assert [f["machine"] for f in describe(path)["frames"]] == ["brief", "section", "fact_check"]


def test_show_reports_a_dead_run_signed_with_another_key_failed_and_nothing_it_holds(tmp_path, monkeypatch):
    from mklang.runs.inspection import describe

    path = dead_run(tmp_path, "triage", "triage.mk", 2)
    monkeypatch.setenv("MKLANG_CHECKPOINT_KEY", "another user's checkpoint key, 32 bytes or more")
    summary = describe(path)
    assert (summary["status"], summary["signature"]["seal"], summary["frames"]) == ("failed", "foreign", [])
    assert summary["reason"].startswith("the checkpoint is signed with another checkpoint key: `mklang resume --trust`")


def test_a_dead_run_is_drawn_as_the_machine_that_ran_and_its_document_has_no_end_state(tmp_path):
    from mklang.runs.inspection import machine_of, run_document

    path = dead_run(tmp_path, "triage", "triage.mk", 2)
    file = tmp_path / "triage" / "triage.mk"
    file.write_text(file.read_text(encoding="utf-8").replace("machine triage", "machine renamed"), encoding="utf-8")
    assert load_file(file).name == "renamed"
    assert machine_of(locate(path)).name == "triage"  # the text the run signed for, not the edited file
    document = run_document(path)
    assert (document["status"], document["at"]) == ("running", None)


def test_the_document_of_a_dead_run_says_how_far_its_journal_got_and_who_holds_it(tmp_path):
    from mklang.runs.inspection import describe, run_document

    path = dead_run(tmp_path, "nested", "brief.mk", 5)
    document = run_document(path)
    assert (document["status"], document["error"], document["checkpoint"]) == ("running", None, str(path))
    assert document["frames"] == [
        {"machine": "brief", "state": "add_section"},
        {"machine": "section", "state": "check"},
        {"machine": "fact_check", "state": "review"},
    ]
    usage = document["usage"]
    assert usage["input_tokens"] + usage["output_tokens"] == describe(path)["tokens"]["spent"] == 140  # the journal's
    assert document["interrupted"].startswith("the run was interrupted at fact_check:review")
    assert "running_pid" not in document
    held = while_held(path, run_document)
    assert held["running_pid"] == os.getpid()
    assert held["interrupted"] == f"the run is still going in process {os.getpid()}, last durable at fact_check:review"


def test_a_resume_that_died_is_documented_running_not_at_the_state_it_had_parked_at(tmp_path):
    from mklang.runs import open_run, proceed
    from mklang.runs import start as start_run
    from mklang.runs.inspection import run_document
    from mklang.scenarios import load_script

    machine = load_file(HITL / "approval" / "approval.mk")
    scenario = load_script(HITL / "approval" / "scenarios.yaml")[0]
    path = tmp_path / "cp.json"
    assert start_run(machine, None, Host.for_scenario(scenario), checkpoint=path, hitl=True).at == "decide"

    def crash(event: Any) -> None:
        raise Crash

    with pytest.raises(Crash):
        resumable = open_run(path)
        proceed(resumable, Host.for_scenario(scenario), reply={"approval.answer": "yes"}, observer=LoopTops(crash))
    assert (load(path).status, load(path).at) == ("suspended", "decide")  # the envelope as it parked
    document = run_document(path)
    assert (document["status"], document["at"]) == ("running", None)


def test_a_run_signed_with_another_key_names_its_seal_and_draws_no_machine(tmp_path, monkeypatch):
    from mklang.runs.inspection import describe, machine_of

    path = dead_run(tmp_path, "triage", "triage.mk", 2)
    monkeypatch.setenv("MKLANG_CHECKPOINT_KEY", "another user's checkpoint key, 32 bytes or more")
    shown = describe(path)
    assert (shown["path"], shown["signature"]) == (
        str(path),
        {"seal": "foreign", "text": "signed with another checkpoint key"},
    )
    with pytest.raises(CheckpointError) as caught:
        machine_of(locate(path))
    assert str(caught.value) == f"{path}: no verified machine file to draw (signed with another checkpoint key)"


@pytest.mark.parametrize("store", ["sqlite:///{tmp}/runs.db", "{tmp}/runs"])
def test_show_of_a_store_that_does_not_exist_creates_none(tmp_path, store):
    from mklang.runs.inspection import describe, run_document

    target = f"{store.format(tmp=tmp_path)}#r" if "://" in store else str(Path(store.format(tmp=tmp_path)) / "r")
    for read in (describe, run_document):
        with pytest.raises(MklangError):
            read(target)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["m.mk", "M.MK", "m.yaml"])
def test_a_machine_file_given_as_a_checkpoint_says_how_to_make_one(tmp_path, name):
    path = tmp_path / name
    path.write_text("machine m\nentry a\n")
    with pytest.raises(CheckpointError) as caught:
        load(path)
    assert str(caught.value) == (
        f"{path} is a machine file, not a checkpoint: `mklang run {path} --checkpoint cp.json` writes one"
    )
