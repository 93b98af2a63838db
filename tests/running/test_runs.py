"""Starting and continuing a checkpointed run (mklang.runs): the envelope a run begins with,
where its machines are found again and which frames may run, a run that died replayed from its
journal, what a resume changes and records, and a resumed run hosted as its checkpoint records."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
from conformance.harness import Recorder, mk, write_machines
from support.crashes import Crash
from support.examples import EXAMPLES, HITL
from support.files import journal_lines, write_journal
from support.runs import JUDGED_TWO_STATES, ROOT_MK, TWO_STATES, LoopTops, project

from mklang.checkpoint.envelope import Envelope, HostSettings, load, save
from mklang.checkpoint.signing import checkpoint_key, sign
from mklang.engine.runtime import Control
from mklang.errors import CheckpointError, ProviderError, UsageError
from mklang.providers.base import NONE, Usage
from mklang.runs import (
    Outcome,
    Removal,
    open_run,
    opened,
    outcome,
    proceed,
    remove_run,
    resume,
    start,
    verified,
)
from mklang.runs.inspection import run_document
from mklang.scenarios import Scenario, ScriptedHost, load_script
from mklang.session import Host
from mklang.stores import locate
from mklang.stores.file import FileStore
from mklang.syntax import load_file
from mklang.syntax.machines import file_sha256
from mklang.syntax.resolve import stdlib_dirs


def suspended(
    tmp_path: Path, *, root_budget: int = 1, sub_budget: int = 3, host: HostSettings | None = None, **options: Any
) -> Path:
    """The project in `tmp_path/project`, its run suspended with checkpoint `tmp_path/cp.json`
    (its host recording `host`)."""
    machine = project(tmp_path / "project", root_budget, sub_budget)
    path = tmp_path / "cp.json"
    recorder = Recorder({"produce": ["one", "two", "three"]})
    settings = host.model_dump() if host is not None else {}
    result = start(machine, None, Host(recorder, settings=settings), checkpoint=path, **options)
    assert result.status == "suspended"
    return path


def inside_sub(tmp_path: Path) -> Path:
    """The project's run suspended at sub.mk's second state, interrupted there."""
    control = Control()

    def interrupt_at_s2(event: Any) -> None:
        if event.state == "s2":
            control.interrupted.set()

    return suspended(tmp_path, root_budget=2, control=control, observer=LoopTops(interrupt_at_s2))


def refusal(path: Path, **options: Any) -> str:
    with pytest.raises(CheckpointError) as caught:
        open_run(path, lock=False, **options)
    return str(caught.value)


def edit(path: Path, change: Any) -> None:
    """Change the envelope's JSON and save it signed again with this user's key."""
    document = load(path).model_dump(mode="json")
    change(document)
    save(path, Envelope.model_validate(document))


# --- start: the envelope a checkpointed run begins with -------------------------------


def test_a_checkpointed_run_starts_running_with_default_settings_and_a_fresh_run_id(tmp_path):
    machine = project(tmp_path / "project", root_budget=5)
    firsts: list[Envelope] = []
    runs = []
    for name in ("one.json", "two.json"):
        path = tmp_path / name
        seen: list[Envelope] = []
        result = start(
            machine,
            None,
            Host(Recorder({"produce": ["x", "y", "z"]})),
            checkpoint=path,
            observer=LoopTops(lambda event, path=path, seen=seen: seen.append(load(path))),
        )
        assert result.status == "done"
        firsts.append(seen[0])
        runs.append(load(path))
    first = firsts[0]
    assert (first.status, first.hitl, first.concurrency) == ("running", False, 8)
    assert first.budgets.model_dump() == {"max_tokens": None, "max_cost": None, "max_time": None}
    assert first.host == HostSettings()
    assert (first.machine.name, first.machine.path) == ("root", "project/root.mk")
    assert first.machine.sha256 == file_sha256(tmp_path / "project" / "root.mk")
    assert first.frames[0]["context"] == {"topic": "tides"}  # no context given: the defaults
    assert len(first.run_id) == 32 and int(first.run_id, 16) >= 0
    assert firsts[1].run_id != first.run_id
    assert [run.run_id for run in runs] == [f.run_id for f in firsts]


def test_a_checkpointed_run_of_a_machine_without_a_file_records_no_root_and_cannot_resume_without_one(tmp_path):
    machine = mk(ROOT_MK.format(budget=1).replace("call sub", "call nothing"))
    path = tmp_path / "cp.json"
    start(machine, {"topic": "moons"}, Host(Recorder()), checkpoint=path)
    envelope = load(path)
    assert (envelope.machine.path, envelope.machine.sha256, envelope.machines) == (None, None, {})
    assert refusal(path) == f"{path}: the checkpoint records no root machine file (use --machine PATH)"


# --- open_run: where the machines are, and which frames may run ----------------


def test_a_moved_root_machine_is_named_by_machine_path_and_its_sub_machines_follow(tmp_path):
    path = inside_sub(tmp_path)  # suspended inside sub
    assert [f["path"] for f in load(path).frames] == ["root.mk", "sub.mk"]
    shutil.move(tmp_path / "project", tmp_path / "moved")
    missing = tmp_path / "project" / "root.mk"
    kept = open_run(path, lock=False)  # the store keeps the texts the checkpoint signed
    assert kept.machines_note is not None
    assert kept.machines_note.startswith(f"{missing} is missing; running the machine texts the store keeps")
    assert [Path(frame.machine.path).name for frame in kept.chain] == ["root.mk", "sub.mk"]
    opened = open_run(path, lock=False, machine_path=str(tmp_path / "moved" / "root.mk"))
    assert [frame.machine.path for frame in opened.chain] == [
        str(tmp_path / "moved" / "root.mk"),
        str(tmp_path / "moved" / "sub.mk"),
    ]
    done = proceed(opened, Host(Recorder({"produce": ["again"]})), budget=5)
    assert (done.status, done.result) == ("done", "again")


def test_with_machine_path_the_root_machine_is_not_the_recorded_one(tmp_path):
    path = suspended(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    (other / "root.mk").write_text((tmp_path / "project" / "root.mk").read_text() + "# edited\n")
    assert refusal(path, machine_path=str(other / "root.mk")) == (
        f"{other / 'root.mk'}: machine file changed since the checkpoint was written "
        "(to move the parked run to it once it is checked compatible: resume with --machine FILE --migrate; "
        "to accept the change unchecked: resume with --force)"
    )
    opened = open_run(path, lock=False, machine_path=str(other / "root.mk"), force=True)
    assert opened.chain[0].machine.path == str(other / "root.mk")


def test_the_first_frame_must_run_the_root_machine(tmp_path):
    path = inside_sub(tmp_path)

    def root_runs_sub(document: dict[str, Any]) -> None:
        document["frames"] = [document["frames"][1]]

    edit(path, root_runs_sub)
    assert refusal(path) == f"{path}: the first frame does not run the root machine {tmp_path / 'project' / 'root.mk'}"


def test_a_hashed_machine_is_checked_in_name_order_and_every_one_must_be_unchanged(tmp_path):
    path = inside_sub(tmp_path)
    assert sorted(load(path).machines) == ["root.mk", "sub.mk"]
    for name in ("sub.mk", "root.mk"):
        machine = tmp_path / "project" / name
        machine.write_text(machine.read_text() + "# edited\n")
    assert refusal(path).startswith(f"{tmp_path / 'project' / 'root.mk'}: machine file changed")
    (tmp_path / "project" / "root.mk").unlink()
    assert refusal(path).startswith(f"{tmp_path / 'project' / 'root.mk'}: machine file of the checkpoint is missing")


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        ("steps", -1, "not a valid mklang checkpoint: frames.0.steps: Input should be greater than or equal to 0"),
        (
            "usage",
            {"input_tokens": -2, "output_tokens": 0, "cost_usd": 0.0},
            "malformed frame: ValueError: usage input_tokens is -2, not a count from 0 to 1,000,000,000,000,000",
        ),
    ],
)
def test_a_malformed_frame_is_refused_in_one_line(tmp_path, field, value, problem):
    path = suspended(tmp_path)
    document = load(path).model_dump(mode="json")
    document["frames"][0][field] = value
    path.write_bytes(sign(document, checkpoint_key())[0])  # signed, so only the frame is wrong
    assert refusal(path) == f"{path}: {problem}"


def test_a_frame_naming_a_file_the_checkpoint_did_not_hash_is_refused(tmp_path):
    path = suspended(tmp_path)
    shutil.copy(tmp_path / "project" / "root.mk", tmp_path / "project" / "evil.mk")
    edit(path, lambda document: document["frames"][0].update(path="evil.mk"))
    assert refusal(path, force=True) == (
        f"{path}: a frame of machine 'root' names evil.mk, which is not one of the checkpoint's hashed machine files"
    )


def test_a_hashed_machine_that_no_longer_loads_is_refused_naming_it(tmp_path):
    path = suspended(tmp_path)
    root = tmp_path / "project" / "root.mk"
    root.write_text("machine root\nentry nowhere\n")
    assert (
        refusal(path, force=True)
        == f"{path}: cannot load machine {root}: {root}:1:1: the file has no `budget <steps>` line"
    )


# --- a run that died: its journal is replayed -----------------------------------------


def dead(tmp_path: Path, at_top: int = 3, **options: Any) -> Path:
    """The project's run (budget 5) died at its `at_top`-th loop-top (from 0) inside sub.mk,
    entered after the last snapshot; checkpoint `tmp_path/cp.json`."""
    machine = project(tmp_path / "project", root_budget=5)
    path = tmp_path / "cp.json"
    tops = iter(range(100))

    def crash(event: Any) -> None:
        if next(tops) == at_top:
            raise Crash

    with pytest.raises(Crash):
        start(
            machine,
            None,
            Host(Recorder({"produce": ["one", "two", "three"]})),
            checkpoint=path,
            observer=LoopTops(crash),
            **options,
        )
    return path


def test_a_dead_run_resumes_from_its_journal_even_inside_a_machine_entered_after_the_snapshot(tmp_path):
    path = dead(tmp_path)
    envelope = load(path)
    assert (envelope.status, sorted(envelope.machines)) == ("running", ["root.mk"])
    opened = open_run(path, lock=False)
    assert (opened.crashed, opened.trusted) == (True, True)
    assert [(frame.machine.name, frame.state) for frame in opened.chain] == [("root", "b"), ("sub", "s2")]
    assert opened.chain[1].context == {"q": "one", "z": "two"}
    done = proceed(opened, Host(Recorder({"produce": ["three"]})))
    assert (done.status, done.result, done.context) == ("done", "three", {"topic": "tides", "x": "one", "y": "three"})
    assert sorted(load(path).machines) == ["root.mk", "sub.mk"]


def test_a_machine_entered_after_the_snapshot_must_be_unchanged_since_its_journal_line(tmp_path):
    path = dead(tmp_path)
    sub = tmp_path / "project" / "sub.mk"
    sub.write_text(sub.read_text() + "# edited\n")
    assert refusal(path) == (
        f"{sub}: machine file changed since the checkpoint was written (to move the parked run to it once it is checked compatible: resume with --machine FILE --migrate; "
        "to accept the change unchecked: resume with --force)"
    )


def test_the_journal_of_an_untrusted_checkpoint_cannot_vouch_for_a_machine(tmp_path, monkeypatch):
    path = dead(tmp_path)
    monkeypatch.setenv("MKLANG_CHECKPOINT_KEY", "another user's checkpoint key, 32 bytes or more")
    assert refusal(path, trust=True) == (
        f"{path}: a frame of machine 'sub' names sub.mk, which is not one of the checkpoint's hashed machine files"
    )


def test_an_untrusted_dead_run_has_every_value_of_every_frame_fenced(tmp_path, monkeypatch):
    path = dead(tmp_path, at_top=1)  # died at root b, before entering sub
    monkeypatch.setenv("MKLANG_CHECKPOINT_KEY", "another user's checkpoint key, 32 bytes or more")
    opened = open_run(path, lock=False, trust=True)
    assert (opened.crashed, opened.trusted) == (True, False)
    assert [frame.tainted for frame in opened.chain] == [{"topic", "x"}]
    clean = open_run(suspended(tmp_path / "clean"), lock=False, trust=True)
    assert clean.trusted and clean.chain[0].tainted == {"x"}  # signed: its taint marks stand


def test_an_edited_envelope_of_a_dead_run_is_untrusted_even_with_an_intact_journal(tmp_path):
    path = dead(tmp_path, at_top=1)
    document = json.loads(path.read_text())
    document["frames"][0]["context"]["topic"] = "edited"
    path.write_text(json.dumps(document))
    opened = open_run(path, lock=False, trust=True)
    assert (opened.crashed, opened.trusted) == (True, False)
    assert opened.chain[0].tainted == {"topic", "x"}


@pytest.mark.parametrize(
    ("edit_line", "problem"),
    [
        (lambda lines: lines[2].pop("d"), "malformed journal: KeyError: 'd'"),
        (
            lambda lines: lines[2]["r"].update(charge="many"),
            "malformed journal: TypeError: unsupported operand type(s) for +=: 'int' and 'str'",
        ),
        (lambda lines: lines[3].update(f="a frame"), "malformed frame: a frame must be a JSON object, not str"),
    ],
)
def test_a_malformed_journal_of_an_untrusted_run_is_refused_in_one_line(tmp_path, monkeypatch, edit_line, problem):
    path = dead(tmp_path)
    lines = journal_lines(path)
    edit_line(lines)
    write_journal(path, lines)
    monkeypatch.setenv("MKLANG_CHECKPOINT_KEY", "another user's checkpoint key, 32 bytes or more")
    assert refusal(path, trust=True, force=True) == f"{path}: {problem}"


# --- proceed: what a resume changes, and where it writes ------------------


def test_a_resume_records_the_budgets_and_settings_it_was_given_and_keeps_the_rest(tmp_path):
    path = suspended(
        tmp_path, max_tokens=100, max_cost=1.5, max_time=600, hitl=True, concurrency=3, host=HostSettings(model="m1")
    )
    opened = open_run(path)
    done = proceed(
        opened,
        Host(Recorder({"produce": ["two", "three"]}), settings={"model": "m2"}),
        budget=5,
        max_tokens=200,
        max_time=900,
        hitl=False,
        concurrency=2,
    )
    assert done.status == "done"
    envelope = load(path)
    assert envelope.budgets.model_dump() == {"max_tokens": 200, "max_cost": 1.5, "max_time": 900}
    assert (envelope.hitl, envelope.concurrency, envelope.host.model) == (False, 2, "m2")
    assert envelope.frames[0]["budget"] == 5


def test_a_resume_given_no_settings_keeps_every_recorded_one_and_records_the_host_it_ran_with(tmp_path):
    path = suspended(tmp_path, max_tokens=100, max_cost=1.5, hitl=True, concurrency=3, host=HostSettings(model="m1"))
    done = proceed(open_run(path), Host(Recorder({"produce": ["two", "three"]})), budget=5)
    assert done.status == "done"
    envelope = load(path)
    assert envelope.budgets.model_dump() == {"max_tokens": 100, "max_cost": 1.5, "max_time": None}
    assert (envelope.hitl, envelope.concurrency) == (True, 3)
    assert envelope.host.model is None  # the host that resumed it, never one the file brought in (ADR 0014)


def test_a_clean_resume_continues_the_envelope_in_place_and_its_journal_records_the_change(tmp_path):
    path = suspended(tmp_path, hitl=True, concurrency=3)
    before = path.read_bytes()
    seen: list[tuple[bytes, dict[str, Any]]] = []
    opened = open_run(path)
    proceed(
        opened,
        Host(Recorder({"produce": ["two", "three"]}), settings={"model": "m2"}),
        budget=4,
        max_cost=2.0,
        reply={"topic": "moons"},
        observer=LoopTops(lambda event: seen.append((path.read_bytes(), journal_lines(path)[0]))),
    )
    stored, header = seen[0]
    assert stored == before  # not rewritten: continued in place
    assert header["resume"] == {
        "budgets": {"max_tokens": None, "max_cost": 2.0, "max_time": None},
        "hitl": True,
        "untrusted_flow": "report",
        "concurrency": 3,
        "host": HostSettings(model="m2").model_dump(mode="json"),
        "budget": 4,
        "set": {"topic": "moons"},
    }
    assert (header["k"], header["g"]) == ("gen", load(path).generation - 1)


def test_a_resume_of_a_dead_run_or_to_another_file_starts_from_a_fresh_snapshot(tmp_path):
    path = dead(tmp_path / "dead", at_top=1)
    seen: list[tuple[Envelope, dict[str, Any]]] = []
    proceed(
        open_run(path),
        Host(Recorder({"produce": ["two", "three"]})),
        observer=LoopTops(lambda event: seen.append((load(path), journal_lines(path)[0]))),
    )
    envelope, header = seen[0]
    assert (envelope.status, envelope.frames[0]["state"], header) == (
        "running",
        "b",
        {**header, "g": envelope.generation},
    )
    assert "resume" not in header

    path = suspended(tmp_path / "clean")
    other = tmp_path / "other.json"
    busy: list[str] = []

    def try_to_open(event: Any) -> None:
        with pytest.raises(CheckpointError) as caught:
            open_run(other)
        busy.append(str(caught.value))

    before = path.read_bytes()
    done = proceed(
        open_run(path),
        Host(Recorder({"produce": ["two", "three"]})),
        budget=5,
        checkpoint=other,
        observer=LoopTops(try_to_open),
    )
    assert done.status == "done" and load(other).status == "done"
    assert busy and all("the run is still going in process" in line for line in busy)  # the new file is locked
    assert path.read_bytes() == before
    open_run(path, allow_rollback=True).release()  # and both locks are free once the run ends
    with pytest.raises(CheckpointError, match="already finished"):
        open_run(other)


# --- machine files as a checkpoint names them: the standard library -------------------

ASKER = """
    machine asker
    entry ask
    budget 3
    state ask {
      call chain_of_thought { question: "When does the train arrive?" }
      output answer
      otherwise -> END
    }
