"""Behaviour that no other test held in place: each test here fails when the rule it names is dropped.

Durability (which file descriptors reach `fsync`, and when), the spend a
provider reports and prices, retry delays, trace keys of real judge
answers, spend before a failing hook, deposits and placeholders at their
edges, static checks at their boundaries, fmt's line width, the spend in a
running snapshot, and a lock file that names a process that is gone.
"""

from __future__ import annotations

import json
import os
import stat
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from conformance.harness import Recorder, mk, run_mk, write_machines
from support.commands import cli
from support.crashes import Crash, dead_run
from support.fakeserver import FakeServer, answer
from support.files import FsyncSpy, journal_path
from support.runs import TWO_STATES, LoopTops

from mklang.checkpoint.envelope import MIGRATIONS, Envelope, MachineRef, dump, load, save
from mklang.checkpoint.journal import StoreJournal
from mklang.cli.syntax_cmds import check_command  # noqa: F401 - registers the command
from mklang.engine.frame import Frame
from mklang.engine.runtime import NullJournal
from mklang.errors import CheckpointError, LoadError, ProviderError
from mklang.providers.base import Produced, Usage
from mklang.providers.factory import make_provider
from mklang.service import start
from mklang.session import Host
from mklang.stores import locate
from mklang.stores.file import FileLock, lock_holder
from mklang.syntax import load_file

# --- fsync: the temp file, the folder, the journal's call lines --------------


def write_atomic(path: Path, payload: bytes) -> None:
    """Write a checkpoint file through the file store (its errors are one CheckpointError line)."""
    location = locate(path)
    location.store.write(location.run, payload, generation=1)


def lock_path(checkpoint: Path) -> Path:
    return Path(f"{checkpoint}.lock")


def holder(checkpoint: Path) -> int | None:
    """The pid a held lock names (-1 when it names none), or None when the lock is free."""
    named = lock_holder(lock_path(checkpoint))
    return None if named is None else int(named) if named.isdigit() else -1


def refuse_if_running(checkpoint: Path) -> None:
    FileLock(lock_path(checkpoint), str(checkpoint)).release()


def test_an_atomic_write_fsyncs_the_whole_temp_file_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    target = tmp_path / "cp.json"
    target.write_bytes(b"old")
    spy = FsyncSpy(monkeypatch, watched=target)
    write_atomic(target, b"new payload")
    [(temp, temp_content), (folder, _)] = spy.synced
    assert Path(temp).parent == tmp_path and Path(temp).name.startswith(".cp.json.") and temp.endswith(".tmp")
    assert temp_content == b"new payload"  # flushed before the fsync, all of it
    assert folder == str(tmp_path)
    assert spy.watched_then == [b"old", b"new payload"]  # temp synced before the rename, the folder after
    assert [p.name for p in tmp_path.iterdir()] == ["cp.json"]


def _journal(tmp_path: Path) -> tuple[StoreJournal, Frame]:
    machine = mk("""
        machine m
        entry a
        budget 3
        state a {
          structure "s"
          prompt "p"
          output o
          otherwise -> END
        }
    """)
    envelope = Envelope(
        mklang_version="test",
        run_id="r",
        status="running",
        machine=MachineRef(name="m", path=None, sha256=None),
        frames=[],
    )
    return StoreJournal(locate(tmp_path / "cp.json"), envelope), Frame.start(machine)


def test_a_journaled_call_line_is_fsynced_once_it_is_in_the_file(tmp_path, monkeypatch):
    journal, frame = _journal(tmp_path)
    journal.snapshot([frame], status="running")
    spy = FsyncSpy(monkeypatch)
    journal.record("r:1.0#1", "produce", Produced("answer", None, Usage(3, 4)))
    journal.store.close()
    [(path, content)] = spy.synced
    assert path == str(journal_path(tmp_path / "cp.json"))
    assert content is not None
    last = json.loads(content.splitlines()[-1])
    assert (last["k"], last["key"], last["v"]["text"]) == ("call", "r:1.0#1", "answer")


def test_every_call_of_a_checkpointed_run_is_durable_before_the_run_goes_on(tmp_path, monkeypatch):
    machine = write_machines(
        tmp_path,
        """
        machine m
        entry a
        budget 5
        state a {
          structure "s"
          prompt "first"
          output x
          when "good" -> b
          otherwise fail
        }
        state b {
          structure "s"
          prompt "second"
          output y
          otherwise -> END
        }
        """,
    )
    spy = FsyncSpy(monkeypatch)
    journal = str(journal_path(tmp_path / "cp.json"))
    result = start(machine, {}, Host(Recorder({"produce": ["1", "2"]})), checkpoint=tmp_path / "cp.json")
    assert result.status == "done"
    durable = {
        json.loads(line)["key"]
        for path, content in spy.synced
        if path == journal and content
        for line in content.splitlines()
        if json.loads(line)["k"] == "call"
    }
    assert len(durable) == sum(result.calls.values()) == 3  # two produce calls and one judge call


# --- deposits: accumulate onto what is already there -------------------------


@pytest.mark.parametrize(
    ("initial", "expected"),
    [
        ('notes: "first"', ["first", "second"]),
        ("notes: 0", [0, "second"]),
        ("notes: null", ["second"]),
        ('notes: ["first"]', ["first", "second"]),
        ("other: 1", ["second"]),
    ],
)
def test_accumulate_turns_an_existing_scalar_into_the_head_of_a_list(initial, expected):
    machine = f"""
        machine m
        entry a
        budget 3
        context {{ {initial} }}
        state a {{
          structure "s"
          prompt "p"
          output notes
          accumulate
          when "judged" -> END
          otherwise -> END
        }}
    """
    provider = Recorder({"produce": ["second"], "judge": [0]})
    result = run_mk(machine, provider=provider)
    assert result.context["notes"] == expected
    assert provider.judged[0].context["notes"] == expected  # the judge sees the deposit once, as it will be


# --- negative numbers: budget, repair, max_visits -----------------------------

NEGATIVE_MK = """\
machine m
entry a
budget -3
state a {
  structure "s"
  prompt "p"
  output o
  max_visits -1
  when "bad" repair -2 -> a
  otherwise -> END
}
"""

NEGATIVE_YAML = """\
mklang: "0.4"
machine: m
entry: a
budget: -3
states:
  a:
    structure: s
    prompt: p
    output: o
    max_visits: -1
    gates:
      - when: bad
        then: {repair: -2}
        to: a
      - when: otherwise
        then: ok
        to: END
"""


