"""Checkpoint files on disk: never torn, journals that lose only a torn line, a current schema.

- Writers of large envelopes are killed with SIGKILL at random moments;
  every checkpoint file that survives loads and holds one whole version.
- A journal cut at any byte offset reads back as its complete lines.
- docs/checkpoint.schema.json is what scripts/write_schema.py writes, and
  real checkpoints validate against it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jsonschema
import pytest
from support import ROOT
from support.checkpoints import frame_record
from support.files import journal_path

from mklang.checkpoint.envelope import Envelope, MachineRef, load
from mklang.checkpoint.journal import StoreJournal, read_journal
from mklang.engine.frame import Frame
from mklang.errors import CheckpointError
from mklang.providers.base import Produced, Usage, Verdict
from mklang.stores import locate
from mklang.syntax import parse

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


def _reap(pid: int) -> int:
    """Wait for a killed writer to be gone (the factory reaps it)."""
    for _ in range(2000):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        time.sleep(0.001)
    raise AssertionError(f"writer {pid} survived SIGKILL")


def _wait_for(path: Path) -> None:
    for _ in range(10_000):
        if path.exists():
            return
        time.sleep(0.001)
    raise AssertionError(f"no writer wrote {path}")


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
                _wait_for(folder / "cp.json")
            time.sleep(rng.uniform(0.0, 0.08))
            os.kill(pid, signal.SIGKILL)
            _reap(pid)
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
    envelope = Envelope(
        mklang_version="test",
        run_id="r",
        status="running",
        machine=MachineRef(name="tiny", path=None, sha256=None),
        frames=[],
    )
    journal = StoreJournal(locate(checkpoint), envelope)
    journal.snapshot([Frame.start(MACHINE)], status="running")
    journal.enter(1, Frame.start(MACHINE, {"x": 1}))
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


def test_the_committed_schema_is_current():
    done = subprocess.run(
        [sys.executable, "scripts/write_schema.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    schema = json.loads((ROOT / "docs" / "checkpoint.schema.json").read_text(encoding="utf-8"))
    assert schema["title"] == "Envelope"
    assert set(Envelope.model_fields) == set(schema["properties"])


def test_a_real_checkpoint_validates_against_the_schema(tmp_path):
    schema = json.loads((ROOT / "docs" / "checkpoint.schema.json").read_text(encoding="utf-8"))
    example = ROOT / "examples" / "approval"
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
    assert set(frame_schema["properties"]) - written == {"branches"}  # only while a fan-out is cut
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
