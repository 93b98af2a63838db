"""The store contract kit (`mklang.stores.conformance`): run against the three built-in stores, and
against a minimal store written here as a package outside mklang would write it, registered
through the `mklang.stores` entry points and declaring no capability."""

from __future__ import annotations

import sys
from functools import partial

import pytest
from support.commands import cli, error_of
from support.examples import HITL

from mklang.checkpoint.envelope import load
from mklang.runs import resume, start
from mklang.scenarios import load_script
from mklang.session import Host
from mklang.stores import RunQuery, locate, open_store, summaries_of
from mklang.stores.conformance import CHECKS, ContractError, verify
from mklang.syntax import load_file

CAPABILITIES = {
    "file": {"SegmentStore", "SummaryStore", "NoteStore"},
    "sqlite": {"SegmentStore", "SummaryStore", "NoteStore", "GenerationStore", "PoolStore"},
    "postgresql": {"SegmentStore", "SummaryStore", "NoteStore", "GenerationStore", "PoolStore"},
}


@pytest.fixture(params=["file", "sqlite", "postgresql"])
def built_in(request, tmp_path) -> tuple[str, str]:
    """A built-in store's kind and the URI of a fresh one."""
    if request.param == "file":
        (tmp_path / "runs").mkdir()
        return "file", str(tmp_path / "runs")
    if request.param == "sqlite":
        return "sqlite", f"sqlite:///{tmp_path}/runs.db"
    return "postgresql", request.getfixturevalue("postgres_uri")


@pytest.mark.parametrize("check", CHECKS, ids=str)
def test_every_built_in_store_keeps_each_promise_of_the_capabilities_it_declares(check, built_in):
    kind, uri = built_in
    assert check.run(partial(open_store, uri)) is (check.needs is None or check.needs in CAPABILITIES[kind])


# A store as a package outside mklang writes one: the core protocol only, runs as files in a folder.
MINIMAL = """
import fcntl, os
from pathlib import Path

from mklang.errors import RunBusy

class Lock:
    def __init__(self, path, locker):
        self.descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            locker(self.descriptor)
        except OSError:
            os.close(self.descriptor)
            raise RunBusy(f"{path}: the run is held by another process") from None
        os.ftruncate(self.descriptor, 0)
        os.write(self.descriptor, str(os.getpid()).encode())

    def release(self):
        if self.descriptor is not None:
            os.close(self.descriptor)
            self.descriptor = None

def flock(descriptor):
    fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)

def lockf(descriptor):  # a POSIX record lock: held per process, not per opener
    fcntl.lockf(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)

class MinimalStore:
    locker = staticmethod(flock)

    def __init__(self, folder):
        self.folder = Path(folder)
        self.folder.mkdir(exist_ok=True)

    def _file(self, run, suffix):
        return self.folder / f"{run}.{suffix}"

    def read(self, run):
        path = self._file(run, "envelope")
        return path.read_bytes() if path.exists() else None

    def write(self, run, payload, *, generation):
        temporary = self._file(run, "tmp")
        temporary.write_bytes(payload)
        os.replace(temporary, self._file(run, "envelope"))

    def read_journal(self, run):
        path = self._file(run, "log")
        return path.read_bytes() if path.exists() else b""

    def start_journal(self, run, payload):
        temporary = self._file(run, "tmp")
        temporary.write_bytes(payload)
        os.replace(temporary, self._file(run, "log"))

    def append(self, run, payload, *, durable):
        with open(self._file(run, "log"), "ab") as log:
            log.write(payload)
            if durable:
                os.fsync(log.fileno())

    def drop_journal(self, run):
        self._file(run, "log").unlink(missing_ok=True)

    def lock(self, run):
        return Lock(self._file(run, "lock"), self.locker)

    def holder(self, run):
        path = self._file(run, "lock")
        try:
            Lock(path, self.locker).release()
        except RunBusy:
            return path.read_text() or "?"
        except FileNotFoundError:
            pass
        return None

    def runs(self):
        return sorted(path.name.removesuffix(".envelope") for path in self.folder.glob("*.envelope"))

    def remove(self, run):
        for suffix in ("envelope", "log"):
            self._file(run, suffix).unlink(missing_ok=True)

    def close(self):
        pass

class PerProcessLockStore(MinimalStore):
    locker = staticmethod(lockf)

def open_minimal(uri, *, create):
    return MinimalStore(uri.split("://", 1)[1])

def open_per_process(uri, *, create):
    return PerProcessLockStore(uri.split("://", 1)[1])
"""


@pytest.fixture
def minimal(tmp_path, monkeypatch):
    """The minimal store installed as a package: its module and dist-info on sys.path, as pip lays them
    out, registering `minimal://FOLDER` (and a variant whose locks are held per process)."""
    site = tmp_path / "site"
    info = site / "mklang_minimal_store-1.0.dist-info"
    info.mkdir(parents=True)
    (site / "mklang_minimal_store.py").write_text(MINIMAL)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mklang-minimal-store\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[mklang.stores]\n"
        "minimal = mklang_minimal_store:open_minimal\n"
        "perprocess = mklang_minimal_store:open_per_process\n"
    )
    monkeypatch.syspath_prepend(str(site))
    yield f"minimal://{tmp_path}/runs"
    sys.modules.pop("mklang_minimal_store", None)


def test_a_minimal_store_from_a_package_passes_the_kit_with_no_capability(minimal):
    report = verify(partial(open_store, minimal))
    assert report.capabilities == set()
    assert report.passed == [check.name for check in CHECKS if check.needs is None]
    assert report.skipped == [check.name for check in CHECKS if check.needs is not None]


def test_the_kit_names_the_promise_a_store_breaks(minimal):
    with pytest.raises(ContractError) as caught:
        verify(partial(open_store, minimal.replace("minimal://", "perprocess://")))
    assert str(caught.value).splitlines() == [
        f"2 of {len(CHECKS)} promises broken:",
        "lock: ContractError: a held lock refuses a second opener (RunBusy)",
        "runs-and-removal: ContractError: remove leaves the run's lock held by its holder",
    ]


def test_a_minimal_store_suspends_resumes_lists_and_refuses_a_batch_in_one_line(minimal, tmp_path):
    where = locate(f"{minimal}#approval-1")
    machine = load_file(HITL / "approval" / "approval.mk")
    scenario = next(s for s in load_script(HITL / "approval" / "scenarios.yaml") if s.name == "ask-then-publish")
    assert start(machine, None, Host.for_scenario(scenario), checkpoint=where).status == "suspended"
    (listed,) = summaries_of(where.store, RunQuery())  # no summaries kept: read from the envelope
    assert (listed.run, listed.status, listed.machine) == ("approval-1", "suspended", "approval")
    assert load(where).texts == {}  # no notes: no machine texts kept
    assert resume(where, Host.for_scenario(scenario), reply={"approval.answer": "yes"}).status == "done"
    items = tmp_path / "items.jsonl"
    items.write_text('{"id": "a"}\n')
    approval = HITL / "approval"
    done = cli(
        "batch",
        str(approval / "approval.mk"),
        *("--inputs", str(items), "--store", minimal),
        *("--script", str(approval / "scenarios.yaml"), "--scenario", "ask-then-publish"),
    )
    assert done.returncode == 2 and error_of(done) == (
        f"mklang: error: {minimal}: a batch needs a store that keeps notes (machine texts, records, spend), "
        "which MinimalStore does not"
    )
