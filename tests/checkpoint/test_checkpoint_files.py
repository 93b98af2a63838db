"""Checkpoint files on disk: never torn, journals that lose only a torn line, a current schema.

- Writers of large envelopes are killed with SIGKILL at random moments and mid-write;
  every checkpoint file that survives loads and holds one whole version.
- A journal cut at any byte offset reads back as its complete lines.
- docs/checkpoint.schema.json is what scripts/write_schema.py writes, and
  real checkpoints validate against it.
"""

from __future__ import annotations

import json
import os
import random
import runpy
import signal
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from conformance.harness import Recorder, write_machines
from support import ROOT
from support.checkpoints import blank_envelope, frame_record
from support.crashes import dead_run
from support.examples import HITL
from support.files import FsyncSpy, holder, journal_path, uncommitted, write_atomic
from support.journals import run_journal
from support.runs import JUDGED_TWO_STATES, LoopTops

from mklang.checkpoint.envelope import MIGRATIONS, Envelope, dump, load, save
from mklang.checkpoint.journal import read_journal
from mklang.engine.frame import Frame
from mklang.errors import CheckpointError
from mklang.providers.base import Produced, Usage, Verdict
from mklang.runs import start
from mklang.scenarios import load_script
from mklang.session import Host
from mklang.stores import locate
from mklang.syntax import load_file, parse

KILLS = 40
PAD = 2_000_000  # bytes per envelope: a write takes long enough to be cut

# A writer factory: it imports the envelope module once, then forks one
# writer per line read from stdin (a folder) and prints its pid. Each writer
# rewrites <folder>/cp.json with `write_atomic` forever, version after
# version; every version carries its number and a pad whose length depends on
# it, so a half-written file cannot pass for a whole one.
FACTORY = textwrap.dedent(f"""
    import os, signal, sys
    from mklang.checkpoint.envelope import Envelope, MachineRef
    from mklang.files import write_atomic

    def write_forever(folder):
        version = 0
        while True:
            version += 1
            envelope = Envelope(mklang_version="test", run_id=str(version), status="running",
                                machine=MachineRef(name="m", path=None, sha256=None),
                                frames=[], result="x" * ({PAD} + version % 1000))
            write_atomic(os.path.join(folder, "cp.json"), envelope.model_dump_json().encode())

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # killed writers are reaped at once
    for line in sys.stdin:
        pid = os.fork()
        if pid == 0:
            write_forever(line.strip())
        print(pid, flush=True)
""")


def _wait_until(done: Callable[[], bool], what: str) -> None:
    """Poll `done`, however slow the machine is, for at most 30 s."""
    deadline = time.monotonic() + 30
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.0002)


def _gone(pid: int) -> bool:
    """Whether a killed writer is gone (the factory reaps it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _writing(folder: Path) -> bool:
    """Whether a writer is in the middle of a write: its temp file is there."""
    return any(path.name != "cp.json" for path in folder.iterdir())


def test_writers_killed_at_random_moments_never_leave_a_torn_checkpoint(tmp_path):
    rng = random.Random(7)
    factory = subprocess.Popen(
        [sys.executable, "-c", FACTORY], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    found, leftovers = 0, 0
    try:
        for kill in range(KILLS):
            folder = tmp_path / f"w{kill}"
            folder.mkdir()
            factory.stdin.write(f"{folder}\n")
            factory.stdin.flush()
            pid = int(factory.stdout.readline())
            if kill % 2:  # after a first whole version, however slow the machine is
                _wait_until((folder / "cp.json").exists, f"a writer wrote {folder / 'cp.json'}")
            if kill % 4 == 3:  # while a later version is being written, however fast the writes are
                _wait_until(partial(_writing, folder), f"a writer was seen writing in {folder}")
            else:
                time.sleep(rng.uniform(0.0, 0.08))
            os.kill(pid, signal.SIGKILL)
            _wait_until(partial(_gone, pid), f"writer {pid} was gone after SIGKILL")
            checkpoint = folder / "cp.json"
            temps = [p.name for p in folder.iterdir() if p.name != "cp.json"]
            # Leftover temp files are hidden and never look like a checkpoint.
            assert all(name.startswith(".cp.json.") and name.endswith(".tmp") for name in temps), temps
            assert sorted(folder.glob("*.json")) in ([], [checkpoint])
            leftovers += bool(temps)
            if checkpoint.exists():
                found += 1
                envelope = load(checkpoint)  # raises on a torn file
                version = int(envelope.run_id)
                assert len(envelope.result) == PAD + version % 1000
                assert stat.S_IMODE(checkpoint.stat().st_mode) == 0o600
    finally:
        factory.stdin.close()
        factory.wait(timeout=10)
    # The kills must have hit both moments: with a whole file present, and mid-write.
    assert found >= KILLS // 2, f"only {found} of {KILLS} kills found a whole checkpoint"
    assert leftovers >= 1, "no kill landed in the middle of a write"


MACHINE = parse(
    textwrap.dedent("""\
    machine tiny
    entry a
    budget 3
    state a {
      structure "s"
      prompt "p"
      output out
      otherwise -> END
    }
