"""Restored and cut-short runs (ADR 0022, ADR 0052, docs/limits.md "Trust"): an older envelope put
back, or a journal cut shorter than what was committed to it, must not run again what ran after it
(paid calls, tool actions, a human approval) without a word. Each test is one attack on real `mklang`
processes killed at injected points (`MKLANG_KILL_AT`), real files and real databases.
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest
from support.commands import cli, cli_env, refused
from support.examples import HITL
from support.forks import forked
from support.services import postgres_schema

APPROVAL = ["--script", "approval/scenarios.yaml", "--scenario", "ask-then-publish", "--format", "json"]
PUBLISHED = '"result": "https://status.example.com/posts/118"'


@pytest.fixture
def approval(tmp_path: Path) -> Path:
    shutil.copytree(HITL / "approval", tmp_path / "approval")
    return tmp_path


def store_rows(uri: str):
    """A DB-API connection to the store's database and its placeholder."""
    if uri.startswith("sqlite"):
        return sqlite3.connect(uri.removeprefix("sqlite:///"), isolation_level=None), "?"
    import psycopg

    return psycopg.connect(uri, autocommit=True), "%s"


@pytest.fixture(params=["sqlite", "postgresql"])
def store_uri(request, approval: Path):
    if request.param == "sqlite":
        yield f"sqlite:///{approval / 'runs.db'}"
    else:
        with postgres_schema() as uri:
            yield uri


def killed_at(where: str, point: str, approval: Path, *args: str) -> None:
    """A run of the approval example at `where`, killed by SIGKILL at the injected point `point`."""
    command = args or ("run", "approval/approval.mk", "--hitl", "--checkpoint", where)
    done = forked(*command, *APPROVAL, cwd=approval, env=cli_env(MKLANG_KILL_AT=point))
    assert done.returncode == -9, done.stderr


# --- a restored older envelope ----------------------------------------------------


def test_a_restored_checkpoint_and_the_first_line_of_its_approving_resume_do_not_publish_again(approval):
    suspended = cli("run", "approval/approval.mk", *APPROVAL, "--hitl", "--checkpoint", "cp.json", cwd=approval)
    assert suspended.returncode == 3, suspended.stderr
    backup = (approval / "cp.json").read_bytes()
    # The approving resume dies just after its journal's first line (which records the approval).
    killed_at("cp.json", "journal.gen:1", approval, "resume", "cp.json", "--set", "approval.answer=yes")
    first_line = (approval / "cp.json.journal").read_bytes()
    published = cli("resume", "cp.json", *APPROVAL, cwd=approval)
    assert published.returncode == 0, published.stderr
    assert PUBLISHED in published.stdout

    (approval / "cp.json").write_bytes(backup)  # put back from a backup, with no --set and no --trust
    (approval / "cp.json.journal").write_bytes(first_line)
    line = refused(cli("resume", "cp.json", *APPROVAL, cwd=approval))
    assert "is older than generation" in line and "human approvals" in line and "--allow-rollback" in line

    again = cli("resume", "cp.json", "--allow-rollback", *APPROVAL, cwd=approval)
    assert again.returncode == 0, again.stderr
    assert "may repeat" not in again.stderr and "resuming it anyway (--allow-rollback)" in again.stderr