"""


def test_a_standard_library_machine_is_recorded_by_name_and_found_again_on_resume(tmp_path):
    (tmp_path / "project").mkdir()
    machine = write_machines(tmp_path / "project", ASKER)
    path = tmp_path / "cp.json"
    llm = {"produce": ["1. it leaves at 9.", "10:00"], "tokens": [10, 10], "judge": [0]}
    first = start(machine, None, Host(Recorder(llm)), checkpoint=path, max_tokens=5)
    assert (first.status, first.reason) == ("suspended", "cost-exhausted")
    envelope = load(path)
    assert [frame["path"] for frame in envelope.frames] == ["asker.mk", "stdlib:chain_of_thought.mk"]
    assert sorted(envelope.machines) == ["asker.mk", "stdlib:chain_of_thought.mk"]
    opened = open_run(path)
    assert opened.chain[1].machine.path == str(stdlib_dirs()[0] / "chain_of_thought.mk")
    done = proceed(opened, Host(Recorder({**llm, "produce": ["10:00"]})), max_tokens=1000)
    assert (done.status, done.result) == ("done", "10:00")


# --- a resume runs with what the host gives it ------------------------------------------

HOOKED = """
    machine hooked
    entry a
    budget 1
    hook stop "True when it should stop."
    state a {
      structure "s"
      prompt "p"
      output x
      otherwise -> b
    }
    state b {
      structure "s"
      prompt "p"
      output y
      when "it should stop" hook stop -> END
      otherwise -> a
    }
