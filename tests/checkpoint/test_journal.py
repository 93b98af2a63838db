"""The run journal: what it holds line by line, the answers it keeps, its compaction, how it is
read back after a crash and replayed onto the envelope's frames; and in process, a run that dies
at any loop-top, across compactions, resumes to the same run.

`Crash` is raised from an event sink at a loop-top: like SIGKILL, it stops the run
with the checkpoint `running` and its journal as the process left them.
The crash tests lower the journal's compaction threshold (`tiny_compaction`) so that
these short runs rewrite their envelope many times.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from conformance.harness import Recorder, write_machines
from support.crashes import Crash
from support.examples import EXAMPLES, HITL
from support.files import holder, journal_lines, uncommitted
from support.journals import journal_records, run_journal, step_record
from support.runs import TWO_STATES, LoopTops, outcome

import mklang.checkpoint.journal as journal_module
from mklang.checkpoint.envelope import load, save
from mklang.checkpoint.journal import (
    DURABILITY_VARIABLE,
    StoreJournal,
    durability_setting,
    read_journal,
    recover,
    resume_change,
)
from mklang.engine.frame import Frame
from mklang.errors import CheckpointError, JournalCut, UsageError
from mklang.providers.base import Produced, Usage
from mklang.runs import resume, start
from mklang.scenarios import load_script
from mklang.session import Host
from mklang.stores import locate
from mklang.syntax import load_file


class CrashAt(LoopTops):
    def __init__(self, n: int):
        super().__init__(self.count)
        self.n, self.seen = n, 0

    def count(self, event):
        self.seen += 1
        if self.seen == self.n:
            raise Crash


@pytest.fixture
def tiny_compaction(monkeypatch):
    monkeypatch.setattr(journal_module, "MIN_COMPACT_BYTES", 512)


@pytest.mark.usefixtures("tiny_compaction")
@pytest.mark.slow
@pytest.mark.parametrize(
    "example, main, scenario_name",
    [
        ("nested", "brief.mk", None),
        ("map-reduce", "digest.mk", None),
        ("triage", "triage.mk", "bug-answered-from-kb-after-one-repair"),
    ],
)
def test_a_run_that_dies_at_any_loop_top_resumes_to_the_same_run(example, main, scenario_name, tmp_path):
    machine = load_file(EXAMPLES / example / main)
    scenarios = load_script(EXAMPLES / example / "scenarios.yaml")
    scenario = next(s for s in scenarios if scenario_name in (None, s.name))
    counter = CrashAt(0)
    reference = outcome(
        start(machine, None, Host.for_scenario(scenario), checkpoint=tmp_path / "ref.json", observer=counter)
    )
    assert reference["status"] == "done"
    for n in range(2, counter.seen + 1):
        checkpoint = tmp_path / f"cp{n}.json"
        with pytest.raises(Crash):
            start(machine, None, Host.for_scenario(scenario), checkpoint=checkpoint, observer=CrashAt(n))
        assert load(checkpoint).status == "running"
        resumed = resume(checkpoint, Host.for_scenario(scenario))
        assert outcome(resumed) == reference, f"crashed at loop-top {n} of {counter.seen}"


@pytest.mark.usefixtures("tiny_compaction")
def test_long_runs_compact_their_journal_into_new_envelope_generations(tmp_path):
    machine = load_file(EXAMPLES / "nested" / "brief.mk")
    scenario = load_script(EXAMPLES / "nested" / "scenarios.yaml")[0]
    checkpoint = tmp_path / "cp.json"
    generations = []

    def watch(event):
        generations.append(load(checkpoint).generation)

    start(machine, None, Host.for_scenario(scenario), checkpoint=checkpoint, observer=LoopTops(watch))
    assert generations[-1] > generations[0] + 2, generations  # rewritten several times along the way
    assert load(checkpoint).status == "done"
    assert not Path(f"{checkpoint}.journal").exists()  # a finished run leaves no journal


@pytest.mark.usefixtures("tiny_compaction")
def test_a_crash_just_after_a_resumed_run_suspends_again_leaves_no_journal_that_applies(tmp_path):
    """A resume journals against the suspended envelope; when it suspends again, a crash between
    writing the new envelope and dropping that journal must not replay the journal onto it."""
    from mklang import faults
    from mklang.providers.scripted import ScriptedProvider
    from mklang.runs import open_run, proceed

    machine_file = tmp_path / "loop.mk"
    machine_file.write_text(
        'machine loop\nentry write\nbudget 2\nstate write {\n  structure "a line"\n  prompt "write"\n'
        '  output lines\n  accumulate\n  when "more" -> write\n}\n'
    )
    machine = load_file(machine_file)

    def provider() -> ScriptedProvider:
        return ScriptedProvider({"produce": ["a line"], "judge": [0]})

    def steps(checkpoint: Path, budget: int, crash_at_envelope: bool = False):
        if crash_at_envelope:
            faults.arm("envelope", 1, lambda: (_ for _ in ()).throw(Crash()))
        try:
            return proceed(open_run(checkpoint), Host(provider()), budget=budget)
        finally:
            faults.disarm()

    reference_at, crashed_at = tmp_path / "reference.json", tmp_path / "crashed.json"
    for checkpoint in (reference_at, crashed_at):
        assert start(machine, {}, Host(provider()), checkpoint=checkpoint).status == "suspended"
    assert steps(reference_at, 4).status == "suspended"
    with pytest.raises(Crash):
        steps(crashed_at, 4, crash_at_envelope=True)  # the second suspension is written, its journal not dropped
    assert Path(f"{crashed_at}.journal").exists()
    assert load(crashed_at).status == "suspended"
    assert outcome(steps(crashed_at, 6)) == outcome(steps(reference_at, 6))
    assert len(load(crashed_at).frames[0]["trace"]) == 6


# --- a resume that died: what it changed comes back from its journal ---------------


@pytest.mark.usefixtures("tiny_compaction")
@pytest.mark.parametrize("crash_at", [0, 1])
def test_a_resume_that_died_is_reopened_with_the_reply_and_settings_it_was_given(tmp_path, crash_at):
    import shutil

    from support.runs import outcome

    from mklang.runs import open_run
    from mklang.runs import resume as resume_run
    from mklang.runs import start as start_run
    from mklang.scenarios import load_script
    from mklang.session import Host

    shutil.copytree(HITL / "approval", tmp_path / "approval")
    machine = load_file(tmp_path / "approval" / "approval.mk")
    scenario = next(s for s in load_script(tmp_path / "approval" / "scenarios.yaml") if s.name == "ask-then-publish")
    settings = {"max_tokens": 10**6, "max_cost": 2.5, "hitl": False, "concurrency": 3}
    reply = {"approval.answer": "yes"}
    reference_at = tmp_path / "reference.json"
    start_run(machine, None, Host.for_scenario(scenario), checkpoint=reference_at)
    reference = outcome(resume_run(reference_at, Host.for_scenario(scenario), reply=reply, **settings))
    assert reference["status"] == "done"

    path = tmp_path / "cp.json"
    start_run(machine, None, Host.for_scenario(scenario), checkpoint=path)
    tops = iter(range(9))

    def crash(event: Any) -> None:
        if next(tops) == crash_at:
            raise Crash

    with pytest.raises(Crash):
        resume_run(path, Host.for_scenario(scenario), reply=reply, observer=LoopTops(crash), **settings)
    reopened = open_run(path, lock=False)
    envelope, innermost = reopened.envelope, reopened.chain[-1]
    assert (envelope.status, envelope.reason, envelope.ask, envelope.reply_to) == ("running", None, None, None)
    assert (envelope.budgets.max_tokens, envelope.budgets.max_cost, envelope.hitl, envelope.concurrency) == (
        10**6,
        2.5,
        False,
        3,
    )
    assert (innermost.context["approval"], innermost.ask, "approval" in innermost.tainted) == (
        {"answer": "yes"},
        None,
        True,
    )
    assert (reopened.crashed, reopened.trusted) == (True, True)
    assert outcome(resume_run(path, Host.for_scenario(scenario))) == reference  # nothing given again


@pytest.mark.usefixtures("tiny_compaction")
def test_a_checkpoint_is_opened_locked_and_each_refusal_is_one_line_that_releases_the_lock(tmp_path, monkeypatch):
    import shutil

    from mklang.runs import open_run
    from mklang.runs import start as start_run
    from mklang.scenarios import load_script
    from mklang.session import Host

    shutil.copytree(HITL / "approval", tmp_path / "approval")
    source = tmp_path / "approval" / "approval.mk"
    scenario = next(s for s in load_script(tmp_path / "approval" / "scenarios.yaml") if s.name == "ask-then-publish")
    path = tmp_path / "cp.json"
    start_run(load_file(source), None, Host.for_scenario(scenario), checkpoint=path)

    def refusal(**options: Any) -> str:
        with pytest.raises(CheckpointError) as caught:
            open_run(path, **options)
        assert holder(path) is None  # the refusal released its lock
        return str(caught.value)

    held = open_run(path)  # locked by default
    with pytest.raises(CheckpointError) as busy:
        open_run(path)
    assert str(busy.value) == (
        f"{path}: the run is still going in process {os.getpid()}; "
        "wait for it, or stop it (Ctrl-C suspends it) before resuming"
    )
    held.lock.release()
    suspended = load(path)
    for changed, message in [
        ({"status": "done"}, "the run already finished; a finished run cannot be resumed"),
        (
            {"status": "halted", "error": "gate-fail"},
            "the run already halted (gate-fail); a finished run cannot be resumed",
        ),
        ({"frames": []}, "the checkpoint holds no frames"),
    ]:
        save(path, suspended.model_copy(update=changed))
        assert refusal() == f"{path}: {message}"
    save(path, suspended)
    source.write_text(source.read_text(encoding="utf-8") + "# edited\n", encoding="utf-8")
    assert refusal() == (
        f"{source}: machine file changed since the checkpoint was written (to move the parked run to it once it is checked compatible: resume with --machine FILE --migrate; "
        "to accept the change unchecked: resume with --force)"
    )
    open_run(path, force=True).lock.release()
    source.rename(tmp_path / "moved.mk")
    kept = open_run(path)  # a missing file: the text the store keeps, which the signature covers
    assert kept.machines_note is not None
    assert kept.machines_note.startswith(f"{source} is missing; running the machine texts the store keeps")
    kept.release()
    (tmp_path / "moved.mk").rename(source)
    monkeypatch.setenv("MKLANG_CHECKPOINT_KEY", "another user's checkpoint key, 32 bytes or more")
    assert refusal(force=True) == (
        f"{path}: the checkpoint is signed with another checkpoint key; resume it with --trust to run it "
        "as untrusted data (host settings from your command line only)"
    )
    opened = open_run(path, force=True, trust=True)
    assert opened.trusted is False
    opened.lock.release()


# --- a halt journaled before the envelope says so ------------------------------


@pytest.mark.usefixtures("tiny_compaction")
def test_a_run_that_dies_after_journaling_a_halt_resumes_to_the_same_halt(tmp_path):
    from support.runs import outcome

    from mklang import faults
    from mklang.runs import resume as resume_run
    from mklang.runs import start as start_run
    from mklang.session import Host

    class Crash(BaseException):
        pass

    def crash() -> None:
        raise Crash

    machine = write_machines(
        tmp_path,
        """
        machine m
        entry a
        budget 5
        tool risky "fails"
        state a {
          structure "s"
          prompt "p"
          output x
          otherwise -> b
        }
        state b {
          tool risky { q: "{{x}}" }
          output y
          otherwise -> END
        }
    """,
    )

    calls = []

    def risky(args: dict[str, Any]) -> Any:
        calls.append(args)
        raise RuntimeError("exploded")

    def host() -> Host:
        return Host(
            provider=Recorder({"produce": ["one"], "tokens": [2, 3]}),
            tools={"risky": risky},
        )

    reference = outcome(start_run(machine, None, host(), checkpoint=tmp_path / "ref.json"))
    assert (reference["status"], reference["usage"]["input_tokens"]) == ("halted", 2)
    faults.arm("journal.halt", 1, crash)
    try:
        with pytest.raises(Crash):
            start_run(machine, None, host(), checkpoint=tmp_path / "cp.json")
    finally:
        faults.disarm()
    assert load(tmp_path / "cp.json").status == "running"
    calls.clear()
    resumed = resume_run(tmp_path / "cp.json", host())
    assert calls == []  # the journaled halt ends the level: the state does not run again
    assert outcome(resumed) == reference
    assert (resumed.error, resumed.at) == ("state-error: tool risky: exploded", "b")


# --- what a run's journal holds, line by line ------------------------------


def test_a_snapshot_writes_a_signed_envelope_of_the_next_generation_and_a_journal_chained_to_it(tmp_path):
    journal, frame = run_journal(tmp_path)
    journal.snapshot([frame], status="running")
    envelope = load(tmp_path / "cp.json")
    assert (envelope.seal, envelope.status, envelope.generation) == ("signed", "running", 1)
    # The root is named relative to the checkpoint's folder, every machine file relative to the root's.
    assert (envelope.machine.path, envelope.machines) == ("proj/m.mk", {"m.mk": "abc"})
    assert [f["path"] for f in envelope.frames] == ["m.mk"]
    assert [{k: v for k, v in line.items() if k != "h"} for line in journal_lines(tmp_path / "cp.json")] == [
        {"k": "gen", "g": 1}
    ]
    assert journal_records(tmp_path) == []
    journal.snapshot([frame], status="running")
    assert load(tmp_path / "cp.json").generation == 2
    assert journal_lines(tmp_path / "cp.json")[0]["g"] == 2
    assert journal_records(tmp_path) == []


def test_a_snapshot_and_a_compaction_record_the_run_as_running_whatever_envelope_it_continues(tmp_path):
    journal, frame = run_journal(tmp_path)
    journal.envelope = journal.envelope.model_copy(update={"status": "suspended", "reason": "escalated"})
    journal.snapshot([frame], status="running", reason=None)
    assert (load(tmp_path / "cp.json").status, load(tmp_path / "cp.json").reason) == ("running", None)
    journal.envelope = journal.envelope.model_copy(update={"status": "suspended"})
    _grow(journal, tmp_path, COMPACT)
    journal.loop_top([frame])
    assert (load(tmp_path / "cp.json").status, load(tmp_path / "cp.json").generation) == ("running", 2)


def test_each_line_of_a_run_is_journaled_with_its_level_and_chained_to_the_last(tmp_path):
    journal, frame = run_journal(tmp_path)
    journal.snapshot([frame], status="running")
    journal.record("r:1.0", "produce", Produced("one", None, Usage(2, 1)))
    journal.step(0, step_record("a", "b", "one"))
    journal.enter(1, frame)
    journal.halt(1, "gate-fail", Usage(3, 4, 0.5))
    records = journal_records(tmp_path)
    assert [{k: v for k, v in r.items() if k != "h"} for r in records] == [
        {
            "k": "call",
            "key": "r:1.0",
            "kind": "produce",
            "v": {"text": "one", "reasoning": None, "usage": Usage(2, 1).to_json()},
        },
        {"k": "step", "d": 0, "r": step_record("a", "b", "one")},
        {"k": "enter", "d": 1, "f": {**frame.to_json(), "path": "m.mk", "sha256": "abc"}},
        {"k": "halt", "d": 1, "e": "gate-fail", "u": {"input_tokens": 3, "output_tokens": 4, "cost_usd": 0.5}},
    ]


class Counted:
    """A host state that counts the times it was saved."""

    def __init__(self) -> None:
        self.saves = 0

    def save(self) -> dict[str, Any]:
        self.saves += 1
        return {"saves": self.saves}

    def restore(self, saved: dict[str, Any]) -> None:
        self.saves = saved["saves"]


def test_every_line_and_envelope_carries_the_host_state_as_of_it_when_the_run_has_one(tmp_path):
    journal, frame = run_journal(tmp_path, host_state=Counted())
    journal.snapshot([frame], status="running")
    journal.record("r:1.0.1", "tool", "t")
    journal.step(0, step_record("a", "b", "one"))
    journal.halt(0, "gate-fail", Usage())
    assert load(tmp_path / "cp.json").host.state == {"saves": 1}
    assert [record["s"] for record in journal_records(tmp_path)] == [{"saves": 2}, {"saves": 3}, {"saves": 4}]
    (tmp_path / "plain").mkdir()
    plain, frame = run_journal(tmp_path / "plain")
    plain.snapshot([frame], status="running")
    plain.step(0, step_record("a", "b", "one"))
    assert "s" not in journal_records(tmp_path / "plain")[0]
    assert load(tmp_path / "plain" / "cp.json").host.state is None


def test_recovery_gives_back_the_host_state_of_the_last_line_that_holds_one(tmp_path):
    machine = write_machines(tmp_path, TWO_STATES)
    call = {"k": "call", "key": "r:1.0.1", "kind": "tool", "v": "t"}
    step = {"k": "step", "d": 0, "r": step_record("a", "b", "one")}
    records = [{**call, "s": {"n": 1}}, {**step, "s": {"n": 2}}, {**call, "key": "r:2.0.1", "s": {"n": 3}}]
    assert recover([Frame.start(machine)], {}, records, lambda _: machine)[2] == {"n": 3}
    # Journals written before lines carried the state: the step lines carry it as `p`.
    earlier = [{**step, "p": {"llm": {"produce": 1}}}, {**call, "key": "r:2.0.1"}]
    assert recover([Frame.start(machine)], {}, earlier, lambda _: machine)[2] == {"llm": {"produce": 1}}
    assert recover([Frame.start(machine)], {}, [], lambda _: machine)[2] is None


class JournalFsyncs:
    """Records the kind of the journal's last line at each fsync of the journal file."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, journal: Path):
        self.kinds: list[str] = []
        self._journal, self._fsync = journal, os.fsync
        monkeypatch.setattr(os, "fsync", self)

    def __call__(self, descriptor: int) -> None:
        if os.readlink(f"/proc/self/fd/{descriptor}") == str(self._journal):
            self.kinds.append(json.loads(self._journal.read_bytes().splitlines()[-1])["k"])
        self._fsync(descriptor)


