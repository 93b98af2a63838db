"""Trace segments (ADR 0040): a long trace is kept beside the envelope, read only when the trace is.

A run is suspended after enough steps that its trace is sealed into several
segments, then resumed to done. The resume must read no segment, the
finished envelope must refer to the segments already written, and the trace
read back through the store must equal the same run's when nothing is
sealed. Each segment is checked against the name the signed envelope gives
it: an edited, missing or swapped segment is one line naming the run, and
an envelope edited to name other segments is tampered. Removing the run
removes its segments, in every store.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import sys
from pathlib import Path

import pytest
from support.commands import cli, refused

import mklang.checkpoint.journal as journal_module
import mklang.checkpoint.segments as segments_module
from mklang.checkpoint.envelope import load, parse
from mklang.engine.trace import Segment
from mklang.errors import CheckpointError
from mklang.providers.scripted import ScriptedProvider
from mklang.runs import open_run, proceed, remove_run, resume, start
from mklang.runs.inspection import describe, run_document
from mklang.session import Host
from mklang.stores import Location, locate, open_store
from mklang.stores.file import FileStore
from mklang.syntax import load_file

STEPS = 40
LOOP = f"""
machine grow
entry write
budget {STEPS}
state write {{
  structure "a line"
  prompt "write"
  output line
  when "finished" -> END
  otherwise -> write
}}
"""


@pytest.fixture(autouse=True)
def small_segments(monkeypatch):
    """Segments of a few steps, and snapshots every few steps: a short run seals several."""
    monkeypatch.setattr(segments_module, "SEGMENT_BYTES", 1024)
    monkeypatch.setattr(journal_module, "MIN_COMPACT_BYTES", 2048)


@pytest.fixture(params=["file", "sqlite", "postgresql"])
def folder_or_uri(request, tmp_path) -> str:
    if request.param == "file":
        (tmp_path / "runs").mkdir()
        return str(tmp_path / "runs")
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/runs.db"
    return request.getfixturevalue("postgres_uri")


def _where(folder_or_uri: str, run: str) -> Location:
    return locate(f"{folder_or_uri}#{run}" if "://" in folder_or_uri else f"{folder_or_uri}/{run}")


def _suspended(where: Location, tmp_path: Path, letter: str = "x") -> Location:
    """A run of `STEPS` steps of 100-character outputs, suspended when its step budget ran out."""
    machine_file = tmp_path / "grow.mk"
    machine_file.write_text(LOOP)
    machine = load_file(machine_file)
    writing = ScriptedProvider({"produce": [letter * 100], "judge": ["none"]})
    suspended = start(machine, {}, Host(writing), checkpoint=where)
    assert (suspended.status, suspended.error) == ("suspended", "budget-exhausted")
    return where


def _finish(where: Location):
    return proceed(open_run(where), Host(ScriptedProvider({"produce": ["y"], "judge": [0]})), budget=STEPS + 1)


def _segments(where: Location) -> list[tuple[str, int]]:
    return [tuple(segment) for segment in dict(load(where).frames[0]).get("segments", [])]


def test_a_resume_reads_no_segment_and_the_finished_run_refers_to_those_written(folder_or_uri, tmp_path, monkeypatch):
    where = _suspended(_where(folder_or_uri, "long"), tmp_path)
    sealed = _segments(where)
    assert len(sealed) >= 3  # the steps since the last segment stay in the envelope
    assert len(dict(load(where).frames[0])["trace"]) == STEPS - sum(steps for _, steps in sealed)

    store_type = type(where.store)
    read = store_type.read_segment
    reads: list[str] = []
    monkeypatch.setattr(
        store_type, "read_segment", lambda store, run, name: reads.append(name) or read(store, run, name)
    )
    done = _finish(where)
    assert done.status == "done" and len(done.root_trace) == STEPS + 1
    assert reads == []  # nothing read the trace
    assert _segments(where)[: len(sealed)] == sealed
    assert done.root_trace[-1]["to"] == "END" and reads == []  # the last step is the tail's
    steps = done.trace
    assert len(steps) == STEPS + 1 and len(reads) == len(_segments(where))  # reading it reads each segment once

    # The same run with nothing sealed has the same trace, as the store gives it back.
    monkeypatch.setattr(segments_module, "SEGMENT_BYTES", 10**9)
    whole = _suspended(_where(folder_or_uri, "whole"), tmp_path)
    assert _segments(whole) == []
    assert _finish(whole).trace == steps
    assert run_document(where)["trace"] == run_document(whole)["trace"] == json.loads(json.dumps(steps))
    assert describe(where, last=3)["last_steps"] == steps[-3:]


def test_removing_a_run_removes_its_segments(folder_or_uri, tmp_path):
    where = _suspended(_where(folder_or_uri, "long"), tmp_path)
    _finish(where)
    names = [name for name, _ in _segments(where)]
    assert names and all(where.store.read_segment("long", name) is not None for name in names)
    assert remove_run(where).removed
    assert all(where.store.read_segment("long", name) is None for name in names)
    if isinstance(where.store, FileStore):
        assert not any((where.store.folder / ".mklang-segments").iterdir())


def _segment_file(where: Location, name: str) -> Path:
    assert isinstance(where.store, FileStore)
    return where.store._segments(where.run) / name


def _unreadable(where: Location, match: str) -> None:
    """Every way of reading the trace refuses in one line naming the run; the envelope itself still verifies."""
    assert load(where).seal == "signed"
    with pytest.raises(CheckpointError, match=match):
        run_document(where)
    refused(cli("show", str(where), "--format", "json"), match.split(":")[0])


def test_an_edited_segment_is_refused_when_the_trace_is_read(tmp_path):
    where = _suspended(locate(tmp_path / "cp.json"), tmp_path)
    _finish(where)
    name = _segments(where)[1][0]
    segment = _segment_file(where, name)
    segment.write_bytes(segment.read_bytes().replace(b"x" * 100, b"y" * 100, 1))
    _unreadable(where, f"cp.json: trace segment {name} was edited after it was written")


def test_a_missing_segment_is_refused_before_a_resume_runs_and_when_the_trace_is_read(tmp_path):
    where = _suspended(locate(tmp_path / "cp.json"), tmp_path)
    name = _segments(where)[0][0]
    _segment_file(where, name).unlink()
    before = (tmp_path / "cp.json").read_bytes()
    with pytest.raises(CheckpointError, match=f"cp.json: trace segment {name} is missing from the run's store"):
        _finish(where)  # the names are listed, no segment is read
    assert (tmp_path / "cp.json").read_bytes() == before
    _unreadable(where, f"cp.json: trace segment {name} is missing")


def test_a_segment_of_another_run_under_this_runs_name_is_refused(tmp_path):
    one = _suspended(locate(tmp_path / "one.json"), tmp_path)
    other = _suspended(locate(tmp_path / "other.json"), tmp_path, letter="w")
    theirs, mine = _segments(one)[-1][0], _segments(other)[-1][0]
    assert theirs != mine
    _segment_file(other, mine).write_bytes(_segment_file(one, theirs).read_bytes())
    _unreadable(other, f"other.json: trace segment {mine} was edited after it was written")


def test_an_envelope_with_segments_laid_out_anew_is_still_signed(tmp_path):
    where = _suspended(locate(tmp_path / "cp.json"), tmp_path)
    path = tmp_path / "cp.json"
    path.write_text(json.dumps(json.loads(path.read_bytes()), indent=2))
    assert _segments(where) and load(where).seal == "signed"


def test_an_envelope_edited_to_name_other_segments_is_tampered(tmp_path):
    one = _suspended(locate(tmp_path / "one.json"), tmp_path)
    other = _suspended(locate(tmp_path / "other.json"), tmp_path, letter="w")
    theirs, mine = _segments(one)[-1][0], _segments(other)[-1][0]
    path = tmp_path / "other.json"
    path.write_bytes(path.read_bytes().replace(mine.encode(), theirs.encode()))
    assert load(other).seal == "tampered"
    with pytest.raises(CheckpointError, match="edited after it was signed with your checkpoint key"):
        open_run(other)


def test_a_restored_older_envelope_with_segments_is_refused_as_a_rollback(tmp_path):
    where = _suspended(locate(tmp_path / "cp.json"), tmp_path)
    saved = (tmp_path / "cp.json").read_bytes()
    _finish(where)
    (tmp_path / "cp.json").write_bytes(saved)
    with pytest.raises(CheckpointError, match=r"is older than generation \d+ already written"):
        open_run(where)


def test_a_foreign_envelope_with_segments_is_refused_and_its_segments_checked_under_trust(tmp_path, monkeypatch):
    monkeypatch.setenv("MKLANG_CHECKPOINT_KEY", "another user's key, long enough to be one: 0123456789")
    where = _suspended(locate(tmp_path / "cp.json"), tmp_path)
    monkeypatch.delenv("MKLANG_CHECKPOINT_KEY")
    assert load(where).seal == "foreign"
    with pytest.raises(CheckpointError, match="signed with another checkpoint key; resume it with --trust"):
        open_run(where)
    name = _segments(where)[0][0]
    segment = _segment_file(where, name)
    segment.write_bytes(segment.read_bytes().replace(b"x", b"z", 1))
    host = Host(ScriptedProvider({"produce": ["y"], "judge": [0]}))
    done = resume(where, host, trust=True, budget=STEPS + 1)
    with pytest.raises(CheckpointError, match=f"trace segment {name} was edited"):
        done.trace  # noqa: B018 - reading it is what is refused


def test_a_sqlite_segment_edited_in_its_row_is_refused(tmp_path):
    where = _suspended(locate(f"sqlite:///{tmp_path}/runs.db#long"), tmp_path)
    name = _segments(where)[0][0]
    with sqlite3.connect(tmp_path / "runs.db") as db:
        db.execute("UPDATE mklang_segments SET body = CAST(REPLACE(CAST(body AS TEXT), 'xx', 'yy') AS BLOB)")
    with pytest.raises(CheckpointError, match=f"#long: trace segment {name} was edited after it was written"):
        list(open_run(where, lock=False).chain[0].trace)


class SegmentlessStore:
    """A store registered by a package written before segments: the file store without them."""

    def __init__(self, folder: Path):
        self._inner = FileStore(folder)

    def __getattr__(self, name: str):
        if name in ("write_segment", "read_segment"):
            raise AttributeError(name)
        return getattr(self._inner, name)


def test_a_store_without_segments_keeps_the_whole_trace_in_the_envelope(tmp_path):
    store = SegmentlessStore(tmp_path)
    where = Location(store, "cp.json", str(tmp_path / "cp.json"), str(tmp_path / "cp.json"), tmp_path / "cp.json")
    _suspended(where, tmp_path)
    frame = dict(load(where).frames[0])
    assert "segments" not in frame and len(frame["trace"]) == STEPS
    assert _finish(where).status == "done"
    assert not (tmp_path / ".mklang-segments").exists()


def test_segments_are_private_files_beside_the_checkpoint(tmp_path):
    where = _suspended(locate(tmp_path / "cp.json"), tmp_path)
    assert open_store(tmp_path).runs() == ["cp.json"]  # the segments' folder is no run
    for name, _ in _segments(where):
        assert os.stat(_segment_file(where, name)).st_mode & 0o077 == 0


def test_a_run_resumed_into_another_checkpoint_takes_its_segments_along(tmp_path):
    where = _suspended(locate(tmp_path / "cp.json"), tmp_path)
    moved = locate(f"sqlite:///{tmp_path}/runs.db#moved")
    host = Host(ScriptedProvider({"produce": ["y"], "judge": [0]}))
    steps = proceed(open_run(where), host, budget=STEPS + 1, checkpoint=moved).trace
    assert len(steps) == STEPS + 1
    assert remove_run(where, unfinished=True).removed  # the first checkpoint and its segments are gone
    assert _segments(moved) and run_document(moved)["trace"] == json.loads(json.dumps(steps))


def test_graph_draws_the_whole_trace_of_a_checkpoint_with_segments(tmp_path):
    where = _suspended(locate(tmp_path / "cp.json"), tmp_path)
    _finish(where)
    (tmp_path / "run.json").write_text(json.dumps(run_document(where)))
    drawn = [
        cli("graph", str(tmp_path / "grow.mk"), "--trace", str(tmp_path / name)) for name in ("cp.json", "run.json")
    ]
    assert drawn[0].returncode == 0 and drawn[0].stdout == drawn[1].stdout
    missing = _segments(where)[0][0]
    _segment_file(where, missing).unlink()
    refused(
        cli("graph", str(tmp_path / "grow.mk"), "--trace", str(tmp_path / "cp.json")),
        f"trace segment {missing} is missing",
    )


@pytest.mark.parametrize("segments", [5, [["not a pair"]], [[1, 2]], [["a" * 64, "3"]]])
def test_a_frame_whose_segments_are_not_name_and_step_pairs_is_refused_not_read_as_none(tmp_path, segments):
    location = locate(tmp_path / "cp.json")
    with pytest.raises(CheckpointError, match=r"its trace segments are not \[sha256, steps\] pairs"):
        segments_module.recorded_trace(location, {"segments": segments, "trace": []}, trusted=False)


def test_an_envelope_resumed_into_another_checkpoint_brings_the_segments_of_the_one_it_was_read_from(tmp_path):
    where = _suspended(locate(tmp_path / "cp.json"), tmp_path)
    moved = tmp_path / "moved.json"  # another run: its segments are its own
    host = Host(ScriptedProvider({"produce": ["y"], "judge": [0]}))
    steps = resume(load(where), host, checkpoint=moved, budget=STEPS + 1).trace
    assert len(steps) == STEPS + 1
    assert remove_run(where, unfinished=True).removed
    assert _segments(locate(moved)) and run_document(moved)["trace"] == json.loads(json.dumps(steps))


def test_an_envelope_read_from_no_store_is_refused_at_once_unless_the_checkpoint_holds_its_segments(tmp_path):
    where = _suspended(locate(tmp_path / "cp.json"), tmp_path)
    raw = (tmp_path / "cp.json").read_bytes()
    first = _segments(where)[0][0]
    host = Host(ScriptedProvider({"produce": ["y"], "judge": [0]}))
    moved = tmp_path / "moved.json"
    with pytest.raises(CheckpointError) as refused:
        resume(parse(raw, "given"), host, checkpoint=moved, budget=STEPS + 1)
    message = str(refused.value)
    assert "\n" not in message and not moved.exists()  # nothing ran, nothing was written
    assert message.startswith(f"{moved}: the envelope names trace segment {first}, which the store there does not hold")
    assert "copy the run's segments there first" in message and ".mklang-segments/ folder" in message
    # Where its segments are, the same envelope resumes.
    done = resume(parse(raw, "given"), host, checkpoint=where, budget=STEPS + 1)
    assert done.status == "done" and len(done.trace) == STEPS + 1


STORE_WITHOUT_SEGMENTS = '''\
from pathlib import Path

from mklang.stores.file import FileStore


class OldStore:
    """A store written before trace segments: a file store without `write_segment` and `read_segment`."""

    def __init__(self, folder):
        self._inner = FileStore(folder)

    def __getattr__(self, name):
        if name in ("write_segment", "read_segment"):
            raise AttributeError(name)
        return getattr(self._inner, name)


def open_old_store(uri, *, create):
    folder = Path(FOLDER) / uri.split("://", 1)[1]
    folder.mkdir(exist_ok=True)
    return OldStore(folder)
'''


@pytest.fixture
def old_store(tmp_path, monkeypatch):
    """An installed package registering the store scheme `old`, written before segments:
    `old://.` is a store of the test's folder."""
    site = tmp_path / "site"
    info = site / "mklang_old_store-1.0.dist-info"
    info.mkdir(parents=True)
    (site / "mklang_old_store.py").write_text(f"FOLDER = {str(tmp_path)!r}\n" + STORE_WITHOUT_SEGMENTS)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mklang-old-store\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[mklang.stores]\nold = mklang_old_store:open_old_store\n")
    monkeypatch.syspath_prepend(str(site))
    yield
    sys.modules.pop("mklang_old_store", None)