"""

UNUSED_STOP = {"stop": lambda context, output: True}  # declared, never reached: a host implements it all the same


def test_a_resume_runs_with_the_hooks_and_the_control_it_is_given(tmp_path):
    machine = write_machines(tmp_path, HOOKED)
    path = tmp_path / "cp.json"
    seen: list[Any] = []

    def stop(context: dict[str, Any], output: Any) -> bool:
        seen.append(output)
        return True

    assert start(machine, None, Host(Recorder(), hooks={"stop": stop}), checkpoint=path).status == "suspended"
    control = Control()
    control.interrupted.set()
    stopped = proceed(open_run(path), Host(Recorder(), hooks={"stop": stop}), budget=5, control=control)
    assert (stopped.status, stopped.reason, stopped.at) == ("suspended", "interrupted", "b")
    done = proceed(open_run(path), Host(Recorder({"produce": ["last"]}), hooks={"stop": stop}))
    assert (done.status, done.result, seen) == ("done", "last", ["last"])


def test_a_scripted_run_saves_its_state_and_a_resume_restores_it_or_runs_without_it(tmp_path):
    machine = project(tmp_path / "project")
    scenario = Scenario("s", llm={"produce": ["one", "two", "three"]})
    first = ScriptedHost(scenario)
    path = tmp_path / "cp.json"
    start(machine, None, Host(first.provider, state=first.state), checkpoint=path)
    recorded = load(path).host.state
    assert recorded == first.state.save() and recorded != ScriptedHost(scenario).state.save()
    shutil.copy(path, tmp_path / "copy.json")

    again = ScriptedHost(scenario)
    done = proceed(open_run(path), Host(again.provider, state=again.state), budget=5)
    assert (done.status, done.result) == ("done", "three")  # the answers after the one already used
    assert load(path).host.state == again.state.save() != recorded

    other = proceed(
        open_run(tmp_path / "copy.json", allow_rollback=True), Host(Recorder({"produce": ["a", "b"]})), budget=5
    )
    assert (other.status, other.result) == ("done", "b")


def _suspended_scripted(tmp_path: Path, scenario: Scenario) -> Path:
    """A checkpoint of a scripted run of the project suspended after one answer (step budget)."""
    path = tmp_path / "cp.json"
    first = ScriptedHost(scenario)
    start(project(tmp_path / "project"), None, Host(first.provider, state=first.state), checkpoint=path)
    return path


def _rewritten(path: Path, host: dict[str, Any]) -> None:
    """The checkpoint with its host record replaced, signed with this user's key."""
    document = json.loads(path.read_text())
    del document["signature"]
    document["host"] = host
    path.write_bytes(sign(document, checkpoint_key())[0])