""")
)


def _real_journal(tmp_path: Path) -> tuple[Path, bytes, int]:
    """A journal written to the file store: a generation, a nested level, and completed calls."""
    checkpoint = tmp_path / "cp.json"
    journal, frame = run_journal(tmp_path)
    journal.snapshot([frame], status="running")
    journal.enter(1, Frame.start(frame.machine, {"x": 1}))
    journal.record("r/1/0", "produce", Produced("déjà vu ✓", None, Usage(3, 2)))
    journal.record("r/1/1", "judge", Verdict(0, Usage(1, 1), "strict"))
    journal.record("r/1/2", "tool", "naïve — ünïcode ✓ " * 5)
    journal.store.close()
    return checkpoint, journal_path(checkpoint).read_bytes(), journal.envelope.generation


def test_a_journal_cut_at_any_byte_reads_back_as_its_complete_lines(tmp_path):
    checkpoint, full, generation = _real_journal(tmp_path)
    lines = full.split(b"\n")[:-1]
    assert len(lines) == 5 and lines[0].startswith(b'{"k":"gen"')
    records = [json.loads(line) for line in lines[1:]]
    assert read_journal(locate(checkpoint), generation) == records
    assert "✓".encode() in lines[-1]  # the last line is cut inside multi-byte characters too
    path = journal_path(checkpoint)
    uncommitted(checkpoint)
    ends = [len(b"\n".join(lines[: n + 1])) + 1 for n in range(len(lines))]  # offsets after each newline
    for offset in range(len(full) + 1):
        path.write_bytes(full[:offset])
        whole = sum(1 for end in ends if end <= offset)  # complete lines, the generation line included
        expected = records[: whole - 1] if whole else []
        assert read_journal(locate(checkpoint), generation) == expected, f"cut at byte {offset} of {len(full)}"


def test_a_journal_of_another_generation_is_ignored(tmp_path):
    checkpoint, _full, generation = _real_journal(tmp_path)
    assert read_journal(locate(checkpoint), generation) != []
    assert read_journal(locate(checkpoint), generation + 1) == []
    journal_path(checkpoint).unlink()
    assert read_journal(locate(checkpoint), generation) == []


def test_the_journal_is_owner_only(tmp_path):
    checkpoint, _, _ = _real_journal(tmp_path)
    assert stat.S_IMODE(journal_path(checkpoint).stat().st_mode) == 0o600
    assert stat.S_IMODE(checkpoint.stat().st_mode) == 0o600


def test_the_committed_schema_is_current(monkeypatch, capsys):
    """The script run in this process (as `python scripts/write_schema.py --check` runs it): its exit code."""
    monkeypatch.setattr(sys, "argv", ["scripts/write_schema.py", "--check"])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(ROOT / "scripts" / "write_schema.py"), run_name="__main__")
    assert done.value.code == 0, capsys.readouterr().err
    schema = json.loads((ROOT / "docs" / "checkpoint.schema.json").read_text(encoding="utf-8"))
    assert schema["title"] == "Envelope"
    assert set(Envelope.model_fields) == set(schema["properties"])


def test_a_real_checkpoint_validates_against_the_schema(tmp_path):
    schema = json.loads((ROOT / "docs" / "checkpoint.schema.json").read_text(encoding="utf-8"))
    example = HITL / "approval"
    checkpoint = tmp_path / "cp.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mklang",
            "run",
            str(example / "approval.mk"),
            "--script",
            str(example / "scenarios.yaml"),
            "--scenario",
            "ask-then-publish",
            "--hitl",
            "--checkpoint",
            str(checkpoint),
            "--format",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 3, done.stderr
    document = json.loads(checkpoint.read_text(encoding="utf-8"))
    jsonschema.validate(document, schema)
    document["status"] = "paused"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(document, schema)


def test_frames_are_typed_in_the_schema_and_on_load(tmp_path):
    schema = json.loads((ROOT / "docs" / "checkpoint.schema.json").read_text(encoding="utf-8"))
    assert schema["properties"]["frames"]["items"] == {"$ref": "#/$defs/FrameRecord"}
    frame_schema = schema["$defs"]["FrameRecord"]
    assert frame_schema["additionalProperties"] is False
    written = set(Frame.start(MACHINE).to_json())
    assert set(frame_schema["required"]) <= written <= set(frame_schema["properties"])
    # branches only while a fan-out is cut; segments once a checkpoint sealed part of the trace
    assert set(frame_schema["properties"]) - written == {"branches", "segments"}
    checkpoint = tmp_path / "cp.json"
    document = {
        "format": 1,
        "mklang_version": "test",
        "run_id": "r",
        "status": "suspended",
        "machine": {"name": "tiny", "path": None, "sha256": None},
        "frames": [{**Frame.start(MACHINE).to_json(), "surprise": 1}],
    }
    checkpoint.write_text(json.dumps(document))
    with pytest.raises(CheckpointError, match=r"cp.json: not a valid mklang checkpoint: frames.0.surprise"):
        load(checkpoint)


# --- format 1 -> 2: machine files named relative to the root machine's folder ---


def test_a_format_1_checkpoint_names_its_machine_files_relative_to_the_root_on_load(tmp_path):
    from mklang.checkpoint.envelope import migrate

    project = tmp_path / "project"
    root = str(project / "main.mk")
    frame = frame_record("main", "a", 0, 5)
    document = {
        "format": 1,
        "machine": {"name": "main", "path": root, "sha256": None},
        "machines": {root: "h1", str(project / "lib" / "sub.mk"): "h2", str(tmp_path / "other.mk"): "h3"},
        "frames": [
            {**frame, "path": str(project / "lib" / "sub.mk")},
            {**frame, "path": None},
            {**frame, "path": "already/relative.mk"},
            "not a frame",
        ],
    }
    migrated = migrate(json.loads(json.dumps(document)))
    assert migrated == {
        **document,
        "format": 2,
        "machines": {"main.mk": "h1", "lib/sub.mk": "h2", "../other.mk": "h3"},
        "frames": [
            {**frame, "path": "lib/sub.mk"},
            {**frame, "path": None},
            {**frame, "path": "already/relative.mk"},
            "not a frame",
        ],
    }  # the root keeps its absolute path: a valid name relative to the checkpoint's folder too
    path = tmp_path / "cp.json"
    path.write_text(
        json.dumps(
            {**document, "frames": document["frames"][:3], "mklang_version": "0", "run_id": "r", "status": "done"}
        )
    )
    loaded = load(path)
    assert (loaded.format, loaded.machines, [f["path"] for f in loaded.frames]) == (
        2,
        {"main.mk": "h1", "lib/sub.mk": "h2", "../other.mk": "h3"},
        ["lib/sub.mk", None, "already/relative.mk"],
    )


@pytest.mark.parametrize(
    "machine", [{"name": "m", "path": "main.mk", "sha256": None}, {"name": "m", "path": None}, "not a map", None]
)
def test_a_format_1_checkpoint_without_an_absolute_root_only_changes_format(machine):
    from mklang.checkpoint.envelope import migrate

    document = {"format": 1, "machine": machine, "machines": {"/abs/x.mk": "h"}, "frames": [{"path": "/abs/x.mk"}]}
    if machine is None:
        del document["machine"]
    assert migrate(dict(document)) == {**document, "format": 2}


def test_a_format_1_checkpoint_with_odd_machines_or_frames_keeps_them(tmp_path):
    from mklang.checkpoint.envelope import migrate

    root = str(tmp_path / "main.mk")
    for odd in ("text", None, 3):
        document = {"format": 1, "machine": {"path": root}, "machines": odd, "frames": odd}
        assert migrate(dict(document)) == {**document, "format": 2}


# --- what a checkpointed run writes: its settings, then how it ended -----------------

ENDS = """
    machine m
    entry a
    budget 5
    tool risky "fails"
    context {{ topic: "tides" }}
    state a {{
      structure "s"
      prompt "{{{{topic}}}} {{{{extra}}}}"
      output x
      otherwise -> b
    }}
    state b {{
      {b}
      output y
      otherwise -> END
    }}
