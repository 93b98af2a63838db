"""Every bad input gets one clear error and exit 2: never a traceback, never an internal error."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import ROOT
from support.commands import cli

TRIAGE = str(ROOT / "examples" / "triage" / "triage.mk")
SCRIPT = str(ROOT / "examples" / "triage" / "scenarios.yaml")


@pytest.fixture(scope="module")
def junk(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("junk")
    (folder / "binary.bin").write_bytes(bytes(range(256)) * 8)
    (folder / "folder").mkdir()
    (folder / "empty.txt").write_text("")
    return folder


@pytest.mark.parametrize(
    "args",
    [
        ["run", "binary.bin"],
        ["run", "folder"],
        ["run", "missing.mk"],
        ["check", "binary.bin"],
        ["fmt", "binary.bin"],
        ["graph", "binary.bin"],
        ["show", "binary.bin"],
        ["show", "folder"],
        ["show", "empty.txt"],
        ["resume", "binary.bin"],
        ["resume", "folder"],
        ["resume", "empty.txt"],
        ["test", TRIAGE, "--script", "binary.bin"],
        ["test", TRIAGE, "--script", "folder"],
        ["run", TRIAGE, "--script", "binary.bin"],
        ["run", TRIAGE, "--script", "empty.txt"],
        ["run", TRIAGE, "--script", SCRIPT, "--input", "binary.bin"],
        ["run", TRIAGE, "--script", SCRIPT, "--max-time", "soon"],
        ["run", TRIAGE, "--script", SCRIPT, "--plugin", "binary.bin"],
        ["run", TRIAGE, "--script", SCRIPT, "--checkpoint", "folder"],
        ["config", "--config", "binary.bin"],
        ["config", "--config", "folder"],
    ],
)
def test_bad_input_is_one_clear_error(args, junk):
    done = cli(*args, "--format", "text", cwd=junk)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "internal error" not in done.stderr, done.stderr
    assert done.stderr.strip(), "the error is said on stderr"
