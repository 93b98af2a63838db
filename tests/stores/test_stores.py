"""Store conformance: the same cases against every checkpoint store (file, SQLite, PostgreSQL).

A store moves bytes: envelopes replaced atomically, journals appended and
replaced by generation, one lock per run that dies with its process, and a
list of runs. On top of that, a real run suspended and crashed through each
store must resume to the uninterrupted result.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from support import ROOT
from support.commands import cli_env
from support.examples import EXAMPLES
from support.runs import LoopTops, outcome
from support.services import postgres_schema

from mklang.checkpoint.envelope import load
from mklang.errors import CheckpointError, RunBusy, UsageError
from mklang.scenarios import load_script
from mklang.service import resume, start
from mklang.session import Host
from mklang.stores import Location, Store, locate, open_store
from mklang.stores.file import FileStore
from mklang.syntax import load_file

ENVELOPE = b'{"format":1,"whatever":"the store does not parse it"}'


@pytest.fixture(params=["file", "sqlite", "postgresql"])
def store_uri(request, tmp_path) -> str:
    """A fresh, empty store of each kind, named as a user names it."""
    if request.param == "file":
        return str(tmp_path / "runs")
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/runs.db"
    return request.getfixturevalue("postgres_uri")


@pytest.fixture
def store(store_uri, tmp_path) -> Store:
    if not store_uri.startswith(("sqlite:", "postgresql:")):
        (tmp_path / "runs").mkdir()
    opened = open_store(store_uri)
    yield opened
    opened.close()


def test_an_envelope_is_written_whole_and_replaced_whole(store):
    assert store.read("a") is None
    store.write("a", ENVELOPE, generation=1)
    assert store.read("a") == ENVELOPE
    store.write("a", ENVELOPE + b" ", generation=2)
    assert store.read("a") == ENVELOPE + b" "
    assert store.read("b") is None


def test_a_store_with_rows_refuses_an_older_generation_and_says_which_it_holds(store):
    store.write("a", ENVELOPE, generation=3)
    if isinstance(store, FileStore):  # a file is restored whole: the user's state folder remembers instead
        assert store.generation("a") == 0
        return
    with pytest.raises(CheckpointError, match="run a holds generation 3: refusing to write the older generation 2"):
        store.write("a", ENVELOPE + b" old", generation=2)
    assert (store.read("a"), store.generation("a")) == (ENVELOPE, 3)
    store.write("a", ENVELOPE + b" again", generation=3)
    assert store.generation("a") == 3 and store.generation("b") == 0


def test_a_journal_appends_and_a_new_generation_replaces_it(store):
    assert store.read_journal("a") == b""
    store.start_journal("a", b"gen 1\n")
    store.append("a", b"step\n", durable=False)
    store.append("a", b"call\n", durable=True)
    assert store.read_journal("a") == b"gen 1\nstep\ncall\n"
    store.start_journal("b", b"other\n")
    store.start_journal("a", b"gen 2\n")
    assert store.read_journal("a") == b"gen 2\n"
    assert store.read_journal("b") == b"other\n"
    store.drop_journal("a")
    assert store.read_journal("a") == b""
    assert store.read_journal("b") == b"other\n"


def test_runs_lists_every_run_with_an_envelope(store):
    assert store.runs() == []
    for run in ("b", "a", "c"):
        store.write(run, ENVELOPE, generation=1)
    store.start_journal("a", b"gen\n")
    assert sorted(store.runs()) == ["a", "b", "c"]


def test_a_listing_pages_runs_by_their_last_write_newest_first(store, monkeypatch):
    clock = iter(range(1_000, 2_000))
    monkeypatch.setattr(time, "time", lambda: float(next(clock)))
    for run in ("b", "a", "c"):
        store.write(run, ENVELOPE, generation=1)
        if isinstance(store, FileStore):  # a file's time is its modification time
            os.utime(store.folder / run, (time.time(), time.time()))
    store.write("b", ENVELOPE, generation=2)  # written again: the newest now
    if isinstance(store, FileStore):
        os.utime(store.folder / "b", (time.time(), time.time()))
    total, page = store.listing(0, 2)
    assert total == 3 and [stamp.run for stamp in page] == ["b", "c"]
    assert [stamp.run for stamp in store.listing(2, 2)[1]] == ["a"]
    assert store.listing(0, 0) == (3, [])
    newest = page[0]
    assert newest.updated > page[1].updated
    if not isinstance(store, FileStore):  # a row keeps when it was first written
        assert newest.started is not None and newest.started < newest.updated


def test_a_sqlite_store_from_before_run_times_lists_its_old_runs_last(tmp_path):
    import sqlite3

    with contextlib.closing(sqlite3.connect(tmp_path / "old.db")) as db, db:
        db.execute("CREATE TABLE mklang_runs (run TEXT PRIMARY KEY, envelope BLOB NOT NULL)")
        db.execute("INSERT INTO mklang_runs (run, envelope) VALUES ('old', ?)", (ENVELOPE,))
    store = open_store(f"sqlite:///{tmp_path}/old.db")
    try:
        store.write("new", ENVELOPE, generation=1)
        total, stamps = store.listing(0, 10)
        assert total == 2 and [(stamp.run, stamp.started is None, stamp.updated == 0) for stamp in stamps] == [
            ("new", False, False),
            ("old", True, True),
        ]
    finally:
        store.close()


def test_notes_are_replaced_whole_and_listed_as_no_run(store):
    assert store.read_note("run:a") is None
    store.write_note("run:a", b'{"first": 1}')
    store.write_note("batch:x", b"ceilings")
    store.write_note("run:a", b'{"second": 2}')
    assert (store.read_note("run:a"), store.read_note("batch:x")) == (b'{"second": 2}', b"ceilings")
    assert store.runs() == []  # notes are not runs


def test_a_note_added_twice_keeps_the_first_even_from_two_processes(store_uri, store):
    assert store.add_note("store:id", b"first") == b"first"
    assert store.add_note("store:id", b"second") == b"first"
    other = open_store(store_uri)  # another process's handle on the same store
    try:
        assert other.add_note("store:id", b"third") == b"first"
        assert other.read_note("store:id") == b"first"
    finally:
        other.close()
    assert store.runs() == []


def test_a_batchs_spend_sums_its_runs_and_a_runs_spend_never_goes_down(store):
    assert store.spend("b1") == (0, 0.0)
    store.record_spend("b1", "a", 100, 0.5)
    store.record_spend("b1", "b", 20, 0.25)
    store.record_spend("b1", "a", 60, 0.75)  # a resumed run replays its journal: fewer tokens so far, not less spent
    store.record_spend("b2", "a", 1, 1.0)
    assert store.spend("b1") == (120, 1.0)
    assert store.spend("b2") == (1, 1.0)
    assert store.runs() == []


HOLDER = textwrap.dedent("""
    import sys, time
    from mklang.stores import open_store
    store = open_store(sys.argv[1])
    lock = store.lock(sys.argv[2])
    print("locked", flush=True)
    time.sleep(60)