@pytest.mark.parametrize(("durability", "synced"), [("call", ["call", "call"]), ("step", ["step", "halt"])])
def test_durability_call_fsyncs_each_call_line_and_durability_step_each_step_and_halt_line(
    tmp_path, monkeypatch, durability, synced
):
    journal, frame = run_journal(tmp_path, durability=durability)
    journal.snapshot([frame], status="running")
    spy = JournalFsyncs(monkeypatch, tmp_path / "cp.json.journal")
    journal.record("r:1.0", "produce", Produced("one", None, Usage()))
    journal.step(0, step_record("a", "b", "one"))
    journal.enter(1, frame)
    journal.record("r:2.0", "tool", "text")
    journal.halt(1, "gate-fail", Usage())
    assert spy.kinds == synced


@pytest.mark.parametrize(("value", "durability"), [(None, "call"), ("call", "call"), ("step", "step")])
def test_the_durability_comes_from_mklang_durability_and_defaults_to_call(monkeypatch, value, durability):
    if value is None:
        monkeypatch.delenv(DURABILITY_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(DURABILITY_VARIABLE, value)
    assert durability_setting() == durability


@pytest.mark.parametrize("value", ["", "Step", "fsync"])
def test_an_unknown_durability_is_a_usage_error_naming_the_choices(monkeypatch, value):
    monkeypatch.setenv(DURABILITY_VARIABLE, value)
    with pytest.raises(UsageError) as caught:
        durability_setting()
    assert str(caught.value) == f"MKLANG_DURABILITY must be call or step, not {value!r}"


# --- answers paid by an earlier process ------------------------------------


def _paid(text: str, tokens: int) -> dict[str, Any]:
    return {"kind": "produce", "v": {"text": text, "reasoning": None, "usage": Usage(tokens, 1).to_json()}}


def test_a_replayed_answer_is_used_once_and_only_for_its_own_kind(tmp_path):
    replay = {"k1": _paid("one", 2), "k2": {"kind": "tool", "v": "text"}, "k3": {**_paid("c", 1), "consumed": True}}
    journal, _ = run_journal(tmp_path, answers=replay)
    assert journal.replay("k1", "produce") == Produced("one", None, Usage(2, 1))
    assert journal.replay("k1", "produce") is None  # used once
    assert journal.replay("k2", "produce") is None  # recorded for another kind of call
    assert journal.replay("k2", "tool") is None  # ... and not used by another call either
    journal.answers["k4"] = {"kind": "tool", "v": "text"}
    assert journal.replay("k4", "tool") == "text"
    assert journal.replay("missing", "tool") is None
    assert journal.replay("k3", "produce") == Produced("c", None, Usage(1, 1))  # marked by an earlier version
    empty, _ = run_journal(tmp_path)
    assert empty.replay("k1", "tool") is None


def test_an_answer_kept_under_a_key_of_an_earlier_version_answers_the_same_call(tmp_path):
    """Keys did not name a fan-out's branch count before: `r:3.2.1` is now `r:3.2of4.1`."""
    replay = {"r:3.2.1": {"kind": "tool", "v": "kept"}, "r:3.1/:1.0.1": _paid("below", 1)}
    journal, _ = run_journal(tmp_path, answers=replay)
    assert journal.replay("r:3.2of4.1", "tool") == "kept"
    assert journal.replay("r:3.1of4/:1.0.1", "produce") == Produced("below", None, Usage(1, 1))
    assert journal.answers == {}


def test_a_snapshot_keeps_the_unreplayed_answers_and_counts_their_spend(tmp_path):
    replay = {"k1": _paid("one", 2), "k2": {"kind": "tool", "v": "text"}, "k3": _paid("three", 5)}
    journal, frame = run_journal(tmp_path, answers=replay)
    frame.usage = Usage(10, 10, 1.0)
    assert journal.unreplayed() == Usage(7, 2)
    journal.snapshot([frame], status="running")
    envelope = load(tmp_path / "cp.json")
    assert envelope.answers == replay
    assert envelope.usage == {"input_tokens": 17, "output_tokens": 12, "cost_usd": 1.0}
    journal.replay("k3", "produce")
    assert journal.unreplayed() == Usage(2, 1)


def test_a_step_or_halt_folds_the_answers_of_its_step_so_they_are_not_kept_again(tmp_path):
    journal, frame = run_journal(tmp_path, answers={"k1": _paid("one", 2), "k2": _paid("two", 3)})
    journal.snapshot([frame], status="running")
    journal.replay("k1", "produce")
    journal.record("k4", "tool", "t")
    journal.step(0, step_record("a", "b", "one"))
    assert journal.unreplayed() == Usage()
    journal.finish([frame], status="suspended")
    assert load(tmp_path / "cp.json").answers == {}
    journal, frame = run_journal(tmp_path, answers={"k1": _paid("one", 2)})
    journal.snapshot([frame], status="running")
    journal.record("k4", "tool", "t")
    journal.halt(0, "gate-fail", Usage())
    journal.finish([frame], status="suspended")
    assert (load(tmp_path / "cp.json").answers, journal.unreplayed()) == ({}, Usage())


def test_a_suspended_envelope_keeps_the_answers_of_the_step_in_flight(tmp_path):
    replay = {"old": _paid("old", 1), "used": _paid("used", 2)}
    journal, frame = run_journal(tmp_path, answers=replay)
    journal.snapshot([frame], status="running")
    journal.replay("used", "produce")
    journal.record("r:1.0#0/x", "tool", "paid")
    journal.finish([frame], status="suspended", reason="budget-exhausted")
    envelope = load(tmp_path / "cp.json")
    assert envelope.answers == {
        "old": _paid("old", 1),
        "used": _paid("used", 2),
        "r:1.0#0/x": {"kind": "tool", "v": "paid"},
    }
    assert (envelope.status, envelope.reason, envelope.generation, envelope.seal) == (
        "suspended",
        "budget-exhausted",
        2,
        "signed",
    )
    assert not (tmp_path / "cp.json.journal").exists()


@pytest.mark.parametrize("status", ["done", "halted"])
def test_a_finished_envelope_keeps_no_answers_and_no_journal(tmp_path, status):
    journal, frame = run_journal(tmp_path, answers={"old": _paid("old", 1)})
    journal.snapshot([frame], status="running")
    journal.record("r:1.0", "tool", "paid")
    journal.finish([frame], status=status)
    envelope = load(tmp_path / "cp.json")
    assert (envelope.status, envelope.answers, envelope.generation) == (status, {}, 2)
    assert [f["path"] for f in envelope.frames] == ["m.mk"]
    assert (envelope.machine.path, envelope.machines) == ("proj/m.mk", {"m.mk": "abc"})
    assert not (tmp_path / "cp.json.journal").exists()


def test_a_finished_fan_out_branch_folds_only_its_own_answers(tmp_path):
    journal, frame = run_journal(tmp_path)
    journal.snapshot([frame], status="running")
    for key in ("r:1.0#1.0", "r:1.0#1/c:1.0", "r:1.0#1", "r:1.0#10.0", "r:1.0#2.0"):
        journal.record(key, "tool", key)
    journal.fold("r:1.0#1")
    journal.finish([frame], status="suspended")
    assert sorted(load(tmp_path / "cp.json").answers) == ["r:1.0#1", "r:1.0#10.0", "r:1.0#2.0"]


# --- compaction -------------------------------------------------------------

COMPACT = 256 * 1024  # a journal is rewritten into a new envelope once it holds this much, or the envelope's size


def _grow(journal: StoreJournal, tmp_path: Path, size: int) -> None:
    """Journal call lines until the lines after the header add up to exactly `size` bytes."""
    header = len((tmp_path / "cp.json.journal").read_bytes())
    empty = len(b'{"k":"call","key":"k","kind":"tool","v":"","h":""}\n') + 64
    journal.record("k", "tool", "x" * (size - empty))
    assert len((tmp_path / "cp.json.journal").read_bytes()) - header == size


@pytest.mark.parametrize(("size", "compacted"), [(COMPACT - 1, False), (COMPACT, True)])
def test_a_journal_is_compacted_into_a_new_envelope_once_it_holds_256_kib(tmp_path, size, compacted):
    journal, frame = run_journal(tmp_path)
    journal.snapshot([frame], status="running")
    _grow(journal, tmp_path, size)
    journal.loop_top([frame])
    envelope = load(tmp_path / "cp.json")
    assert (envelope.generation, envelope.status) == ((2, "running") if compacted else (1, "running"))
    journal.loop_top([frame])  # a fresh generation starts counting again
    assert load(tmp_path / "cp.json").generation == envelope.generation


def test_a_journal_grows_as_large_as_a_large_envelope_before_it_is_compacted(tmp_path):
    journal, frame = run_journal(tmp_path)
    frame.context["big"] = "y" * COMPACT
    journal.snapshot([frame], status="running")
    size = (tmp_path / "cp.json").stat().st_size
    _grow(journal, tmp_path, size - 1)
    journal.loop_top([frame])
    assert load(tmp_path / "cp.json").generation == 1
    journal.record("k2", "tool", "z")
    journal.loop_top([frame])
    assert load(tmp_path / "cp.json").generation == 2


def test_a_resumed_envelope_is_compacted_only_once_the_journal_is_as_large_as_it(tmp_path):
    journal, frame = run_journal(tmp_path)
    frame.context["big"] = "y" * COMPACT
    journal.finish([frame], status="suspended")
    envelope = load(tmp_path / "cp.json")
    resumed, _ = run_journal(tmp_path)
    resumed.envelope = envelope
    resumed.resume({"set": {}}, envelope.stored_bytes)
    _grow(resumed, tmp_path, envelope.stored_bytes - 1)
    resumed.loop_top([frame])
    assert load(tmp_path / "cp.json").generation == envelope.generation
    resumed.record("k2", "tool", "z")
    resumed.loop_top([frame])
    assert load(tmp_path / "cp.json").generation == envelope.generation + 1


# --- reading it back after a crash -------------------------------------------


def _journaled(tmp_path: Path) -> tuple[StoreJournal, Frame, Path]:
    """A snapshot and three journal lines: a call, a step, a call."""
    journal, frame = run_journal(tmp_path)
    journal.snapshot([frame], status="running")
    journal.record("r:1.0", "tool", "first")
    journal.step(0, step_record("a", "b", "one"))
    journal.record("r:2.0", "tool", "second")
    return journal, frame, tmp_path / "cp.json.journal"


def test_a_journal_line_cut_mid_way_is_ignored_on_recovery(tmp_path):
    _, _, path = _journaled(tmp_path)
    uncommitted(tmp_path / "cp.json")
    whole = path.read_bytes()
    assert [r["k"] for r in journal_records(tmp_path)] == ["call", "step", "call"]
    path.write_bytes(whole[:-1])  # the last newline never reached the file
    assert [r["k"] for r in journal_records(tmp_path)] == ["call", "step"]
    path.write_bytes(whole[: whole.index(b"\n") + 1] + b'{"k":"call","key":"r:1.0","kind":"to')
    assert journal_records(tmp_path) == []


@pytest.mark.parametrize("damage", [b"not json\n", b"[1, 2]\n", b'"text"\n'])
def test_the_journal_is_read_up_to_the_first_line_that_is_not_a_record(tmp_path, damage):
    _, _, path = _journaled(tmp_path)
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join([*lines[:2], damage, *lines[2:]]))
    location = locate(tmp_path / "cp.json")
    assert [r["k"] for r in read_journal(location, 1)] == ["call"]


