"""What a user remembers of the runs they have seen (ADR 0022): the newest generation of each run id,
in a private folder of their state home, so a restored older checkpoint is told from the newest."""

from __future__ import annotations

import stat

import pytest

from mklang.checkpoint import generations


def test_generations_live_in_a_private_folder_of_the_state_home_and_only_ever_rise(tmp_path, monkeypatch):
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert generations.state_folder() == tmp_path / ".local" / "state" / "mklang"
    assert generations.seen("run-a") == 0
    generations.remember("run-a", 3)
    generations.remember("run-a", 2)  # an older generation read later does not lower it
    assert (generations.seen("run-a"), generations.seen("run-b")) == (3, 0)
    folder = tmp_path / ".local" / "state" / "mklang" / "generations"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    (record,) = folder.iterdir()
    assert stat.S_IMODE(record.stat().st_mode) == 0o600


def test_a_state_home_that_cannot_be_written_is_a_one_line_checkpoint_error(tmp_path, monkeypatch):
    blocked = tmp_path / "state"
    blocked.write_text("a file where the folder would go")
    monkeypatch.setenv("XDG_STATE_HOME", str(blocked))
    with pytest.raises(generations.CheckpointError, match=r"cannot read the run.s generation: Not a directory$"):
        generations.remember("run-a", 1)
