"""Cancelling stored runs (`mklang runs cancel`, ADR 0068): a parked run halts `cancelled` at
once, a run another process is running halts `cancelled` at its next loop-top, and a cancelled
run is finished: it cannot be resumed or answered. Refusals change nothing."""

from __future__ import annotations

import contextlib
import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import forks
from support.commands import cli, cli_env, error_of, wait_for
from support.examples import EXAMPLES
from support.services import postgres_schema

from mklang.checkpoint.envelope import load
from mklang.runs import location
from mklang.runs.cancelling import cancel, note_key
from mklang.stores import locate, open_store

SCRIPT = ["--script", "approval/scenarios.yaml", "--scenario", "ask-then-publish"]
LOOP = 'machine loop\nentry s\nbudget 100000\nstate s {\n  structure "a word"\n  prompt "go"\n  output o\n  when "it is done" -> END\n  otherwise -> s\n}\n'
SLOW = "scenarios:\n  - name: slow\n    llm:\n      delay_ms: 20\n      produce: [ok]\n      judge: [none]\n"


@pytest.fixture
def approval(tmp_path: Path) -> Path:
    shutil.copytree(EXAMPLES / "approval", tmp_path / "approval")
    return tmp_path


def park(folder: Path, run: str) -> str:
    target = f"sqlite:///runs.db#{run}"
    done = cli("run", "approval/approval.mk", "--checkpoint", target, *SCRIPT, cwd=folder)
    assert done.returncode == 3, done.stdout + done.stderr
    return target


def envelope(folder: Path, target: str):
    return load(locate(target.replace("sqlite:///", f"sqlite:///{folder}/")))


def cancel_cli(folder: Path, *names: str) -> object:
    return cli("runs", "cancel", "--store", "sqlite:///runs.db", *names, "--format", "text", cwd=folder)


def test_a_parked_run_halts_cancelled_and_cannot_be_answered_or_resumed(approval):
    target = park(approval, "a")
    done = cancel_cli(approval, "a")
    assert (done.returncode, done.stdout) == (0, "sqlite:///runs.db#a: cancelled\n"), done.stderr
    stopped = envelope(approval, target)
    assert (stopped.status, stopped.error, stopped.at, stopped.ask) == ("halted", "cancelled", "draft", None)
    [acted] = stopped.actions
    assert (acted.action, acted.by) == ("cancel", "cli") and acted.at.endswith("Z")
    before = stopped.model_dump_json()
    answered = cli("resume", target, "--answer", "approve", *SCRIPT, cwd=approval)
    assert answered.returncode == 2
    assert error_of(answered).endswith("the run already halted (cancelled); a finished run cannot be resumed")
    assert envelope(approval, target).model_dump_json() == before
    shown = json.loads(cli("show", target, "--summary", "--format", "json", cwd=approval).stdout)
    assert (shown["status"], shown["error"], shown["actions"][0]["action"]) == ("halted", "cancelled", "cancel")


def test_finished_unknown_and_busy_runs_are_refused_one_line_each(approval):
    park(approval, "a")
    park(approval, "b")
    assert cancel_cli(approval, "a").returncode == 0
    store = open_store(f"sqlite:///{approval}/runs.db")
    lock = store.lock("b")  # another process answering it holds it, not running it yet
    try:
        done = cancel_cli(approval, "a", "b", "nope")
    finally:
        lock.release()
        store.close()
    assert done.returncode == 1 and done.stdout == ""
    lines = done.stderr.splitlines()
    assert lines[0] == "refused: sqlite:///runs.db#a: already halted (cancelled): not cancelled"
    assert lines[1].startswith("refused: ") and "busy" in lines[1] and lines[1].endswith("not cancelled, try again")
    assert lines[2] == "refused: sqlite:///runs.db#nope: no such run"
    assert envelope(approval, "sqlite:///runs.db#b").status == "suspended"


