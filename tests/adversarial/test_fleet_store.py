"""Attacks on the fleet's stores and batches: run names, replaced runs, unreadable and forged rows.

Each test drives the CLI as a user would (in this process through its entry
function, or as a real process where signals or two processes are the
point: forked, support/forks.py) against the fake model server on 127.0.0.1, so every paid call is
counted where it is paid, and against the real PostgreSQL where a test names it.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import signal
import socket
import stat
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from support.batches import CALLS, MACHINE
from support.commands import cli, cli_env, error_in, model_config, run_cli, wait_for
from support.examples import HITL
from support.fakeserver import FakeServer, Reply, answer
from support.fleet import Lines
from support.forks import piped
from support.services import require_server

import mklang as api
from mklang.errors import UsageError
from mklang.stores import open_store


@pytest.fixture
def project(tmp_path: Path, server: FakeServer, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder (the current one) with MACHINE as m.mk and a config whose model is the fake server."""
    server.fallback = answer("ok", input_tokens=10, output_tokens=5)
    (tmp_path / "m.mk").write_text(MACHINE, encoding="utf-8")
    model_config(server.openai_url, tmp_path / "mklang.toml")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def write_inputs(folder: Path, *lines: dict[str, Any]) -> Path:
    path = folder / "inputs.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


# Run names --------------------------------------------------------------------------------------

