"""The checkpoint stores (file, SQLite, PostgreSQL) beyond the contract kit (`test_store_contract.py`).

A real run suspended and crashed through each store must resume to the
uninterrupted result. Then each store at its own edges:
what SQLite syncs, the file store's spend, notes and lock files, PostgreSQL's lock
sessions, and errors that name the store.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import socket
import stat
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
import pytest
from support.checkpoints import blank_envelope
from support.commands import cli
from support.crashes import Crash
from support.examples import EXAMPLES, HITL
from support.files import holder, lock_path, refuse_if_running
from support.runs import LoopTops, outcome
from support.services import postgres_schema

from mklang.checkpoint.envelope import dump, load
from mklang.errors import CheckpointError, RunBusy, UsageError
from mklang.runs import resume, start
from mklang.runs.inspection import describe
from mklang.scenarios import load_script
from mklang.session import Host
from mklang.stores import Location, RunQuery, Store, locate, open_store, run_name
from mklang.stores.file import FileLock, FileStore, hashed_name, lock_holder
from mklang.stores.postgres import PostgresStore
from mklang.stores.sqlite import SqliteStore
from mklang.stores.summary import RunSummary
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


def test_a_store_with_rows_refuses_an_older_generation_and_says_which_it_holds(store):
    if isinstance(store, FileStore):
        pytest.skip("a file is restored whole: the user's state folder remembers its generation instead")
    store.write("a", ENVELOPE, generation=3)
    with pytest.raises(CheckpointError, match="run a holds generation 3: refusing to write the older generation 2"):
        store.write("a", ENVELOPE + b" old", generation=2)
    store.write("a", ENVELOPE + b" again", generation=3)
    assert (store.read("a"), store.generation("a"), store.generation("b")) == (ENVELOPE + b" again", 3, 0)


def test_a_query_in_python_takes_unknown_times_for_the_earliest():
    """As the SQL stores order and filter NULL times (a run summarized before times were kept)."""
    known, unknown = RunSummary("k", started=0.5, updated=0.5), RunSummary("u")
    assert RunQuery().page([unknown, known]) == [known, unknown]
    assert RunQuery(since=0.5).page([unknown, known]) == [known]


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
    machine = load_file(HITL / "approval" / "approval.mk")
    scenario = next(s for s in load_script(HITL / "approval" / "scenarios.yaml") if s.name == "ask-then-publish")
    where = _location(store_uri, "approval-1")
    first = start(machine, None, Host.for_scenario(scenario), checkpoint=where)
    assert (first.status, first.reply_to) == ("suspended", "approval.answer")
    assert load(where).status == "suspended"
    done = resume(where, Host.for_scenario(scenario), reply={"approval.answer": "yes"})
    assert done.status == "done"
    assert load(where).status == "done"
    assert "approval-1" in store.runs()


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
    from mklang.runs import outcome as batch_outcome
    from mklang.runs.inspection import describe

    machine = load_file(HITL / "approval" / "approval.mk")
    scenario = next(s for s in load_script(HITL / "approval" / "scenarios.yaml") if s.name == "ask-then-publish")
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

    example = HITL / "approval"
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
    assert [(run["checkpoint"], run["machine"], run["status"]) for run in listed["runs"]] == [
        (target, "approval", "suspended")
    ]
    assert listed["runs"][0]["reason"].startswith("Publish this announcement?")
    done = cli("resume", target, "--set", "approval.answer=yes", "--format", "json", cwd=elsewhere)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["context"]["approval"]["answer"] == "yes"
    assert json.loads(cli("runs", "--store", postgres_uri, cwd=elsewhere).stdout)["runs"][0]["status"] == "done"


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
    machine = load_file(HITL / "approval" / "approval.mk")
    scenario = next(s for s in load_script(HITL / "approval" / "scenarios.yaml") if s.name == "ask-then-publish")
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


def test_a_sqlite_store_file_may_have_a_colon_in_its_name(tmp_path, monkeypatch):
    from mklang.stores import open_store
    from mklang.stores.sqlite import SqliteStore

    monkeypatch.chdir(tmp_path)
    store = open_store("sqlite:///a:b.db")
    assert isinstance(store, SqliteStore) and (tmp_path / "a:b.db").is_file()
    store.close()


def test_file_store_notes_and_spend_are_private_and_their_damage_is_named(tmp_path):
    from mklang.stores import open_store

    store = open_store(tmp_path)
    store.write_note("batch:b", b"n")
    store.record_spend("b", "r", 1, 0.5)
    (batch,) = (tmp_path / ".mklang-spend").iterdir()
    for folder in (tmp_path / ".mklang-notes", batch):  # the folders that hold the files
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert store.runs() == []
    (spent,) = (tmp_path / ".mklang-spend").glob("*/*")
    spent.write_text("lots")
    with pytest.raises(CheckpointError) as caught:
        store.spend("b")
    assert str(caught.value).startswith(f"{spent}: cannot read a run's recorded spend: ")
    (note,) = (tmp_path / ".mklang-notes").iterdir()
    note.unlink()
    note.mkdir()
    with pytest.raises(CheckpointError) as caught:
        store.read_note("batch:b")
    assert str(caught.value) == f"{note}: cannot read the batch note: Is a directory"
    with pytest.raises(CheckpointError) as caught:
        store.write_note("batch:b", b"n")
    assert str(caught.value) == f"{note}: cannot write the batch note: Is a directory"


# --- stores at their edges: a lock taken twice in one process, errors, odd files ---

POSTGRES = "postgresql://postgres@127.0.0.1:5432/test"


@pytest.fixture(params=["file", "sqlite", "postgresql"])
def named_store(request, tmp_path) -> Any:
    """A fresh store, how it names a run in its messages, and the holder it reports for this process."""
    import socket

    from mklang.stores import open_store

    me = str(os.getpid())
    if request.param == "file":
        folder = tmp_path / "runs"
        folder.mkdir()
        store, name = open_store(folder), lambda run: str(folder / run)
    elif request.param == "sqlite":
        path = tmp_path / "runs.db"
        store, name = open_store(f"sqlite:///{path}"), lambda run: f"sqlite:///{path}#{run}"
    else:
        store, name = open_store(request.getfixturevalue("postgres_uri")), lambda run: f"{POSTGRES}#{run}"
        me = f"{me}@{socket.gethostname()}"
    yield store, name, me
    store.close()


def test_a_run_locked_in_this_process_cannot_be_locked_again_but_another_run_can(named_store):
    store, name, me = named_store
    first = store.lock("run 1")
    try:
        assert store.holder("run 1") == me
        assert store.holder("run 2") is None
        with pytest.raises(CheckpointError) as caught:
            store.lock("run 1")
        assert str(caught.value) == (
            f"{name('run 1')}: the run is still going in process {me}; "
            "wait for it, or stop it (Ctrl-C suspends it) before resuming"
        )
        store.lock("run 2").release()
    finally:
        first.release()
    assert store.holder("run 1") is None
    store.lock("run 1").release()


def test_a_closed_database_store_fails_with_one_line_naming_the_store(tmp_path, postgres_uri):
    from mklang.stores import open_store

    closed = {
        f"{tmp_path}/runs.db: SQLite checkpoint store: Cannot operate on a closed database.": open_store(
            f"sqlite:///{tmp_path}/runs.db"
        ),
        f"{POSTGRES}: PostgreSQL checkpoint store: the connection is closed": open_store(postgres_uri),
    }
    for message, store in closed.items():
        store.close()
        for use in (
            partial(store.read, "a"),
            partial(store.write, "a", b"{}", generation=1),
            partial(store.read_journal, "a"),
            partial(store.start_journal, "a", b"gen\n"),
            partial(store.append, "a", b"step\n", durable=True),
            partial(store.drop_journal, "a"),
            store.runs,
            partial(store.read_note, "batch:x"),
            partial(store.write_note, "batch:x", b"note"),
            partial(store.record_spend, "b", "a", 1, 0.5),
            partial(store.spend, "b"),
        ):
            with pytest.raises(CheckpointError) as caught:
                use()
            assert str(caught.value) == message


def test_a_sqlite_store_serves_every_thread_of_the_process(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from mklang.stores import open_store

    store = open_store(f"sqlite:///{tmp_path}/runs.db")
    with ThreadPoolExecutor(1) as pool:
        pool.submit(partial(store.write, "a", b"{}", generation=1)).result()
        pool.submit(store.start_journal, "a", b"gen\n").result()
    assert (store.read("a"), store.read_journal("a")) == (b"{}", b"gen\n")
    assert stat.S_IMODE((tmp_path / "runs.db.locks").stat().st_mode) == 0o700  # the locks are the owner's
    store.close()


@pytest.mark.parametrize("uri", ["sqlite://host/runs.db", "sqlite:///", "sqlite://"])
def test_a_sqlite_uri_without_a_local_path_is_a_usage_error(uri):
    from mklang.errors import UsageError
    from mklang.stores import open_store

    with pytest.raises(UsageError) as caught:
        open_store(uri)
    assert str(caught.value) == f"{uri}: expected sqlite:///relative/path.db or sqlite:////absolute/path.db"


def test_a_sqlite_store_may_be_a_one_letter_file_and_not_a_folder(tmp_path, monkeypatch):
    from mklang.stores import open_store

    monkeypatch.chdir(tmp_path)
    open_store("sqlite:///a").close()
    assert (tmp_path / "a").is_file()
    with pytest.raises(CheckpointError) as caught:
        open_store(f"sqlite:///{tmp_path}")
    assert str(caught.value) == f"{tmp_path}: cannot open the SQLite checkpoint store: unable to open database file"


def test_postgresql_store_errors_are_the_first_line_of_the_servers_and_hide_the_uri_options(monkeypatch):
    import sys

    from mklang.errors import UsageError
    from mklang.stores import open_store

    with pytest.raises(CheckpointError) as caught:
        open_store("postgresql://postgres@127.0.0.1:1/test?connect_timeout=2&application_name=a?b")
    assert str(caught.value).startswith(
        "postgresql://postgres@127.0.0.1:1/test: cannot connect to the PostgreSQL checkpoint store: connection failed: "
    )
    assert "\n" not in str(caught.value) and str(caught.value).endswith(
        "Connection refused (is the server up, and the URI's host, port, user and database right?)"
    )
    require_postgres()
    with pytest.raises(UsageError) as caught:
        open_store(f"{POSTGRES}?options=-csearch_path%3Dmk_no_such_schema")
    assert str(caught.value).startswith(f"{POSTGRES}: the schema the URI's search_path names does not exist")
    monkeypatch.setitem(sys.modules, "psycopg", None)
    with pytest.raises(UsageError) as missing:
        open_store(POSTGRES)
    assert str(missing.value) == "the PostgreSQL store needs psycopg: pip install 'mklang[distributed]>=2'"


def require_postgres() -> None:
    from support.services import require_server

    require_server("PostgreSQL")


def test_the_file_store_lists_only_checkpoint_files(tmp_path):
    from mklang.stores import open_store

    envelope = dump(blank_envelope())
    for name in ("cp.json", ".hidden.json", "cp.json.tmp", "cp.json.journal", "cp.json.lock", "b.json"):
        (tmp_path / name).write_bytes(envelope)
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    (tmp_path / "folder").mkdir()
    assert open_store(tmp_path).runs() == ["b.json", "cp.json"]


def test_a_dropped_journal_takes_no_more_appends(tmp_path):
    from mklang.stores import open_store

    store = open_store(tmp_path)
    store.start_journal("cp.json", b"gen\n")
    store.drop_journal("cp.json")
    with pytest.raises(CheckpointError, match="the journal was not started"):
        store.append("cp.json", b"step\n", durable=False)
    assert not (tmp_path / "cp.json.journal").exists()


# --- a lock file that names a process that is gone ----------------------------


def test_show_of_a_run_locked_before_its_first_checkpoint_names_the_process_not_a_missing_file(named_store):
    store, name, me = named_store

    def show(run: str) -> str:
        with pytest.raises(CheckpointError) as caught:
            describe(Location(store, run, name(run), name(run)))
        return str(caught.value)

    lock = store.lock("run-1")
    try:
        assert (
            show("run-1")
            == f"{name('run-1')}: no checkpoint yet: the run in process {me} has not written its first one"
        )
        assert show("run-2") == f"{name('run-2')}: no such checkpoint"
    finally:
        lock.release()
    assert show("run-1") == f"{name('run-1')}: no such checkpoint"


def test_a_stale_lock_file_does_not_block_and_is_taken_over(tmp_path):
    checkpoint = tmp_path / "cp.json"
    lock_path(checkpoint).write_text(f"{os.getpid()}\n")  # a pid, but no process holds the lock
    assert holder(checkpoint) is None
    refuse_if_running(checkpoint)
    lock = FileLock(lock_path(checkpoint), str(checkpoint))
    try:
        assert lock_path(checkpoint).read_text() == f"{os.getpid()}\n"
        assert holder(checkpoint) == os.getpid()
        with pytest.raises(CheckpointError, match=f"still going in process {os.getpid()}"):
            refuse_if_running(checkpoint)
        with pytest.raises(CheckpointError, match=f"still going in process {os.getpid()}"):
            FileLock(lock_path(checkpoint), str(checkpoint))
    finally:
        lock.release()
    assert holder(checkpoint) is None


def test_a_longer_stale_pid_is_replaced_not_overwritten_in_place(tmp_path):
    checkpoint = tmp_path / "cp.json"
    lock_path(checkpoint).write_text("123456789012\n")
    lock = FileLock(lock_path(checkpoint), str(checkpoint))
    try:
        assert lock_path(checkpoint).read_text() == f"{os.getpid()}\n"
    finally:
        lock.release()


def test_a_held_lock_whose_file_names_no_pid_reports_an_unknown_holder(tmp_path):
    checkpoint = tmp_path / "cp.json"
    lock = FileLock(lock_path(checkpoint), str(checkpoint))
    try:
        lock_path(checkpoint).write_text("garbage\n")
        assert holder(checkpoint) == -1
    finally:
        lock.release()


def test_a_checkpoint_is_located_by_path_or_by_store_uri_and_run(tmp_path, monkeypatch):
    from mklang.errors import UsageError

    monkeypatch.chdir(tmp_path)
    by_path = locate("cp.json")
    assert (by_path.run, str(by_path), by_path.key, by_path.anchor) == (
        "cp.json",
        "cp.json",
        str(tmp_path / "cp.json"),
        Path("cp.json"),
    )
    assert locate(str(tmp_path / "cp.json")).key == by_path.key  # two names of one run
    in_sqlite = locate("sqlite:///runs.db#run-1")
    assert (in_sqlite.run, str(in_sqlite), in_sqlite.key, in_sqlite.anchor) == (
        "run-1",
        "sqlite:///runs.db#run-1",
        "sqlite:///runs.db#run-1",
        Path("runs.db"),
    )
    in_sqlite.store.close()
    with pytest.raises(UsageError, match=r"sqlite:///runs\.db: run name 'run#1' is not valid"):
        locate("sqlite:///runs.db#run#1")  # the first '#' ends the store, the rest is no run name
    with pytest.raises(UsageError) as caught:
        locate("sqlite:///runs.db")
    assert str(caught.value) == "sqlite:///runs.db: a store URI names a run after '#', e.g. sqlite:///runs.db#RUN_ID"


def test_a_postgresql_checkpoint_anchors_machine_paths_in_the_current_folder(tmp_path, monkeypatch, postgres_uri):

    monkeypatch.chdir(tmp_path)
    location = locate(f"{postgres_uri}#r")
    assert (location.run, location.anchor) == ("r", tmp_path / "checkpoint")
    location.store.close()


def test_file_store_errors_name_the_file_and_say_what_failed(tmp_path):
    from mklang.stores import open_store
    from mklang.stores.file import FileStore

    store = open_store(tmp_path)
    (tmp_path / "cp.json.journal").mkdir()
    with pytest.raises(CheckpointError) as caught:
        store.read_journal("cp.json")
    assert str(caught.value) == f"{tmp_path / 'cp.json.journal'}: cannot read the journal: Is a directory"
    with pytest.raises(CheckpointError) as caught:
        store.start_journal("cp.json", b"gen\n")
    assert str(caught.value) == f"{tmp_path / 'cp.json.journal'}: cannot write the journal: Is a directory"
    missing = FileStore(tmp_path / "missing")
    with pytest.raises(CheckpointError) as caught:
        missing.lock("cp.json")
    assert (
        str(caught.value)
        == f"{tmp_path / 'missing' / 'cp.json'}: cannot lock the checkpoint: No such file or directory"
    )
    missing.drop_journal("cp.json")  # nothing to drop is fine


def test_file_store_errors_of_segments_notes_and_removal_name_the_file_and_say_what_failed(tmp_path):
    store = FileStore(tmp_path)
    store.write("other.json", ENVELOPE, generation=1)
    segments = tmp_path / ".mklang-segments" / hashed_name("other.json")
    segments.parent.mkdir()
    segments.write_bytes(b"not a folder")
    with pytest.raises(CheckpointError) as caught:
        store.remove("other.json")
    assert str(caught.value) == f"{segments}: cannot remove the run's trace segments: Not a directory"
    (tmp_path / ".mklang-segments" / hashed_name("cp.json")).write_bytes(b"not a folder")
    with pytest.raises(CheckpointError) as caught:
        store.write_segment("cp.json", "s1", b"segment")
    where = tmp_path / ".mklang-segments" / hashed_name("cp.json") / "s1"
    assert str(caught.value) == f"{where}: cannot write the trace segment: File exists"
    note = tmp_path / ".mklang-notes" / hashed_name("batch:b")
    note.mkdir(parents=True)
    with pytest.raises(CheckpointError) as caught:
        store.drop_note("batch:b")
    assert str(caught.value) == f"{note}: cannot remove the note: Is a directory"
    unreadable = tmp_path / ".mklang-segments" / hashed_name("third.json") / "s1"
    unreadable.mkdir(parents=True)
    with pytest.raises(CheckpointError) as caught:
        store.read_segment("third.json", "s1")
    assert str(caught.value) == f"{unreadable}: cannot read the trace segment: Is a directory"
    (tmp_path / "folder.json").mkdir()
    with pytest.raises(CheckpointError) as caught:
        store.remove("folder.json")
    assert str(caught.value) == f"{tmp_path / 'folder.json'}: cannot remove it: Is a directory"


def test_the_file_store_reads_the_notes_spend_and_segments_an_earlier_release_wrote(tmp_path):
    """Their files are named by the first 32 hex digits of the sha256 of the key's UTF-8 bytes, for good."""

    def named(text: str) -> str:
        return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]

    (tmp_path / ".mklang-notes").mkdir()
    (tmp_path / ".mklang-notes" / named("store:identity")).write_bytes(b"the fleet's queue")
    (tmp_path / ".mklang-spend" / named("batch-é")).mkdir(parents=True)
    (tmp_path / ".mklang-spend" / named("batch-é") / named("run-1")).write_text("12 0.25")
    (tmp_path / ".mklang-segments" / named("run-1")).mkdir(parents=True)
    (tmp_path / ".mklang-segments" / named("run-1") / "s1").write_bytes(b"steps")
    store = FileStore(tmp_path)
    assert store.read_note("store:identity") == b"the fleet's queue"
    assert store.spend("batch-é") == (12, 0.25)
    assert store.read_segment("run-1", "s1") == b"steps"