def test_a_cancel_request_not_signed_with_the_key_asks_nothing(approval):
    target = park(approval, "a")
    store = open_store(f"sqlite:///{approval}/runs.db")
    try:
        store.write_note(note_key("a"), json.dumps({"run": "a", "by": "mallory", "at": "x"}).encode())
        from mklang.runs.cancelling import requested

        assert requested(location(store, "sqlite:///runs.db", "a")) is None
    finally:
        store.close()
    done = cli("resume", target, "--answer", "approve", *SCRIPT, cwd=approval)
    assert done.returncode == 0, done.stderr  # the forged note cancelled nothing


def test_two_cancels_at_once_exactly_one_cancels(approval):
    park(approval, "a")
    store = open_store(f"sqlite:///{approval}/runs.db")
    try:
        results: list[str] = []
        barrier = threading.Barrier(2)

        def one() -> None:
            barrier.wait()
            results.append(cancel(location(store, "sqlite:///runs.db", "a"), by="cli").outcome)

        threads = [threading.Thread(target=one) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        store.close()
    assert sorted(results) == ["cancelled", "refused"]
    assert len(envelope(approval, "sqlite:///runs.db#a").actions) == 1


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_running_run_in_another_process_halts_cancelled_at_its_next_loop_top(tmp_path, backend):
    (tmp_path / "loop.mk").write_text(LOOP)
    (tmp_path / "slow.yaml").write_text(SLOW)
    with backend_store(backend, tmp_path) as uri:
        target = f"{uri}#spin"
        command = ["run", "loop.mk", "--checkpoint", target, "--script", "slow.yaml", "--scenario", "slow"]
        process = forks.start([*command, "--format", "json"], cli_env(), tmp_path)
        store = open_store(uri)
        try:
            wait_for(lambda: b'"status":"running"' in (store.read("spin") or b""), process, "the run started")
            done = cli("runs", "cancel", "--store", uri, "spin", "--format", "json", cwd=tmp_path)
            assert done.returncode == 0, done.stdout
            assert json.loads(done.stdout)["cancelled"] == [{"run": target, "outcome": "requested", "why": None}]
            ended = process.wait(timeout=30)
            assert ended.returncode == 1, ended.stderr
            result = json.loads(ended.stdout)
            assert (result["status"], result["error"], result["at"]) == ("halted", "cancelled", "s")
            stopped = load(locate(target))
            assert (stopped.status, stopped.error) == ("halted", "cancelled")
            assert [acted.by for acted in stopped.actions] == ["cli"]
            assert 0 < stopped.frames[0]["steps"] < 100000
            assert store.read_note(note_key("spin")) is None  # honoured, then dropped
            again = cli("resume", target, "--script", "slow.yaml", "--scenario", "slow", cwd=tmp_path)
            assert again.returncode == 2 and "already halted (cancelled)" in error_of(again)
        finally:
            store.close()


@contextlib.contextmanager
def backend_store(backend: str, folder: Path) -> Iterator[str]:
    if backend == "sqlite":
        yield f"sqlite:///{folder}/race.db"
    else:
        with postgres_schema() as uri:
            yield uri


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_two_cancel_processes_racing_on_each_parked_run_exactly_one_cancels(approval, backend):
    """Real processes: for each of four parked runs two `runs cancel` at once; each run is halted
    `cancelled` once, by the one process that said so; the other was refused (busy or already halted)."""
    with backend_store(backend, approval) as store:
        runs = [f"r{n}" for n in range(4)]
        for run in runs:
            done = cli("run", "approval/approval.mk", "--checkpoint", f"{store}#{run}", *SCRIPT, cwd=approval)
            assert done.returncode == 3, done.stderr
        command = ["runs", "cancel", "--store", store, *runs, "--format", "json"]
        racers = [forks.start(command, cli_env(), approval) for _ in range(2)]
        said = [json.loads(process.wait().stdout)["cancelled"] for process in racers]
        for n, run in enumerate(runs):
            outcomes = sorted([said[0][n]["outcome"], said[1][n]["outcome"]])
            assert outcomes == ["cancelled", "refused"], (run, said)
            stopped = load(locate(f"{store}#{run}"))
            assert (stopped.status, stopped.error, len(stopped.actions)) == ("halted", "cancelled", 1)