BAD_NAMES = ["../x", "..", "/tmp/elsewhere/cp.json", "a\nb", "a\x00b", "x" * 300, ".hidden", "a/b", "cp.json.journal"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_a_batch_input_id_that_is_no_run_name_is_refused_before_any_run(project, server, capsys, name):
    write_inputs(project, {"id": "fine-1", "topic": "a"}, {"id": name, "topic": "b"})
    code, out, err = run_cli(
        capsys, "batch", "m.mk", "--inputs", "inputs.jsonl", "--store", "runs", "--config", "mklang.toml"
    )
    line = error_in(out, err)
    assert code == 2 and "inputs.jsonl:2: run name" in line and "is not valid" in line, err
    assert server.count == 0  # nothing ran, not even the good line
    assert not (project / "runs").exists() or not any((project / "runs").iterdir())
    assert not (project / "x").exists() and not Path("/tmp/elsewhere").exists()


@pytest.mark.parametrize("name", ["../x", "a\nb", "x" * 300])
def test_a_store_run_name_is_checked_by_run_resume_and_show(project, server, capsys, name):
    target = f"sqlite:///runs.db#{name}"
    for command in (
        ["run", "m.mk", "-q", "--config", "mklang.toml", "--checkpoint", target],
        ["resume", target],
        ["show", target],
    ):
        code, out, err = run_cli(capsys, *command)
        assert code == 2 and "run name" in error_in(out, err), (command, err)
    assert server.count == 0


def test_a_checkpoint_file_name_is_a_run_name_too(project, server, capsys):
    code, out, err = run_cli(capsys, "run", "m.mk", "-q", "--config", "mklang.toml", "--checkpoint", "runs/.cp.json")
    assert code == 2 and "runs: run name '.cp.json' is not valid" in error_in(out, err)
    assert server.count == 0


def test_the_python_batch_checks_run_names_the_same_way(project, server):
    from mklang.providers.factory import make_provider

    provider = make_provider(config_path=str(project / "mklang.toml"))
    with pytest.raises(UsageError, match=r"input 1: run name '\.\./x' is not valid"):
        api.batch(project / "m.mk", [{"id": "../x", "topic": "a"}], store=str(project / "runs"), provider=provider)
    assert server.count == 0


def test_an_input_without_id_is_named_alike_by_the_cli_and_the_python_batch(project, server, capsys):
    from mklang.providers.factory import make_provider

    write_inputs(project, {"topic": "a", "n": 1})
    store = "sqlite:///runs.db"
    code, _, err = run_cli(
        capsys, "batch", "m.mk", "--inputs", "inputs.jsonl", "--store", store, "--config", "mklang.toml"
    )
    assert code == 0, err
    provider = make_provider(config_path=str(project / "mklang.toml"))
    again = api.batch(project / "m.mk", [{"n": 1, "topic": "a"}], store=store, provider=provider)
    assert [(result.status, result.run) for result in again] == [("done", open_store(store).runs()[0])]
    assert server.count == CALLS  # the API found the CLI's run finished: nothing paid twice


# A run never silently replaces another ---------------------------------------------------------


def suspend_at(capsys: pytest.CaptureFixture[str], target: str) -> None:
    """A run at `target` suspended on its token budget after its first call."""
    code, _, err = run_cli(
        capsys, "run", "m.mk", "-q", "--config", "mklang.toml", "--checkpoint", target, "--max-tokens", "1"
    )
    assert code == 3, err


@pytest.mark.parametrize("target", ["cp.json", "sqlite:///runs.db#T-1"])
def test_a_run_is_refused_where_a_run_is_not_finished_and_replace_says_so(project, server, capsys, target):
    suspend_at(capsys, target)
    before = server.count
    code, out, err = run_cli(capsys, "run", "m.mk", "-q", "--config", "mklang.toml", "--checkpoint", target)
    line = error_in(out, err)
    assert code == 2 and "a run that is not finished is there (suspended (cost-exhausted))" in line, err
    assert f"`mklang resume {shlex.quote(target)}`" in line and "--replace" in line
    assert server.count == before  # refused before any call
    code, out, err = run_cli(
        capsys, "run", "m.mk", "-q", "--config", "mklang.toml", "--checkpoint", target, "--replace"
    )
    assert code == 0 and json.loads(out)["status"] == "done", err
    assert server.count == before + CALLS


def test_a_finished_run_is_replaced_by_a_new_one(project, server, capsys):
    for _ in range(2):
        code, out, err = run_cli(capsys, "run", "m.mk", "-q", "--config", "mklang.toml", "--checkpoint", "cp.json")
        assert code == 0 and json.loads(out)["status"] == "done", err
    assert server.count == 2 * CALLS


def test_a_file_that_is_no_run_is_not_overwritten(project, server, capsys):
    notes = project / "notes.txt"
    notes.write_text("my notes\n", encoding="utf-8")
    code, out, err = run_cli(capsys, "run", "m.mk", "-q", "--config", "mklang.toml", "--checkpoint", "notes.txt")
    assert code == 2 and "it is not replaced: name another checkpoint, or give --replace" in error_in(out, err)
    assert notes.read_text(encoding="utf-8") == "my notes\n" and server.count == 0


def test_a_resume_elsewhere_does_not_replace_the_run_there(project, server, capsys):
    suspend_at(capsys, "a.json")
    suspend_at(capsys, "b.json")
    before = (project / "b.json").read_bytes()
    code, out, err = run_cli(capsys, "resume", "a.json", "--checkpoint", "b.json", "--max-tokens", "1000")
    assert code == 2 and "`mklang resume b.json`" in error_in(out, err)
    assert (project / "b.json").read_bytes() == before and server.count == 2


def test_replace_without_a_checkpoint_is_refused(project, server, capsys):
    code, out, err = run_cli(capsys, "run", "m.mk", "-q", "--config", "mklang.toml", "--replace")
    assert code == 2 and "--replace" in error_in(out, err) and server.count == 0


# Two batch passes at once -----------------------------------------------------------------------

RACE_ITEMS = 120


def test_two_batches_over_one_postgresql_store_pay_each_run_once(postgres_uri, tmp_path, server):
    """Each batch takes a run's lock before it reads whether the run is there: a run the other one
    finished meanwhile is skipped, never started again."""
    server.handler = lambda request: answer("ok", input_tokens=10, output_tokens=5, delay=0.005)
    (tmp_path / "m.mk").write_text(MACHINE, encoding="utf-8")
    model_config(server.openai_url, tmp_path / "mklang.toml")
    write_inputs(tmp_path, *({"id": f"r-{n}", "topic": str(n)} for n in range(RACE_ITEMS)))
    command = ["batch", "m.mk", "--inputs", "inputs.jsonl", "--store", postgres_uri]
    command += ["--config", "mklang.toml", "--concurrency", "8", "--format", "json"]
    batches = [piped([*command, "--out", f"out{n}.jsonl"], cli_env(), tmp_path) for n in range(2)]
    for n, process in enumerate(batches):
        _, err = process.communicate(timeout=300)
        assert process.returncode in (0, 3) and "Traceback" not in err, err  # 3: a run the other batch held
        failed = [line for line in (tmp_path / f"out{n}.jsonl").read_text().splitlines() if '"failed"' in line]
        assert failed == [], failed
    assert server.count == RACE_ITEMS * CALLS  # every run paid once, whichever batch ran it
    done = cli(
        "batch",
        "m.mk",
        "--inputs",
        "inputs.jsonl",
        "--store",
        postgres_uri,
        "--config",
        "mklang.toml",
        "--format",
        "json",
        cwd=tmp_path,
    )
    assert (done.returncode, json.loads(done.stdout)["done"], server.count) == (0, RACE_ITEMS, RACE_ITEMS * CALLS)


# Unreadable and unverified runs ------------------------------------------------------------------


def rows(uri: str, sql: str, *args: Any) -> None:
    """Change a SQL store's rows behind mklang's back, as an attacker or a broken disk would."""
    if uri.startswith("sqlite:"):
        import sqlite3

        with sqlite3.connect(uri.removeprefix("sqlite:///")) as db:
            db.execute(sql, args)
        return
    import psycopg

    with psycopg.connect(uri, autocommit=True) as db:
        db.execute(sql.replace("?", "%s"), args)


@pytest.fixture(params=["sqlite", "postgresql"])
def store_uri(request: pytest.FixtureRequest) -> str:
    if request.param == "sqlite":
        return "sqlite:///runs.db"
    return request.getfixturevalue("postgres_uri")


def test_an_unreadable_run_is_failed_with_its_reason_and_the_batch_goes_on(project, server, capsys, store_uri):
    write_inputs(project, *({"id": f"r-{n}", "topic": str(n)} for n in range(4)))
    batch = ["batch", "m.mk", "--inputs", "inputs.jsonl", "--store", store_uri, "--config", "mklang.toml"]
    assert run_cli(capsys, *batch)[0] == 0
    rows(store_uri, "UPDATE mklang_runs SET envelope = ? WHERE run = ?", b"\x00garbage{", "r-1")
    hostile = ["..", "a\nb", "x" * 300] + (
        ["a\x00b"] if store_uri.startswith("sqlite") else []
    )  # PostgreSQL text has no NUL
    for name in hostile:  # rows no mklang run would write
        rows(store_uri, "INSERT INTO mklang_runs (run, envelope) VALUES (?, ?)", name, b"{}")
    code, _, _ = run_cli(capsys, *batch, "--out", "out.jsonl")
    out = [json.loads(line) for line in (project / "out.jsonl").read_text().splitlines()]
    assert code == 1 and [line["status"] for line in out] == ["done", "failed", "done", "done"]
    assert "r-1: the checkpoint is not valid JSON" in out[1]["reason"] and out[1]["result"] is None
    assert server.count == 4 * CALLS  # the failed run is not started over what is there
    code, listing, err = run_cli(capsys, "runs", "--store", store_uri, "--format", "json")
    listed = {entry["run"]: entry for entry in json.loads(listing)["runs"]}
    assert code == 0 and [listed[f"r-{n}"]["status"] for n in (0, 2, 3)] == ["done"] * 3, err
    # A listing shows each run's summary (display only): r-1's says it is done; `show` reads the envelope.
    code, out, err = run_cli(capsys, "show", f"{store_uri}#r-1")
    assert code == 2 and "r-1: the checkpoint is not valid JSON" in error_in(out, err)
    for name in hostile:  # rows no mklang run wrote: listed without a status, never named for a command
        assert listed[name]["status"] is None and "is not valid: a run name is" in listed[name]["reason"]
        assert listed[name]["checkpoint"] is None
    code, text, _ = run_cli(capsys, "runs", "--store", store_uri, "--format", "text")
    assert code == 0 and text.count(" ? ") == 2 * len(hostile) and text.count("done") == 4  # r-1 too
    assert len(text.splitlines()) == 5 + len(hostile)  # a header; a newline in a row's name fakes no line


def test_a_run_whose_signature_was_removed_is_failed_never_a_result(project, server, capsys, store_uri):
    write_inputs(project, {"id": "r-0", "topic": "0"}, {"id": "r-1", "topic": "1"})
    batch = ["batch", "m.mk", "--inputs", "inputs.jsonl", "--store", store_uri, "--config", "mklang.toml"]
    assert run_cli(capsys, *batch)[0] == 0
    forged = json.loads(open_store(store_uri).read("r-1") or b"")
    del forged["signature"]
    forged["result"] = "what the attacker wants reported"
    rows(store_uri, "UPDATE mklang_runs SET envelope = ? WHERE run = ?", json.dumps(forged).encode(), "r-1")
    code, _, _ = run_cli(capsys, *batch, "--out", "out.jsonl")
    out = [json.loads(line) for line in (project / "out.jsonl").read_text().splitlines()]
    assert code == 1 and (out[1]["status"], out[1]["result"]) == ("failed", None)
    assert f"{store_uri}#r-1: the checkpoint is not signed" in out[1]["reason"]
    code, shown, _ = run_cli(capsys, "show", f"{store_uri}#r-1", "--format", "json")
    assert code == 0 and json.loads(shown)["status"] == "failed" and "attacker" not in shown
    assert server.count == 2 * CALLS


# Store URIs: errors, passwords, files ------------------------------------------------------------


def test_runs_and_show_never_create_a_store(project, capsys):
    for command in (
        ["runs", "--store", "sqlite:///runz.db"],
        ["show", "sqlite:///runz.db#r-1"],
        ["runs", "--store", "no-such-folder"],
    ):
        code, out, err = run_cli(capsys, *command)
        line = error_in(out, err)
        assert code == 2 and ("no such SQLite checkpoint store" in line or "no such checkpoint store" in line), line
    assert sorted(path.name for path in project.iterdir()) == ["m.mk", "mklang.toml"]


def test_runs_on_a_postgresql_database_without_a_store_is_one_line_and_creates_nothing(postgres_uri, capsys):
    code, out, err = run_cli(capsys, "runs", "--store", postgres_uri)
    assert code == 2 and "no mklang checkpoint store in this database and schema" in error_in(out, err)
    import psycopg

    with psycopg.connect(postgres_uri) as db:
        assert db.execute("SELECT to_regclass('mklang_runs')").fetchone() == (None,)


def test_an_unknown_scheme_lists_the_supported_ones_and_is_never_a_file(project, capsys):
    code, out, err = run_cli(capsys, "show", "mysql://me:hunter2@db/mk#r-1")
    line = error_in(out, err)
    assert code == 2 and "unknown store scheme 'mysql': a store is a folder, sqlite:///" in line
    assert "hunter2" not in line and "mysql://me:***@db/mk" in line
    code, out, err = run_cli(
        capsys, "run", "m.mk", "-q", "--config", "mklang.toml", "--checkpoint", "mysql://db/mk#r-1"
    )
    assert code == 2 and "unknown store scheme" in error_in(out, err)
    assert not (project / "mysql:").exists()


def test_a_missing_postgresql_schema_is_one_line_saying_what_to_do(project, capsys):
    require_server("PostgreSQL")
    uri = "postgresql://postgres:hunter2@127.0.0.1:5432/test?options=-csearch_path%3Dmk_no_such_schema"
    code, out, err = run_cli(capsys, "run", "m.mk", "-q", "--config", "mklang.toml", "--checkpoint", f"{uri}#r-1")
    line = error_in(out, err)
    assert code == 2 and "search_path names does not exist: create it (CREATE SCHEMA name)" in line
    assert "hunter2" not in line and "postgres:***@127.0.0.1" in line


def test_a_password_in_a_store_uri_is_never_printed(postgres_uri, project, server, capsys):
    """The server trusts local connections, so a URI with a password works and each output can be read."""
    uri = postgres_uri.replace("postgres@", "postgres:hunter2@")
    code, out, err = run_cli(
        capsys, "run", "m.mk", "-q", "--config", "mklang.toml", "--checkpoint", f"{uri}#r-1", "--max-tokens", "1"
    )
    assert code == 3 and "continue with: mklang resume" in err and "postgres:***@" in err
    printed = [out, err]
    printed += run_cli(capsys, "show", f"{uri}#r-1")[1:] + run_cli(capsys, "runs", "--store", uri)[1:]
    printed += run_cli(capsys, "run", "m.mk", "-q", "--config", "mklang.toml", "--checkpoint", f"{uri}#r-1")[1:]
    write_inputs(project, {"id": "r-1", "topic": "x"})
    printed += run_cli(capsys, "batch", "m.mk", "--inputs", "inputs.jsonl", "--store", uri, "--config", "mklang.toml")[
        1:
    ]
    assert all("hunter2" not in text for text in printed), printed
    assert "`mklang resume 'postgresql://postgres:***@" in error_in(*printed[-4:-2])  # the refusal to replace the run


def test_a_sqlite_store_is_created_owner_only_and_continue_with_is_one_line(project, server, capsys):
    deep = "sqlite:///" + "a-long-folder-name-" * 4 + "runs.db#" + "a-long-run-name-" * 5
    (project / ("a-long-folder-name-" * 4 + "runs.db")).parent.mkdir(exist_ok=True)
    code, _, err = run_cli(
        capsys,
        "run",
        "m.mk",
        "-q",
        "--config",
        "mklang.toml",
        "--checkpoint",
        deep,
        "--max-tokens",
        "1",
        "--format",
        "text",
    )
    assert code == 3
    assert [line for line in err.splitlines() if "continue with" in line] == [
        f"checkpoint: {deep}; continue with: mklang resume '{deep}' --max-tokens 30"
    ]
    for path in project.glob("*runs.db*"):
        if path.is_file():
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


# A batch does what a run does: dollar ceilings, Ctrl-C, failed runs named ----------------------


def test_a_batch_dollar_ceiling_on_a_model_without_a_price_is_refused_before_any_run(project, server, capsys):
    write_inputs(project, {"id": "r-0", "topic": "0"})
    code, out, err = run_cli(
        capsys,
        "batch",
        "m.mk",
        "--inputs",
        "inputs.jsonl",
        "--store",
        "runs",
        "--config",
        "mklang.toml",
        "--batch-max-cost",
        "1",
    )
    assert code == 2 and error_in(out, err).startswith(
        "mklang: error: --batch-max-cost needs a price for local:m (tier"
    )
    assert server.count == 0 and not (project / "runs").exists()


def test_the_batch_dollar_ceiling_holds_on_the_local_executor_and_a_higher_one_finishes(project, server, capsys):
    """$1 per token, 15 tokens a call: $15 a call, so a $100 ceiling stops the batch after 7 calls
    (the ceiling is checked before each call; the call in flight may cross it)."""
    with (project / "mklang.toml").open("a", encoding="utf-8") as config:
        config.write('\n[prices."local:m"]\ninput = 1000000\noutput = 1000000\n')
    write_inputs(project, *({"id": f"r-{n}", "topic": str(n)} for n in range(10)))
    batch = ["batch", "m.mk", "--inputs", "inputs.jsonl", "--store", "sqlite:///runs.db", "--config", "mklang.toml"]
    code, out, err = run_cli(
        capsys, *batch, "--batch-max-cost", "100", "--concurrency", "1", "--out", "out.jsonl", "--format", "json"
    )
    assert code == 3, err
    assert server.count == 7 and json.loads(out)["usage"]["cost_usd"] == pytest.approx(105)
    results = [json.loads(line) for line in (project / "out.jsonl").read_text().splitlines()]
    assert [line["status"] for line in results] == ["done"] * 3 + ["suspended"] * 7
    assert {line["reason"] for line in results[3:]} == {"batch-ceiling"}
    code, out, err = run_cli(capsys, *batch, "--batch-max-cost", "1000", "--format", "json")
    assert (code, json.loads(out)["done"], server.count) == (0, 10, 10 * CALLS), err


def test_each_failed_run_is_named_with_its_reason_capped(project, server, capsys):
    write_inputs(project, *({"id": f"r-{n}", "topic": str(n)} for n in range(13)))
    batch = ["batch", "m.mk", "--inputs", "inputs.jsonl", "--store", "runs", "--config", "mklang.toml"]
    for n in range(13):  # a file that is no run where each run's checkpoint goes
        (project / "runs").mkdir(exist_ok=True)
        (project / "runs" / f"r-{n}").write_text("not a run", encoding="utf-8")
    code, _, err = run_cli(capsys, *batch, "--format", "json")
    named = [line for line in err.splitlines() if line.startswith("mklang: run ")]
    assert code == 1 and len(named) == 10
    assert named[0].startswith("mklang: run r-0 failed: runs/r-0: the checkpoint is not valid JSON")
    assert err.splitlines()[-1] == "mklang: and 3 more failed run(s): --out FILE lists each"
    assert server.count == 0


def held_calls(server: FakeServer) -> threading.Event:
    """Each call the fake model gets waits, unanswered, until the event returned is set."""
    release = threading.Event()

    def held(request: Any) -> Reply:
        release.wait(timeout=60)
        return answer("ok", input_tokens=10, output_tokens=5)

    server.handler = held
    return release


def test_ctrl_c_suspends_a_local_batch_at_the_next_loop_top_writes_out_and_exits_3(project, server):
    release = held_calls(server)
    write_inputs(project, *({"id": f"r-{n}", "topic": str(n)} for n in range(6)))
    command = ["batch", "m.mk", "--inputs", "inputs.jsonl", "--store", "sqlite:///r.db"]
    command += ["--config", "mklang.toml", "--concurrency", "2", "--out", "out.jsonl", "--format", "json"]
    process = piped(command, cli_env(), project)
    said = Lines(process)
    try:
        wait_for(lambda: server.count >= 2, process, "two calls were in flight")
        process.send_signal(signal.SIGINT)
        wait_for(lambda: said.having("interrupt received"), process, "the batch heard the interrupt")
    finally:
        release.set()  # the calls in flight answer; each run stops at its next loop-top
    process.wait(timeout=30)
    err = "\n".join(said.done())
    assert process.returncode == 3 and "Traceback" not in err, err
    assert json.loads(process.stdout.read())["pending"] == 6
    results = [json.loads(line) for line in (project / "out.jsonl").read_text().splitlines()]
    assert [line["status"] for line in results] == ["pending"] * 6
    assert server.count == 2  # the calls in flight ended; no run went on to its next call, none started
    again = cli(*command, cwd=project)
    assert again.returncode == 0 and server.count == 6 * CALLS  # the paid calls were not paid again


def test_a_second_ctrl_c_exits_a_local_batch_at_once(project, server):
    release = held_calls(server)
    write_inputs(project, {"id": "r-0", "topic": "0"})
    command = ["batch", "m.mk", "--inputs", "inputs.jsonl", "--store", "sqlite:///r.db", "--config", "mklang.toml"]
    process = piped(command, cli_env(), project)
    said = Lines(process)
    try:
        wait_for(lambda: server.count >= 1, process, "a call was in flight")
        process.send_signal(signal.SIGINT)
        wait_for(lambda: said.having("interrupt received"), process, "the batch heard the first interrupt")
        process.send_signal(signal.SIGINT)
        began = time.monotonic()
        process.wait(timeout=10)
        waited = time.monotonic() - began
    finally:
        release.set()
    lines = said.done()
    assert process.returncode == 130 and waited < 5 and "mklang: interrupted again: exiting now" in lines[-1], lines


# Broker URLs ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("broker", "needle"),
    [
        ("rabbit://guest:hunter2@127.0.0.1//", "unknown broker URL scheme 'rabbit': a broker is amqp://"),
        ("amqp://guest:hunter2@127.0.0.1:1//", "cannot reach the broker: [Errno 111] Connection refused"),
        ("redis://:hunter2@127.0.0.1:1/0", "cannot reach the broker: Error 111 connecting to 127.0.0.1:1"),
    ],
)
def test_a_misspelt_or_unreachable_broker_is_one_line_with_its_password_hidden(project, server, capsys, broker, needle):
    write_inputs(project, {"id": "r-0", "topic": "0"})
    for command in (
        ["batch", "m.mk", "--inputs", "inputs.jsonl", "--store", "sqlite:///runs.db", "--executor", "celery"],
        ["worker", "--store", "sqlite:///runs.db", "--config", "mklang.toml"],
    ):
        code, out, err = run_cli(capsys, *command, "--broker", broker)
        line = error_in(out, err)
        assert code == 2 and needle in line and "hunter2" not in line and ":***@127.0.0.1" in line, err
    assert server.count == 0


