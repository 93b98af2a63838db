"""Attacks on the fleet's stores and batches: run names, replaced runs, unreadable and forged rows.

Each test drives the CLI as a user would (in this process through its entry
function, or as a real subprocess where signals or two processes are the
point) against the fake model server on 127.0.0.1, so every paid call is
counted where it is paid, and against the real PostgreSQL where a test names it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import cli_env, mklang, model_config
from fakeserver import FakeServer, answer

import mklang as api
from mklang.checkpoint.store import open_store
from mklang.cli import main
from mklang.errors import UsageError

MACHINE = """\
mklang 0.4
machine twostep
entry one
budget 10

state one {
  structure "One word."
  prompt "first {{topic}}"
  output a
  otherwise -> two
}

state two {
  structure "One word."
  prompt "second {{topic}}"
  output b
  otherwise -> END
}
"""
CALLS = 2  # model calls of one run of MACHINE


@pytest.fixture
def project(tmp_path: Path, server: FakeServer, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder (the current one) with MACHINE as m.mk and a config whose model is the fake server."""
    server.fallback = answer("ok", input_tokens=10, output_tokens=5)
    (tmp_path / "m.mk").write_text(MACHINE, encoding="utf-8")
    model_config(server.openai_url, tmp_path / "mklang.toml")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Run the CLI in this process: exit code, stdout, stderr; it never prints a traceback."""
    capsys.readouterr()
    try:
        main(list(args))
        code = 0
    except SystemExit as stop:
        code = int(stop.code or 0)
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return code, out, err


def error_line(err: str) -> str:
    """The one error line the CLI printed."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def write_inputs(folder: Path, *lines: dict[str, Any]) -> Path:
    path = folder / "inputs.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


# Run names --------------------------------------------------------------------------------------