def test_a_store_row_and_journal_restored_for_a_fresh_state_folder_do_not_publish_again(
    approval, store_uri, tmp_path_factory
):
    """The store keeps how far each run id got (ADR 0052): another machine, user or CI job, with a
    state folder that never saw the run, is refused an old envelope and journal put back whole."""
    target = f"{store_uri}#announce"
    assert cli("run", "approval/approval.mk", *APPROVAL, "--hitl", "--checkpoint", target, cwd=approval).returncode == 3
    db, mark = store_rows(store_uri)
    try:
        old = db.execute(f"SELECT envelope, generation FROM mklang_runs WHERE run = {mark}", ("announce",)).fetchone()
        # The approving resume dies after its first paid call; its journal's first line records the approval.
        killed_at(target, "journal.call:1", approval, "resume", target, "--set", "approval.answer=yes")
        first_lines = db.execute(f"SELECT line FROM mklang_journal WHERE run = {mark} ORDER BY seq", ("announce",))
        approving = [bytes(line) for (line,) in first_lines.fetchall()]
        assert len(approving) == 2 and b'"resume":' in approving[0]
        published = cli("resume", target, *APPROVAL, cwd=approval)
        assert published.returncode == 0 and PUBLISHED in published.stdout, published.stderr

        # A backup of the run's rows taken while the approving resume ran, put back whole.
        db.execute(
            f"UPDATE mklang_runs SET envelope = {mark}, generation = {mark} WHERE run = {mark}", (*old, "announce")
        )
        for line in approving:
            db.execute(f"INSERT INTO mklang_journal (run, line) VALUES ({mark}, {mark})", ("announce", line))
        fresh = cli_env(XDG_STATE_HOME=str(tmp_path_factory.mktemp("fresh-state")))
        line = refused(cli("resume", target, *APPROVAL, cwd=approval, env=fresh))
        assert f"generation {old[1]} of run" in line and "human approvals" in line and "--allow-rollback" in line

        # The row's own generation refuses too, whatever the state folder or the record of the run id.
        db.execute("DELETE FROM mklang_generations")
        db.execute(f"UPDATE mklang_runs SET generation = 99 WHERE run = {mark}", ("announce",))
        line = refused(cli("resume", target, *APPROVAL, cwd=approval, env=fresh))
        assert f"generation {old[1]} of run" in line and "older than generation 99" in line
    finally:
        db.close()


# --- a journal cut shorter than what was committed ---------------------------------


def test_a_journal_cut_back_to_its_header_after_a_kill_is_refused_not_paid_again(approval):
    killed_at("cp.json", "journal.call:1", approval)  # its first paid answer is committed
    journal = approval / "cp.json.journal"
    whole = journal.read_bytes()
    header = whole[: whole.index(b"\n") + 1]
    before = (approval / "cp.json").read_bytes()
    for cut in (header, whole[:-20]):
        journal.write_bytes(cut)  # a copy cut short, or lines removed by hand
        line = refused(cli("resume", "cp.json", *APPROVAL, cwd=approval))
        assert line.endswith(
            f"cp.json.journal: the journal holds {len(cut)} bytes, fewer than the {len(whole)} committed to it: "
            "it was cut short after the run stopped (a truncated copy, or lines removed); recovering from it "
            "would pay its calls again, so it is refused"
        ), line
        assert (approval / "cp.json").read_bytes() == before
    journal.write_bytes(whole + b'{"k":"call","key":"torn')  # a line a crash tore past the last commit
    resumed = cli("resume", "cp.json", *APPROVAL, cwd=approval)
    assert resumed.returncode == 3, resumed.stderr
    assert "the journal ends in 1 incomplete or unreadable line(s) after line 2" in resumed.stderr


def test_journal_rows_deleted_after_a_kill_are_refused_not_paid_again(approval, store_uri):
    target = f"{store_uri}#announce"
    killed_at(target, "journal.call:1", approval)
    db, mark = store_rows(store_uri)
    try:
        lines = db.execute(f"SELECT seq, line FROM mklang_journal WHERE run = {mark} ORDER BY seq", ("announce",))
        (header_seq, _), *calls = lines.fetchall()
        committed = sum(len(bytes(line)) for _, line in [(header_seq, _), *calls])
        assert len(calls) == 1
        db.execute(f"DELETE FROM mklang_journal WHERE run = {mark} AND seq > {mark}", ("announce", header_seq))
        line = refused(cli("resume", target, *APPROVAL, cwd=approval))
        assert f"#announce: the journal holds {len(bytes(_))} bytes, fewer than the {committed} committed" in line
        db.execute(f"DELETE FROM mklang_journal WHERE run = {mark}", ("announce",))  # every line, its header too
        assert "the journal holds 0 bytes" in refused(cli("resume", target, *APPROVAL, cwd=approval))
    finally:
        db.close()