def test_a_journal_line_may_nest_values_as_deep_as_a_checkpoint(tmp_path):
    journal, frame = run_journal(tmp_path)
    journal.snapshot([frame], status="running")
    deep: Any = "leaf"
    for _ in range(64 + 10):
        deep = [deep]
    journal.record("r:1.0", "tool", deep)
    assert [r["v"] for r in journal_records(tmp_path)] == [deep]


def test_a_journal_of_another_generation_or_without_its_header_is_stale(tmp_path):
    _, _, path = _journaled(tmp_path)
    location = locate(tmp_path / "cp.json")
    assert [r["k"] for r in read_journal(location, 1)] == ["call", "step", "call"]
    assert read_journal(location, 0) == []
    assert read_journal(location, 2) == []
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[1:]))  # the header is gone
    assert read_journal(location, 1) == []
    path.write_bytes(b"")
    assert read_journal(location, 1) == []
    path.unlink()
    assert read_journal(location, 1) == []


def test_a_journal_line_edited_after_it_was_signed_is_refused_naming_its_line(tmp_path):
    _, _, path = _journaled(tmp_path)
    signature = load(tmp_path / "cp.json").signature
    assert signature is not None
    mac = signature.hmac
    location = locate(tmp_path / "cp.json")
    path.write_bytes(path.read_bytes().replace(b'"second"', b'"forged"'))
    with pytest.raises(CheckpointError) as caught:
        read_journal(location, 1, chain_from=mac)
    assert str(caught.value) == (
        f"{location}: journal line 4 was edited after it was signed (resume with --trust to use it as untrusted data)"
    )
    assert [r["v"] for r in read_journal(location, 1) if r["k"] == "call"] == ["first", "forged"]  # read as data