def test_a_lock_file_is_owner_only_never_followed_through_a_link_and_released_once(tmp_path):
    from mklang.stores import open_store

    store = open_store(tmp_path)
    lock = store.lock("cp.json")
    assert stat.S_IMODE((tmp_path / "cp.json.lock").stat().st_mode) == 0o600
    lock.release()
    lock.release()  # a second release does nothing
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (tmp_path / "other.json.lock").symlink_to(victim)
    with pytest.raises(CheckpointError, match="cannot lock the checkpoint: Too many levels of symbolic links"):
        store.lock("other.json")
    assert store.holder("other.json") is None
    assert victim.read_text() == "keep me"


def test_a_closed_file_store_takes_no_more_journal_lines(tmp_path):
    from mklang.stores import open_store

    store = open_store(tmp_path)
    store.start_journal("cp.json", b"gen 1\n")
    store.start_journal("cp.json", b"gen 2\n")
    store.append("cp.json", b"step\n", durable=False)
    assert store.read_journal("cp.json") == b"gen 2\nstep\n"
    store.close()
    with pytest.raises(CheckpointError, match="the journal was not started"):
        store.append("cp.json", b"late\n", durable=False)


# --- SQLite: durable lines are synced, the others reach the OS only ------------


def synchronous(store: SqliteStore) -> str:
    """The connection's sync setting: what its next commit will be."""
    return {1: "NORMAL", 2: "FULL"}[store._db.execute("PRAGMA synchronous").fetchone()[0]]


