"""Managing stored runs on every store (a folder, SQLite, PostgreSQL): `runs`, `runs rm`, `runs prune`.

Runs are the approval example with its scripted model, run through the CLI in
this process: one parked on its human question, one done. A listing reads
each run's summary (display only); removing decides from the signed
envelope, under the run's lock.
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.commands import cli_env, error_in, run_cli
from support.examples import HITL

from mklang.runs import record_key, report_key
from mklang.stores import open_store

APPROVAL = HITL / "approval"
ASK = "Publish this announcement? Answer yes, or say what to change."
HEADER = ["RUN", "MACHINE", "STATUS", "REASON", "OR", "QUESTION", "SPEND", "STARTED", "(UTC)", "UPDATED", "(UTC)"]


@pytest.fixture(params=["file", "sqlite", "postgresql"])
def store_uri(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh store of each kind, the current folder a temporary one."""
    monkeypatch.chdir(tmp_path)
    if request.param == "file":
        (tmp_path / "runs").mkdir()
        return "runs"
    if request.param == "sqlite":
        return "sqlite:///runs.db"
    return str(request.getfixturevalue("postgres_uri"))


def target(store: str, run: str) -> str:
    return f"{store}#{run}" if "://" in store else f"{store}/{run}"


def start(capsys: pytest.CaptureFixture[str], store: str, run: str, scenario: str = "ask-then-publish") -> int:
    """Run the approval example into the store: `ask-then-publish` parks, `approved-answer-given-up-front` is done."""
    code, _, err = run_cli(
        capsys, "run", str(APPROVAL / "approval.mk"), "-q", "--script", str(APPROVAL / "scenarios.yaml"),
        "--scenario", scenario, "--checkpoint", target(store, run), "--format", "json",
        *(["--hitl"] if scenario == "ask-then-publish" else []),
    )  # fmt: skip
    assert code in (0, 3), err
    return code


def listing(capsys: pytest.CaptureFixture[str], store: str, *options: str) -> dict:
    code, out, err = run_cli(capsys, "runs", "--store", store, "--format", "json", *options)
    assert code == 0, err
    return json.loads(out)


def names(document: dict) -> list[str]:
    return [run["run"] for run in document["runs"]]


def tamper(store: str, run: str, **fields: object) -> None:
    """Edit a run's summary as someone with write access to the store could."""
    if store.startswith("sqlite:"):
        with sqlite3.connect(store.removeprefix("sqlite:///")) as db:
            for name, value in fields.items():
                db.execute(f"UPDATE mklang_runs SET {name} = ? WHERE run = ?", (value, run))
    elif store.startswith("postgresql:"):
        import psycopg

        with psycopg.connect(store, autocommit=True) as db:
            for name, value in fields.items():
                db.execute(f"UPDATE mklang_runs SET {name} = %s WHERE run = %s", (value, run))
    else:
        path = Path(store) / ".mklang-runs" / run
        path.write_text(json.dumps({**json.loads(path.read_text()), **fields}), encoding="utf-8")