def test_a_journal_mac_edited_into_non_ascii_text_is_refused_as_an_edit(tmp_path):
    _, _, path = _journaled(tmp_path)
    lines = path.read_bytes().splitlines(keepends=True)
    mac = json.loads(lines[2])["h"].encode()
    lines[2] = lines[2].replace(mac, "é".encode() + mac[2:])
    path.write_bytes(b"".join(lines))
    with pytest.raises(CheckpointError) as caught:
        journal_records(tmp_path)
    assert "journal line 3 was edited after it was signed" in str(caught.value)


def test_a_torn_line_is_not_checked_against_its_mac(tmp_path):
    _, _, path = _journaled(tmp_path)
    uncommitted(tmp_path / "cp.json")
    path.write_bytes(path.read_bytes()[:-5])
    assert [r["k"] for r in journal_records(tmp_path)] == ["call", "step"]


# --- a resume continues a suspended envelope in place -------------------------


def _suspended_journal(tmp_path: Path) -> tuple[StoreJournal, Frame]:
    journal, frame = run_journal(tmp_path)
    journal.finish([frame], status="suspended", reason="escalated")
    resumed, _ = run_journal(tmp_path)
    resumed.envelope = load(tmp_path / "cp.json")
    return resumed, frame


CHANGE = {"budget": 9, "set": {"go": "yes"}}