def test_sqlite_syncs_envelopes_and_durable_lines_and_not_the_others(tmp_path):
    store = SqliteStore(tmp_path / "runs.db")
    try:
        assert synchronous(store) == "FULL"
        store.append("a", b"step\n", durable=False)
        assert synchronous(store) == "NORMAL"
        store.append("a", b"more\n", durable=False)
        assert synchronous(store) == "NORMAL"
        store.write("a", b"{}", generation=1)
        assert synchronous(store) == "FULL"
        store.append("a", b"step\n", durable=False)
        store.append("a", b"call\n", durable=True)
        assert synchronous(store) == "FULL"
        store.append("a", b"step\n", durable=False)
        store.start_journal("a", b"gen\n")
        assert synchronous(store) == "FULL"
        assert store.read_journal("a") == b"gen\n"
    finally:
        store.close()


def test_sqlite_store_at_an_unopenable_path_is_one_checkpoint_error(tmp_path):
    (tmp_path / "runs.db").mkdir()
    with pytest.raises(CheckpointError, match=r"runs\.db: cannot open the SQLite checkpoint store"):
        SqliteStore(tmp_path / "runs.db")


# --- the file store: spend files, lock files ---------------------------------


def test_a_file_stores_spend_ignores_a_half_written_spend_file(tmp_path):
    store = FileStore(tmp_path)
    store.record_spend("batch", "run 1", 10, 0.5)
    store.record_spend("batch", "run 2", 5, 0.25)
    (folder,) = (tmp_path / ".mklang-spend").iterdir()
    (folder / ".run 3.tmp").write_text("1000 9.0")  # an atomic write cut before its rename
    assert store.spend("batch") == (15, 0.75)
    assert store.spend("another batch") == (0, 0.0)