def test_runs_lists_newest_first_under_headers_with_filters_and_pages(store_uri, capsys, monkeypatch):
    start(capsys, store_uri, "p-1")
    start(capsys, store_uri, "d-1", "approved-answer-given-up-front")
    start(capsys, store_uri, "p-2")
    listed = listing(capsys, store_uri)
    assert names(listed) == ["p-2", "d-1", "p-1"] and (listed["page"], listed["more"]) == (1, False)
    parked = listed["runs"][0]
    assert (parked["machine"], parked["status"], parked["reason"]) == ("approval", "suspended", ASK)
    assert parked["checkpoint"] == target(store_uri, "p-2") and parked["started"] <= parked["updated"]
    assert listed["runs"][1]["status"] == "done" and listed["runs"][1]["reason"] is None

    code, text, _ = run_cli(capsys, "runs", "--store", store_uri, "--format", "text")
    lines = text.splitlines()
    assert code == 0 and lines[0].split() == HEADER
    assert [line.split()[:3] for line in lines[1:]] == [
        ["p-2", "approval", "suspended"],
        ["d-1", "approval", "done"],
        ["p-1", "approval", "suspended"],
    ]
    assert "Publish this announcement?" in lines[1]

    assert names(listing(capsys, store_uri, "--status", "suspended")) == ["p-2", "p-1"]
    assert names(listing(capsys, store_uri, "--status", "done", "--status", "halted")) == ["d-1"]
    assert names(listing(capsys, store_uri, "--machine", "approval")) == ["p-2", "d-1", "p-1"]
    assert names(listing(capsys, store_uri, "--machine", "other")) == []
    assert names(listing(capsys, store_uri, "--since", "1h")) == ["p-2", "d-1", "p-1"]
    assert names(listing(capsys, store_uri, "--since", "2999-01-01")) == []
    first = listing(capsys, store_uri, "--limit", "2")
    assert (names(first), first["more"]) == (["p-2", "d-1"], True)
    second = listing(capsys, store_uri, "--limit", "2", "--page", "2")
    assert (names(second), second["more"]) == (["p-1"], False)

    before = listed["runs"][2]
    with monkeypatch.context() as later:  # the listing's times are in whole seconds: resume two seconds on
        later.setattr(time, "time", lambda now=time.time: now() + 2)
        code, _, err = run_cli(
            capsys, "resume", target(store_uri, "p-1"), "--set", "approval.answer=yes", "--format", "json"
        )
    assert code == 0, err
    after = {run["run"]: run for run in listing(capsys, store_uri)["runs"]}["p-1"]
    assert after["status"] == "done" and after["started"] == before["started"] and after["updated"] > before["updated"]


def test_runs_refuses_a_bad_filter_in_one_line(store_uri, capsys):
    start(capsys, store_uri, "p-1")
    for options, message in (
        (["--status", "lost"], "--status expects one of running, suspended, done, halted"),
        (["--since", "yesterday"], "--since expects a duration such as 90s, 10m, 1h30m or 7d"),
    ):
        code, out, err = run_cli(capsys, "runs", "--store", store_uri, *options)
        assert code == 2 and message in error_in(out, err, code)


def test_listing_a_store_imports_no_engine_no_batch_and_no_renderer(tmp_path, monkeypatch, capsys):
    """`mklang runs` pays for parsing its command line and reading one page, nothing a run needs."""
    monkeypatch.chdir(tmp_path)
    start(capsys, "sqlite:///runs.db", "p-1")
    code = (
        "import sys\nfrom mklang.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as done:\n"
        "    sys.stderr.write(f'exit {done.code} ' + ' '.join(sorted(sys.modules)))\n"
    )
    args = ["runs", "--store", "sqlite:///runs.db", "--limit", "50", "--format", "json"]
    done = subprocess.run([sys.executable, "-c", code, *args], env=cli_env(), capture_output=True, text=True)
    exit_line, *loaded = done.stderr.rsplit("exit ", 1)[-1].split()
    assert exit_line == "0" and names(json.loads(done.stdout)) == ["p-1"], done.stderr
    heavy = ("mklang.engine", "mklang.model", "mklang.effects", "mklang.batching", "mklang.runs", "rich", "pydantic")
    assert [name for name in loaded if name.startswith(heavy)] == []


def test_a_page_of_a_sqlite_store_and_its_open_read_through_indexes(tmp_path, monkeypatch, capsys):
    """Neither the listing's page nor the backfill every open runs scans the table or sorts it:
    on a store of 10,000 runs either would read every row."""
    from mklang.stores import RunQuery, summaries_of
    from mklang.stores.sqlite import SqliteStore

    monkeypatch.chdir(tmp_path)
    start(capsys, "sqlite:///runs.db", "p-1")
    asked: list[str] = []
    connect = SqliteStore._connect

    def traced(store: SqliteStore) -> sqlite3.Connection:
        connection = connect(store)
        connection.set_trace_callback(asked.append)
        return connection

    monkeypatch.setattr(SqliteStore, "_connect", traced)
    opened = open_store("sqlite:///runs.db", create=False)
    try:
        assert [summary.run for summary in summaries_of(opened, RunQuery(limit=51, offset=50))] == []
    finally:
        opened.close()
    selects = [sql for sql in asked if sql.startswith("SELECT") and "FROM mklang_runs" in sql]
    assert any("ORDER BY" in sql for sql in selects) and any("IS NULL" in sql for sql in selects), selects
    with sqlite3.connect("runs.db") as db:
        for sql in selects:
            plan = " / ".join(row[-1] for row in db.execute(f"EXPLAIN QUERY PLAN {sql}"))
            assert "USING INDEX" in plan and "TEMP B-TREE" not in plan, (sql, plan)