def test_a_checkpoint_that_saved_a_scripted_position_resumes_from_it_and_is_rewritten_with_a_state(tmp_path):
    """Checkpoints written before host states call a scripted host's state `host.position`."""
    scenario = Scenario("s", llm={"produce": ["one", "two", "three"]})
    path = _suspended_scripted(tmp_path, scenario)
    host = json.loads(path.read_text())["host"]
    _rewritten(path, {**{k: v for k, v in host.items() if k != "state"}, "position": {"llm": {"produce": 1}}})
    assert load(path).host.state == {"llm": {"produce": 1}}
    again = ScriptedHost(scenario)
    done = proceed(open_run(path), Host(again.provider, state=again.state), budget=5)
    assert (done.status, done.result) == ("done", "three")
    written = json.loads(path.read_text())["host"]
    assert "position" not in written and written["state"] == {
        "llm": {"produce": 3, "judge": 0},
        "tools": {},
        "hooks": {},
    }


def test_a_host_state_the_host_cannot_read_is_refused_in_one_line(tmp_path):
    scenario = Scenario("s", llm={"produce": ["one", "two", "three"]})
    path = _suspended_scripted(tmp_path, scenario)
    _rewritten(path, {**json.loads(path.read_text())["host"], "state": {"llm": {"produce": "many"}}})
    again = ScriptedHost(scenario)
    with pytest.raises(CheckpointError) as caught:
        proceed(open_run(path), Host(again.provider, state=again.state))
    assert (
        str(caught.value) == f"{path}: malformed host state: ValueError: invalid literal for int() with base 10: 'many'"
    )


def test_a_resumed_dead_run_replays_the_calls_its_step_in_flight_had_paid_for(tmp_path):
    class DiesAtTheJudge(Recorder):
        def judge(self, conditions, output, reasoning, context, tier):
            raise Crash

    machine = write_machines(tmp_path, HOOKED.replace("hook stop -> END", "-> END").replace("budget 1", "budget 5"))
    path = tmp_path / "cp.json"
    with pytest.raises(Crash):
        start(machine, None, Host(DiesAtTheJudge({"produce": ["paid", "b-one"]}), hooks=UNUSED_STOP), checkpoint=path)
    opened = open_run(path)
    assert opened.crashed and [(f.state, f.context) for f in opened.chain] == [("b", {"x": "paid"})]
    assert len(opened.answers) == 1  # b's answer, paid for before the judge call died
    provider = Recorder({"produce": ["never"], "judge": [0]})
    done = proceed(opened, Host(provider, hooks=UNUSED_STOP))
    assert (done.status, done.context, provider.produced) == ("done", {"x": "paid", "y": "b-one"}, [])


def test_a_resumed_run_that_finishes_keeps_no_detail_of_the_suspension(tmp_path):
    class Down(Recorder):
        def produce(self, system, user, tier, reason):
            raise ProviderError("HTTP 503 from the model server")

    machine = project(tmp_path / "project", root_budget=5)
    path = tmp_path / "cp.json"
    start(machine, None, Host(Down()), checkpoint=path)
    assert (load(path).reason, load(path).detail) == ("provider-error", "HTTP 503 from the model server")
    assert proceed(open_run(path), Host(Recorder())).status == "done"
    done = load(path)
    assert (done.status, done.reason, done.detail) == ("done", None, None)


def test_the_document_of_a_run_suspended_on_a_provider_error_gives_the_error(tmp_path):
    class Down(Recorder):
        def produce(self, system, user, tier, reason):
            raise ProviderError("HTTP 503 from the model server")

    path = tmp_path / "cp.json"
    start(project(tmp_path / "project", root_budget=5), None, Host(Down()), checkpoint=path)
    document = run_document(path)
    assert (document["status"], document["reason"], document["detail"]) == (
        "suspended",
        "provider-error",
        "HTTP 503 from the model server",
    )
    assert (document["error"], document["checkpoint"]) == (None, str(path))


def test_an_edited_journal_of_a_signed_dead_run_is_still_replayed_when_trusted_as_data(tmp_path):
    path = dead(tmp_path, at_top=1)
    journal = Path(f"{path}.journal")
    journal.write_bytes(journal.read_bytes().replace(b'"text":"one"', b'"text":"edited"'))  # the paid answer
    with pytest.raises(CheckpointError, match="journal line 2 was edited"):
        open_run(path, lock=False)
    opened = open_run(path, lock=False, trust=True)
    assert (opened.trusted, opened.crashed) == (False, True)
    assert [(frame.state, frame.context) for frame in opened.chain] == [("b", {"topic": "tides", "x": "one"})]


# --- a resumed run is hosted as the checkpoint records -----------------------------------

FAN = """
    machine fan
    entry a
    budget 1
    context { xs: ["p", "q", "r"] }
    state a {
      structure "s"
      prompt "p"
      output first
      otherwise -> each
    }
    state each {
      over xs
      structure "s"
      prompt "{{item}}"
      output o
      otherwise escalate -> last ask "Done?" reply_to ok
    }
    state last {
      structure "s"
      prompt "p"
      output y
      otherwise -> END
    }
"""