@pytest.mark.parametrize(("name", "text"), [("m.mk", NEGATIVE_MK), ("m.yaml", NEGATIVE_YAML)])
def test_negative_budget_repair_and_max_visits_are_load_errors(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(LoadError) as caught:
        load_file(path)
    found = {(d.code, d.message, d.line) for d in caught.value.diagnostics}
    what = {message.split(" must")[0]: (code, line) for code, message, line in found}
    assert {code for code, _, _ in found} == {"invalid-number"}
    assert set(what) == {"budget", "max_visits", "a repair budget" if name.endswith(".mk") else "repair"}
    assert what["budget"][1] == 4 if name.endswith(".yaml") else 3
    assert all('not "-' in message for _, message, _ in found)


@pytest.mark.parametrize("option", ["--budget", "--max-tokens"])
def test_resume_refuses_a_negative_budget_before_reading_the_checkpoint(tmp_path, option):
    done = cli("resume", str(tmp_path / "missing.json"), option, "-1", cwd=tmp_path)
    assert done.returncode == 2
    assert option in done.stderr and "missing.json" not in done.stderr


# --- a running snapshot counts the spend of every level -----------------------


def test_a_running_snapshot_adds_the_spend_of_nested_levels(tmp_path):
    journal, root = _journal(tmp_path)
    child = Frame.start(root.machine)
    root.usage = Usage(100, 20, 0.25)
    child.usage = Usage(5, 1, 0.5)
    journal.snapshot([root, child], status="running")
    journal.store.close()
    envelope = load(tmp_path / "cp.json")
    assert envelope.usage == Usage(105, 21, 0.75).to_json()
    assert [frame["usage"] for frame in envelope.frames] == [root.usage.to_json(), child.usage.to_json()]


# --- a lock file that names a process that is gone ----------------------------


def test_a_stale_lock_file_does_not_block_and_is_taken_over(tmp_path):
    checkpoint = tmp_path / "cp.json"
    lock_path(checkpoint).write_text(f"{os.getpid()}\n")  # a pid, but no process holds the lock
    assert holder(checkpoint) is None
    refuse_if_running(checkpoint)
    lock = FileLock(lock_path(checkpoint), str(checkpoint))
    try:
        assert lock_path(checkpoint).read_text() == f"{os.getpid()}\n"
        assert holder(checkpoint) == os.getpid()
        with pytest.raises(CheckpointError, match=f"still going in process {os.getpid()}"):
            refuse_if_running(checkpoint)
        with pytest.raises(CheckpointError, match=f"still going in process {os.getpid()}"):
            FileLock(lock_path(checkpoint), str(checkpoint))
    finally:
        lock.release()
    assert holder(checkpoint) is None


def test_a_longer_stale_pid_is_replaced_not_overwritten_in_place(tmp_path):
    checkpoint = tmp_path / "cp.json"
    lock_path(checkpoint).write_text("123456789012\n")
    lock = FileLock(lock_path(checkpoint), str(checkpoint))
    try:
        assert lock_path(checkpoint).read_text() == f"{os.getpid()}\n"
    finally:
        lock.release()


def test_a_held_lock_whose_file_names_no_pid_reports_an_unknown_holder(tmp_path):
    checkpoint = tmp_path / "cp.json"
    lock = FileLock(lock_path(checkpoint), str(checkpoint))
    try:
        lock_path(checkpoint).write_text("garbage\n")
        assert holder(checkpoint) == -1
    finally:
        lock.release()


# --- the envelope file: owner-only, compact UTF-8, strict JSON, no leftovers ---


def _envelope(**fields: Any) -> Envelope:
    return Envelope(
        mklang_version="test",
        run_id="r",
        status="running",
        machine=MachineRef(name="m", path=None, sha256=None),
        frames=[],
        **fields,
    )


def test_a_checkpoint_file_is_owner_only_compact_utf8_and_strict_json(tmp_path):
    target = tmp_path / "cp.json"
    target.write_bytes(b"{}")
    target.chmod(0o644)
    save(target, _envelope(result={"text": "café", "ratio": float("nan"), "big": float("inf")}))
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    raw_bytes = target.read_bytes()
    assert "café".encode() in raw_bytes  # UTF-8 as is, not \\u escapes
    assert b", " not in raw_bytes and b": " not in raw_bytes  # no padding: the envelope is rewritten often

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    document = json.loads(raw_bytes, parse_constant=refuse)
    assert document["result"] == {"text": "café", "ratio": None, "big": None}


def test_a_write_that_cannot_happen_is_one_line_naming_the_file(tmp_path):
    with pytest.raises(CheckpointError) as caught:
        write_atomic(tmp_path / "missing" / "cp.json", b"{}")
    assert (
        str(caught.value)
        == f"{tmp_path / 'missing' / 'cp.json'}: cannot write the checkpoint: No such file or directory"
    )


def test_a_failed_rename_leaves_the_old_file_and_no_temp_file(tmp_path):
    target = tmp_path / "cp.json"
    target.mkdir()  # a folder where the file should go: the rename fails
    with pytest.raises(CheckpointError, match="cannot write the checkpoint: Is a directory"):
        write_atomic(target, b"new")
    assert [path.name for path in tmp_path.iterdir()] == ["cp.json"]


def test_a_temp_file_already_gone_when_the_rename_fails_reports_the_rename_error(tmp_path, monkeypatch):
    def replace_fails_after_the_temp_vanished(source: str, destination: Any) -> None:
        os.unlink(source)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", replace_fails_after_the_temp_vanished)
    with pytest.raises(CheckpointError, match=r"cannot write the checkpoint: Permission denied$"):
        write_atomic(tmp_path / "cp.json", b"new")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"run_id": "r"}, "not a mklang checkpoint (no 'format' field)"),
        ({"format": "1"}, "not a mklang checkpoint (no 'format' field)"),
        ({"format": 0}, "checkpoint format 0 is too old to migrate"),
        ({"format": 3}, "checkpoint format 3 is newer than this mklang understands (2)"),
    ],
)
def test_a_document_of_another_format_is_one_line_naming_the_file(tmp_path, document, message):
    path = tmp_path / "cp.json"
    path.write_text(json.dumps(document))
    with pytest.raises(CheckpointError) as caught:
        load(path)
    assert str(caught.value) == f"{path}: {message}"


def test_registered_migrations_upgrade_an_old_checkpoint_step_by_step_on_load(tmp_path, monkeypatch):
    current = json.loads(dump(_envelope(result="kept")))
    older = {**current, "format": -1, "state_of_run": current.pop("status")}
    del older["status"]

    def from_minus_one(data: dict[str, Any]) -> dict[str, Any]:
        return {**data, "format": 0}

    def from_zero(data: dict[str, Any]) -> dict[str, Any]:
        upgraded = {key: value for key, value in data.items() if key != "state_of_run"}
        return {**upgraded, "status": data["state_of_run"], "format": 1}

    monkeypatch.setitem(MIGRATIONS, -1, from_minus_one)
    monkeypatch.setitem(MIGRATIONS, 0, from_zero)
    path = tmp_path / "cp.json"
    path.write_text(json.dumps(older))
    envelope = load(path)
    assert (envelope.format, envelope.status, envelope.result) == (2, "running", "kept")


def _nested(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such checkpoint"),
        ("folder", "cannot read the checkpoint: Is a directory"),
        (b"  \n", "the checkpoint is empty"),
        (b'{"format": 1,', "the checkpoint is not valid JSON (truncated or corrupted?): "),
        (b"[1]", "not a mklang checkpoint (expected a JSON object)"),
        (b'{"format": 1, "run_id": "r"}', "not a valid mklang checkpoint: mklang_version: Field required"),
        (
            dump(_envelope()).replace(b'"name":"m"', b'"name":1'),
            "not a valid mklang checkpoint: machine.name: Input should be a valid string",
        ),
        (
            json.dumps({"format": 1, "frames": [_nested(3 * 64)]}).encode(),
            "the checkpoint holds values nested more than",
        ),
    ],
    # ids that stay the same in every process (a dump is signed with the process's key)
    ids=["missing", "folder", "empty", "truncated", "array", "partial", "mistyped", "too-deep"],
)
def test_every_way_a_checkpoint_is_unusable_is_one_line_naming_the_file(tmp_path, content, message):
    path = tmp_path / "cp.json"
    if content == "folder":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(CheckpointError) as caught:
        load(path)
    assert str(caught.value).startswith(f"{path}: {message}")


def test_a_checkpoint_may_nest_values_deeper_than_other_json_input(tmp_path):
    path = tmp_path / "cp.json"
    save(path, _envelope(result=_nested(64 + 10)))
    assert load(path).result == _nested(64 + 10)


def test_a_map_renders_as_json_that_keeps_non_ascii_text():
    machine = """
        machine m
        entry a
        budget 3
        context { m: { k: "café ✓" } }
        state a {
          structure "s"
          prompt "{{m}}"
          output o
          otherwise -> END
        }
    """
    provider = Recorder({"produce": ["x"]})
    run_mk(machine, provider=provider)
    assert provider.produced[0].user == '{"k": "café ✓"}'


def test_branch_locals_are_read_by_path_and_shadow_context_keys():
    machine = """
        machine m
        entry a
        budget 5
        context { item: "shadowed", people: [{ name: "Ada", langs: ["en", "fr"] }, { name: "Bo" }] }
        state a {
          over people
          structure "s"
          prompt "{{item.name}}|{{item.langs.-1}}|{{item.missing}}|{{index}}"
          output o
          otherwise -> END
        }
    """
    provider = Recorder({"produce": ["x"]})
    run_mk(machine, provider=provider, concurrency=1)
    assert sorted(request.user for request in provider.produced) == ["Ada|fr||0", "Bo|||1"]