def test_a_file_stores_notes_spend_and_segments_are_owner_only_at_every_level(tmp_path):
    store = FileStore(tmp_path)
    store.record_spend("batch", "run", 10, 0.5)
    store.write_note("key", b"note")
    store.write_segment("run", "s1", b"segment")
    written = list(tmp_path.rglob("*"))
    assert {path.relative_to(tmp_path).parts[0] for path in written} == {
        ".mklang-spend",
        ".mklang-notes",
        ".mklang-segments",
    }
    assert len(written) == 8  # three folders, the batch's and the run's folders, the spend file, the note, the segment
    assert (tmp_path / ".mklang-segments" / hashed_name("run") / "s1").read_bytes() == b"segment"
    for path in written:
        assert stat.S_IMODE(path.stat().st_mode) in (0o700, 0o600), path


def test_a_file_stores_run_summaries_are_owner_only(tmp_path):
    store = FileStore(tmp_path)
    store.summarize("run", RunSummary("run", run_id="id-run", status="running"))
    store.summarize("run", RunSummary("run", run_id="id-run", status="done"))  # replaced, not edited
    written = list((tmp_path / ".mklang-runs").rglob("*"))
    assert len(written) == 1 and json.loads(written[0].read_text())["status"] == "done"
    for path in [tmp_path / ".mklang-runs", *written]:
        assert stat.S_IMODE(path.stat().st_mode) in (0o700, 0o600), path


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_file_journal_holds_two_open_files_per_run_across_generations_the_journal_and_its_mark(tmp_path):
    store = FileStore(tmp_path)
    store.start_journal("run", b"gen 1\n")
    opened = open_descriptors()
    for generation in range(2, 7):
        store.start_journal("run", f"gen {generation}\n".encode())
        store.append("run", b"step\n", durable=False)
    assert open_descriptors() == opened
    assert store.read_journal("run") == b"gen 6\nstep\n"
    store.drop_journal("run")
    assert open_descriptors() == opened - 2
    store.close()