OLD_SQLITE = """
CREATE TABLE mklang_runs (run TEXT PRIMARY KEY, envelope BLOB NOT NULL, generation INTEGER NOT NULL DEFAULT 0);
CREATE TABLE mklang_journal (run TEXT NOT NULL, seq INTEGER PRIMARY KEY AUTOINCREMENT, line BLOB NOT NULL);
CREATE INDEX mklang_journal_run ON mklang_journal (run, seq);
CREATE TABLE mklang_notes (key TEXT PRIMARY KEY, value BLOB NOT NULL);
CREATE TABLE mklang_spend (
    batch TEXT NOT NULL, run TEXT NOT NULL, tokens INTEGER NOT NULL, cost REAL NOT NULL, PRIMARY KEY (batch, run)
);
"""


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_a_store_of_the_previous_release_opens_and_lists_its_runs(kind, tmp_path, monkeypatch, capsys, request):
    """Its tables gain the summary's columns on open, filled from each run's envelope; times stay unknown."""
    monkeypatch.chdir(tmp_path)
    start(capsys, ".", "p-1")  # a parked run's envelope (its machine named from this folder), as before too
    envelope = (tmp_path / "p-1").read_bytes()
    if kind == "sqlite":
        store = "sqlite:///old.db"
        with sqlite3.connect("old.db") as db:
            db.executescript(OLD_SQLITE)
            db.execute("INSERT INTO mklang_runs (run, envelope, generation) VALUES (?, ?, 1)", ("p-1", envelope))
    else:
        import psycopg

        store = str(request.getfixturevalue("postgres_uri"))
        with psycopg.connect(store, autocommit=True) as db:
            db.execute(
                OLD_SQLITE.replace("BLOB", "BYTEA").replace(
                    "INTEGER PRIMARY KEY AUTOINCREMENT", "BIGSERIAL PRIMARY KEY"
                )
            )
            db.execute("INSERT INTO mklang_runs (run, envelope, generation) VALUES (%s, %s, 1)", ("p-1", envelope))
    listed = listing(capsys, store)["runs"]
    assert [(run["run"], run["status"], run["reason"], run["started"]) for run in listed] == [
        ("p-1", "suspended", ASK, None)
    ]
    code, text, _ = run_cli(capsys, "runs", "--store", store, "--format", "text")
    assert code == 0 and text.splitlines()[1].split()[-2:] == ["-", "-"]
    code, _, err = run_cli(capsys, "resume", f"{store}#p-1", "--set", "approval.answer=yes", "--format", "json")
    assert code == 0, err
    (run,) = listing(capsys, store)["runs"]
    assert run["status"] == "done" and run["started"] is not None


def test_rm_removes_a_finished_run_whole_and_keeps_an_unfinished_one_unless_asked(store_uri, capsys):
    start(capsys, store_uri, "d-1", "approved-answer-given-up-front")
    start(capsys, store_uri, "p-1")
    opened = open_store(store_uri)
    opened.write_note(record_key("d-1"), b"record")
    opened.write_note(report_key("d-1"), b"report")
    code, out, err = run_cli(
        capsys, "runs", "rm", target(store_uri, "d-1"), target(store_uri, "p-1"), "--format", "text"
    )
    assert code == 1 and f"removed {target(store_uri, 'd-1')} (done)" in out and "1 run(s) removed, 1 kept" in out
    assert err.strip() == f"mklang: kept {target(store_uri, 'p-1')}: not finished (suspended): --unfinished removes it"
    assert opened.read("d-1") is None and opened.read_journal("d-1") == b""
    assert opened.read_note(record_key("d-1")) is None and opened.read_note(report_key("d-1")) is None
    assert names(listing(capsys, store_uri)) == ["p-1"]
    code, out, _ = run_cli(capsys, "runs", "rm", target(store_uri, "p-1"), "--unfinished", "--format", "json")
    assert code == 0 and json.loads(out) == {"removed": [target(store_uri, "p-1")], "kept": []}
    assert opened.read("p-1") is None and names(listing(capsys, store_uri)) == []
    code, _, err = run_cli(capsys, "runs", "rm", target(store_uri, "p-1"))
    assert code == 1 and err.strip() == f"mklang: kept {target(store_uri, 'p-1')}: no such run"
    opened.close()