def test_a_resume_runs_with_the_recorded_calls_in_flight_and_hitl(tmp_path):
    class Threads(Recorder):
        def __init__(self) -> None:
            super().__init__({"tokens": [1, 1]})
            self.threads: set[int] = set()

        def produce(self, system, user, tier, reason):
            self.threads.add(threading.get_ident())
            return super().produce(system, user, tier, reason)

    machine = write_machines(tmp_path, FAN)
    path = tmp_path / "cp.json"
    first = start(machine, None, Host(Recorder({"tokens": [5, 5]})), checkpoint=path, concurrency=1, hitl=True)
    assert (first.status, first.reason, first.at) == ("suspended", "budget-exhausted", "each")
    provider = Threads()
    again = proceed(open_run(path), Host(provider), budget=5)
    assert (again.status, again.reason, again.ask) == ("suspended", "escalated", "Done?")
    assert provider.threads == {threading.get_ident()}  # one call at a time: all on this thread
    assert (load(path).usage, again.usage) == (again.usage.to_json(), Usage(8, 8))  # the first call's too


def test_a_resume_keeps_the_recorded_time_budget(tmp_path):
    machine = write_machines(tmp_path, TWO_STATES)
    path = tmp_path / "cp.json"
    first = start(machine, None, Host(Recorder()), checkpoint=path, max_time=0)
    assert (first.status, first.reason, first.at) == ("suspended", "time-exhausted", "a")
    again = proceed(open_run(path), Host(Recorder()))
    assert (again.status, again.reason, again.at) == ("suspended", "time-exhausted", "a")
    done = proceed(open_run(path), Host(Recorder()), max_time=60)
    assert done.status == "done"


def test_an_escalated_checkpoint_whose_frames_predate_their_pending_ask_takes_the_envelopes_question(tmp_path):
    machine = write_machines(
        tmp_path, TWO_STATES.replace("otherwise -> b", 'otherwise escalate -> b ask "Go on?" reply_to go')
    )
    path = tmp_path / "cp.json"
    start(machine, None, Host(Recorder()), checkpoint=path, hitl=True)
    assert (load(path).reason, load(path).frames[-1]["ask"]) == ("escalated", {"ask": "Go on?", "reply_to": "go"})

    def older(document: dict[str, Any]) -> None:
        del document["frames"][-1]["ask"]

    edit(path, older)
    assert "ask" not in load(path).frames[-1]
    opened = open_run(path)
    assert opened.chain[-1].ask == {"ask": "Go on?", "reply_to": "go"}
    again = proceed(opened, Host(Recorder()))
    assert (again.status, again.reason, again.ask, again.reply_to) == ("suspended", "escalated", "Go on?", "go")
    done = proceed(open_run(path), Host(Recorder()), reply={"go": "yes"})
    assert (done.status, done.context["go"]) == ("done", "yes")


PUBLISH = """
    machine pub
    entry a
    budget 5
    tool publish "Publishes its text; returns the URL."
    state a {
      tool publish { text: "one" }
      output first
      when "it went out" -> b
      otherwise -> b
    }
    state b {
      tool publish { text: "two" }
      output second
      otherwise -> END
    }
"""


def test_a_scripted_tool_answer_replayed_after_a_crash_is_not_answered_again(tmp_path):
    def dies(*args: Any) -> Any:
        raise Crash

    machine = write_machines(tmp_path, PUBLISH)
    scenario = Scenario("s", llm={"judge": [0]}, tools={"publish": ["url-1", "url-2"]})
    host = ScriptedHost(scenario)
    host.provider.judge = dies  # type: ignore[method-assign]
    path = tmp_path / "cp.json"
    with pytest.raises(Crash):
        start(machine, None, Host(host.provider, tools=host.tools.functions(), state=host.state), checkpoint=path)
    again = ScriptedHost(scenario)
    done = proceed(open_run(path), Host(again.provider, tools=again.tools.functions(), state=again.state))
    assert (done.status, done.context) == ("done", {"first": "url-1", "second": "url-2"})


def test_a_chain_that_no_longer_fits_its_machines_is_refused_even_with_force(tmp_path):
    path = suspended(tmp_path)
    root = tmp_path / "project" / "root.mk"
    root.write_text(root.read_text().replace("state b", "state c").replace("-> b", "-> c"))
    assert refusal(path, force=True) == f"{path}: frame 1 (root at b): state 'b' no longer exists in {root}"


def test_a_checkpointed_run_reads_its_durability_setting_before_it_starts(tmp_path, monkeypatch):
    monkeypatch.setenv("MKLANG_DURABILITY", "sometimes")
    with pytest.raises(UsageError) as caught:
        start(write_machines(tmp_path, TWO_STATES), None, Host(Recorder()), checkpoint=tmp_path / "cp.json")
    assert str(caught.value) == "MKLANG_DURABILITY must be call or step, not 'sometimes'"


def test_a_checkpointed_run_keys_its_tool_calls_by_its_own_run_id_across_a_resume(tmp_path):
    keys: list[str] = []

    def publish(arguments: dict[str, Any], idempotency_key: str) -> str:
        keys.append(idempotency_key)
        return "url"

    machine = write_machines(tmp_path, PUBLISH.replace("budget 5", "budget 1"))
    path = tmp_path / "cp.json"
    start(machine, None, Host(Recorder(), tools={"publish": publish}), checkpoint=path)
    run_id = load(path).run_id
    proceed(open_run(path), Host(Recorder(), tools={"publish": publish}), budget=5)
    assert keys == [f"{run_id}/r:1.0.1", f"{run_id}/r:2.0.1"]


def test_a_checkpointed_run_stops_at_its_dollar_budget(tmp_path):
    class Priced(Recorder):
        def __init__(self) -> None:
            super().__init__()
            self.tokens = Usage(1, 1, 0.5)

    path = tmp_path / "cp.json"
    result = start(write_machines(tmp_path, TWO_STATES), None, Host(Priced()), checkpoint=path, max_cost=0.4)
    assert (result.status, result.reason, result.at) == ("suspended", "cost-exhausted", "b")
    again = proceed(open_run(path), Host(Priced()))
    assert (again.status, again.reason, again.at) == ("suspended", "cost-exhausted", "b")


def test_a_resume_given_a_host_record_keeps_the_host_state_the_checkpoint_saved(tmp_path):
    machine = project(tmp_path / "project")
    host = ScriptedHost(Scenario("s", llm={"produce": ["one", "two", "three"]}))
    path = tmp_path / "cp.json"
    start(machine, None, Host(host.provider, state=host.state), checkpoint=path)
    recorded = load(path).host.state
    again = proceed(open_run(path), Host(Recorder(), settings={"model": "m2"}))
    assert (again.status, again.reason) == ("suspended", "budget-exhausted")
    assert (load(path).host.model, load(path).host.state) == ("m2", recorded)


# What a batch's processes and workers hand each other ------------------------------------------


def test_an_outcome_read_back_from_its_json_line_is_the_outcome_written():
    """A spread batch's children report each run as a JSON line the parent reads back: the
    result and the spend travel with it."""
    written = Outcome("item-1", "done", None, {"answer": [1, 2]}, {"tokens": 12, "cost": 0.5})
    assert Outcome.from_json(json.loads(json.dumps(written.to_json()))) == written
    assert Outcome.from_json({"id": 7, "status": "pending"}) == Outcome("7", "pending", None, None, {})