@pytest.mark.parametrize("given", ["opened", "envelope"])
def test_a_run_resumed_into_a_store_without_segments_keeps_every_step_in_its_envelope(old_store, tmp_path, given):
    where = _suspended(locate(tmp_path / "cp.json"), tmp_path)
    assert _segments(where)
    moved = locate("old://.#moved")
    assert not hasattr(moved.store, "write_segment")
    host = Host(ScriptedProvider({"produce": ["y"], "judge": [0]}))
    source = open_run(where) if given == "opened" else load(where)
    again = (proceed if given == "opened" else resume)(source, host, checkpoint=moved)
    assert (again.status, again.error) == ("suspended", "budget-exhausted")  # its envelope written there
    frame = dict(load(moved).frames[0])
    assert "segments" not in frame and frame["trace"] == json.loads(json.dumps(again.trace))
    assert len(again.trace) == STEPS
    assert remove_run(where, unfinished=True).removed  # nothing there is needed any more
    done = resume(locate("old://.#moved"), host, budget=STEPS + 1)
    assert done.status == "done" and done.trace[:STEPS] == again.trace and len(done.trace) == STEPS + 1


def test_a_segment_edited_at_the_source_is_refused_when_a_store_without_segments_takes_the_steps(old_store, tmp_path):
    where = _suspended(locate(tmp_path / "cp.json"), tmp_path)
    name = _segments(where)[0][0]
    segment = _segment_file(where, name)
    segment.write_bytes(segment.read_bytes().replace(b"x" * 100, b"y" * 100, 1))
    host = Host(ScriptedProvider({"produce": ["y"], "judge": [0]}))
    with pytest.raises(CheckpointError, match=f"cp.json: trace segment {name} was edited after it was written"):
        resume(load(where), host, checkpoint=locate("old://.#moved"), budget=STEPS + 1)


