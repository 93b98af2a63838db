"""Every bad input gets one clear error and exit 2: never a traceback, never an internal error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import ROOT

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
    env = {k: v for k, v in os.environ.items() if k != "MKLANG_DEBUG"}
    done = subprocess.run(
        [sys.executable, "-m", "mklang", *args, "--format", "text"],
        cwd=junk,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr and "internal error" not in done.stderr, done.stderr
    assert done.stderr.strip(), "the error is said on stderr"