@pytest.mark.parametrize(
    ("raw", "wording"),
    [
        (b"[1, 2]", "the note is not a JSON object"),
        (b"{not json", "the note is not a JSON object"),
        (json.dumps({"outcome": {}}).encode(), "the note is not signed"),
    ],
)
def test_a_note_that_is_not_a_fleet_signed_object_is_refused_in_one_line(raw, wording):
    with pytest.raises(CheckpointError) as caught:
        verified(raw, "the note")
    assert str(caught.value) == wording


def test_a_note_signed_with_the_fleet_key_is_read_and_one_edited_or_signed_elsewhere_is_refused():
    document = {"outcome": {"id": "a", "status": "done"}}
    raw = sign(document, checkpoint_key())[0]
    assert verified(raw, "the note")["outcome"] == document["outcome"]
    edited = raw.replace(b'"done"', b'"halted"')
    with pytest.raises(
        CheckpointError, match=r"^the note is edited after it was signed with the fleet checkpoint key$"
    ):
        verified(edited, "the note")
    foreign = sign(document, b"another key")[0]
    with pytest.raises(CheckpointError, match=r"^the note is signed with another checkpoint key$"):
        verified(foreign, "the note")


# --- the runs of a store: what each came to, and which `mklang runs rm` removes ----------------

SPENT = {"input_tokens": 6, "output_tokens": 8, "cost_usd": 0.0}
NOTHING_SPENT = {"input_tokens": 0, "output_tokens": 0, "cost_usd": 0.0}
NOT_JSON = "the checkpoint is not valid JSON (truncated or corrupted?): Expecting value: line 1 column 1 (char 0)"


def runs_of_every_kind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder store holding a run of each kind a batch or `runs rm` meets: done, halted (its gate
    failed), suspended on its budget, interrupted, dead at its first loop-top, dead while a resume
    of it ran, bytes that are no checkpoint, and a run signed with another user's key."""
    runs = tmp_path / "runs"
    runs.mkdir()
    (tmp_path / "judged").mkdir()
    two, judged = write_machines(tmp_path, TWO_STATES), write_machines(tmp_path / "judged", JUDGED_TWO_STATES)

    def crash(event: Any) -> None:
        raise Crash

    start(two, None, Host(Recorder({"produce": ["x", "y"], "tokens": [3, 4]})), checkpoint=runs / "done")
    start(judged, None, Host(Recorder({"judge": [NONE], "tokens": [3, 4]})), checkpoint=runs / "halted")
    start(two, None, Host(Recorder()), checkpoint=runs / "suspended", max_tokens=0)
    interrupted = Control()
    interrupted.interrupted.set()
    start(two, None, Host(Recorder()), checkpoint=runs / "interrupted", control=interrupted)
    with pytest.raises(Crash):
        start(two, None, Host(Recorder()), checkpoint=runs / "dead", observer=LoopTops(crash))
    start(two, None, Host(Recorder()), checkpoint=runs / "resuming", max_tokens=0)
    with pytest.raises(Crash):
        proceed(open_run(runs / "resuming"), Host(Recorder()), max_tokens=100, observer=LoopTops(crash))
    (runs / "junk").write_bytes(b"not a checkpoint")
    with monkeypatch.context() as elsewhere:
        elsewhere.setenv("MKLANG_CHECKPOINT_KEY", "another user's checkpoint key, 32 bytes or more")
        start(two, None, Host(Recorder()), checkpoint=runs / "foreign")
    return runs


def test_a_batch_reports_each_run_as_its_signed_envelope_says_and_fails_one_it_cannot_verify(tmp_path, monkeypatch):
    """A run dead or interrupted is `pending` (the next pass resumes it); one that is not a
    checkpoint, or not signed with this user's key, is `failed` with why: never reported as a result."""
    store = FileStore(runs_of_every_kind(tmp_path, monkeypatch))
    assert [outcome(store, run) for run in ("done", "halted", "suspended", "interrupted")] == [
        Outcome("done", "done", None, "y", SPENT),
        Outcome("halted", "halted", "gate-fail", None, {"input_tokens": 3, "output_tokens": 4, "cost_usd": 0.0}),
        Outcome("suspended", "suspended", "cost-exhausted", None, NOTHING_SPENT),
        Outcome("interrupted", "pending", None, None, NOTHING_SPENT),
    ]
    assert [outcome(store, run) for run in ("dead", "resuming", "missing", "junk", "foreign")] == [
        Outcome("dead", "pending", None, None, NOTHING_SPENT),
        Outcome("resuming", "pending", None, None, NOTHING_SPENT),
        Outcome("missing", "pending"),
        Outcome("junk", "failed", f"junk: {NOT_JSON}"),
        Outcome("foreign", "failed", "foreign: the checkpoint is signed with another checkpoint key"),
    ]


def test_a_run_kept_for_its_status_is_told_each_status_that_would_have_it_removed(tmp_path, monkeypatch):
    runs = runs_of_every_kind(tmp_path, monkeypatch)
    kept = remove_run(locate(runs / "done"), unfinished=True, statuses=("suspended", "running"))
    assert kept == Removal(str(runs / "done"), False, "done", f"{runs / 'done'}: done, not suspended or running")
    assert (runs / "done").exists()


def test_runs_rm_keeps_each_run_it_may_not_remove_saying_what_it_is_and_why(tmp_path, monkeypatch):
    """What `mklang runs rm` and `runs prune` report of each run (`--json` prints these records):
    decided under the run's lock from its signed envelope."""
    runs = runs_of_every_kind(tmp_path, monkeypatch)
    assert not (runs / "halted.lock").exists()  # a run that ended leaves no lock file
    (runs / "halted.lock").symlink_to(tmp_path / "elsewhere.lock")  # a lock file is never opened through a link
    held = locate(runs / "done").store.lock("done")
    try:
        busy = remove_run(locate(runs / "done"), unfinished=True)
    finally:
        held.release()
    assert busy == Removal(
        str(runs / "done"),
        False,
        "running",
        f"{runs / 'done'}: the run is still going in process {os.getpid()}; "
        "wait for it, or stop it (Ctrl-C suspends it) before resuming",
    )
    where = {run: str(runs / run) for run in ("done", "halted", "missing", "junk", "foreign", "suspended", "resuming")}
    assert remove_run(locate(runs / "done"), statuses=("halted",)) == Removal(
        where["done"], False, "done", f"{where['done']}: done, not halted"
    )
    assert [remove_run(locate(runs / run)) for run in where] == [
        Removal(where["done"], True, "done"),
        Removal(
            where["halted"],
            False,
            None,
            f"{where['halted']}: cannot lock the checkpoint: Too many levels of symbolic links",
        ),
        Removal(where["missing"], False, None, f"{where['missing']}: no such run"),
        Removal(where["junk"], False, None, f"{where['junk']}: {NOT_JSON}: not removed"),
        Removal(
            where["foreign"],
            False,
            None,
            f"{where['foreign']}: not finished (signed with another checkpoint key): --unfinished removes it",
        ),
        Removal(
            where["suspended"],
            False,
            "suspended",
            f"{where['suspended']}: not finished (suspended): --unfinished removes it",
        ),
        Removal(
            where["resuming"], False, "running", f"{where['resuming']}: not finished (running): --unfinished removes it"
        ),
    ]
    assert remove_run(locate(runs / "foreign"), unfinished=True) == Removal(where["foreign"], True, None)
    assert FileStore(runs).runs() == ["dead", "halted", "interrupted", "resuming", "suspended"]
    assert (runs / "junk").read_bytes() == b"not a checkpoint"