def test_appending_to_a_journal_never_started_names_its_file(tmp_path):
    store = FileStore(tmp_path)
    with pytest.raises(CheckpointError, match=rf"^{tmp_path / 'run'}\.journal: the journal was not started$"):
        store.append("run", b"step\n", durable=True)


@pytest.fixture
def flocked(tmp_path) -> Iterator[Path]:
    """A lock file held by another open file (as another process would hold it), still empty."""
    path = tmp_path / "held.lock"
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(descriptor, fcntl.LOCK_EX)
    yield path
    os.close(descriptor)


def test_a_held_lock_file_still_empty_names_an_unknown_holder(flocked):
    assert lock_holder(flocked) == "?"
    flocked.write_text("4242\n")
    assert lock_holder(flocked) == "4242"


def test_a_held_lock_file_naming_its_holder_in_bytes_that_are_not_text_is_still_shown(flocked):
    flocked.write_bytes(b"42\xff\n")
    assert lock_holder(flocked) == "42\ufffd"


def test_a_file_run_written_before_summaries_is_summarized_from_its_envelope_timed_by_its_file(tmp_path):
    store = FileStore(tmp_path)
    envelopes = {
        "parked": {"status": "suspended", "reason": "escalated", "ask": "Publish?", "run_id": "r-1"},
        "stopped": {"status": "suspended", "reason": "budget-exhausted", "error": "not shown"},
        "failed": {"status": "halted", "reason": "not shown", "error": "no gate matched", "ask": "not shown"},
        "odd": {"status": "lost", "run_id": 7, "machine": "approval", "usage": [3, 4]},  # not of its type: unknown
    }
    machine, usage = {"name": "approval"}, {"input_tokens": 3, "output_tokens": 4, "cost_usd": 1}
    for run, fields in envelopes.items():
        store.write(run, json.dumps({"format": 2, "machine": machine, "usage": usage, **fields}).encode(), generation=1)
    store.write("torn", b'{"format": 2, "run_id"', generation=1)
    for when, run in enumerate(("parked", "stopped", "failed", "odd", "torn"), start=1):
        os.utime(tmp_path / run, (when * 1000, when * 1000))
    summaries = {summary.run: summary for summary in store.summaries(RunQuery())}
    assert summaries == {
        "parked": RunSummary("parked", "r-1", "approval", "suspended", "Publish?", 7, 1.0, 1000.0, 1000.0),
        "stopped": RunSummary("stopped", None, "approval", "suspended", "budget-exhausted", 7, 1.0, 2000.0, 2000.0),
        "failed": RunSummary("failed", None, "approval", "halted", "no gate matched", 7, 1.0, 3000.0, 3000.0),
        "odd": RunSummary("odd", started=4000.0, updated=4000.0),
        "torn": RunSummary("torn", started=5000.0, updated=5000.0),
    }
    store.write("flags", b'{"format": 2, "usage": {"input_tokens": true, "output_tokens": 4}}', generation=1)
    (flags,) = store.summaries(RunQuery(limit=1))  # the newest file: listed first
    assert (flags.run, flags.tokens) == ("flags", 4)


def test_a_lock_file_that_is_a_symlink_is_not_followed(flocked, tmp_path):
    flocked.write_text("4242\n")
    link = tmp_path / "run.lock"
    link.symlink_to(flocked)
    assert lock_holder(link) is None
    assert lock_holder(tmp_path / "missing.lock") is None


# --- PostgreSQL: lock connections kept, closed, and replaced -----------------


def me() -> str:
    """This process as the store names it (read at test time: the mutation runner forks after import)."""
    return f"{os.getpid()}@{socket.gethostname()}"


@pytest.fixture
def postgres(postgres_uri) -> Iterator[PostgresStore]:
    store = PostgresStore(postgres_uri)
    yield store
    store.close()


def sessions(uri: str, name: str) -> list[int]:
    """The server's sessions of this process named `name`."""
    with psycopg.connect(uri, autocommit=True) as db:
        rows = db.execute("SELECT pid FROM pg_stat_activity WHERE application_name = %s", (name,)).fetchall()
    return [row[0] for row in rows]


def end_sessions(uri: str, name: str) -> None:
    """End this process's sessions named `name` from the server's side, as a restart or failover does."""
    with psycopg.connect(uri, autocommit=True) as db:
        ended = db.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s", (name,)
        ).fetchall()
    assert ended, f"no session named {name}"


def test_a_released_lock_connection_is_kept_for_the_next_lock_and_closed_with_the_store(postgres_uri):
    """Counted apart from the sessions other stores of this process (other tests) may still hold."""
    data_name, lock_name = f"mklang-data {me()}", f"mklang {me()}"
    before = set(sessions(postgres_uri, data_name)) | set(sessions(postgres_uri, lock_name))
    postgres = PostgresStore(postgres_uri)
    (data,) = set(sessions(postgres_uri, data_name)) - before
    postgres.lock("a").release()
    (kept,) = set(sessions(postgres_uri, lock_name)) - before
    postgres.lock("b").release()
    assert set(sessions(postgres_uri, lock_name)) - before == {kept}
    held = postgres.lock("c")
    postgres.close()
    held.release()  # released after the store closed: its connection is closed, not kept
    assert not {data, kept} & set(sessions(postgres_uri, data_name) + sessions(postgres_uri, lock_name))
    assert set(sessions(postgres_uri, lock_name)) - before == set()


def test_a_run_whose_lock_session_ended_cannot_write_and_its_store_goes_on(postgres, postgres_uri):
    lock = postgres.lock("a")
    postgres.write("a", b"before", generation=1)
    end_sessions(postgres_uri, f"mklang {me()}")
    # The server's notice or the closed socket, whichever the client reads first: the session is gone.
    ended = (
        r"PostgreSQL checkpoint store: (terminating connection|connection socket closed|server closed the connection)"
    )
    with pytest.raises(CheckpointError, match=ended):
        postgres.start_journal("a", b"gen\n")
    with pytest.raises(CheckpointError, match="PostgreSQL checkpoint store"):
        postgres.write("a", b"after", generation=2)
    lock.release()
    assert postgres.read("a") == b"before"
    assert postgres.read_journal("a") == b""
    postgres.lock("a").release()