def test_a_resume_journals_what_it_changed_against_the_signed_envelope_it_leaves_as_it_was(tmp_path):
    journal, _ = _suspended_journal(tmp_path)
    before = (tmp_path / "cp.json").read_bytes()
    journal.resume(CHANGE, journal.envelope.stored_bytes)
    journal.record("r:1.0", "tool", "paid")
    assert (tmp_path / "cp.json").read_bytes() == before
    header = journal_lines(tmp_path / "cp.json")[0]
    assert (header["k"], header["g"], header["resume"]) == ("gen", 1, CHANGE)
    assert [r["k"] for r in journal_records(tmp_path)] == ["call"]  # chained from the envelope's signature
    store = locate(tmp_path / "cp.json").store
    assert resume_change(store, "cp.json", journal.envelope) == CHANGE


def test_what_a_resume_changed_is_read_only_from_the_head_of_its_own_generation(tmp_path):
    journal, _ = _suspended_journal(tmp_path)
    envelope = journal.envelope
    store = locate(tmp_path / "cp.json").store
    assert resume_change(store, "cp.json", envelope) is None  # no resume began
    journal.resume(CHANGE, envelope.stored_bytes)
    path = tmp_path / "cp.json.journal"
    whole = path.read_bytes()
    uncommitted(tmp_path / "cp.json")
    assert resume_change(store, "cp.json", envelope.model_copy(update={"status": "running"})) is None
    assert resume_change(store, "cp.json", envelope.model_copy(update={"generation": 2})) is None
    for head in (
        whole[:-1],  # the head line is torn
        b"not json\n",
        b"[1]\n",
        b'{"k":"step","g":1,"resume":{"set":{}}}\n',
        b'{"k":"gen","g":1}\n',
        b'{"k":"gen","g":1,"resume":[1]}\n',
    ):
        path.write_bytes(head)
        assert resume_change(store, "cp.json", envelope) is None, head
    path.write_bytes(b'{"k":"gen","g":1,"resume":{"set":{}}}\n{"k":"call"}\n')
    assert resume_change(store, "cp.json", envelope) == {"set": {}}