@pytest.mark.parametrize("read_as", ["signed", "signed elsewhere", "edited"])
def test_a_journal_torn_at_its_end_is_replayed_up_to_the_tear_and_the_user_is_told(tmp_path, monkeypatch, read_as):
    """What a crash mid-write leaves: the lines before the tear are replayed and `mklang resume` says
    what runs again, whether the journal is checked against its MACs or read as untrusted data."""
    path = dead(tmp_path, at_top=1)
    journal = Path(f"{path}.journal")
    whole = journal.read_bytes()
    if read_as == "edited":
        whole = whole.replace(b'"text":"one"', b'"text":"edited"')  # the paid answer
    if read_as == "signed elsewhere":
        monkeypatch.setenv("MKLANG_CHECKPOINT_KEY", "another user's checkpoint key, 32 bytes or more")
    journal.write_bytes(whole + b'{"k":"st')
    complete = len(whole.splitlines())
    opened = open_run(path, lock=False, trust=read_as != "signed")
    assert (opened.crashed, opened.trusted) == (True, read_as == "signed")
    assert opened.notes == [
        f"{path}: the journal ends in 1 incomplete or unreadable line(s) after line {complete} "
        "(a crash mid-write, or a truncated copy): what they recorded runs again, paid calls included"
    ]


# --- resume: verify, then continue (what `mklang test` runs a scenario's resumes through) ----------


def test_resume_refuses_what_open_run_refuses_unless_told_and_writes_where_it_is_told(tmp_path, monkeypatch):
    def host() -> Host:
        return Host(Recorder({"produce": ["again"]}))

    def refused(path: Path, **options: Any) -> str:
        with pytest.raises(CheckpointError) as caught:
            resume(path, host(), budget=5, **options)
        return str(caught.value)

    path = suspended(tmp_path / "plain")
    assert refused(load(path)) == "resuming an Envelope needs checkpoint=PATH to persist the run to"
    copy = tmp_path / "plain" / "copy.json"
    shutil.copy(path, copy)
    before = path.read_bytes()
    elsewhere = resume(path, host(), budget=5, checkpoint=tmp_path / "plain" / "other.json")
    assert (elsewhere.status, load(tmp_path / "plain" / "other.json").status) == ("done", "done")
    assert path.read_bytes() == before  # the run went on at the checkpoint given
    assert refused(copy).endswith("resume with --allow-rollback to run it anyway")
    assert resume(copy, host(), budget=5, allow_rollback=True).status == "done"

    path = suspended(tmp_path / "edited")
    root = tmp_path / "edited" / "project" / "root.mk"
    shutil.copytree(root.parent, tmp_path / "edited" / "moved")
    root.write_text(root.read_text() + "# edited\n")
    assert (
        refused(path)
        == f"{root}: machine file changed since the checkpoint was written (to move the parked run to it once it is checked compatible: resume with --machine FILE --migrate; "
        "to accept the change unchecked: resume with --force)"
    )
    moved = resume(path, host(), budget=5, machine_path=str(tmp_path / "edited" / "moved" / "root.mk"))
    assert (moved.status, moved.result) == ("done", "again")
    path = suspended(tmp_path / "forced")
    root = tmp_path / "forced" / "project" / "root.mk"
    root.write_text(root.read_text() + "# edited\n")
    assert resume(path, host(), budget=5, force=True).status == "done"

    monkeypatch.setenv("MKLANG_CHECKPOINT_KEY", "another user's checkpoint key, 32 bytes or more")
    path = suspended(tmp_path / "foreign")
    monkeypatch.delenv("MKLANG_CHECKPOINT_KEY")
    assert refused(path).startswith(
        f"{path}: the checkpoint is signed with another checkpoint key; resume it with --trust"
    )


# --- what a checkpoint location holds before a run is started there, and what opening one tells -----


def test_a_run_is_started_over_a_finished_run_but_not_over_an_unfinished_one_or_other_bytes(tmp_path):
    machine = project(tmp_path / "project", root_budget=5)
    folder = tmp_path / "my runs"
    folder.mkdir()
    parked = suspended(tmp_path)
    shutil.copy(parked, folder / "cp.json")
    (folder / "junk").write_bytes(b"not a checkpoint")

    def host() -> Host:
        return Host(Recorder({"produce": ["x", "y", "z"]}))

    def refused(path: Path) -> str:
        with pytest.raises(CheckpointError) as caught:
            start(machine, None, host(), checkpoint=path)
        return str(caught.value)

    assert refused(folder / "cp.json") == (
        f"{folder / 'cp.json'}: a run that is not finished is there (suspended (budget-exhausted)); continue it "
        f"with `mklang resume '{folder / 'cp.json'}'`, or start over with --replace"
    )
    assert refused(folder / "junk") == (
        f"{folder / 'junk'}: the checkpoint is not valid JSON (truncated or corrupted?): Expecting value: line 1 "
        "column 1 (char 0); it is not replaced: name another checkpoint, or give --replace"
    )
    for name in ("cp.json", "junk"):
        assert start(machine, None, host(), checkpoint=folder / name, replace=True).status == "done"
    finished = load(folder / "cp.json").run_id
    again = start(machine, None, host(), checkpoint=folder / "cp.json")  # a finished run is replaced as it is
    assert again.status == "done" and load(folder / "cp.json").run_id != finished
    with pytest.raises(UsageError) as caught:
        start(machine, None, host(), replace=True)
    assert str(caught.value) == "replace=True replaces the run at a checkpoint: it needs checkpoint="


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (
            lambda document: document["usage"].update(input_tokens=-1),
            "ValueError: usage input_tokens is -1, not a count from 0 to 1,000,000,000,000,000",
        ),
        (
            lambda document: document.update(answers={"r:1.0.1": {"kind": "produce", "v": 5}}),
            "TypeError: 'int' object is not subscriptable",
        ),
    ],
    ids=["spend", "paid answer"],
)
def test_a_checkpoint_whose_spend_or_paid_answer_is_malformed_is_refused_in_one_line(tmp_path, change, problem):
    """Budgets stop a run by what it spent: a spend that is not a count would let it run on."""
    path = suspended(tmp_path)
    edit(path, change)
    assert refusal(path) == f"{path}: malformed spend: {problem}"