def test_a_run_whose_lock_session_ended_takes_no_more_journal_lines(postgres, postgres_uri):
    lock = postgres.lock("a")
    postgres.start_journal("a", b"gen\n")
    postgres.append("a", b"step\n", durable=False)
    end_sessions(postgres_uri, f"mklang {me()}")
    with pytest.raises(CheckpointError, match="PostgreSQL checkpoint store"):
        postgres.append("a", b"late\n", durable=True)
    lock.release()
    assert postgres.read_journal("a") == b"gen\nstep\n"


def test_a_store_whose_sessions_the_server_ended_locks_and_reads_again(postgres, postgres_uri):
    postgres.write("a", b"envelope", generation=1)
    first, second = postgres.lock("a"), postgres.lock("b")
    first.release()
    second.release()  # two kept connections, both about to end
    end_sessions(postgres_uri, f"mklang {me()}")
    end_sessions(postgres_uri, f"mklang-data {me()}")
    lock = postgres.lock("a")  # the kept connections' sessions ended: a new one takes the lock
    with pytest.raises(CheckpointError):  # the statement that finds the shared session ended fails ...
        postgres.read("b")
    assert postgres.read("a") == b"envelope"  # ... and the next one runs on a new session
    assert postgres.holder("a") == me()
    lock.release()
    assert postgres.holder("a") is None


def test_a_failed_lock_keeps_its_connection_for_the_next_lock(postgres, postgres_uri):
    other = PostgresStore(postgres_uri)
    try:
        held = postgres.lock("a")
        with pytest.raises(RunBusy, match=f"still going in process {me()}"):
            other.lock("a")
        assert len(sessions(postgres_uri, f"mklang {me()}")) == 2  # the holder's and the one that tried
        other.lock("b").release()
        assert len(sessions(postgres_uri, f"mklang {me()}")) == 2
        held.release()
    finally:
        other.close()


def test_a_lock_whose_new_session_fails_as_well_is_one_line_naming_the_store(postgres, postgres_uri, monkeypatch):
    postgres.lock("a").release()
    end_sessions(postgres_uri, f"mklang {me()}")  # the kept lock session ended: the lock is tried on a new one
    connect = postgres._connect

    def ended_at_once(name: str) -> Any:
        db = connect(name)
        db.close()
        return db

    monkeypatch.setattr(postgres, "_connect", ended_at_once)
    with pytest.raises(CheckpointError) as caught:
        postgres.lock("a")
    where = postgres_uri.split("?")[0]  # the URI's options are not shown
    assert str(caught.value) == f"{where}: PostgreSQL checkpoint store: the connection is closed"


def test_runs_of_one_name_in_two_schemas_are_locked_apart(postgres, postgres_uri):
    with postgres_schema() as elsewhere:
        other = PostgresStore(elsewhere)
        try:
            held = postgres.lock("a")
            other.lock("a").release()
            assert other.holder("a") is None
            assert postgres.holder("a") == me()
            held.release()
        finally:
            other.close()


def test_a_lock_whose_session_ended_releases_quietly(postgres, postgres_uri):
    lock = postgres.lock("r")
    end_sessions(postgres_uri, f"mklang {me()}")
    lock.release()
    assert postgres.holder("r") is None
    postgres.lock("r").release()


# --- PostgreSQL: durable lines wait for the flush, the others do not ----------


def judged_loop_on_postgres(uri: str, run: str, steps: int) -> None:
    from mklang.providers.scripted import ScriptedProvider
    from mklang.syntax import parse

    machine = parse(
        f'machine loop\nentry s\nbudget {steps}\nstate s {{\n  structure "x"\n  prompt "again"\n  output o\n'
        '  when "again" -> s\n  otherwise -> s\n}\n'
    )
    host = Host(ScriptedProvider({"produce": ["ok"] * steps, "judge": [0]}))
    assert len(start(machine, {}, host, checkpoint=f"{uri}#{run}").trace) == steps


@pytest.mark.parametrize(("durability", "flushed"), [("step", 1), ("call", 2)])
def test_a_judged_step_on_postgres_is_three_round_trips_and_flushes_once_with_step_durability(
    postgres_uri, monkeypatch, durability, flushed
):
    """Read from the protocol itself: a step is its two call lines and its step line, one
    exchange with the server each; `step` waits for one flush, `call` for each call's too."""
    from support.pgtrace import counted

    monkeypatch.setenv("MKLANG_DURABILITY", durability)
    judged_loop_on_postgres(postgres_uri, "warm", 2)  # the tables
    counts = []
    for steps in (10, 20):
        with counted() as whole_run:
            judged_loop_on_postgres(postgres_uri, f"r{steps}", steps)
        counts.append(whole_run)
    short, long = counts
    assert (long.exchanges - short.exchanges, long.commits - short.commits) == (3 * 10, 3 * 10)
    assert long.flushed - short.flushed == flushed * 10
    # Besides the steps, a run waits for 3 flushes: the first envelope (its summary in the same
    # statement) and its journal, and the last envelope; dropping the journal does not, nor does opening
    # a store whose tables are there (it reads the catalog and changes nothing).
    assert short.flushed == flushed * 10 + 3


def test_a_connection_the_server_replaced_prepares_the_journal_lines_again(postgres, postgres_uri):
    postgres.start_journal("a", b"gen\n")
    postgres.append("a", b"one\n", durable=True)
    end_sessions(postgres_uri, f"mklang-data {me()}")
    with pytest.raises(CheckpointError, match="PostgreSQL checkpoint store"):
        postgres.append("a", b"lost\n", durable=False)
    postgres.append("a", b"two\n", durable=False)  # a new session: its statements prepared anew
    postgres.append("a", b"three\n", durable=True)
    assert postgres.read_journal("a") == b"gen\none\ntwo\nthree\n"