""")


def test_a_run_is_locked_by_one_process_until_it_dies(store, store_uri):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, store_uri, "run-1"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=cli_env(),
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert str(holder.pid) in (store.holder("run-1") or "")
        with pytest.raises(RunBusy, match=f"still going in process .*{holder.pid}"):
            store.lock("run-1")
        other = store.lock("run-2")  # runs lock independently
        other.release()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # The lock dies with its process: at once for a flock, as soon as the server sees the
    # connection drop for PostgreSQL (its backend ends a moment after the client).
    deadline = time.monotonic() + 10
    while store.holder("run-1") is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    lock = store.lock("run-1")
    assert store.holder("run-1") is not None
    lock.release()
    assert store.holder("run-1") is None
    store.lock("run-1").release()  # and can be taken again


def test_runs_of_one_name_in_two_postgresql_schemas_lock_apart():
    """Advisory locks are per database: a run's key names its schema, so two stores never block each other."""
    with postgres_schema() as first_uri, postgres_schema() as second_uri:
        first, second = open_store(first_uri), open_store(second_uri)
        try:
            held = first.lock("run-1")
            other = second.lock("run-1")
            assert second.holder("run-1") is not None and first.holder("run-1") is not None
            with pytest.raises(RunBusy, match="still going"):
                first.lock("run-1")
            other.release()
            held.release()
        finally:
            first.close()
            second.close()


def _location(store_uri: str, run: str) -> Location:
    return locate(f"{store_uri}#{run}" if "://" in store_uri else f"{store_uri}/{run}")