def test_rm_refuses_a_run_name_that_leaves_the_store_before_removing_anything(store_uri, capsys, tmp_path):
    start(capsys, store_uri, "d-1", "approved-answer-given-up-front")
    outside = tmp_path / "precious.json"
    outside.write_text('{"format": 2, "mine": true}', encoding="utf-8")
    hostile = ["../precious.json", "..", ".mklang-runs/d-1", "d-1/../../precious.json"]
    if "://" not in store_uri:  # a folder store's run is named by its path
        hostile = [".."]
    for name in hostile:
        code, out, err = run_cli(
            capsys, "runs", "rm", target(store_uri, "d-1"), target(store_uri, name), "--unfinished"
        )
        assert code == 2 and "is not valid: a run name is" in error_in(out, err, code)
    assert names(listing(capsys, store_uri)) == ["d-1"] and outside.exists()
    if "://" not in store_uri:  # a path to what is no checkpoint (outside, or a summary) is never removed
        for path in (f"{store_uri}/../precious.json", f"{store_uri}/.mklang-runs/d-1", f"{store_uri}/."):
            code, _, err = run_cli(capsys, "runs", "rm", path, "--unfinished")
            assert code == 1 and "not removed" in err and Path(path).exists(), err


def test_a_run_whose_lock_is_held_is_never_removed(store_uri, capsys):
    start(capsys, store_uri, "d-1", "approved-answer-given-up-front")
    opened = open_store(store_uri)
    held = opened.lock("d-1")  # as a resume or a worker holds it while the run goes on
    try:
        code, _, err = run_cli(capsys, "runs", "rm", target(store_uri, "d-1"), "--unfinished")
        assert code == 1 and "the run is still going in process" in err
        code, out, err = run_cli(
            capsys, "runs", "prune", "--store", store_uri, "--older-than", "0s", "--format", "json"
        )
        assert code == 0 and json.loads(out)["removed"] == [] and "still going" in err
        assert opened.read("d-1") is not None
    finally:
        held.release()
    code, out, _ = run_cli(capsys, "runs", "prune", "--store", store_uri, "--older-than", "0s", "--format", "json")
    assert code == 0 and json.loads(out)["removed"] == [target(store_uri, "d-1")]
    opened.close()


def test_prune_removes_old_finished_runs_and_a_tampered_summary_decides_nothing(store_uri, capsys):
    start(capsys, store_uri, "d-1", "approved-answer-given-up-front")
    start(capsys, store_uri, "p-1")
    start(capsys, store_uri, "p-2")
    code, out, _ = run_cli(capsys, "runs", "prune", "--store", store_uri, "--older-than", "30d", "--format", "text")
    assert code == 0 and out.splitlines() == ["0 run(s) removed, 0 kept"]
    # Someone who can write the store says the parked runs finished long ago: their envelopes say otherwise.
    tamper(store_uri, "p-1", status="done", updated=0.0)
    tamper(store_uri, "p-2", status="halted", updated=0.0)
    code, out, err = run_cli(capsys, "runs", "prune", "--store", store_uri, "--older-than", "1d", "--format", "text")
    assert code == 0 and "0 run(s) removed, 2 kept" in out
    assert "not finished (suspended)" in err
    code, out, _ = run_cli(capsys, "runs", "prune", "--store", store_uri, "--older-than", "0s", "--status", "halted")
    assert code == 0 and json.loads(out)["removed"] == []  # d-1 is done, not halted
    code, out, _ = run_cli(capsys, "runs", "prune", "--store", store_uri, "--older-than", "0s", "--format", "json")
    assert code == 0 and json.loads(out)["removed"] == [target(store_uri, "d-1")]
    opened = open_store(store_uri)
    assert opened.read("p-1") is not None and opened.read("p-2") is not None
    opened.close()
    code, out, err = run_cli(
        capsys, "runs", "prune", "--store", store_uri, "--older-than", "1d", "--status", "suspended"
    )
    assert code == 2 and "unfinished runs are kept" in error_in(out, err, code)


