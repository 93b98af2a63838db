"""Checkpoints written before envelopes were encoded in field order (canonical JSON, keys sorted) still resume.

`format2/suspended.json` was written by mklang 0.4.0 with the key below: a
run of `grow.mk` suspended by its step budget after three steps.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from mklang.checkpoint import segments
from mklang.checkpoint.envelope import load
from mklang.providers.scripted import ScriptedProvider
from mklang.runs import open_run, proceed
from mklang.runs.inspection import run_document
from mklang.session import Host
from mklang.version import __version__

FIXTURE = Path(__file__).parent / "format2"
KEY = "format-2-fixture-key-0123456789abcdef"


@pytest.fixture
def checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("MKLANG_CHECKPOINT_KEY", KEY)
    for name in ("grow.mk", "suspended.json"):
        shutil.copy(FIXTURE / name, tmp_path / name)
    return tmp_path / "suspended.json"


def test_a_canonically_signed_checkpoint_resumes_to_done_and_is_rewritten_signed(checkpoint):
    before = load(checkpoint)
    assert (before.seal, before.status, len(before.frames[0]["trace"])) == ("signed", "suspended", 3)
    done = proceed(open_run(checkpoint), Host(ScriptedProvider({"produce": ["y"], "judge": [0]})), budget=4)
    assert (done.status, len(done.trace)) == ("done", 4)
    assert done.trace[0]["output"] == 'line é\n"quoted"'
    after = load(checkpoint)
    assert (after.seal, after.status, after.frames[0]["trace"][:3]) == ("signed", "done", before.frames[0]["trace"])
    # The envelope records the package that wrote it; an older one's version is no obstacle.
    assert (before.mklang_version, after.mklang_version) == ("0.4.0", __version__)
    assert (before.format, after.format) == (2, 3)  # format 2 is read as it is; what is written next is format 3


def test_a_format_2_checkpoint_resumed_seals_its_trace_into_segments(checkpoint, monkeypatch):
    monkeypatch.setattr(segments, "SEGMENT_BYTES", 1)
    done = proceed(open_run(checkpoint), Host(ScriptedProvider({"produce": ["y"], "judge": [0]})), budget=4)
    after = dict(load(checkpoint).frames[0])
    assert [steps for _, steps in after["segments"]] == [4] and after["trace"] == []
    assert run_document(checkpoint)["trace"] == list(done.trace)


def test_an_edit_to_a_canonically_signed_checkpoint_is_refused(checkpoint):
    checkpoint.write_bytes(checkpoint.read_bytes().replace(b'"budget":3', b'"budget":9', 1))
    assert load(checkpoint).seal == "tampered"
