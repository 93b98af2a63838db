"""Attacks on the fleet's stores and batches: run names, replaced runs, unreadable and forged rows.

Each test drives the CLI as a user would (in this process through its entry
function, or as a real subprocess where signals or two processes are the
point) against the fake model server on 127.0.0.1, so every paid call is
counted where it is paid, and against the real PostgreSQL where a test names it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import model_config
from fakeserver import FakeServer, answer

import mklang as api
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
        ["run", "m.mk", "--config", "mklang.toml", "--checkpoint", target],
        ["resume", target],
        ["show", target],
    ):
        code, _, err = cli(capsys, *command)
        assert code == 2 and "run name" in error_line(err), (command, err)
    assert server.count == 0


def test_a_checkpoint_file_name_is_a_run_name_too(project, server, capsys):
    code, _, err = cli(capsys, "run", "m.mk", "--config", "mklang.toml", "--checkpoint", "runs/.cp.json")
    assert code == 2 and "runs: run name '.cp.json' is not valid" in error_line(err)
    assert server.count == 0


def test_the_python_batch_checks_run_names_the_same_way(project, server):
    from mklang.providers.factory import make_provider

    provider = make_provider(config_path=str(project / "mklang.toml"))
    with pytest.raises(UsageError, match=r"input 1: run name '\.\./x' is not valid"):
        api.batch(project / "m.mk", [{"id": "../x", "topic": "a"}], store=str(project / "runs"), provider=provider)
    assert server.count == 0