def test_an_untrusted_checkpoint_runs_at_most_its_machines_step_budget_and_is_told_why(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MKLANG_CHECKPOINT_KEY", "another user's checkpoint key, 32 bytes or more")
    path, within = suspended(tmp_path), suspended(tmp_path / "within")  # both at the machine's step budget 1
    edit(path, lambda document: document["frames"][0].update(budget=1000))
    monkeypatch.delenv("MKLANG_CHECKPOINT_KEY")
    with opened(within, trust=True) as resumable:
        assert (resumable.trusted, resumable.chain[0].budget, resumable.notes) == (False, 1, [])
    with opened(path, trust=True) as resumable:
        assert (resumable.trusted, resumable.chain[0].budget) == (False, 1)
    assert capsys.readouterr().err.splitlines() == [
        "mklang: note: the checkpoint is not signed with your key: ignored its step budget 1000 for root "
        "(at most the machine's 1; --budget N)"
    ]


def test_a_reply_set_on_the_object_holding_the_awaited_answer_answers_it(tmp_path):
    """A reply setting the object that holds the awaited answer (`approval` for `approval.answer`) answers it."""
    (scenario,) = [s for s in load_script(HITL / "approval" / "scenarios.yaml") if s.name == "ask-then-publish"]
    path = tmp_path / "cp.json"
    with Host.for_scenario(scenario) as host:
        parked = start(load_file(HITL / "approval" / "approval.mk"), {}, host, checkpoint=path, hitl=True)
    assert (parked.status, parked.reason, parked.reply_to) == ("suspended", "escalated", "approval.answer")
    with Host.for_scenario(scenario) as host:
        done = proceed(open_run(path), host, reply={"approval": {"answer": "yes"}})
    assert (done.status, done.context["approval"]) == ("done", {"answer": "yes"})


def test_a_resume_into_another_checkpoint_replaces_no_unfinished_run_there_unless_told(tmp_path):
    """No run is silently replaced: a resume written to another checkpoint is refused where a run
    not finished is (one suspended, one that died mid-way), as a new run is, unless `replace`."""
    parked = suspended(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    occupied = suspended(other)  # suspended (budget-exhausted)
    died = tmp_path / "died.json"

    def crashed_at(event: Any) -> None:
        raise Crash

    with pytest.raises(Crash):  # killed at its first loop-top: the run is left running
        start(project(tmp_path / "project"), None, Host(Recorder()), checkpoint=died, observer=LoopTops(crashed_at))
    for target, state in ((occupied, "suspended (budget-exhausted)"), (died, "running")):
        with pytest.raises(CheckpointError) as caught:
            proceed(open_run(parked), Host(Recorder({"produce": ["two", "three"]})), budget=5, checkpoint=target)
        assert str(caught.value) == (
            f"{target}: a run that is not finished is there ({state}); continue it with "
            f"`mklang resume {target}`, or start over with --replace"
        )
    done = proceed(
        open_run(parked), Host(Recorder({"produce": ["two", "three"]})), budget=5, checkpoint=occupied, replace=True
    )
    assert done.status == "done" and load(occupied).status == "done"


def test_a_resume_records_the_untrusted_flow_policy_given_and_keeps_the_recorded_one_when_none_is(tmp_path):
    path = suspended(tmp_path, untrusted_flow="halt")
    assert load(path).untrusted_flow == "halt"
    assert proceed(open_run(path), Host(Recorder({"produce": ["two", "three"]})), budget=5).status == "done"
    assert load(path).untrusted_flow == "halt"
    (tmp_path / "told").mkdir()
    other = suspended(tmp_path / "told", untrusted_flow="halt")
    told = proceed(open_run(other), Host(Recorder({"produce": ["two", "three"]})), budget=5, untrusted_flow="report")
    assert told.status == "done" and load(other).untrusted_flow == "report"


def test_an_old_envelope_put_back_in_a_database_is_refused_by_the_generation_the_store_keeps(tmp_path, monkeypatch):
    """On a store shared by machines, the generation the database records refuses a restored older
    envelope where this machine has never seen the run."""
    import sqlite3

    database = tmp_path / "runs.db"
    path = f"sqlite:///{database}#r"
    machine = project(tmp_path / "project", 1, 3)
    assert start(machine, None, Host(Recorder({"produce": ["one"]})), checkpoint=path).status == "suspended"
    with sqlite3.connect(database) as db:
        [(old,)] = db.execute("SELECT envelope FROM mklang_runs WHERE run = 'r'").fetchall()
    assert proceed(open_run(path), Host(Recorder({"produce": ["two", "three"]})), budget=5).status == "done"
    with sqlite3.connect(database) as db:
        db.execute("UPDATE mklang_runs SET envelope = ? WHERE run = 'r'", (old,))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "another-machine"))
    assert "is older than generation" in refusal(path)


def test_a_resume_checks_only_the_machines_its_checkpoint_cannot_vouch_for(tmp_path, monkeypatch):
    """The hashes and the frames are checked on every resume; the static checks are not run again on a
    machine file a signed checkpoint of this version found unchanged: it passed them when the run
    started. A file not hashed yet, a `force`d resume and an untrusted checkpoint are checked."""
    import mklang.checker

    shutil.copytree(EXAMPLES / "nested", tmp_path / "nested")
    machine = load_file(tmp_path / "nested" / "brief.mk")
    scenario = load_script(tmp_path / "nested" / "scenarios.yaml")[0]
    checked: list[str] = []
    check = mklang.checker.check
    monkeypatch.setattr(mklang.checker, "check", lambda m, *a, **k: checked.append(m.name) or check(m, *a, **k))
    path = tmp_path / "cp.json"
    assert start(machine, {}, Host.for_scenario(scenario), checkpoint=path, max_tokens=5).status == "suspended"
    assert checked == ["section", "fact_check"]  # the root was checked as it was loaded
    assert sorted(load(path).machines) == ["brief.mk", "section.mk"]  # fact_check.mk is not entered yet
    for copy, options, expected in (
        ("trusted", {}, ["fact_check"]),
        ("forced", {"force": True}, ["section", "fact_check"]),
        ("untrusted", {"trust": True}, ["section", "fact_check"]),
    ):
        shutil.copy(path, tmp_path / f"{copy}.json")
        checked.clear()
        again = {"allow_rollback": True}  # each copy repeats the same run
        with monkeypatch.context() as key:
            if copy == "untrusted":
                key.setenv("MKLANG_CHECKPOINT_KEY", "another user's checkpoint key, 32 bytes or more")
            resumed = resume(
                tmp_path / f"{copy}.json", Host.for_scenario(scenario), max_tokens=10**6, **again, **options
            )
        assert (resumed.status, checked) == ("done", expected), copy
    (tmp_path / "nested" / "section.mk").write_text("mklang 0.4\nnot a machine\n", encoding="utf-8")
    with pytest.raises(CheckpointError, match=r"section\.mk: machine file changed since the checkpoint was written"):
        resume(path, Host.for_scenario(scenario), allow_rollback=True)  # what the checks would find, the hash finds