"""


def test_a_checkpointed_run_records_its_settings_and_how_it_ended(tmp_path):

    machine = write_machines(tmp_path, ENDS.format(b='structure "s"\n      prompt "p"'))
    path = tmp_path / "cp.json"
    snapshots: list[Envelope] = []
    result = start(
        machine,
        {"extra": "more"},
        Host(
            Recorder({"produce": ["one", "two"], "tokens": [2, 1]}),
            tools={"risky": lambda arguments: None},
            settings={"model": "m1"},
        ),
        checkpoint=path,
        max_tokens=500,
        max_cost=2.5,
        max_time=60,
        concurrency=3,
        hitl=True,
        observer=LoopTops(lambda event: snapshots.append(load(path))),
    )
    assert result.status == "done"
    first = snapshots[0]
    assert (first.status, first.machine.path, first.machine.sha256 is not None) == ("running", "m.mk", True)
    assert (first.budgets.max_tokens, first.budgets.max_cost, first.budgets.max_time) == (500, 2.5, 60)
    assert (first.concurrency, first.hitl, first.host.model) == (3, True, "m1")
    assert first.frames[0]["context"] == {"topic": "tides", "extra": "more"}
    done = load(path)
    assert (done.status, done.result, done.error, done.at) == ("done", "two", None, None)
    assert done.usage == {"input_tokens": 4, "output_tokens": 2, "cost_usd": 0.0}


def test_a_checkpointed_run_records_the_halt_and_the_question_it_ended_on(tmp_path):
    def risky(arguments: dict[str, Any]) -> Any:
        raise RuntimeError("exploded")

    machine = write_machines(tmp_path, ENDS.format(b='tool risky { q: "{{x}}" }'))
    path = tmp_path / "halted.json"
    start(machine, {"extra": ""}, Host(Recorder(), tools={"risky": risky}), checkpoint=path)
    halted = load(path)
    assert (halted.status, halted.error, halted.at, halted.result) == (
        "halted",
        "state-error: tool risky: exploded",
        "b",
        None,
    )
    (tmp_path / "asking").mkdir()
    asking = write_machines(
        tmp_path / "asking",
        ENDS.format(b='structure "s"\n      prompt "p"').replace(
            "otherwise -> b", 'otherwise escalate -> b ask "Go on?" reply_to go'
        ),
    )
    path = tmp_path / "suspended.json"
    start(asking, {"extra": ""}, Host(Recorder(), tools={"risky": risky}), checkpoint=path, hitl=True)
    suspended = load(path)
    assert (suspended.status, suspended.reason, suspended.at, suspended.ask, suspended.reply_to) == (
        "suspended",
        "escalated",
        "b",
        "Go on?",
        "go",
    )


def test_an_edited_journal_of_a_signed_run_is_refused_unless_trusted_then_read_as_untrusted(tmp_path):
    from mklang.runs import open_run

    path = dead_run(tmp_path, "triage", "triage.mk", 2)
    journal = journal_path(path)
    lines = journal.read_bytes().splitlines(keepends=True)
    lines[1] = lines[1].replace(b'"billing"', b'"refunds"', 1)  # a paid answer, edited
    journal.write_bytes(b"".join(lines))
    with pytest.raises(CheckpointError) as caught:
        open_run(path, lock=False)
    assert str(caught.value) == (
        f"{path}: journal line 2 was edited after it was signed (resume with --trust to use it as untrusted data)"
    )
    assert open_run(path, lock=False, trust=True).trusted is False


def test_a_resume_may_write_to_another_checkpoint_and_leaves_the_first_as_it_was(tmp_path):
    import shutil

    from mklang.runs import resume as resume_run
    from mklang.runs import start as start_run
    from mklang.session import Host

    shutil.copytree(HITL / "approval", tmp_path / "approval")
    scenario = next(s for s in load_script(tmp_path / "approval" / "scenarios.yaml") if s.name == "ask-then-publish")
    path, other = tmp_path / "cp.json", tmp_path / "other.json"
    start_run(load_file(tmp_path / "approval" / "approval.mk"), None, Host.for_scenario(scenario), checkpoint=path)
    before = path.read_bytes()
    done = resume_run(path, Host.for_scenario(scenario), reply={"approval.answer": "yes"}, checkpoint=other)
    assert (done.status, load(other).status) == ("done", "done")
    assert path.read_bytes() == before
    assert holder(path) is None  # the lock is released when the run ends


# --- the envelope file: owner-only, compact UTF-8, strict JSON, no leftovers ---


def test_a_checkpoint_file_is_owner_only_compact_utf8_and_strict_json(tmp_path):
    target = tmp_path / "cp.json"
    target.write_bytes(b"{}")
    target.chmod(0o644)
    save(target, blank_envelope(result={"text": "café", "ratio": float("nan"), "big": float("inf")}))
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    raw_bytes = target.read_bytes()
    assert "café".encode() in raw_bytes  # UTF-8 as is, not \\u escapes
    assert b", " not in raw_bytes and b": " not in raw_bytes  # no padding: the envelope is rewritten often

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    document = json.loads(raw_bytes, parse_constant=refuse)
    assert document["result"] == {"text": "café", "ratio": None, "big": None}


def test_a_write_that_cannot_happen_is_one_line_naming_the_file(tmp_path):
    with pytest.raises(CheckpointError) as caught:
        write_atomic(tmp_path / "missing" / "cp.json", b"{}")
    assert (
        str(caught.value)
        == f"{tmp_path / 'missing' / 'cp.json'}: cannot write the checkpoint: No such file or directory"
    )


def test_a_failed_rename_leaves_the_old_file_and_no_temp_file(tmp_path):
    target = tmp_path / "cp.json"
    target.mkdir()  # a folder where the file should go: the rename fails
    with pytest.raises(CheckpointError, match="cannot write the checkpoint: Is a directory"):
        write_atomic(target, b"new")
    assert [path.name for path in tmp_path.iterdir()] == ["cp.json"]


def test_a_temp_file_already_gone_when_the_rename_fails_reports_the_rename_error(tmp_path, monkeypatch):
    def replace_fails_after_the_temp_vanished(source: str, destination: Any) -> None:
        os.unlink(source)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", replace_fails_after_the_temp_vanished)
    with pytest.raises(CheckpointError, match=r"cannot write the checkpoint: Permission denied$"):
        write_atomic(tmp_path / "cp.json", b"new")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"run_id": "r"}, "not a mklang checkpoint (no 'format' field)"),
        ({"format": "1"}, "not a mklang checkpoint (no 'format' field)"),
        ({"format": 0}, "checkpoint format 0 is too old to migrate"),
        ({"format": 4}, "checkpoint format 4 is newer than this mklang understands (3)"),
    ],
)
def test_a_document_of_another_format_is_one_line_naming_the_file(tmp_path, document, message):
    path = tmp_path / "cp.json"
    path.write_text(json.dumps(document))
    with pytest.raises(CheckpointError) as caught:
        load(path)
    assert str(caught.value) == f"{path}: {message}"


def test_registered_migrations_upgrade_an_old_checkpoint_step_by_step_on_load(tmp_path, monkeypatch):
    current = json.loads(dump(blank_envelope(result="kept")))
    older = {**current, "format": -1, "state_of_run": current.pop("status")}
    del older["status"]

    def from_minus_one(data: dict[str, Any]) -> dict[str, Any]:
        return {**data, "format": 0}

    def from_zero(data: dict[str, Any]) -> dict[str, Any]:
        upgraded = {key: value for key, value in data.items() if key != "state_of_run"}
        return {**upgraded, "status": data["state_of_run"], "format": 1}

    monkeypatch.setitem(MIGRATIONS, -1, from_minus_one)
    monkeypatch.setitem(MIGRATIONS, 0, from_zero)
    path = tmp_path / "cp.json"
    path.write_text(json.dumps(older))
    envelope = load(path)
    assert (envelope.format, envelope.status, envelope.result) == (2, "running", "kept")


def _nested(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such checkpoint"),
        ("folder", "cannot read the checkpoint: Is a directory"),
        (b"  \n", "the checkpoint is empty"),
        (b'{"format": 1,', "the checkpoint is not valid JSON (truncated or corrupted?): "),
        (b"[1]", "not a mklang checkpoint (expected a JSON object)"),
        (b'{"format": 1, "run_id": "r"}', "not a valid mklang checkpoint: mklang_version: Field required"),
        (
            dump(blank_envelope()).replace(b'"name":"m"', b'"name":1'),
            "not a valid mklang checkpoint: machine.name: Input should be a valid string",
        ),
        (
            json.dumps({"format": 1, "frames": [_nested(3 * 64)]}).encode(),
            "the checkpoint holds values nested more than",
        ),
    ],
    # ids that stay the same in every process (a dump is signed with the process's key)
    ids=["missing", "folder", "empty", "truncated", "array", "partial", "mistyped", "too-deep"],
)
def test_every_way_a_checkpoint_is_unusable_is_one_line_naming_the_file(tmp_path, content, message):
    path = tmp_path / "cp.json"
    if content == "folder":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(CheckpointError) as caught:
        load(path)
    assert str(caught.value).startswith(f"{path}: {message}")


def test_a_checkpoint_may_nest_values_deeper_than_other_json_input(tmp_path):
    path = tmp_path / "cp.json"
    save(path, blank_envelope(result=_nested(64 + 10)))
    assert load(path).result == _nested(64 + 10)


# --- fsync: the temp file, the folder, the journal's call lines --------------


def test_an_atomic_write_fsyncs_the_whole_temp_file_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    target = tmp_path / "cp.json"
    target.write_bytes(b"old")
    spy = FsyncSpy(monkeypatch, watched=target)
    write_atomic(target, b"new payload")
    [(temp, temp_content), (folder, _)] = spy.synced
    assert Path(temp).parent == tmp_path and Path(temp).name.startswith(".cp.json.") and temp.endswith(".tmp")
    assert temp_content == b"new payload"  # flushed before the fsync, all of it
    assert folder == str(tmp_path)
    assert spy.watched_then == [b"old", b"new payload"]  # temp synced before the rename, the folder after
    assert [p.name for p in tmp_path.iterdir()] == ["cp.json"]


def test_a_journaled_call_line_is_fsynced_once_it_is_in_the_file(tmp_path, monkeypatch):
    journal, frame = run_journal(tmp_path)
    journal.snapshot([frame], status="running")
    spy = FsyncSpy(monkeypatch)
    journal.record("r:1.0#1", "produce", Produced("answer", None, Usage(3, 4)))
    journal.store.close()
    [(path, content)] = spy.synced
    assert path == str(journal_path(tmp_path / "cp.json"))
    assert content is not None
    last = json.loads(content.splitlines()[-1])
    assert (last["k"], last["key"], last["v"]["text"]) == ("call", "r:1.0#1", "answer")


def test_every_call_of_a_checkpointed_run_is_durable_before_the_run_goes_on(tmp_path, monkeypatch):
    machine = write_machines(tmp_path, JUDGED_TWO_STATES)
    spy = FsyncSpy(monkeypatch)
    journal = str(journal_path(tmp_path / "cp.json"))
    result = start(machine, {}, Host(Recorder({"produce": ["1", "2"]})), checkpoint=tmp_path / "cp.json")
    assert result.status == "done"
    durable = {
        json.loads(line)["key"]
        for path, content in spy.synced
        if path == journal and content
        for line in content.splitlines()
        if json.loads(line)["k"] == "call"
    }
    assert len(durable) == sum(result.calls.values()) == 3  # two produce calls and one judge call


# --- a running snapshot counts the spend of every level -----------------------


def test_a_running_snapshot_adds_the_spend_of_nested_levels(tmp_path):
    journal, root = run_journal(tmp_path)
    child = Frame.start(root.machine)
    root.usage = Usage(100, 20, 0.25)
    child.usage = Usage(5, 1, 0.5)
    journal.snapshot([root, child], status="running")
    journal.store.close()
    envelope = load(tmp_path / "cp.json")
    assert envelope.usage == Usage(105, 21, 0.75).to_json()
    assert [frame["usage"] for frame in envelope.frames] == [root.usage.to_json(), child.usage.to_json()]