BAD_NAMES = ["../x", "..", "/tmp/elsewhere/cp.json", "a\nb", "a\x00b", "x" * 300, ".hidden", "a/b", "cp.json.journal"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_a_batch_input_id_that_is_no_run_name_is_refused_before_any_run(project, server, capsys, name):
    write_inputs(project, {"id": "fine-1", "topic": "a"}, {"id": name, "topic": "b"})
    code, _, err = cli(
        capsys, "batch", "m.mk", "--inputs", "inputs.jsonl", "--store", "runs", "--config", "mklang.toml"
    )
    line = error_line(err)
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
        code, _, err = cli(capsys, *command)
        assert code == 2 and "run name" in error_line(err), (command, err)
    assert server.count == 0


def test_a_checkpoint_file_name_is_a_run_name_too(project, server, capsys):
    code, _, err = cli(capsys, "run", "m.mk", "-q", "--config", "mklang.toml", "--checkpoint", "runs/.cp.json")
    assert code == 2 and "runs: run name '.cp.json' is not valid" in error_line(err)
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
    code, _, err = cli(capsys, "batch", "m.mk", "--inputs", "inputs.jsonl", "--store", store, "--config", "mklang.toml")
    assert code == 0, err
    provider = make_provider(config_path=str(project / "mklang.toml"))
    again = api.batch(project / "m.mk", [{"n": 1, "topic": "a"}], store=store, provider=provider)
    assert [(result.status, result.run) for result in again] == [("done", open_store(store).runs()[0])]
    assert server.count == CALLS  # the API found the CLI's run finished: nothing paid twice


# A run never silently replaces another ---------------------------------------------------------


def suspend_at(capsys: pytest.CaptureFixture[str], target: str) -> None:
    """A run at `target` suspended on its token budget after its first call."""
    code, _, err = cli(
        capsys, "run", "m.mk", "-q", "--config", "mklang.toml", "--checkpoint", target, "--max-tokens", "1"
    )
    assert code == 3, err


@pytest.mark.parametrize("target", ["cp.json", "sqlite:///runs.db#T-1"])
def test_a_run_is_refused_where_a_run_is_not_finished_and_replace_says_so(project, server, capsys, target):
    suspend_at(capsys, target)
    before = server.count
    code, _, err = cli(capsys, "run", "m.mk", "-q", "--config", "mklang.toml", "--checkpoint", target)
    line = error_line(err)
    assert code == 2 and "a run that is not finished is there (suspended (cost-exhausted))" in line, err
    assert f"`mklang resume {target}`" in line and "--replace" in line
    assert server.count == before  # refused before any call
    code, out, err = cli(capsys, "run", "m.mk", "-q", "--config", "mklang.toml", "--checkpoint", target, "--replace")
    assert code == 0 and json.loads(out)["status"] == "done", err
    assert server.count == before + CALLS


def test_a_finished_run_is_replaced_by_a_new_one(project, server, capsys):
    for _ in range(2):
        code, out, err = cli(capsys, "run", "m.mk", "-q", "--config", "mklang.toml", "--checkpoint", "cp.json")
        assert code == 0 and json.loads(out)["status"] == "done", err
    assert server.count == 2 * CALLS


def test_a_file_that_is_no_run_is_not_overwritten(project, server, capsys):
    notes = project / "notes.txt"
    notes.write_text("my notes\n", encoding="utf-8")
    code, _, err = cli(capsys, "run", "m.mk", "-q", "--config", "mklang.toml", "--checkpoint", "notes.txt")
    assert code == 2 and "it is not replaced: name another checkpoint, or give --replace" in error_line(err)
    assert notes.read_text(encoding="utf-8") == "my notes\n" and server.count == 0


def test_a_resume_elsewhere_does_not_replace_the_run_there(project, server, capsys):
    suspend_at(capsys, "a.json")
    suspend_at(capsys, "b.json")
    before = (project / "b.json").read_bytes()
    code, _, err = cli(capsys, "resume", "a.json", "--checkpoint", "b.json", "--max-tokens", "1000")
    assert code == 2 and "`mklang resume b.json`" in error_line(err)
    assert (project / "b.json").read_bytes() == before and server.count == 2


def test_replace_without_a_checkpoint_is_refused(project, server, capsys):
    code, _, err = cli(capsys, "run", "m.mk", "-q", "--config", "mklang.toml", "--replace")
    assert code == 2 and "--replace" in error_line(err) and server.count == 0


# Two batch passes at once -----------------------------------------------------------------------

RACE_ITEMS = 120


def test_two_batches_over_one_postgresql_store_pay_each_run_once(postgres_uri, tmp_path, server):
    """Each batch takes a run's lock before it reads whether the run is there: a run the other one
    finished meanwhile is skipped, never started again."""
    server.handler = lambda request: answer("ok", input_tokens=10, output_tokens=5, delay=0.005)
    (tmp_path / "m.mk").write_text(MACHINE, encoding="utf-8")
    model_config(server.openai_url, tmp_path / "mklang.toml")
    write_inputs(tmp_path, *({"id": f"r-{n}", "topic": str(n)} for n in range(RACE_ITEMS)))
    command = [sys.executable, "-m", "mklang", "batch", "m.mk", "--inputs", "inputs.jsonl", "--store", postgres_uri]
    command += ["--config", "mklang.toml", "--concurrency", "8", "--format", "json"]
    batches = [
        subprocess.Popen(
            [*command, "--out", f"out{n}.jsonl"],
            cwd=tmp_path,
            env=cli_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in range(2)
    ]
    for n, process in enumerate(batches):
        _, err = process.communicate(timeout=300)
        assert process.returncode in (0, 3) and "Traceback" not in err, err  # 3: a run the other batch held
        failed = [line for line in (tmp_path / f"out{n}.jsonl").read_text().splitlines() if '"failed"' in line]
        assert failed == [], failed
    assert server.count == RACE_ITEMS * CALLS  # every run paid once, whichever batch ran it
    done = mklang(
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