def test_a_dotted_input_writes_inside_the_map_and_keeps_its_siblings():
    machine = """
        machine m
        entry a
        budget 3
        context { ticket: { body: "", id: "T-1" }, flat: 1 }
        state a {
          structure "s"
          prompt "{{ticket.body}} {{ticket.id}} {{new.deep.key}} {{flat}}"
          output o
          otherwise -> END
        }
    """
    provider = Recorder({"produce": ["x"]})
    result = run_mk(machine, {"ticket.body": "hello", "new.deep.key": 5, "flat": 2}, provider=provider)
    assert result.context["ticket"] == {"body": "hello", "id": "T-1"}
    assert result.context["new"] == {"deep": {"key": 5}}
    assert "ticket.body" not in result.context
    assert provider.produced[0].user.startswith("<data-")  # host inputs are tainted


def test_a_hook_gate_that_repairs_spends_its_own_repair_budget():
    machine = """
        machine m
        entry a
        budget 9
        hook bad "True when the draft is bad."
        state a {
          structure "s"
          prompt "p"
          output o
          when "the draft is bad" hook bad repair 2 -> a
          otherwise -> END
        }
    """
    result = run_mk(machine, llm={"produce": ["x"]}, hooks={"bad": lambda context, output: True})
    assert result.status == "done", result.error
    assert [(step["policy"], step["gate_via"]) for step in result.trace] == [
        ("repair", "hook"),
        ("repair", "hook"),
        ("ok", "otherwise"),
    ]


# --- an unreadable judge answer: fallback or halt, with the batches before it --


@pytest.mark.parametrize(
    ("catch_all", "second", "status", "fallback"),
    [
        ("otherwise -> END", '{"choice": 9}', "done", True),
        ("", '{"choice": 9}', "judge-unparseable", None),
        ("", '{"choice": 2}', "no-gate-matched", None),
    ],
)
def test_an_unusable_second_batch_after_a_none_batch_keeps_what_the_batches_cost_and_said(
    tmp_path, catch_all, second, status, fallback
):
    machine = f"""
        machine m
        entry a
        budget 3
        hook never "False."
        state a {{
          structure "s"
          prompt "p"
          output o
          when "first" -> END
          when "second" hook never -> END
          when "third" -> END
          {catch_all}
        }}
    """
    path = tmp_path / "mklang.toml"
    with FakeServer() as server:
        server.add(
            answer("out", input_tokens=10, output_tokens=5),
            answer("2", input_tokens=100, output_tokens=1),
            answer(second, input_tokens=1000, output_tokens=1),
        )
        path.write_text(
            f'[tiers]\ndefault = "p:m"\n[providers.p]\nkind = "openai"\nbase_url = "{server.openai_url}"\nretries = 0\n'
        )
        result = run_mk(machine, provider=make_provider(config_path=str(path)), hooks={"never": lambda c, o: False})
    assert status in (result.status, result.error)
    [step] = result.trace
    none_batches = 1 + (second == '{"choice": 2}')
    assert (step.get("judge_none"), step.get("judge_fallback"), step.get("judge_parse")) == (
        none_batches,
        fallback,
        "strict",
    )
    assert step["usage"] == Usage(1110, 7).to_json()
    assert result.usage == Usage(1110, 7)


class KeyJournal(NullJournal):
    """Keeps the idempotency key of every call a run makes."""

    def __init__(self) -> None:
        self.keys: list[tuple[str, str]] = []

    def record(self, key: str, kind: str, value: Any) -> None:
        self.keys.append((kind, key))


def test_every_call_of_a_run_has_its_own_stable_idempotency_key():
    machine = """
        machine m
        entry a
        budget 5
        hook never "False."
        state a {
          structure "s"
          prompt "p"
          output o
          when "first" -> END
          when "second" hook never -> END
          when "third" -> END
          otherwise -> b
        }
        state b {
          structure "s"
          prompt "p"
          output o
          when "done" -> END
          otherwise -> END
        }
    """
    journal = KeyJournal()
    run_mk(machine, llm={"judge": ["none"]}, hooks={"never": lambda c, o: False}, journal=journal)
    assert journal.keys == [
        ("produce", "r:1.0.1"),
        ("judge", "r:1.g.1"),
        ("judge", "r:1.g.2"),
        ("produce", "r:2.0.1"),
        ("judge", "r:2.g.1"),
    ]


@pytest.mark.parametrize("name", ["m.mk", "M.MK", "m.yaml"])
def test_a_machine_file_given_as_a_checkpoint_says_how_to_make_one(tmp_path, name):
    path = tmp_path / name
    path.write_text("machine m\nentry a\n")
    with pytest.raises(CheckpointError) as caught:
        load(path)
    assert str(caught.value) == (
        f"{path} is a machine file, not a checkpoint: `mklang run {path} --checkpoint cp.json` writes one"
    )


# --- stores at their edges: a lock taken twice in one process, errors, odd files ---

POSTGRES = "postgresql://postgres@127.0.0.1:5432/test"


@pytest.fixture(params=["file", "sqlite", "postgresql"])
def named_store(request, tmp_path) -> Any:
    """A fresh store, how it names a run in its messages, and the holder it reports for this process."""
    import socket

    from mklang.stores import open_store

    me = str(os.getpid())
    if request.param == "file":
        folder = tmp_path / "runs"
        folder.mkdir()
        store, name = open_store(folder), lambda run: str(folder / run)
    elif request.param == "sqlite":
        path = tmp_path / "runs.db"
        store, name = open_store(f"sqlite:///{path}"), lambda run: f"sqlite:///{path}#{run}"
    else:
        store, name = open_store(request.getfixturevalue("postgres_uri")), lambda run: f"{POSTGRES}#{run}"
        me = f"{me}@{socket.gethostname()}"
    yield store, name, me
    store.close()


def test_a_run_locked_in_this_process_cannot_be_locked_again_but_another_run_can(named_store):
    store, name, me = named_store
    first = store.lock("run 1")
    try:
        assert store.holder("run 1") == me
        assert store.holder("run 2") is None
        with pytest.raises(CheckpointError) as caught:
            store.lock("run 1")
        assert str(caught.value) == (
            f"{name('run 1')}: the run is still going in process {me}; "
            "wait for it, or stop it (Ctrl-C suspends it) before resuming"
        )
        store.lock("run 2").release()
    finally:
        first.release()
    assert store.holder("run 1") is None
    store.lock("run 1").release()


def test_a_closed_database_store_fails_with_one_line_naming_the_store(tmp_path, postgres_uri):
    from mklang.stores import open_store

    closed = {
        f"{tmp_path}/runs.db: SQLite checkpoint store: Cannot operate on a closed database.": open_store(
            f"sqlite:///{tmp_path}/runs.db"
        ),
        f"{POSTGRES}: PostgreSQL checkpoint store: the connection is closed": open_store(postgres_uri),
    }
    for message, store in closed.items():
        store.close()
        for use in (
            partial(store.read, "a"),
            partial(store.write, "a", b"{}", generation=1),
            partial(store.read_journal, "a"),
            partial(store.start_journal, "a", b"gen\n"),
            partial(store.append, "a", b"step\n", durable=True),
            partial(store.drop_journal, "a"),
            store.runs,
            partial(store.read_note, "batch:x"),
            partial(store.write_note, "batch:x", b"note"),
            partial(store.record_spend, "b", "a", 1, 0.5),
            partial(store.spend, "b"),
        ):
            with pytest.raises(CheckpointError) as caught:
                use()
            assert str(caught.value) == message