def test_a_run_suspends_into_the_store_and_resumes_from_it(store, store_uri):
    machine = load_file(EXAMPLES / "approval" / "approval.mk")
    scenario = next(s for s in load_script(EXAMPLES / "approval" / "scenarios.yaml") if s.name == "ask-then-publish")
    where = _location(store_uri, "approval-1")
    first = start(machine, None, Host.for_scenario(scenario), checkpoint=where)
    assert (first.status, first.reply_to) == ("suspended", "approval.answer")
    assert load(where).status == "suspended"
    done = resume(where, Host.for_scenario(scenario), reply={"approval.answer": "yes"})
    assert done.status == "done"
    assert load(where).status == "done"
    assert "approval-1" in store.runs()


class Crash(BaseException):
    """Raised at a loop-top like SIGKILL: nothing in the engine catches it."""


def test_a_run_crashed_at_any_loop_top_resumes_from_the_store(store, store_uri, monkeypatch):
    import mklang.checkpoint.journal as journal_module

    monkeypatch.setattr(journal_module, "MIN_COMPACT_BYTES", 512)  # compaction happens in these short runs
    machine = load_file(EXAMPLES / "nested" / "brief.mk")
    scenario = load_script(EXAMPLES / "nested" / "scenarios.yaml")[0]
    seen = []
    reference = outcome(
        start(
            machine,
            None,
            Host.for_scenario(scenario),
            checkpoint=_location(store_uri, "ref"),
            observer=LoopTops(seen.append),
        )
    )
    assert reference["status"] == "done"
    for n in range(2, len(seen) + 1, 3):
        where = _location(store_uri, f"crash-{n}")
        count = iter(range(1, n + 1))

        def crash_at_n(event, count=count, n=n):
            if next(count, n) == n:
                raise Crash

        with pytest.raises(Crash):
            start(machine, None, Host.for_scenario(scenario), checkpoint=where, observer=LoopTops(crash_at_n))
        assert load(where).status == "running"
        assert outcome(resume(where, Host.for_scenario(scenario))) == reference, f"crashed at loop-top {n}"


def test_a_resume_continues_the_stored_envelope_in_place_even_across_a_crash(store, store_uri):
    """A clean resume starts a journal generation against the suspended envelope instead of
    rewriting it; a crash mid-way shows as running, and a bare resume keeps the reply and budgets."""
    from mklang.inspection import describe
    from mklang.service import outcome as batch_outcome

    machine = load_file(EXAMPLES / "approval" / "approval.mk")
    scenario = next(s for s in load_script(EXAMPLES / "approval" / "scenarios.yaml") if s.name == "ask-then-publish")
    reply = {"approval.answer": "yes"}
    reference_at = _location(store_uri, "reference")
    start(machine, None, Host.for_scenario(scenario), checkpoint=reference_at)
    reference = outcome(resume(reference_at, Host.for_scenario(scenario), reply=reply, max_tokens=10**6))
    assert reference["status"] == "done"

    where = _location(store_uri, "approval-2")
    host = Host.for_scenario(scenario)
    assert start(machine, None, host, checkpoint=where).status == "suspended"
    suspended = store.read("approval-2")
    loop_tops = iter(range(3))

    def crash_at_the_second_loop_top(event):
        if next(loop_tops) == 1:
            raise Crash

    with pytest.raises(Crash):
        resume(where, host, reply=reply, max_tokens=10**6, observer=LoopTops(crash_at_the_second_loop_top))
    assert store.read("approval-2") == suspended  # continued in place, not rewritten
    summary = describe(where)
    assert (summary["status"], summary["tokens"]["budget"]) == ("running", 10**6)
    assert "was interrupted" in summary["interrupted"]
    assert batch_outcome(store, "approval-2").status == "pending"
    assert outcome(resume(where, Host.for_scenario(scenario))) == reference  # no reply given again
    assert load(where).status == "done"