SCRIPT = 'scenarios:\n  - name: finish\n    llm: {produce: ["y"], judge: [0]}\n'


def test_a_checkpoint_file_copied_without_its_segments_folder_says_to_copy_that_folder(tmp_path):
    where = _suspended(locate(tmp_path / "cp.json"), tmp_path)
    (tmp_path / "copy").mkdir()
    (tmp_path / "script.yaml").write_text(SCRIPT)
    for name in ("cp.json", "grow.mk"):
        shutil.copy(tmp_path / name, tmp_path / "copy" / name)
    copied = tmp_path / "copy" / "cp.json"
    first = _segments(where)[0][0]
    resume_it = ["resume", str(copied), "--budget", str(STEPS + 1), "--script", str(tmp_path / "script.yaml")]
    for command in (["show", str(copied)], ["show", str(copied), "--format", "json"], resume_it):
        hint = "copied without it; a checkpoint file needs the .mklang-segments/ folder beside it copied with it"
        refused(cli(*command), f"trace segment {first} is missing from the run's store", hint)
    assert load(locate(copied)).status == "suspended"  # the resume ran nothing
    shutil.copytree(tmp_path / ".mklang-segments", tmp_path / "copy" / ".mklang-segments")
    resumed = cli(*resume_it, "--format", "json")
    assert resumed.returncode == 0 and json.loads(resumed.stdout)["status"] == "done"