def test_a_broker_port_that_drops_each_connection_is_tried_once(project, capsys):
    """What answers there is no broker: the command says so at once, not after a pause and another try."""
    accepted: list[tuple[str, int]] = []
    done = threading.Event()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(0.05)

        def drop() -> None:
            while not done.is_set():
                with contextlib.suppress(TimeoutError):
                    connection, peer = listener.accept()
                    accepted.append(peer)
                    connection.close()

        dropping = threading.Thread(target=drop)
        dropping.start()
        broker = f"amqp://guest:guest@127.0.0.1:{listener.getsockname()[1]}//"
        try:
            code, out, err = run_cli(capsys, "worker", "--store", "sqlite:///runs.db", "--broker", broker)
        finally:
            done.set()
            dropping.join()
    assert code == 2 and "cannot reach the broker" in error_in(out, err), err
    assert len(accepted) == 1


def test_a_wrong_broker_password_is_one_line_without_the_password(project, capsys):
    require_server("RabbitMQ")
    write_inputs(project, {"id": "r-0", "topic": "0"})
    broker = "amqp://guest:hunter2@127.0.0.1:5672//"
    command = ["batch", "m.mk", "--inputs", "inputs.jsonl", "--store", "sqlite:///runs.db", "--executor", "celery"]
    code, out, err = run_cli(capsys, *command, "--broker", broker)
    line = error_in(out, err)
    assert code == 2 and "ACCESS_REFUSED" in line and "hunter2" not in line, err