def test_a_parked_run_in_postgresql_is_listed_and_answered_from_another_folder(postgres_uri, tmp_path):
    from support.commands import cli

    example = EXAMPLES / "approval"
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    here.mkdir()
    elsewhere.mkdir()
    target = f"{postgres_uri}#approval-7"
    first = cli(
        "run", str(example / "approval.mk"), "--script", str(example / "scenarios.yaml"), "--scenario",
        "ask-then-publish", "--hitl", "--checkpoint", target, "--format", "json", cwd=here,
    )  # fmt: skip
    assert first.returncode == 3, first.stderr
    listed = json.loads(cli("runs", "--store", postgres_uri, "--status", "suspended", cwd=elsewhere).stdout)
    assert [(run["path"], run["reason"], run["reply_to"]) for run in listed] == [
        (target, "escalated", "approval.answer")
    ]
    assert listed[0]["ask"]
    done = cli("resume", target, "--set", "approval.answer=yes", "--format", "json", cwd=elsewhere)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["context"]["approval"]["answer"] == "yes"
    assert json.loads(cli("runs", "--store", postgres_uri, cwd=elsewhere).stdout)[0]["status"] == "done"


# --- The registry of store URI schemes: built-in ones, and packages' entry points ------------

PLUGIN = '''\
from pathlib import Path

from mklang.stores.file import FileStore

OPENED = []


def open_folder_store(uri, *, create):
    """`folders://NAME`: a file store in the folder NAME under the one this package names."""
    OPENED.append((uri, create))
    folder = Path(FOLDER) / uri.split("://", 1)[1]
    folder.mkdir(exist_ok=True)
    return FileStore(folder)


def broken(uri, *, create):
    raise AssertionError("never called")
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """An installed package registering the schemes `folders` and `broken` in the group `mklang.stores`:
    its module and its dist-info in a folder on sys.path, as pip lays them out."""
    site = tmp_path / "site"
    info = site / "mklang_folder_store-1.0.dist-info"
    info.mkdir(parents=True)
    (site / "mklang_folder_store.py").write_text(f"FOLDER = {str(tmp_path)!r}\n" + PLUGIN)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mklang-folder-store\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[mklang.stores]\n"
        "folders = mklang_folder_store:open_folder_store\n"
        "broken = mklang_folder_store_missing:broken\n"
        "sqlite = mklang_folder_store:broken\n"
    )
    monkeypatch.syspath_prepend(str(site))
    yield
    sys.modules.pop("mklang_folder_store", None)


def test_a_package_adds_a_store_scheme_through_an_entry_point(plugin, tmp_path):
    where = locate("folders://team#run-1", create=False)
    import mklang_folder_store

    assert mklang_folder_store.OPENED == [("folders://team", False)]
    assert isinstance(where.store, FileStore) and where.store.folder == tmp_path / "team"
    machine = load_file(EXAMPLES / "approval" / "approval.mk")
    scenario = next(s for s in load_script(EXAMPLES / "approval" / "scenarios.yaml") if s.name == "ask-then-publish")
    assert start(machine, None, Host.for_scenario(scenario), checkpoint=where).status == "suspended"
    assert load(locate("folders://team#run-1")).status == "suspended"
    assert open_store("folders://team").runs() == ["run-1"]


def test_a_built_in_scheme_is_never_taken_over_by_a_package(plugin, tmp_path):
    store = open_store(f"sqlite:///{tmp_path}/runs.db")
    assert type(store).__name__ == "SqliteStore"
    store.close()


def test_an_unknown_scheme_names_every_known_one_in_one_line(plugin):
    with pytest.raises(UsageError) as caught:
        open_store("mysql://user:secret@host/db")
    message = str(caught.value)
    assert "\n" not in message and "secret" not in message
    assert message.startswith("mysql://user:***@host/db: unknown store scheme 'mysql': a store is a folder")
    assert message.endswith("(known schemes: broken, folders, postgres, postgresql, sqlite)")


def test_a_scheme_whose_package_cannot_load_is_one_line_naming_it(plugin):
    with pytest.raises(UsageError) as caught:
        open_store("broken://x")
    assert str(caught.value) == (
        "store scheme 'broken': cannot load mklang_folder_store_missing:broken: "
        "ModuleNotFoundError: No module named 'mklang_folder_store_missing'"
    )


def test_a_built_in_scheme_looks_up_no_installed_package(monkeypatch, tmp_path):
    import importlib.metadata

    def looked_up(**_):
        raise AssertionError("entry points read for a built-in scheme")

    monkeypatch.setattr(importlib.metadata, "entry_points", looked_up)
    open_store(f"sqlite:///{tmp_path}/runs.db").close()