def test_threads_sharing_a_lock_connection_prepare_its_journal_lines_once(postgres):
    import threading

    postgres.start_journal("a", b"gen\n")
    lock = postgres.lock("a")  # a new connection: nothing prepared on it yet
    barrier = threading.Barrier(8)

    def branch(n: int) -> None:
        barrier.wait()
        for line in range(5):
            postgres.append("a", f"{n}.{line}\n".encode(), durable=line % 2 == 0)

    threads = [threading.Thread(target=branch, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    lines = postgres.read_journal("a").splitlines()
    lock.release()
    assert lines[0] == b"gen" and sorted(lines[1:]) == sorted(
        f"{n}.{line}".encode() for n in range(8) for line in range(5)
    )


def test_a_journal_line_the_server_refuses_is_a_checkpoint_error_with_its_first_line(postgres, postgres_uri):
    postgres.start_journal("a", b"gen\n")
    postgres.append("a", b"one\n", durable=False)  # prepared on this connection
    with psycopg.connect(postgres_uri, autocommit=True) as db:
        db.execute("ALTER TABLE mklang_journal ADD CONSTRAINT short CHECK (length(line) < 8)")
    with pytest.raises(CheckpointError, match=r"PostgreSQL checkpoint store: new row .* violates check constraint"):
        postgres.append("a", b"far too long\n", durable=True)
    assert postgres.read_journal("a") == b"gen\none\n"


def test_postgres_turns_off_the_flush_wait_for_one_line_only(postgres):
    postgres.start_journal("a", b"gen\n")
    lock = postgres.lock("a")
    postgres.append("a", b"step\n", durable=False)
    for db in (postgres._db, postgres._held["a"]):
        assert db.execute("SHOW synchronous_commit").fetchone() == ("on",)
    assert PostgresStore(postgres.conninfo).read_journal("a") == b"gen\nstep\n"  # committed: on the server
    lock.release()


def test_postgres_keeps_a_summary_and_drops_a_journal_in_one_round_trip_each_without_waiting_for_the_flush(
    postgres, postgres_uri
):
    from support.pgtrace import counted

    postgres.write("a", ENVELOPE, generation=1)
    counts = []
    for times in (2, 4):
        with counted() as whole:
            store = PostgresStore(postgres_uri)
            for number in range(times):
                store.summarize("a", RunSummary("a", run_id="r", status="running", tokens=number))
                store.start_journal("a", b"gen\n")
                store.drop_journal("a")
            store.close()
        counts.append(whole)
    short, long = counts
    # Each pair: the summary and the dropped journal one exchange and one unflushed commit each; the
    # journal's start (between them) one exchange too, flushed.
    assert long.exchanges - short.exchanges == 2 * (2 + 1)
    assert (long.commits - short.commits, long.flushed - short.flushed) == (2 * 3, 2 * 1)
    assert postgres.summaries(RunQuery())[0].tokens == 3
    assert postgres.read_journal("a") == b""
    assert postgres._db.execute("SHOW synchronous_commit").fetchone() == ("on",)


def test_a_run_removed_while_the_file_store_lists_its_runs_is_left_out_and_fails_nothing(tmp_path, monkeypatch):
    """`runs rm` in another process may remove a file between the folder's listing and its reading."""
    import mklang.stores.file as file_store

    store = FileStore(tmp_path)
    for run in ("a.json", "b.json", "c.json"):
        store.write(run, ENVELOPE, generation=1)

    def removed_just_before(path: Any, *args: Any, **kwargs: Any) -> Any:
        if Path(path).name == "b.json":
            os.remove(path)
        return open(path, *args, **kwargs)

    monkeypatch.setattr(file_store, "open", removed_just_before, raising=False)
    assert store.runs() == ["a.json", "c.json"]


def test_a_run_removed_while_the_file_store_summarizes_it_is_summarized_from_what_was_read(tmp_path, monkeypatch):
    store = FileStore(tmp_path)
    store.write("a.json", b'{"format":3,"status":"done","run_id":"r-1"}', generation=1)  # written before summaries
    read = store.read

    def removed_once_read(run: str) -> bytes | None:
        raw = read(run)
        os.remove(tmp_path / run)
        return raw

    monkeypatch.setattr(store, "read", removed_once_read)
    [summary] = store.summaries(RunQuery())
    assert (summary.run, summary.run_id, summary.status, summary.updated) == ("a.json", "r-1", "done", None)


def test_file_store_segments_that_cannot_be_listed_name_the_folder_and_why(tmp_path):
    store = FileStore(tmp_path)
    segments = tmp_path / ".mklang-segments" / hashed_name("cp.json")
    segments.parent.mkdir()
    segments.write_bytes(b"not a folder")
    with pytest.raises(CheckpointError) as caught:
        store.segment_names("cp.json")
    assert str(caught.value) == f"{segments}: cannot list the trace segments: Not a directory"


@pytest.mark.parametrize(
    ("failing", "why"),
    [("write_atomic", "No space left on device"), ("link", "Operation not permitted")],
    ids=["disk full", "no hard links"],
)
def test_a_file_store_note_that_cannot_be_added_names_the_file_and_why(tmp_path, monkeypatch, failing, why):
    """A batch's first note of a store (its identity) is added by a hard link; a disk that is full, or
    a file system without hard links, is said in one line naming the note."""
    import errno

    import mklang.stores.file as file_store

    def fails(*args: Any, **kwargs: Any) -> None:
        number = errno.ENOSPC if failing == "write_atomic" else errno.EPERM
        raise OSError(number, os.strerror(number))

    monkeypatch.setattr(file_store if failing == "write_atomic" else os, failing, fails)
    store = FileStore(tmp_path)
    with pytest.raises(CheckpointError) as caught:
        store.add_note("store:identity", b"the fleet's queue")
    note = tmp_path / ".mklang-notes" / hashed_name("store:identity")
    assert str(caught.value) == f"{note}: cannot write the note: {why}"
    assert [path.name for path in note.parent.iterdir()] == []  # no temporary file left behind


def test_a_sqlite_store_that_is_not_there_or_cannot_be_made_says_so_in_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError) as missing:
        open_store("sqlite:///runs.db", create=False)  # `mklang runs` and `runs rm` make no store
    assert str(missing.value) == (
        "sqlite:///runs.db: no such SQLite checkpoint store: runs.db does not exist (check the path: "
        "sqlite:///runs.db is relative to the current folder, sqlite:////abs/runs.db absolute)"
    )
    assert not (tmp_path / "runs.db").exists()
    (tmp_path / "file").write_text("a file, not a folder")
    with pytest.raises(CheckpointError) as caught:
        open_store("sqlite:///file/runs.db")
    assert str(caught.value) == "file/runs.db: cannot open the SQLite checkpoint store: Not a directory"


def test_a_sqlite_store_written_before_runs_kept_their_generation_opens_and_takes_new_generations(tmp_path):
    import sqlite3

    with sqlite3.connect(tmp_path / "old.db") as db:
        db.execute("CREATE TABLE mklang_runs (run TEXT PRIMARY KEY, envelope BLOB NOT NULL)")
        db.execute("INSERT INTO mklang_runs VALUES ('a', ?)", (ENVELOPE,))
    db.close()
    store = SqliteStore(tmp_path / "old.db")
    try:
        assert (store.read("a"), store.generation("a")) == (ENVELOPE, 0)
        store.write("a", b"newer", generation=1)
        assert (store.read("a"), store.generation("a")) == (b"newer", 1)
    finally:
        store.close()


def test_a_run_whose_lock_session_ended_keeps_no_segment_or_summary_and_is_not_removed(postgres, postgres_uri):
    """Whatever the run writes, or whoever removes it, goes through its lock's session: with the lock
    lost, another process may hold the run, so nothing of it changes."""
    postgres.write("a", b"before", generation=1, summary=RunSummary("a", status="suspended"))
    lock = postgres.lock("a")
    postgres.start_journal("a", b"gen\n")
    end_sessions(postgres_uri, f"mklang {me()}")
    for change in (
        lambda: postgres.write_segment("a", "s1", b"steps"),
        lambda: postgres.summarize("a", RunSummary("a", status="done")),
        lambda: postgres.remove("a"),
    ):
        with pytest.raises(CheckpointError, match="PostgreSQL checkpoint store"):
            change()
    lock.release()
    assert (postgres.read("a"), postgres.read_journal("a"), postgres.read_segment("a", "s1")) == (
        b"before",
        b"gen\n",
        None,
    )
    assert [summary.status for summary in postgres.summaries(RunQuery())] == ["suspended"]


def test_a_file_store_summary_of_the_wrong_types_is_listed_with_those_fields_unknown(tmp_path):
    """A summary is display only, but one edited by hand or by someone with write access to the
    folder must neither break `mklang runs` nor be listed as what it is not."""
    store = FileStore(tmp_path)
    for run in ("a.json", "b.json"):
        store.write(run, ENVELOPE, generation=1)
    (tmp_path / ".mklang-runs").mkdir(exist_ok=True)
    (tmp_path / ".mklang-runs" / "a.json").write_text(
        json.dumps(
            {"run_id": 5, "machine": ["m"], "status": "lost", "reason": 3, "tokens": True, "cost_usd": "7"}
            | {"started": "yesterday", "updated": False}
        )
    )
    (tmp_path / ".mklang-runs" / "b.json").write_text(
        json.dumps({"run_id": "r-2", "status": "done", "tokens": 12.0, "cost_usd": 0.25, "started": 5, "updated": 6})
    )
    assert store.summaries(RunQuery()) == [
        RunSummary("b.json", "r-2", None, "done", None, 12, 0.25, 5.0, 6.0),
        RunSummary("a.json"),
    ]


@pytest.mark.parametrize(
    ("name", "valid"),
    [
        ("a" * 128, True),
        ("a" * 129, False),
        ("run-1.retry_2:b", True),
        ("-run", False),
        ("run 1", False),
        ("run.journal", False),
        ("run.lock", False),
        ("run.tmp", False),
        ("ŕun", False),
    ],
)
def test_a_run_name_is_1_to_128_safe_characters_not_ending_as_a_store_file_does(name, valid):
    if valid:
        assert run_name(name) == name
    else:
        with pytest.raises(UsageError) as refused:
            run_name(name)
        shown = repr(name) if len(name) <= 40 else f"{name[:40]!r}..."  # a long name is cut
        assert str(refused.value).startswith(f"run name {shown} is not valid: a run name is 1 to 128 ASCII letters")


def test_opening_a_store_waits_on_no_transaction_in_flight(postgres, postgres_uri):
    """A process opening the store while another's journal line is mid-transaction (holding
    `mklang_journal`, about to update `mklang_runs`) takes no table lock: were it to run the
    schema's `ALTER TABLE ... IF NOT EXISTS` again, it would queue behind that transaction, and the
    two could deadlock. The server gives up on a lock after 2 s here, so a wait fails the test."""
    postgres.write("a", b"envelope", generation=1)
    with psycopg.connect(postgres_uri) as in_flight:  # a transaction, left open while the store opens
        in_flight.execute("INSERT INTO mklang_journal (run, line) VALUES ('a', 'line')")
        in_flight.execute("UPDATE mklang_runs SET journal_bytes = journal_bytes + 4 WHERE run = 'a'")
        opened = PostgresStore(postgres_uri + "%20-clock_timeout%3D2000")
        try:
            assert opened.read("a") == b"envelope"
        finally:
            opened.close()


def test_a_store_missing_a_column_gets_it_on_open(postgres, postgres_uri):
    """A database from an earlier release (here: without the summary's `reason`) is brought up to date."""
    with psycopg.connect(postgres_uri, autocommit=True) as db:
        db.execute("ALTER TABLE mklang_runs DROP COLUMN reason")
    PostgresStore(postgres_uri).close()
    with psycopg.connect(postgres_uri, autocommit=True) as db:
        names = {
            row[0]
            for row in db.execute(
                "SELECT column_name FROM information_schema.columns "
                "WHERE table_schema = current_schema() AND table_name = 'mklang_runs'"
            )
        }
    assert "reason" in names


def test_every_statement_of_the_postgresql_schema_is_one_the_open_checks_for():
    """`_has_schema` skips the DDL when the catalog has what `SCHEMA` declares: a statement of a
    form it does not look for would never run on an existing store."""
    from mklang.stores import postgres as module

    statements = [s.strip() for s in module.SCHEMA.split(";") if s.strip()]
    assert statements and all(any(re.match(p, s) for p in module._DECLARED) for s in statements), statements