# A misspelt reply ------------------------------------------------------------------------------


def test_a_reply_to_a_misspelt_path_is_refused_with_did_you_mean(tmp_path, capsys, monkeypatch):
    import shutil

    shutil.copytree(HITL / "approval", tmp_path / "approval")
    monkeypatch.chdir(tmp_path)
    script = ["--script", "approval/scenarios.yaml", "--scenario", "ask-then-publish"]
    code, out, err = run_cli(capsys, "run", "approval/approval.mk", "-q", *script, "--hitl", "--checkpoint", "cp.json")
    assert code == 3, err
    before = (tmp_path / "cp.json").read_bytes()
    code, out, err = run_cli(capsys, "resume", "cp.json", "--set", "approval.anwser=yes", *script)
    assert code == 2 and error_in(out, err) == (
        "mklang: error: cp.json: the run waits for a reply to approval.answer, and --set approval.anwser does not "
        'answer it; did you mean "approval.answer"?; give --set approval.answer=<reply>'
    )
    assert (tmp_path / "cp.json").read_bytes() == before  # the run is still parked, untouched
    code, out, err = run_cli(capsys, "resume", "cp.json", "--set", "approval.answer=yes", *script, "--format", "json")
    assert code == 0 and json.loads(out)["status"] == "done", err