def test_a_resume_whose_journal_was_cut_is_still_seen_resuming_and_its_recovery_is_refused(tmp_path):
    """What a cut journal keeps of its head still says a resume began (so `runs rm` and a batch see the
    run as running); recovering from what is left is refused (ADR 0052)."""
    journal, _ = _suspended_journal(tmp_path)
    envelope = journal.envelope
    journal.resume(CHANGE, envelope.stored_bytes)
    journal.record("r:1.0", "tool", "paid")  # durable: the store counts it
    path = tmp_path / "cp.json.journal"
    path.write_bytes(path.read_bytes().splitlines(keepends=True)[0])  # cut back to its head
    location = locate(tmp_path / "cp.json")
    assert resume_change(location.store, "cp.json", envelope) == CHANGE
    with pytest.raises(JournalCut, match=r"cp.json.journal: the journal holds \d+ bytes, fewer than the \d+ committed"):
        read_journal(location, envelope.generation)


def test_a_resume_change_may_nest_values_as_deep_as_a_checkpoint(tmp_path):
    journal, _ = _suspended_journal(tmp_path)
    deep: Any = "leaf"
    for _ in range(64 + 10):
        deep = [deep]
    journal.resume({"set": {"x": deep}}, journal.envelope.stored_bytes)
    store = locate(tmp_path / "cp.json").store
    assert resume_change(store, "cp.json", journal.envelope) == {"set": {"x": deep}}