def test_a_sqlite_store_serves_every_thread_of_the_process(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from mklang.stores import open_store

    store = open_store(f"sqlite:///{tmp_path}/runs.db")
    with ThreadPoolExecutor(1) as pool:
        pool.submit(partial(store.write, "a", b"{}", generation=1)).result()
        pool.submit(store.start_journal, "a", b"gen\n").result()
    assert (store.read("a"), store.read_journal("a")) == (b"{}", b"gen\n")
    assert stat.S_IMODE((tmp_path / "runs.db.locks").stat().st_mode) == 0o700  # the locks are the owner's
    store.close()


@pytest.mark.parametrize("uri", ["sqlite://host/runs.db", "sqlite:///", "sqlite://"])
def test_a_sqlite_uri_without_a_local_path_is_a_usage_error(uri):
    from mklang.errors import UsageError
    from mklang.stores import open_store

    with pytest.raises(UsageError) as caught:
        open_store(uri)
    assert str(caught.value) == f"{uri}: expected sqlite:///relative/path.db or sqlite:////absolute/path.db"


def test_a_sqlite_store_may_be_a_one_letter_file_and_not_a_folder(tmp_path, monkeypatch):
    from mklang.stores import open_store

    monkeypatch.chdir(tmp_path)
    open_store("sqlite:///a").close()
    assert (tmp_path / "a").is_file()
    with pytest.raises(CheckpointError) as caught:
        open_store(f"sqlite:///{tmp_path}")
    assert str(caught.value) == f"{tmp_path}: cannot open the SQLite checkpoint store: unable to open database file"


def test_postgresql_store_errors_are_the_first_line_of_the_servers_and_hide_the_uri_options(monkeypatch):
    import sys

    from mklang.errors import UsageError
    from mklang.stores import open_store

    with pytest.raises(CheckpointError) as caught:
        open_store("postgresql://postgres@127.0.0.1:1/test?connect_timeout=2&application_name=a?b")
    assert str(caught.value).startswith(
        "postgresql://postgres@127.0.0.1:1/test: cannot connect to the PostgreSQL checkpoint store: connection failed: "
    )
    assert "\n" not in str(caught.value) and str(caught.value).endswith(
        "Connection refused (is the server up, and the URI's host, port, user and database right?)"
    )
    require_postgres()
    with pytest.raises(UsageError) as caught:
        open_store(f"{POSTGRES}?options=-csearch_path%3Dmk_no_such_schema")
    assert str(caught.value).startswith(f"{POSTGRES}: the schema the URI's search_path names does not exist")
    monkeypatch.setitem(sys.modules, "psycopg", None)
    with pytest.raises(UsageError) as missing:
        open_store(POSTGRES)
    assert str(missing.value) == "the PostgreSQL store needs psycopg: pip install 'mklang[distributed]'"


def require_postgres() -> None:
    from support.services import require_server

    require_server("PostgreSQL")


def test_the_file_store_lists_only_checkpoint_files(tmp_path):
    from mklang.stores import open_store

    envelope = dump(_envelope())
    for name in ("cp.json", ".hidden.json", "cp.json.tmp", "cp.json.journal", "cp.json.lock", "b.json"):
        (tmp_path / name).write_bytes(envelope)
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    (tmp_path / "folder").mkdir()
    assert open_store(tmp_path).runs() == ["b.json", "cp.json"]


def test_a_dropped_journal_takes_no_more_appends(tmp_path):
    from mklang.stores import open_store

    store = open_store(tmp_path)
    store.start_journal("cp.json", b"gen\n")
    store.drop_journal("cp.json")
    with pytest.raises(CheckpointError, match="the journal was not started"):
        store.append("cp.json", b"step\n", durable=False)
    assert not (tmp_path / "cp.json.journal").exists()


# --- what a checkpoint may decide about the host that resumes it (ADR 0014) ---

NOTHING_GIVEN = dict.fromkeys(("script", "scenario", "provider", "model", "config", "replay", "plugins"))


def _recorded(**fields: Any) -> Any:
    from mklang.checkpoint.envelope import HostSettings

    return HostSettings(**fields)


def test_a_trusted_checkpoint_answers_as_the_run_did_when_the_command_line_gives_no_way():
    from mklang.checkpoint.trust import host_choice

    recorded = _recorded(script="s.yaml", scenario="a", model="m", replay="c.yaml", record="new.yaml", plugins=["p"])
    reused, ignored = host_choice(recorded, NOTHING_GIVEN, trusted=True)
    assert ignored == []
    assert reused == {
        "script": "s.yaml",
        "scenario": "a",
        "provider": None,
        "model": "m",
        "config": None,
        "replay": "c.yaml",
        "plugins": ["p"],
    }  # never re-recording
    chosen, _ = host_choice(recorded, {**NOTHING_GIVEN, "scenario": "b"}, trusted=True)
    assert (chosen["script"], chosen["scenario"]) == ("s.yaml", "b")


def test_an_untrusted_checkpoint_decides_nothing_and_names_what_it_would_have():
    from mklang.checkpoint.trust import host_choice

    recorded = _recorded(script="s.yaml", scenario="a", model="m", replay="c.yaml", plugins=["p"])
    assert host_choice(recorded, NOTHING_GIVEN, trusted=False) == (
        NOTHING_GIVEN,
        ["script", "scenario", "model", "replay", "plugins"],
    )
    assert host_choice(_recorded(), NOTHING_GIVEN, trusted=False) == (NOTHING_GIVEN, [])  # nothing recorded


def test_one_way_of_answering_given_keeps_every_recorded_one_out():
    from mklang.checkpoint.trust import host_choice

    recorded = _recorded(script="s.yaml", scenario="a", plugins=["p"])
    for name in ("script", "provider", "model", "config", "replay"):
        given = {**NOTHING_GIVEN, name: "given"}
        reused, _ = host_choice(recorded, given, trusted=True)
        assert reused == {**given, "plugins": ["p"]}
        assert host_choice(recorded, given, trusted=False) == (given, ["plugins"])
    given = {**NOTHING_GIVEN, "provider": "given", "plugins": []}  # --plugin given: the recorded ones stay out
    assert host_choice(recorded, given, trusted=True) == (given, [])


# --- fan-out edges: what `over` is, a branch's reasoning and its failed call -----


@pytest.mark.parametrize(
    ("xs", "what"), [(None, "missing"), ('"text"', "a str, not a list"), ("{ a: 1 }", "a dict, not a list")]
)
def test_over_a_value_that_is_not_a_list_halts_at_the_state_saying_what_it_is(xs, what):
    context = f"context {{ xs: {xs} }}" if xs is not None else ""
    result = run_mk(f"""
        machine fan
        entry start
        budget 5
        {context}
        state start {{
          structure "s"
          prompt "p"
          output first
          otherwise -> each
        }}
        state each {{
          over xs
          structure "s"
          prompt "{{{{item}}}}"
          output o
          otherwise -> END
        }}
    """)
    assert (result.status, result.error, result.at) == ("halted", f"state-error: over: 'xs' is {what}", "each")


def test_a_branch_keeps_its_reasoning_only_when_it_has_some():
    result = run_mk(
        """
        machine fan
        entry each
        budget 5
        context { xs: ["a", "b"] }
        state each {
          over xs
          reason
          structure "s"
          prompt "{{item}}"
          output o
          otherwise -> END
        }
        """,
        llm={"produce": {"a": {"text": "A", "reasoning": "because"}, "b": {"text": "B", "reasoning": None}}},
    )
    assert result.status == "done", result.error
    first, second = result.trace[0]["branches"]
    assert (first["output"], first["reasoning"]) == ("A", "because")
    assert (second["output"], "reasoning" in second) == ("B", False)


def test_an_escalation_suspends_with_its_question_and_a_provider_error_with_its_detail():
    result = run_mk(
        """
        machine ask
        entry a
        budget 5
        state a {
          structure "s"
          prompt "p"
          output x
          otherwise escalate -> b ask "Publish?" reply_to answer
        }
        state b {
          structure "s"
          prompt "p"
          output y
          otherwise -> END
        }
        """,
        suspendable=True,
        hitl=True,
    )
    assert (result.status, result.reason, result.ask, result.reply_to) == (
        "suspended",
        "escalated",
        "Publish?",
        "answer",
    )

    class Down(Recorder):
        def produce(self, system, user, tier, reason):
            raise ProviderError("HTTP 503 from the model server")

    parked = run_mk(
        'machine m\nentry a\nbudget 5\nstate a {\n structure "s"\n prompt "p"\n output x\n otherwise -> END\n}\n',
        provider=Down(),
        suspendable=True,
    )
    assert (parked.status, parked.reason, parked.detail) == (
        "suspended",
        "provider-error",
        "HTTP 503 from the model server",
    )
    assert parked.to_json()["detail"] == "HTTP 503 from the model server"


def test_an_interrupt_ends_a_run_that_cannot_suspend_at_its_state_with_its_spend():
    from mklang.engine.runtime import Control

    control = Control()

    class InterruptAfterOne(Recorder):
        def produce(self, system, user, tier, reason):
            control.interrupted.set()
            return Produced("x", None, Usage(3, 4, 0.5))

    result = run_mk(
        TWO_STATES,
        provider=InterruptAfterOne(),
        control=control,
    )
    assert (result.status, result.error, result.at) == ("halted", "interrupted", "b")
    assert result.usage == Usage(3, 4, 0.5)


# --- a halt journaled before the envelope says so ------------------------------


def test_a_run_that_dies_after_journaling_a_halt_resumes_to_the_same_halt(tmp_path):
    from support.runs import outcome

    from mklang import faults
    from mklang.service import resume as resume_run
    from mklang.service import start as start_run
    from mklang.session import Host

    class Crash(BaseException):
        pass

    def crash() -> None:
        raise Crash

    machine = write_machines(
        tmp_path,
        """
        machine m
        entry a
        budget 5
        tool risky "fails"
        state a {
          structure "s"
          prompt "p"
          output x
          otherwise -> b
        }
        state b {
          tool risky { q: "{{x}}" }
          output y
          otherwise -> END
        }
    """,
    )

    calls = []

    def risky(args: dict[str, Any]) -> Any:
        calls.append(args)
        raise RuntimeError("exploded")

    def host() -> Host:
        return Host(
            provider=Recorder({"produce": ["one"], "tokens": [2, 3]}),
            tools={"risky": risky},
        )

    reference = outcome(start_run(machine, None, host(), checkpoint=tmp_path / "ref.json"))
    assert (reference["status"], reference["usage"]["input_tokens"]) == ("halted", 2)
    faults.arm("journal.halt", 1, crash)
    try:
        with pytest.raises(Crash):
            start_run(machine, None, host(), checkpoint=tmp_path / "cp.json")
    finally:
        faults.disarm()
    assert load(tmp_path / "cp.json").status == "running"
    calls.clear()
    resumed = resume_run(tmp_path / "cp.json", host())
    assert calls == []  # the journaled halt ends the level: the state does not run again
    assert outcome(resumed) == reference
    assert (resumed.error, resumed.at) == ("state-error: tool risky: exploded", "b")


def test_the_engine_stop_signal_reads_as_its_reason():
    from mklang.engine.signals import Stop

    frame = Frame.start(mk("machine m\nentry a\nbudget 1\nstate a {\n  tool t\n  output o\n  otherwise -> END\n}\n"))
    assert [
        str(signal)
        for signal in (
            Stop("halted", "gate-fail", "a"),
            Stop("suspended", "escalated", "a", [frame]),
            Stop("stopped", "cost-exhausted", "a"),
            Stop("interrupted", "interrupted", "a"),
        )
    ] == ["gate-fail", "escalated", "cost-exhausted", "interrupted"]


def test_file_store_errors_name_the_file_and_say_what_failed(tmp_path):
    from mklang.stores import open_store
    from mklang.stores.file import FileStore

    store = open_store(tmp_path)
    (tmp_path / "cp.json.journal").mkdir()
    with pytest.raises(CheckpointError) as caught:
        store.read_journal("cp.json")
    assert str(caught.value) == f"{tmp_path / 'cp.json.journal'}: cannot read the journal: Is a directory"
    with pytest.raises(CheckpointError) as caught:
        store.start_journal("cp.json", b"gen\n")
    assert str(caught.value) == f"{tmp_path / 'cp.json.journal'}: cannot write the journal: Is a directory"
    missing = FileStore(tmp_path / "missing")
    with pytest.raises(CheckpointError) as caught:
        missing.lock("cp.json")
    assert (
        str(caught.value)
        == f"{tmp_path / 'missing' / 'cp.json'}: cannot lock the checkpoint: No such file or directory"
    )
    missing.drop_journal("cp.json")  # nothing to drop is fine


def test_a_lock_file_is_owner_only_never_followed_through_a_link_and_released_once(tmp_path):
    from mklang.stores import open_store

    store = open_store(tmp_path)
    lock = store.lock("cp.json")
    assert stat.S_IMODE((tmp_path / "cp.json.lock").stat().st_mode) == 0o600
    lock.release()
    lock.release()  # a second release does nothing
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (tmp_path / "other.json.lock").symlink_to(victim)
    with pytest.raises(CheckpointError, match="cannot lock the checkpoint: Too many levels of symbolic links"):
        store.lock("other.json")
    assert store.holder("other.json") is None
    assert victim.read_text() == "keep me"


def test_a_closed_file_store_takes_no_more_journal_lines(tmp_path):
    from mklang.stores import open_store

    store = open_store(tmp_path)
    store.start_journal("cp.json", b"gen 1\n")
    store.start_journal("cp.json", b"gen 2\n")
    store.append("cp.json", b"step\n", durable=False)
    assert store.read_journal("cp.json") == b"gen 2\nstep\n"
    store.close()
    with pytest.raises(CheckpointError, match="the journal was not started"):
        store.append("cp.json", b"late\n", durable=False)


def test_a_reply_to_the_asked_path_or_a_map_above_it_answers_the_question():
    machine = mk("machine m\nentry a\nbudget 1\nstate a {\n  tool t\n  output o\n  otherwise -> END\n}\n")
    for reply, answered in [
        ("approval.answer", True),
        ("approval", True),
        ("approv", False),
        ("approval.answer.x", False),
    ]:
        frame = Frame.start(machine)
        frame.ask = {"ask": "Publish?", "reply_to": "approval.answer"}
        frame.decision_tainted = True
        frame.inject(reply, "yes")
        assert (frame.ask is None) is answered, reply
        assert frame.decision_tainted is not answered, reply  # only the reply to the question confirms
        assert {reply.split(".")[0]} <= frame.external & frame.tainted  # every injected value is outside data


def test_each_branch_of_a_fan_out_keys_its_calls_by_its_number():
    class FoldJournal(KeyJournal):
        def __init__(self) -> None:
            super().__init__()
            self.folded: list[str] = []

        def fold(self, prefix: str) -> None:
            self.folded.append(prefix)

    journal = FoldJournal()
    result = run_mk(
        """
        machine m
        entry each
        budget 5
        context { xs: ["a", "b", "c"] }
        state each {
          over xs
          structure "s"
          prompt "{{item}}"
          output o
          otherwise -> END
        }
        """,
        journal=journal,
    )
    assert result.status == "done", result.error
    assert sorted(journal.keys) == [("produce", "r:1.1of3.1"), ("produce", "r:1.2of3.1"), ("produce", "r:1.3of3.1")]
    assert sorted(journal.folded) == ["r:1.1of3", "r:1.2of3", "r:1.3of3"]  # each finished branch's answers fold into it


def test_an_interrupt_inside_a_called_machine_ends_the_whole_run_with_every_levels_spend(tmp_path):
    from mklang.engine.runtime import Control

    control = Control()

    class InterruptInTheChild(Recorder):
        def produce(self, system, user, tier, reason):
            if user == "child a":
                control.interrupted.set()
            return Produced("x", None, Usage(1, 1, 0.25))

    machine = write_machines(
        tmp_path,
        """
        machine parent
        entry warm
        budget 5
        state warm {
          structure "s"
          prompt "warm"
          output w
          otherwise -> go
        }
        state go {
          call child
          output r
          otherwise -> END
        }
        """,
        """
        machine child
        entry a
        budget 5
        state a {
          structure "s"
          prompt "child a"
          output o
          otherwise -> b
        }
        state b {
          structure "s"
          prompt "child b"
          output o
          otherwise -> END
        }
        """,
    )
    result = run_mk(machine, provider=InterruptInTheChild(), control=control)
    assert (result.status, result.error, result.at) == ("halted", "interrupted", "b")
    assert result.usage == Usage(2, 2, 0.5)


def test_the_calls_of_a_called_machine_are_keyed_under_the_call(tmp_path):
    machine = write_machines(
        tmp_path,
        """
        machine parent
        entry go
        budget 5
        state go {
          call child
          output r
          otherwise -> END
        }
        """,
        """
        machine child
        entry a
        budget 5
        state a {
          structure "s"
          prompt "p"
          output o
          otherwise -> END
        }
        """,
    )
    journal = KeyJournal()
    assert run_mk(machine, journal=journal).status == "done"
    assert journal.keys == [("produce", "r:1.0/:1.0.1")]


# --- the scratchpad and where a checkpoint lives --------------------------------


def test_the_scratchpad_asks_alone_without_a_system_message_and_joins_every_block():
    from mklang.providers.scratchpad import INSTRUCTION, split, with_instruction

    assert with_instruction("") == INSTRUCTION
    assert with_instruction("Be brief.") == f"Be brief.\n\n{INSTRUCTION}"
    assert split("<think> a </think>x<reasoning>b</reasoning> y ") == ("x y", "a\n\nb")


def test_a_checkpoint_is_located_by_path_or_by_store_uri_and_run(tmp_path, monkeypatch):
    from mklang.errors import UsageError
    from mklang.stores import locate

    monkeypatch.chdir(tmp_path)
    by_path = locate("cp.json")
    assert (by_path.run, str(by_path), by_path.key, by_path.anchor) == (
        "cp.json",
        "cp.json",
        str(tmp_path / "cp.json"),
        Path("cp.json"),
    )
    assert locate(str(tmp_path / "cp.json")).key == by_path.key  # two names of one run
    in_sqlite = locate("sqlite:///runs.db#run-1")
    assert (in_sqlite.run, str(in_sqlite), in_sqlite.key, in_sqlite.anchor) == (
        "run-1",
        "sqlite:///runs.db#run-1",
        "sqlite:///runs.db#run-1",
        Path("runs.db"),
    )
    in_sqlite.store.close()
    with pytest.raises(UsageError, match=r"sqlite:///runs\.db: run name 'run#1' is not valid"):
        locate("sqlite:///runs.db#run#1")  # the first '#' ends the store, the rest is no run name
    with pytest.raises(UsageError) as caught:
        locate("sqlite:///runs.db")
    assert str(caught.value) == "sqlite:///runs.db: a store URI names a run after '#', e.g. sqlite:///runs.db#RUN_ID"


def test_a_postgresql_checkpoint_anchors_machine_paths_in_the_current_folder(tmp_path, monkeypatch, postgres_uri):
    from mklang.stores import locate

    monkeypatch.chdir(tmp_path)
    location = locate(f"{postgres_uri}#r")
    assert (location.run, location.anchor) == ("r", tmp_path / "checkpoint")
    location.store.close()


# --- tool and call states at their edges -------------------------------------------

TOOL_MACHINE = """
    machine m
    entry a
    budget 5
    tool lookup "finds"
    state a {
      tool lookup { q: "x" }
      output found
      otherwise -> END
    }
"""


def test_a_tool_gets_its_arguments_and_an_idempotency_key_and_a_map_it_returns_is_json_text():
    seen = []

    def lookup(arguments: dict[str, Any], idempotency_key: str) -> Any:
        seen.append((arguments, idempotency_key))
        return {"hits": [1, 2]}

    journal = KeyJournal()
    result = run_mk(TOOL_MACHINE, tools={"lookup": lookup}, journal=journal)
    assert result.status == "done", result.error
    [(arguments, key)] = seen
    assert arguments == {"q": "x"}
    run_id, _, call = key.partition("/")
    assert (bool(run_id), call) == (True, "r:1.0.1")
    assert journal.keys == [("tool", "r:1.0.1")]
    assert result.context["found"] == '{"hits": [1, 2]}'


def test_an_answer_nested_too_deep_for_its_parse_halts_the_state():
    result = run_mk(
        """
        machine m
        entry a
        budget 5
        state a {
          structure "s"
          prompt "p"
          parse json
          output o
          otherwise -> END
        }
        """,
        llm={"produce": ["[" * 200 + "]" * 200]},
    )
    assert result.status == "halted"
    assert result.error.startswith("state-error: parse-json: the answer is nested more than")


CALLING = """
    machine parent
    entry go
    budget 5
    context { xs: ["a"] }
    state go {
      call child
      output r
      otherwise -> each
    }
    state each {
      over xs
      call child
      output rs
      otherwise -> END
    }
"""

SHORT_CHILD = """
    machine child
    entry a
    budget {budget}
    state a {{
      structure "s"
      prompt "a"
      output o
      otherwise -> b
    }}
    state b {{
      structure "s"
      prompt "b"
      output o
      otherwise -> END
    }}
"""


def test_a_called_machine_is_journaled_one_level_down_except_inside_a_branch(tmp_path):
    class EnterJournal(NullJournal):
        def __init__(self) -> None:
            self.entered: list[tuple[int, str]] = []

        def enter(self, depth: int, frame: Frame) -> None:
            self.entered.append((depth, frame.machine.name))

    journal = EnterJournal()
    result = run_mk(write_machines(tmp_path, CALLING, SHORT_CHILD.format(budget=5)), journal=journal)
    assert result.status == "done", result.error
    assert journal.entered == [(1, "child")]  # the call in the fan-out branch is not


def test_a_called_machine_that_runs_out_of_steps_suspends_a_suspendable_run(tmp_path):
    machine = write_machines(tmp_path, CALLING, SHORT_CHILD.format(budget=1))
    result = run_mk(machine, suspendable=True)
    assert (result.status, result.reason, result.at) == ("suspended", "budget-exhausted", "b")
    assert [frame.machine.name for frame in result.frames] == ["parent", "child"]


def test_scripted_answers_go_to_branches_by_index_whatever_order_they_ask_in(tmp_path):
    import time as clock

    def wait(arguments: dict[str, Any]) -> str:
        clock.sleep(float(arguments["s"]))
        return "waited"

    machine = write_machines(
        tmp_path,
        """
        machine parent
        entry each
        budget 9
        context { xs: ["0.3", "0"] }
        state each {
          over xs
          call child { d: "{{item}}" }
          output o
          otherwise -> END
        }
        """,
        """
        machine child
        entry t
        budget 5
        tool wait "sleeps"
        state t {
          tool wait { s: "{{d}}" }
          output w
          otherwise -> p
        }
        state p {
          structure "s"
          prompt "p"
          output o
          otherwise -> END
        }
        """,
    )
    result = run_mk(machine, tools={"wait": wait}, llm={"produce": ["first", "second"]})
    assert result.result == ["first", "second"]  # branch 0 asked last


# --- steps, visits and the clock at their edges ----------------------------------


def test_max_visits_1_lets_a_state_run_once():
    result = run_mk("""
        machine m
        entry a
        budget 5
        state a {
          structure "s"
          prompt "p"
          output o
          max_visits 1
          otherwise -> a
        }
    """)
    assert (result.error, result.at, len(result.trace)) == ("loop-ceiling", "a", 1)


def test_a_fan_out_over_one_item_costs_one_step():
    result = run_mk(
        """
        machine m
        entry each
        budget 2
        context { xs: ["a"] }
        state each {
          over xs
          structure "s"
          prompt "{{item}}"
          output o
          otherwise -> b
        }
        state b {
          structure "s"
          prompt "p"
          output p
          otherwise -> END
        }
        """,
        suspendable=True,
    )
    assert (result.status, [step["state"] for step in result.trace]) == ("done", ["each", "b"])


def test_a_call_that_fails_after_the_deadline_is_the_time_budget_not_a_provider_error():
    import time as clock

    class Slow(Recorder):
        def produce(self, system, user, tier, reason):
            clock.sleep(0.2)
            raise ProviderError("timeout: no answer")

    machine = 'machine m\nentry a\nbudget 5\nstate a {\n structure "s"\n prompt "p"\n output x\n otherwise -> END\n}\n'
    halted = run_mk(machine, provider=Slow(), max_time=0.05)
    assert (halted.status, halted.error, halted.at) == ("halted", "time-exhausted", "a")
    parked = run_mk(machine, provider=Slow(), max_time=0.05, suspendable=True)
    assert (parked.status, parked.reason) == ("suspended", "time-exhausted")


FAN = """
    machine m
    entry each
    budget {budget}
    tool probe "looks"
    context {{ xs: ["a", "b", "c"] }}
    state each {{
      over xs
      {face}
      output o
      otherwise -> END
    }}
"""


def test_a_branch_reads_the_context_and_fences_what_the_host_gave():
    provider = Recorder()
    result = run_mk(
        FAN.format(budget=5, face='structure "s"\n      prompt "{{item}} for {{topic}}"'),
        {"topic": "tides"},
        provider=provider,
    )
    assert result.status == "done", result.error
    users = sorted(request.user for request in provider.produced)
    assert len(users) == 3 and all("tides" in user and "<data-" in user for user in users)


def test_a_fan_out_cut_by_the_step_budget_suspends_with_its_finished_branches():
    result = run_mk(
        FAN.format(budget=2, face='structure "s"\n      prompt "{{item}}"'),
        provider=Recorder({"produce": ["A", "B", "C"]}),
        suspendable=True,
        concurrency=1,
    )
    assert (result.status, result.reason, result.at) == ("suspended", "budget-exhausted", "each")
    assert sorted(result.frames[-1].branches) == [0, 1]


def test_an_exception_that_is_not_a_halt_leaves_the_fan_out():
    class Crash(BaseException):
        pass

    finished = []

    def probe(arguments: dict[str, Any]) -> str:
        if arguments["q"] == "b":
            raise Crash
        finished.append(arguments["q"])
        return "ok"

    with pytest.raises(Crash):
        run_mk(FAN.format(budget=5, face='tool probe { q: "{{item}}" }'), tools={"probe": probe})
    assert "a" in finished  # branches launched before it still finish


def test_a_sqlite_store_file_may_have_a_colon_in_its_name(tmp_path, monkeypatch):
    from mklang.stores import open_store
    from mklang.stores.sqlite import SqliteStore

    monkeypatch.chdir(tmp_path)
    store = open_store("sqlite:///a:b.db")
    assert isinstance(store, SqliteStore) and (tmp_path / "a:b.db").is_file()
    store.close()


def test_a_runs_recorded_spend_keeps_the_most_of_tokens_and_of_dollars_apart(named_store):
    store, _, _ = named_store
    store.record_spend("b", "run ä/1", 100, 0.5)
    store.record_spend("b", "run ä/1", 150, 0.25)  # more tokens, fewer dollars
    assert store.spend("b") == (150, 0.5)
    store.record_spend("b", "run ä/1", 10, 0.75)  # more dollars, fewer tokens
    assert store.spend("b") == (150, 0.75)
    store.record_spend("b", "run ä/1", 1, 0.1)  # less of both: nothing changes
    store.record_spend("b", "run 2", 5, 0.25)
    assert store.spend("b") == (155, 1.0)
    assert (store.spend("other"), store.read_note("batch:b")) == ((0, 0.0), None)
    store.record_spend("c", "r", 1, 0.0)  # a first record of one token and no dollars
    assert store.spend("c") == (1, 0.0)
    store.write_note("batch:b", b"\x00binary\xff")
    assert store.read_note("batch:b") == b"\x00binary\xff"


def test_file_store_notes_and_spend_are_private_and_their_damage_is_named(tmp_path):
    from mklang.stores import open_store

    store = open_store(tmp_path)
    store.write_note("batch:b", b"n")
    store.record_spend("b", "r", 1, 0.5)
    (batch,) = (tmp_path / ".mklang-spend").iterdir()
    for folder in (tmp_path / ".mklang-notes", batch):  # the folders that hold the files
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert store.runs() == []
    (spent,) = (tmp_path / ".mklang-spend").glob("*/*")
    spent.write_text("lots")
    with pytest.raises(CheckpointError) as caught:
        store.spend("b")
    assert str(caught.value).startswith(f"{spent}: cannot read a run's recorded spend: ")
    (note,) = (tmp_path / ".mklang-notes").iterdir()
    note.unlink()
    note.mkdir()
    with pytest.raises(CheckpointError) as caught:
        store.read_note("batch:b")
    assert str(caught.value) == f"{note}: cannot read the batch note: Is a directory"
    with pytest.raises(CheckpointError) as caught:
        store.write_note("batch:b", b"n")
    assert str(caught.value) == f"{note}: cannot write the batch note: Is a directory"


# --- a resume that died: what it changed comes back from its journal ---------------


@pytest.mark.parametrize("crash_at", [0, 1])
def test_a_resume_that_died_is_reopened_with_the_reply_and_settings_it_was_given(tmp_path, crash_at):
    import shutil

    from support import ROOT
    from support.runs import outcome

    from mklang.scenarios import load_script
    from mklang.service import open_run
    from mklang.service import resume as resume_run
    from mklang.service import start as start_run
    from mklang.session import Host

    shutil.copytree(ROOT / "examples" / "approval", tmp_path / "approval")
    machine = load_file(tmp_path / "approval" / "approval.mk")
    scenario = next(s for s in load_script(tmp_path / "approval" / "scenarios.yaml") if s.name == "ask-then-publish")
    settings = {"max_tokens": 10**6, "max_cost": 2.5, "hitl": False, "concurrency": 3}
    reply = {"approval.answer": "yes"}
    reference_at = tmp_path / "reference.json"
    start_run(machine, None, Host.for_scenario(scenario), checkpoint=reference_at)
    reference = outcome(resume_run(reference_at, Host.for_scenario(scenario), reply=reply, **settings))
    assert reference["status"] == "done"

    path = tmp_path / "cp.json"
    start_run(machine, None, Host.for_scenario(scenario), checkpoint=path)
    tops = iter(range(9))

    def crash(event: Any) -> None:
        if next(tops) == crash_at:
            raise Crash

    with pytest.raises(Crash):
        resume_run(path, Host.for_scenario(scenario), reply=reply, observer=LoopTops(crash), **settings)
    reopened = open_run(path, lock=False)
    envelope, innermost = reopened.envelope, reopened.chain[-1]
    assert (envelope.status, envelope.reason, envelope.ask, envelope.reply_to) == ("running", None, None, None)
    assert (envelope.budgets.max_tokens, envelope.budgets.max_cost, envelope.hitl, envelope.concurrency) == (
        10**6,
        2.5,
        False,
        3,
    )
    assert (innermost.context["approval"], innermost.ask, "approval" in innermost.tainted) == (
        {"answer": "yes"},
        None,
        True,
    )
    assert (reopened.crashed, reopened.trusted) == (True, True)
    assert outcome(resume_run(path, Host.for_scenario(scenario))) == reference  # nothing given again


def test_a_checkpoint_is_opened_locked_and_each_refusal_is_one_line_that_releases_the_lock(tmp_path, monkeypatch):
    import shutil

    from support import ROOT

    from mklang.scenarios import load_script
    from mklang.service import open_run
    from mklang.service import start as start_run
    from mklang.session import Host

    shutil.copytree(ROOT / "examples" / "approval", tmp_path / "approval")
    source = tmp_path / "approval" / "approval.mk"
    scenario = next(s for s in load_script(tmp_path / "approval" / "scenarios.yaml") if s.name == "ask-then-publish")
    path = tmp_path / "cp.json"
    start_run(load_file(source), None, Host.for_scenario(scenario), checkpoint=path)

    def refusal(**options: Any) -> str:
        with pytest.raises(CheckpointError) as caught:
            open_run(path, **options)
        assert holder(path) is None  # the refusal released its lock
        return str(caught.value)

    held = open_run(path)  # locked by default
    with pytest.raises(CheckpointError) as busy:
        open_run(path)
    assert str(busy.value) == (
        f"{path}: the run is still going in process {os.getpid()}; "
        "wait for it, or stop it (Ctrl-C suspends it) before resuming"
    )
    held.lock.release()
    suspended = load(path)
    for changed, message in [
        ({"status": "done"}, "the run already finished; a finished run cannot be resumed"),
        (
            {"status": "halted", "error": "gate-fail"},
            "the run already halted (gate-fail); a finished run cannot be resumed",
        ),
        ({"frames": []}, "the checkpoint holds no frames"),
    ]:
        save(path, suspended.model_copy(update=changed))
        assert refusal() == f"{path}: {message}"
    save(path, suspended)
    source.write_text(source.read_text(encoding="utf-8") + "# edited\n", encoding="utf-8")
    assert refusal() == (
        f"{source}: machine file changed since the checkpoint was written (resume with --force to accept the change)"
    )
    open_run(path, force=True).lock.release()
    source.rename(tmp_path / "moved.mk")
    kept = open_run(path)  # a missing file: the text the store keeps, which the signature covers
    assert kept.machines_note is not None
    assert kept.machines_note.startswith(f"{source} is missing; running the machine texts the store keeps")
    kept.release()
    (tmp_path / "moved.mk").rename(source)
    monkeypatch.setenv("MKLANG_CHECKPOINT_KEY", "another user's checkpoint key, 32 bytes or more")
    assert refusal(force=True) == (
        f"{path}: the checkpoint is signed with another checkpoint key; resume it with --trust to run it "
        "as untrusted data (host settings from your command line only)"
    )
    opened = open_run(path, force=True, trust=True)
    assert opened.trusted is False
    opened.lock.release()


# --- what a checkpointed run writes: its settings, then how it ended -----------------

ENDS = """
    machine m
    entry a
    budget 5
    tool risky "fails"
    context {{ topic: "tides" }}
    state a {{
      structure "s"
      prompt "{{{{topic}}}} {{{{extra}}}}"
      output x
      otherwise -> b
    }}
    state b {{
      {b}
      output y
      otherwise -> END
    }}
"""


def test_a_checkpointed_run_records_its_settings_and_how_it_ended(tmp_path):

    machine = write_machines(tmp_path, ENDS.format(b='structure "s"\n      prompt "p"'))
    path = tmp_path / "cp.json"
    snapshots: list[Envelope] = []
    result = start(
        machine,
        {"extra": "more"},
        Host(
            Recorder({"produce": ["one", "two"], "tokens": [2, 1]}),
            tools={"risky": lambda arguments: None},
            settings={"model": "m1"},
        ),
        checkpoint=path,
        max_tokens=500,
        max_cost=2.5,
        max_time=60,
        concurrency=3,
        hitl=True,
        observer=LoopTops(lambda event: snapshots.append(load(path))),
    )
    assert result.status == "done"
    first = snapshots[0]
    assert (first.status, first.machine.path, first.machine.sha256 is not None) == ("running", "m.mk", True)
    assert (first.budgets.max_tokens, first.budgets.max_cost, first.budgets.max_time) == (500, 2.5, 60)
    assert (first.concurrency, first.hitl, first.host.model) == (3, True, "m1")
    assert first.frames[0]["context"] == {"topic": "tides", "extra": "more"}
    done = load(path)
    assert (done.status, done.result, done.error, done.at) == ("done", "two", None, None)
    assert done.usage == {"input_tokens": 4, "output_tokens": 2, "cost_usd": 0.0}


def test_a_checkpointed_run_records_the_halt_and_the_question_it_ended_on(tmp_path):
    def risky(arguments: dict[str, Any]) -> Any:
        raise RuntimeError("exploded")

    machine = write_machines(tmp_path, ENDS.format(b='tool risky { q: "{{x}}" }'))
    path = tmp_path / "halted.json"
    start(machine, {"extra": ""}, Host(Recorder(), tools={"risky": risky}), checkpoint=path)
    halted = load(path)
    assert (halted.status, halted.error, halted.at, halted.result) == (
        "halted",
        "state-error: tool risky: exploded",
        "b",
        None,
    )
    (tmp_path / "asking").mkdir()
    asking = write_machines(
        tmp_path / "asking",
        ENDS.format(b='structure "s"\n      prompt "p"').replace(
            "otherwise -> b", 'otherwise escalate -> b ask "Go on?" reply_to go'
        ),
    )
    path = tmp_path / "suspended.json"
    start(asking, {"extra": ""}, Host(Recorder(), tools={"risky": risky}), checkpoint=path, hitl=True)
    suspended = load(path)
    assert (suspended.status, suspended.reason, suspended.at, suspended.ask, suspended.reply_to) == (
        "suspended",
        "escalated",
        "b",
        "Go on?",
        "go",
    )


def test_an_edited_journal_of_a_signed_run_is_refused_unless_trusted_then_read_as_untrusted(tmp_path):
    from mklang.service import open_run

    path = dead_run(tmp_path, "triage", "triage.mk", 2)
    journal = journal_path(path)
    lines = journal.read_bytes().splitlines(keepends=True)
    lines[1] = lines[1].replace(b'"billing"', b'"refunds"', 1)  # a paid answer, edited
    journal.write_bytes(b"".join(lines))
    with pytest.raises(CheckpointError) as caught:
        open_run(path, lock=False)
    assert str(caught.value) == (
        f"{path}: journal line 2 was edited after it was signed (resume with --trust to use it as untrusted data)"
    )
    assert open_run(path, lock=False, trust=True).trusted is False


def test_a_resume_may_write_to_another_checkpoint_and_leaves_the_first_as_it_was(tmp_path):
    import shutil

    from support import ROOT

    from mklang.scenarios import load_script
    from mklang.service import resume as resume_run
    from mklang.service import start as start_run
    from mklang.session import Host

    shutil.copytree(ROOT / "examples" / "approval", tmp_path / "approval")
    scenario = next(s for s in load_script(tmp_path / "approval" / "scenarios.yaml") if s.name == "ask-then-publish")
    path, other = tmp_path / "cp.json", tmp_path / "other.json"
    start_run(load_file(tmp_path / "approval" / "approval.mk"), None, Host.for_scenario(scenario), checkpoint=path)
    before = path.read_bytes()
    done = resume_run(path, Host.for_scenario(scenario), reply={"approval.answer": "yes"}, checkpoint=other)
    assert (done.status, load(other).status) == ("done", "done")
    assert path.read_bytes() == before
    assert holder(path) is None  # the lock is released when the run ends


def test_the_clock_and_a_batch_ceiling_stop_a_run_at_a_loop_top_by_name():
    from mklang.engine.runtime import Control

    late = run_mk(TWO_STATES, max_time=0, suspendable=True)
    assert (late.status, late.reason, late.at) == ("suspended", "time-exhausted", "a")
    seen = []

    def ceiling(spent: Usage) -> bool:
        seen.append(spent)
        return spent.tokens >= 3

    control = Control()
    control.ceiling = ceiling
    capped = run_mk(TWO_STATES, llm={"tokens": [2, 1]}, control=control, suspendable=True)
    assert (capped.status, capped.reason, capped.at) == ("suspended", "batch-ceiling", "b")
    assert seen[-1] == Usage(2, 1)