@pytest.mark.parametrize(
    ("content", "named_for"),
    [
        (b'[{"step": 1}, {"step": 2}]', 3),  # fewer steps than its name says
        (b'[{"step": 1}, {"step": 2}]', 1),  # more
        (b'[{"step": 1}, "a text"]', 2),  # as many, one of them not a step
        (b'{"step": 1}', 1),  # not a list
        (b"[{", 1),  # not JSON
    ],
)
def test_a_segment_that_does_not_hold_the_steps_it_is_named_for_is_refused(tmp_path, content, named_for):
    """Its sha256 matches: only an envelope someone else wrote (read under --trust) names it so."""
    store = FileStore(tmp_path)
    name = hashlib.sha256(content).hexdigest()
    store.write_segment("cp.json", name, content)
    read = segments_module.reader(store, "cp.json", "cp.json", trusted=False)
    with pytest.raises(CheckpointError) as refused:
        read(Segment(name, named_for))
    assert (
        str(refused.value) == f"cp.json: trace segment {name} does not hold the {named_for} trace steps it is named for"
    )


def test_a_segment_holding_the_steps_it_is_named_for_reads_as_them(tmp_path):
    store, content = FileStore(tmp_path), b'[{"step": 1}, {"step": 2}]'
    name = hashlib.sha256(content).hexdigest()
    store.write_segment("cp.json", name, content)
    read = segments_module.reader(store, "cp.json", "cp.json", trusted=False)
    assert read(Segment(name, 2)) == [{"step": 1}, {"step": 2}]
