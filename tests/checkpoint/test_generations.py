"""The newest generation of each run id (ADR 0022, 0052): kept by the run's store where it can keep it
(SQLite, PostgreSQL), else in a private folder of the user's state home, so a restored older checkpoint
is told from the newest."""

from __future__ import annotations

import stat

import pytest

from mklang.checkpoint import generations
from mklang.stores.file import FileStore
from mklang.stores.sqlite import SqliteStore


def test_a_file_stores_generations_live_in_a_private_folder_of_the_state_home_and_only_ever_rise(tmp_path, monkeypatch):
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    store = FileStore(tmp_path)
    assert generations.state_folder() == tmp_path / ".local" / "state" / "mklang"
    assert generations.newest(store, "cp.json", "run-a") == 0
    generations.remember(store, "run-a", 3)
    generations.remember(store, "run-a", 2)  # an older generation read later does not lower it
    assert (generations.newest(store, "cp.json", "run-a"), generations.newest(store, "cp.json", "run-b")) == (3, 0)
    folder = tmp_path / ".local" / "state" / "mklang" / "generations"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    (record,) = folder.iterdir()
    assert stat.S_IMODE(record.stat().st_mode) == 0o600


def test_a_state_home_that_cannot_be_written_is_a_one_line_checkpoint_error(tmp_path, monkeypatch):
    blocked = tmp_path / "state"
    blocked.write_text("a file where the folder would go")
    monkeypatch.setenv("XDG_STATE_HOME", str(blocked))
    with pytest.raises(generations.CheckpointError, match=r"cannot read the run.s generation: Not a directory$"):
        generations.remember(FileStore(tmp_path), "run-a", 1)


def test_a_database_store_keeps_generations_itself_and_the_state_home_is_not_written(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    store = SqliteStore(tmp_path / "runs.db")
    try:
        generations.remember(store, "run-a", 4)
        assert not (tmp_path / "state").exists()
        assert generations.newest(store, "elsewhere", "run-a") == 4  # by run id, whatever the run's name
        store.write("cp", b"{}", generation=6)
        assert generations.newest(store, "cp", "run-b") == 6  # the run's row counts too
    finally:
        store.close()
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "fresh"))  # another user, machine or CI job
    reopened = SqliteStore(tmp_path / "runs.db")
    try:
        assert generations.newest(reopened, "elsewhere", "run-a") == 4
    finally:
        reopened.close()