@pytest.mark.parametrize(
    "scenario", ["ask-then-publish", "approved-answer-given-up-front", "rejected", "endless-revisions-hit-the-ceiling"]
)
def test_show_prints_the_document_run_printed(store_uri, capsys, scenario):
    """Parked, done, halted, and suspended on a budget: the same document, less what one process paid."""
    code, out, err = run_cli(
        capsys, "run", str(APPROVAL / "approval.mk"), "-q", "--script", str(APPROVAL / "scenarios.yaml"),
        "--scenario", scenario, "--checkpoint", target(store_uri, "r-1"), "--format", "json",
        *(["--hitl"] if scenario == "ask-then-publish" else []),
    )  # fmt: skip
    printed = json.loads(out)
    assert printed.pop("calls") and code in (0, 1, 3), err
    code, shown, _ = run_cli(capsys, "show", target(store_uri, "r-1"), "--format", "json")
    assert code == 0 and json.loads(shown) == printed
    code, text, _ = run_cli(capsys, "show", target(store_uri, "r-1"), "--format", "text")
    assert code == 0 and text.splitlines()[0].startswith(printed["status"]) and "trace" in text


def test_show_prints_a_batch_run_as_the_batch_reported_it(store_uri, capsys, tmp_path):
    (tmp_path / "items.jsonl").write_text('{"id": "post-1", "approval": {"answer": "yes"}}\n', encoding="utf-8")
    code, _, err = run_cli(
        capsys, "batch", str(APPROVAL / "approval.mk"), "--inputs", "items.jsonl", "--store", store_uri,
        "--script", str(APPROVAL / "scenarios.yaml"), "--scenario", "approved-answer-given-up-front",
        "--out", "out.jsonl", "--format", "json",
    )  # fmt: skip
    assert code == 0, err
    reported = json.loads((tmp_path / "out.jsonl").read_text())
    code, shown, _ = run_cli(capsys, "show", target(store_uri, "post-1"), "--format", "json")
    document = json.loads(shown)
    assert code == 0 and (document["status"], document["result"], document["usage"]) == (
        reported["status"],
        reported["result"],
        reported["usage"],
    )
    assert document["context"]["approval"] == {"answer": "yes"} and document["trace"][-1]["state"] == "publish"


def test_rm_json_lists_each_kept_run_with_its_verified_status_and_why(store_uri, capsys):
    """What a script reads of `runs rm --format json`: each kept run named as given, its status as its
    signed envelope says (None: no run there) and the one line said on stderr."""
    start(capsys, store_uri, "d-1", "approved-answer-given-up-front")
    start(capsys, store_uri, "p-1")
    opened = open_store(store_uri)
    held = opened.lock("d-1")
    try:
        code, out, err = run_cli(
            capsys, "runs", "rm", *(target(store_uri, run) for run in ("p-1", "gone", "d-1")), "--format", "json"
        )
    finally:
        held.release()
        opened.close()
    # PostgreSQL names its lock's holder by pid and host, and the store without the URI's options.
    holder = f"{os.getpid()}@{socket.gethostname()}" if store_uri.startswith("postgresql:") else str(os.getpid())
    locked = target(store_uri.partition("?")[0], "d-1")
    kept = [
        {
            "run": target(store_uri, "p-1"),
            "removed": False,
            "status": "suspended",
            "why": f"{target(store_uri, 'p-1')}: not finished (suspended): --unfinished removes it",
        },
        {
            "run": target(store_uri, "gone"),
            "removed": False,
            "status": None,
            "why": f"{target(store_uri, 'gone')}: no such run",
        },
        {
            "run": target(store_uri, "d-1"),
            "removed": False,
            "status": "running",
            "why": f"{locked}: the run is still going in process {holder}; "
            "wait for it, or stop it (Ctrl-C suspends it) before resuming",
        },
    ]
    assert code == 1 and json.loads(out) == {"removed": [], "kept": kept}
    assert err.splitlines() == [f"mklang: kept {removal['why']}" for removal in kept]