# --- replaying its records onto the envelope's frames --------------------------


def test_recovery_replays_steps_entered_levels_halts_and_the_calls_of_the_step_in_flight(tmp_path):
    machine = write_machines(tmp_path, TWO_STATES)
    top, child = Frame.start(machine), Frame.start(machine)
    child.context["from"] = "journal"
    loaded: list[dict[str, Any]] = []

    def machine_for(frame: dict[str, Any]) -> Any:
        loaded.append(frame)
        return machine

    answers = {"old": {"kind": "tool", "v": "kept"}}
    records = [
        {"k": "call", "key": "r:1.0", "kind": "tool", "v": "one", "h": "mac"},
        {"k": "step", "d": 0, "r": step_record("a", "b", "x1", tokens=2), "p": {"llm": 1}},
        {"k": "enter", "d": 1, "f": child.to_json()},
        {"k": "step", "d": 1, "r": step_record("a", "b", "y1", tokens=3)},
        {"k": "call", "key": "r:2.0", "kind": "produce", "v": {"text": "t"}, "h": "mac"},
        {"k": "future kind"},
    ]
    chain, calls, host_state = recover([top], answers, records, machine_for)
    assert answers == {"old": {"kind": "tool", "v": "kept"}}  # the envelope's own record is not touched
    assert [(f.state, f.steps, f.usage.input_tokens) for f in chain] == [("b", 1, 2), ("b", 1, 3)]
    assert (chain[0].context["x"], chain[1].context["x"], chain[1].context["from"]) == ("x1", "y1", "journal")
    assert loaded == [child.to_json()]
    assert calls == {"r:2.0": {"kind": "produce", "v": {"text": "t"}}}
    assert host_state == {"llm": 1}  # a step without a state keeps the last one


def test_recovery_keeps_the_unreplayed_answers_until_a_step_and_no_host_state_without_one(tmp_path):
    machine = write_machines(tmp_path, TWO_STATES)
    answers = {"old": {"kind": "tool", "v": "kept"}}
    records = [{"k": "call", "key": "r:1.0", "kind": "tool", "v": "one"}]
    chain, calls, host_state = recover([Frame.start(machine)], answers, records, lambda f: machine)
    assert calls == {"old": {"kind": "tool", "v": "kept"}, "r:1.0": {"kind": "tool", "v": "one"}}
    assert (host_state, chain[0].state) == (None, "a")
    steps = [{"k": "step", "d": 0, "r": step_record("a", "b", 1)}]
    _, calls, host_state = recover([Frame.start(machine)], answers, steps, lambda f: machine)
    assert (calls, host_state) == ({}, None)


def test_a_level_entered_at_a_depth_replaces_the_levels_from_that_depth_on(tmp_path):
    machine = write_machines(tmp_path, TWO_STATES)
    chain = [Frame.start(machine), Frame.start(machine), Frame.start(machine)]
    entered = Frame.start(machine)
    entered.state = "b"
    recovered, _, _ = recover(chain, {}, [{"k": "enter", "d": 1, "f": entered.to_json()}], lambda f: machine)
    assert [f.state for f in recovered] == ["a", "b"]


def test_a_step_or_halt_at_a_level_drops_the_levels_below_it(tmp_path):
    machine = write_machines(tmp_path, TWO_STATES)
    chain = [Frame.start(machine), Frame.start(machine), Frame.start(machine)]
    recovered, _, _ = recover(chain, {}, [{"k": "step", "d": 1, "r": step_record("a", "b", 1)}], lambda f: machine)
    assert [f.state for f in recovered] == ["a", "b"]
    assert len(chain) == 3  # the caller's chain is not changed
    records = [
        {"k": "call", "key": "r:1.0", "kind": "tool", "v": "one"},
        {"k": "halt", "d": 0, "e": "gate-fail", "u": {"input_tokens": 4, "output_tokens": 1, "cost_usd": 0.25}},
    ]
    recovered, calls, _ = recover(chain, {"old": {"kind": "tool", "v": "x"}}, records, lambda f: machine)
    assert [(f.halted, f.usage) for f in recovered] == [("gate-fail", Usage(4, 1, 0.25))]
    assert calls == {}


def test_the_callers_replay_map_is_not_used_up_by_the_run(tmp_path):
    replay = {"k1": {"kind": "tool", "v": "text"}}
    journal, _ = run_journal(tmp_path, answers=replay)
    assert journal.replay("k1", "tool") == "text"
    assert replay == {"k1": {"kind": "tool", "v": "text"}}


def test_a_machine_loaded_after_the_journal_started_is_named_in_the_next_snapshot(tmp_path):
    hashes: dict[str, str] = {}
    journal, frame = run_journal(tmp_path, hashes=hashes)
    journal.snapshot([frame], status="running")
    assert load(tmp_path / "cp.json").machines == {}
    hashes[str(tmp_path / "proj" / "child.mk")] = "def"
    journal.snapshot([frame], status="running")
    assert load(tmp_path / "cp.json").machines == {"child.mk": "def"}
    hashes[str(tmp_path / "proj" / "sub" / "other.mk")] = "ghi"
    journal.finish([frame], status="done")
    assert load(tmp_path / "cp.json").machines == {"child.mk": "def", "sub/other.mk": "ghi"}


def test_a_journal_without_a_root_names_machine_files_relative_to_the_current_folder(tmp_path):
    journal, frame = run_journal(tmp_path, paths=None, hashes=None)
    journal.snapshot([frame], status="running")
    envelope = load(tmp_path / "cp.json")
    assert (envelope.machine.path, envelope.machines) == (None, {})
    assert [f["path"] for f in envelope.frames] == [os.path.relpath(tmp_path / "proj" / "m.mk")]


def test_journal_lines_are_compact_json_that_keeps_non_ascii_text(tmp_path):
    journal, frame = run_journal(tmp_path)
    journal.snapshot([frame], status="running")
    journal.record("k", "tool", "été")
    line = (tmp_path / "cp.json.journal").read_bytes().splitlines()[1]
    assert line.startswith('{"k":"call","key":"k","kind":"tool","v":"été","h":"'.encode())


def test_each_journal_line_is_a_crash_point_reached_once_the_line_is_in_the_file(tmp_path):
    from mklang import faults

    journal, frame = run_journal(tmp_path)
    journal.snapshot([frame], status="running")
    reached: list[tuple[str, str]] = []

    def watch(point: str) -> None:
        if point.startswith("journal."):
            reached.append((point, json.loads((tmp_path / "cp.json.journal").read_bytes().splitlines()[-1])["k"]))

    faults.watch(watch)
    try:
        journal.record("r:1.0", "tool", "t")
        journal.step(0, step_record("a", "b", "one"))
        journal.enter(1, frame)
        journal.halt(1, "gate-fail", Usage())
    finally:
        faults.disarm()
    assert reached == [
        ("journal.call", "call"),
        ("journal.step", "step"),
        ("journal.enter", "enter"),
        ("journal.halt", "halt"),
    ]


def test_a_new_runs_first_envelope_is_not_remembered_and_every_later_one_is(tmp_path, monkeypatch):
    """Only a newer envelope makes a restored copy a rollback (ADR 0022): the first envelope of a
    new run id has none older, so its generation is not worth a record; a recovery's is."""
    from mklang.checkpoint import generations

    remembered: list[int] = []
    monkeypatch.setattr(generations, "remember", lambda store, run_id, generation: remembered.append(generation))
    machine = load_file(EXAMPLES / "nested" / "brief.mk")
    scenario = load_script(EXAMPLES / "nested" / "scenarios.yaml")[0]
    checkpoint = tmp_path / "cp.json"
    with pytest.raises(Crash):
        start(machine, None, Host.for_scenario(scenario), checkpoint=checkpoint, observer=CrashAt(2))
    assert (load(checkpoint).generation, remembered) == (1, [])
    resume(checkpoint, Host.for_scenario(scenario))
    # The generation resumed, the recovery's snapshot, then its finish.
    assert (load(checkpoint).generation, remembered) == (3, [1, 2, 3])
    remembered.clear()
    start(machine, None, Host.for_scenario(scenario), checkpoint=tmp_path / "other.json")
    assert remembered == [2]  # a run that goes from start to done: its last envelope only
