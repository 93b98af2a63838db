"""`mklang batch`, `mklang runs` and `mklang.batch`: many durable runs in one store.

The model is the fake HTTP server on 127.0.0.1, so every paid call is counted
where it is paid. A batch killed with SIGKILL and run again finishes every
item and pays again only the calls that were in flight at the kill.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from support.batches import CALLS, MACHINE, results, write_items
from support.batches import batch_project as batch_project  # the fixture `project`
from support.batches import batch_server as batch_server  # the fixture `server`
from support.commands import cli, cli_env, model_config, refused, wait_for

import mklang as api
from mklang.batching import Batch, Item, batch_id
from mklang.checkpoint.envelope import load
from mklang.errors import MklangError, UsageError, first_line
from mklang.providers.base import Usage
from mklang.runs import Outcome, location
from mklang.runs.inspection import describe, described
from mklang.stores import locate, open_store, target
from mklang.stores.file import FileStore


def batch(project: Path, *options: str) -> subprocess.CompletedProcess[str]:
    return cli("batch", "twostep.mk", "--inputs", "items.jsonl", "--config", "mklang.toml", *options, cwd=project)


def test_a_batch_runs_every_item_once_and_a_rerun_skips_the_finished(project, server):
    write_items(project, 12)
    done = batch(project, "--store", "sqlite:///runs.db", "--out", "out.jsonl", "--format", "json")
    assert done.returncode == 0, done.stderr
    totals = json.loads(done.stdout)
    assert (totals["items"], totals["done"], totals["exit_code"]) == (12, 12, 0)
    assert server.count == 12 * CALLS
    out = results(project / "out.jsonl")
    assert [line["id"] for line in out] == [f"item-{n}" for n in range(12)]  # input order
    assert all(line["status"] == "done" and line["result"] == f"answer {n}" for n, line in enumerate(out))
    again = batch(project, "--store", "sqlite:///runs.db", "--format", "json")
    assert (again.returncode, json.loads(again.stdout)["done"]) == (0, 12)
    assert server.count == 12 * CALLS  # nothing paid twice


def test_runs_lists_a_stores_runs_with_their_status_and_filters_them(project):
    write_items(project, 3)
    assert batch(project, "--store", "sqlite:///runs.db", "--format", "json").returncode == 0
    listed = json.loads(cli("runs", "--store", "sqlite:///runs.db", cwd=project).stdout)["runs"]  # piped: JSON
    assert sorted(run["checkpoint"] for run in listed) == [f"sqlite:///runs.db#item-{n}" for n in range(3)]
    assert {run["status"] for run in listed} == {"done"}
    suspended = cli("runs", "--store", "sqlite:///runs.db", "--status", "suspended", cwd=project)
    assert json.loads(suspended.stdout)["runs"] == []
    refused(cli("runs", "--store", "sqlite:///runs.db", "--status", "lost", cwd=project), "--status expects one of")


def test_batch_wide_ceilings_suspend_the_rest_and_a_rerun_with_more_finishes(project, server):
    write_items(project, 10)
    first = batch(project, "--store", "sqlite:///runs.db", "--batch-max-tokens", "90", "--concurrency", "1")
    assert first.returncode == 3, first.stderr  # some suspended: a re-run continues them
    paid = server.count
    assert paid < 10 * CALLS
    assert paid * 15 <= 90 + 15  # the ceiling holds within the call in flight
    second = batch(project, "--store", "sqlite:///runs.db", "--out", "out.jsonl", "--format", "json")
    assert second.returncode == 0, second.stderr
    assert server.count == 10 * CALLS  # the re-run paid only what the first had not
    assert all(line["status"] == "done" for line in results(project / "out.jsonl"))


FAN_OUT = """\
mklang 0.4
machine fan
entry many
budget 30

state many {
  sample 20
  structure "One word."
  prompt "idea {{topic}}"
  output ideas
  otherwise -> END
}
"""


def test_a_batch_ceiling_cuts_a_fan_out_mid_way_and_a_rerun_pays_no_branch_twice(tmp_path, server):
    from mklang.providers.factory import make_provider

    (tmp_path / "fan.mk").write_text(FAN_OUT, encoding="utf-8")
    provider = make_provider(config_path=model_config(server.openai_url, tmp_path / "mklang.toml"))
    inputs = [{"id": f"item-{n}", "topic": f"t-{n}"} for n in range(2)]
    store, ceiling, per_call = f"sqlite:///{tmp_path}/runs.db", 40, 15
    first = api.batch(tmp_path / "fan.mk", inputs, store=store, provider=provider, batch_max_tokens=ceiling)
    assert [(o.status, o.reason) for o in first] == [("suspended", "batch-ceiling")] * 2
    # Over the ceiling by at most the calls in flight when it was reached: here the branches of
    # the runs in flight, up to each run's concurrency (8).
    assert ceiling <= server.count * per_call <= ceiling + 2 * 8 * per_call
    assert sum(Usage.from_json(o.usage).tokens for o in first) == server.count * per_call
    again = api.batch(tmp_path / "fan.mk", inputs, store=store, provider=provider, batch_max_tokens=100 * ceiling)
    assert [o.status for o in again] == ["done"] * 2
    assert server.count == 2 * 20  # branches paid before the cut were kept, not paid again


def test_a_batch_killed_mid_way_finishes_on_a_rerun_without_paying_a_completed_call_twice(project, server):
    items, concurrency = 40, 4
    write_items(project, items)
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mklang",
            "batch",
            "twostep.mk",
            "--inputs",
            "items.jsonl",
            "--config",
            "mklang.toml",
            "--store",
            "sqlite:///runs.db",
            "--concurrency",
            str(concurrency),
            "--format",
            "json",
        ],
        cwd=project,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: server.count >= items, process, "half the calls were paid")
    process.send_signal(signal.SIGKILL)
    process.communicate()
    paid_before = server.count
    assert paid_before < items * CALLS, "the batch ended before the kill"
    done = batch(project, "--store", "sqlite:///runs.db", "--out", "out.jsonl", "--format", "json")
    assert done.returncode == 0, done.stderr
    assert all(line["status"] == "done" for line in results(project / "out.jsonl"))
    assert [line["result"] for line in results(project / "out.jsonl")] == [f"answer {n}" for n in range(items)]
    # Calls journaled before the kill are answered from the journal; only those in flight are paid again.
    assert items * CALLS <= server.count <= items * CALLS + concurrency


def test_the_python_api_runs_a_batch_in_a_store(tmp_path, server):
    from mklang.providers.factory import make_provider

    (tmp_path / "twostep.mk").write_text(MACHINE, encoding="utf-8")
    provider = make_provider(config_path=model_config(server.openai_url, tmp_path / "mklang.toml"))
    inputs = [{"id": f"item-{n}", "topic": f"t-{n}"} for n in range(5)]
    outcomes = api.batch(tmp_path / "twostep.mk", inputs, store=f"sqlite:///{tmp_path}/runs.db", provider=provider)
    assert [(o.run, o.status, o.result) for o in outcomes] == [(f"item-{n}", "done", f"answer {n}") for n in range(5)]
    assert sorted(open_store(f"sqlite:///{tmp_path}/runs.db").runs()) == [f"item-{n}" for n in range(5)]
    again = api.batch(tmp_path / "twostep.mk", inputs, store=f"sqlite:///{tmp_path}/runs.db", provider=provider)
    assert [o.status for o in again] == ["done"] * 5 and server.count == 5 * CALLS


def test_bad_batch_input_is_a_usage_error(project):
    (project / "items.jsonl").write_text('{"id": 1}\n[1, 2]\n')
    refused(batch(project, "--store", "sqlite:///runs.db"), "items.jsonl:2: each line must hold a JSON object")
    (project / "items.jsonl").write_text('{"id": 1}\n{"id": 1}\n')
    refused(batch(project, "--store", "sqlite:///runs.db"), "appears twice")
    (project / "items.jsonl").unlink()
    refused(batch(project, "--store", "sqlite:///runs.db"), "items.jsonl: cannot read the --inputs file: ")


class Priced:
    """A provider object that charges a quarter dollar a call and counts the calls it is paid for."""

    def __init__(self) -> None:
        self.calls = 0
        self._lock = threading.Lock()

    def produce(self, system: str, user: str, tier: str, reason: bool) -> api.Produced:
        with self._lock:
            self.calls += 1
        return api.Produced("word", None, api.Usage(10, 5, cost_usd=0.25))

    def judge(self, conditions, output, reasoning, context, tier) -> api.Verdict:
        return api.Verdict(0, api.Usage())


@pytest.mark.parametrize(
    ("ceiling", "detail"),
    [
        ({"batch_max_cost": 1.75}, "batch dollars $1.7500 of $1.7500"),
        ({"batch_max_tokens": 105}, "batch tokens 105 of 105"),
        ({"batch_max_tokens": 91}, "batch tokens 105 of 91"),
    ],
    ids=["dollars", "tokens-reached-exactly", "tokens-crossed"],
)
def test_the_batch_ceiling_stops_the_batch_where_its_summed_spend_reaches_it(tmp_path, ceiling, detail):
    """Two calls a run of 15 tokens and $0.25 each, one run at a time: $1.75 and 105 tokens are
    reached by the seventh call, 91 tokens crossed by it, inside the fourth run, before its second
    call. That run and every later one are suspended; a pass with the same ceiling pays nothing (the
    first pass's spend counts), and one with a higher ceiling pays only the rest."""
    (tmp_path / "twostep.mk").write_text(MACHINE, encoding="utf-8")
    provider = Priced()
    inputs = [{"id": f"item-{n}", "topic": f"t-{n}"} for n in range(10)]
    options = dict(store=tmp_path / "runs", provider=provider, concurrency=1)
    first = api.batch(tmp_path / "twostep.mk", inputs, **ceiling, **options)
    assert [(o.status, o.reason) for o in first] == [("done", None)] * 3 + [("suspended", "batch-ceiling")] * 7
    assert provider.calls == 7
    assert [Usage.from_json(o.usage).cost_usd for o in first] == [0.5] * 3 + [0.25] + [0.0] * 6
    shown = json.loads(cli("show", str(tmp_path / "runs" / "item-3"), "--format", "json").stdout)
    assert (shown["reason"], shown["detail"]) == ("batch-ceiling", detail)  # which ceiling, how far
    again = api.batch(tmp_path / "twostep.mk", inputs, **ceiling, **options)
    assert [o.status for o in again] == ["done"] * 3 + ["suspended"] * 7 and provider.calls == 7
    assert [o.usage for o in again] == [o.usage for o in first]  # what each run has spent, started or not
    higher = api.batch(tmp_path / "twostep.mk", inputs, batch_max_cost=5, batch_max_tokens=300, **options)
    assert [o.status for o in higher] == ["done"] * 10
    assert provider.calls == 10 * CALLS  # the fourth run's first call is not paid again


def test_an_input_without_id_is_named_by_the_sha256_of_its_canonical_json(tmp_path):
    """docs/scale.md: keys sorted, no spaces, text as UTF-8 (not escaped); the first 16 hex digits.
    A re-run of an older batch finds its runs only while the name stays this."""
    (tmp_path / "twostep.mk").write_text(MACHINE, encoding="utf-8")
    given = {"topic": "t-é", "b": [1, {"z": None, "a": "x"}]}
    canonical = '{"b":[1,{"a":"x","z":null}],"topic":"t-é"}'
    (named,) = api.batch(tmp_path / "twostep.mk", [given], store=tmp_path / "runs", provider=Priced())
    assert named.run == hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]
    assert named.status == "done"


def test_a_batch_is_named_by_the_sha256_of_its_sorted_run_names():
    """docs/scale.md: the batch's ceilings count what its runs spent in earlier passes, kept in the
    store under this name; a pass in any order, or after an upgrade, finds it only while it stays this."""
    items = [Item(run, {}) for run in ("item-2", "item-10", "é")]
    named = batch_id(items)
    assert named == hashlib.sha256("item-10\nitem-2\né".encode()).hexdigest()[:16] == batch_id(reversed(items))
    assert batch_id(items[:2]) != named


def test_a_batchs_summary_counts_each_status_and_its_exit_code_says_whether_a_rerun_continues(tmp_path):
    from mklang.batching import exit_code, summary, write_results
    from mklang.runs import Outcome

    spent = Usage(10, 5, 0.25).to_json()
    outcomes = [
        Outcome("a", "done", None, "é", spent),
        Outcome("b", "halted", "cost-exhausted", None, spent),
        Outcome("c", "failed", "unreadable"),
        Outcome("d", "pending", "locked"),
        Outcome("e", "suspended", "batch-ceiling"),
        Outcome("f", "done"),
    ]
    assert summary(outcomes) == {
        "items": 6,
        **{"done": 2, "halted": 1, "suspended": 1, "pending": 1, "failed": 1},
        "usage": Usage(20, 10, 0.5).to_json(),
        "exit_code": 3,
    }
    assert summary([])["done"] == 0
    # 3: some run continues on a re-run; else 1: some halted or failed; else 0.
    assert [exit_code(outcomes[i:]) for i in range(5)] == [3, 3, 3, 3, 3]
    assert [exit_code([o, outcomes[5]]) for o in outcomes[:4]] == [0, 1, 1, 3]
    write_results(tmp_path / "out.jsonl", outcomes)
    lines = (tmp_path / "out.jsonl").read_bytes().decode("utf-8").splitlines()
    assert [json.loads(line) for line in lines] == [o.to_json() for o in outcomes]
    assert '"é"' in lines[0]  # text as it is, not escaped
    with pytest.raises(UsageError) as unwritable:
        write_results(tmp_path / "no-folder" / "out.jsonl", outcomes)
    assert (
        str(unwritable.value)
        == f"{tmp_path / 'no-folder' / 'out.jsonl'}: cannot write the results: No such file or directory"
    )


@pytest.mark.parametrize(
    "budget, more",
    [({"max_tokens": 15}, {"max_tokens": 30}), ({"max_cost": 0.25}, {"max_cost": 0.5})],
    ids=["tokens", "dollars"],
)
def test_each_run_of_a_batch_keeps_its_own_budget(tmp_path, budget, more):
    """15 tokens and $0.25 a call: each run stops after its first call, and a pass with twice as much finishes."""
    (tmp_path / "twostep.mk").write_text(MACHINE, encoding="utf-8")
    provider = Priced()
    inputs = [{"id": f"item-{n}", "topic": f"t-{n}"} for n in range(3)]
    first = api.batch(tmp_path / "twostep.mk", inputs, store=tmp_path / "runs", provider=provider, **budget)
    assert [o.status for o in first] == ["suspended"] * 3 and provider.calls == 3
    done = api.batch(tmp_path / "twostep.mk", inputs, store=tmp_path / "runs", provider=provider, **more)
    assert [o.status for o in done] == ["done"] * 3 and provider.calls == 3 * CALLS


@pytest.fixture
def twostep(tmp_path: Path) -> api.Machine:
    """MACHINE, loaded from tmp_path/twostep.mk."""
    (tmp_path / "twostep.mk").write_text(MACHINE, encoding="utf-8")
    return api.load(tmp_path / "twostep.mk")


def _runs_of(machine: api.Machine, store: FileStore, provider: Priced, hitl: bool = False, **options) -> Batch:
    """A batch of `machine` over the folder store `store`, each run answered by `provider`."""
    from contextlib import nullcontext

    from mklang.session import Host

    host = Host(provider=provider)
    return Batch(machine, store, str(store.folder), lambda: nullcontext(host), hitl=hitl, **options)


def test_an_interrupted_batch_starts_no_run_and_reports_each_pending(tmp_path, twostep):
    """What Ctrl-C does to the runs not started yet: each stays for the next pass, reported as it is."""
    provider, told = Priced(), []
    store = open_store(str(tmp_path / "runs"))
    stop = threading.Event()
    stop.set()
    try:
        batch = _runs_of(twostep, store, provider, on_outcome=told.append, stop=stop)
        outcomes = batch.run([Item(f"item-{n}", {"topic": f"t-{n}"}) for n in range(3)])
    finally:
        store.close()
    assert [(o.run, o.status, o.reason) for o in outcomes] == [
        (f"item-{n}", "pending", "interrupted") for n in range(3)
    ]
    assert sorted(told, key=lambda o: o.run) == outcomes and provider.calls == 0


def test_a_run_held_elsewhere_is_pending_one_that_cannot_be_locked_failed_and_the_others_run(tmp_path, twostep):
    """A run whose lock another process holds is `pending` (it is still going there); one whose lock
    cannot be taken is `failed`; each with the one-line reason, told as it is known; the rest run."""
    provider, told = Priced(), []
    store = open_store(str(tmp_path / "runs"))
    held = store.lock("item-0")  # a file lock conflicts with another open of the file, as in another process
    (tmp_path / "runs" / "item-1.lock").mkdir()
    try:
        items = [Item(f"item-{n}", {"topic": f"t-{n}"}) for n in range(3)]
        outcomes = _runs_of(twostep, store, provider, on_outcome=told.append).run(items, concurrency=1)
        assert outcomes[0] == Outcome(
            "item-0",
            "pending",
            f"{tmp_path / 'runs' / 'item-0'}: the run is still going in process {os.getpid()}; "
            "wait for it, or stop it (Ctrl-C suspends it) before resuming",
        )
        assert outcomes[1] == Outcome(
            "item-1", "failed", f"{tmp_path / 'runs' / 'item-1'}: cannot lock the checkpoint: Is a directory"
        )
        assert (outcomes[2].status, outcomes[2].result) == ("done", "word")
        assert told == outcomes and provider.calls == CALLS
    finally:
        held.release()
        store.close()


PARSED = """\
mklang 0.4
machine parsed
entry ask
budget 5

state ask {
  structure "JSON"
  prompt "first {{topic}}"
  parse json
  output a
  otherwise -> again
}

state again {
  structure "JSON"
  prompt "second {{topic}}"
  parse json
  output b
  otherwise -> END
}
"""


class ByTopic:
    """A provider that answers NaN in JSON to topic `nan`, what is not JSON to `broken`, and stops the
    batch (Ctrl-C) while it answers `stop`."""

    def __init__(self, stop: threading.Event) -> None:
        self.stop = stop

    def produce(self, system: str, user: str, tier: str, reason: bool) -> api.Produced:
        if "stop" in user:
            self.stop.set()
        # Topics with letters no hex nonce has: the prompt fences each topic in <data-NONCE> tags.
        return api.Produced("not json" if "broken" in user else '{"n": NaN}', None, api.Usage(10, 5))

    def judge(self, conditions, output, reasoning, context, tier) -> api.Verdict:
        return api.Verdict(0, api.Usage())


def test_what_a_batch_tells_of_each_run_it_ran_is_what_its_envelope_in_the_store_says(tmp_path):
    """The outcome of a run the batch ran is taken from the envelope it wrote, not read back: it is
    the one the store gives (`runs.outcome`), NaN in a result included (the envelope keeps null)."""
    from mklang.runs import outcome

    (tmp_path / "parsed.mk").write_text(PARSED, encoding="utf-8")
    stop, store = threading.Event(), open_store(str(tmp_path / "runs"))
    try:
        batch = _runs_of(api.load(tmp_path / "parsed.mk"), store, ByTopic(stop), stop=stop)
        told = batch.run([Item(topic, {"topic": topic}) for topic in ("nan", "broken", "stop")], concurrency=1)
        stored = [outcome(store, topic) for topic in ("nan", "broken", "stop")]
    finally:
        store.close()
    assert [(o.status, o.reason) for o in told] == [
        ("done", None),
        ("halted", told[1].reason),
        ("pending", None),  # interrupted: the next pass resumes it
    ]
    assert told[1].reason.startswith("state-error: parse-json")
    assert told[0].result == {"n": None} and told[0].usage == {"input_tokens": 20, "output_tokens": 10, "cost_usd": 0.0}
    assert told == stored


class Recorded:
    """An event sink that keeps every event it is told."""

    def __init__(self) -> None:
        self.events: list[api.Event] = []

    def emit(self, event: api.Event) -> None:
        self.events.append(event)


def test_each_run_of_a_batch_starts_with_the_batchs_settings_and_is_observed_by_its_name(tmp_path, twostep):
    """And the machine's text is kept in the store once for the batch, not once per run."""
    observer, items = Recorded(), [Item(f"item-{n}", {"topic": f"t-{n}"}) for n in range(2)]
    settings = dict(max_time=600, untrusted_flow="halt", hitl=True)
    store, kept = open_store(str(tmp_path / "runs")), []
    add_note = store.add_note
    store.add_note = lambda key, text: kept.append(key) or add_note(key, text)
    try:
        _runs_of(twostep, store, Priced(), observer=observer, **settings).run(items)
    finally:
        store.close()
    assert kept == [f"machine:{hashlib.sha256(MACHINE.encode()).hexdigest()}"]
    for item in items:
        started = load(locate(tmp_path / "runs" / item.run))
        assert (started.budgets.max_time, started.untrusted_flow, started.hitl) == (600, "halt", True)
    assert {event.run for event in observer.events} == {"item-0", "item-1"}


def test_what_show_tells_of_a_batchs_run_and_of_one_that_cannot_be_read(tmp_path, twostep):
    """`described` is `mklang show` of a store's run; an unreadable run is `failed` with why,
    named as commands name it, so one bad run does not hide the others."""
    store = open_store(str(tmp_path / "runs"))
    try:
        _runs_of(twostep, store, Priced()).run([Item("item-0", {"topic": "t-0"})])
        (tmp_path / "runs" / "broken").write_bytes(b"not a checkpoint")
        shown = described(store, str(tmp_path / "runs"), "item-0")
        assert (shown["path"], shown["status"], shown["last_steps"]) == (str(tmp_path / "runs" / "item-0"), "done", [])
        assert len(described(store, str(tmp_path / "runs"), "item-0", last=1)["last_steps"]) == 1
        broken = described(store, str(tmp_path / "runs"), "broken")
    finally:
        store.close()
    assert (broken["path"], broken["status"]) == (str(tmp_path / "runs" / "broken"), "failed")
    with pytest.raises(MklangError) as unreadable:
        describe(tmp_path / "runs" / "broken")
    assert broken["reason"] == first_line(unreadable.value)


def test_a_run_that_cannot_be_read_is_shown_failed_and_not_resumable_with_nothing_it_holds(tmp_path):
    store = open_store(str(tmp_path / "runs"))
    try:
        (tmp_path / "runs" / "broken").write_bytes(b"not a checkpoint")
        broken = described(store, str(tmp_path / "runs"), "broken")
    finally:
        store.close()
    assert broken == {
        "path": str(tmp_path / "runs" / "broken"),
        "status": "failed",
        "reason": f"{tmp_path / 'runs' / 'broken'}: the checkpoint is not valid JSON (truncated or corrupted?): "
        "Expecting value: line 1 column 1 (char 0)",
        "frames": [],
        "resumable": False,
        "signature": {"seal": None, "text": "unreadable"},
        "host": {},
    }


FOLDERS = {"relative folder": "runs", "absolute folder": "{tmp}/runs", "sqlite": "sqlite:///runs.db"}


@pytest.mark.parametrize("kind", [*FOLDERS, "postgresql"])
def test_a_batch_names_and_anchors_each_run_as_show_and_resume_find_it(kind, tmp_path, monkeypatch, request):
    """The run a batch writes records its machine as `mklang resume STORE#RUN` (or FOLDER/RUN) reads it."""
    monkeypatch.chdir(tmp_path)
    uri = request.getfixturevalue("postgres_uri") if kind == "postgresql" else FOLDERS[kind].format(tmp=tmp_path)
    named = f"{uri}#item-0" if "://" in uri else str(Path(uri) / "item-0")
    assert target(uri, "item-0") == named
    store, found = open_store(uri), locate(named)
    try:
        mine = location(store, uri, "item-0")
        assert mine.store is store
        assert (mine.run, mine.text, mine.key, mine.anchor) == (found.run, found.text, found.key, found.anchor)
    finally:
        store.close()
        found.store.close()


def test_a_batch_whose_machine_file_is_gone_fails_each_run_saying_why(tmp_path, twostep):
    (tmp_path / "twostep.mk").unlink()
    store = open_store(str(tmp_path / "runs"))
    try:
        outcomes = _runs_of(twostep, store, Priced()).run([Item(f"item-{n}", {"topic": "t"}) for n in range(2)])
    finally:
        store.close()
    why = f"the batch: cannot keep the text of {tmp_path / 'twostep.mk'} in the store: No such file or directory"
    assert [(o.status, o.reason) for o in outcomes] == [("failed", why)] * 2


def test_a_batch_given_kept_texts_starts_its_runs_with_them_and_continues_them_past_an_edit(tmp_path, twostep):
    """What a worker does: its runs start with the machine texts the batch was enqueued with, and a run
    continued after the machine file was edited runs the texts the store keeps (no user is there to
    choose); without `kept_texts` the edit stops it, as it stops `mklang resume`."""
    from mklang.checkpoint.texts import keep_texts

    def edit(old: str, new: str) -> None:
        (tmp_path / "twostep.mk").write_text(MACHINE.replace(old, new), encoding="utf-8")

    provider, given, own = Priced(), Item("given", {"topic": "t-0"}), Item("own", {"topic": "t-1"})
    store = open_store(str(tmp_path / "runs"))
    try:
        enqueued = keep_texts(store, twostep, "the batch")
        edit("second", "then")
        assert _runs_of(twostep, store, provider, texts=enqueued).run([given])[0].status == "done"
        assert load(locate(tmp_path / "runs" / "given")).texts == enqueued
        assert _runs_of(twostep, store, provider, max_tokens=15).run([own])[0].status == "suspended"
        edit("first", "one")
        (edited,) = _runs_of(twostep, store, provider, max_tokens=30).run([own])
        (kept,) = _runs_of(twostep, store, provider, kept_texts=True, max_tokens=30).run([own])
    finally:
        store.close()
    assert edited.status == "failed" and "twostep.mk" in edited.reason
    assert kept.status == "done" and provider.calls == 2 * CALLS


def test_a_batch_continuing_a_suspended_run_tells_its_events_by_name_and_its_interrupt_reaches_it(tmp_path, twostep):
    """A second pass continues each suspended run with the batch's observer and its Ctrl-C: stopped
    at its first loop-top, the run stays for the next pass, having spent only what the first paid."""
    from mklang.engine.events import StateEntered

    stop = threading.Event()

    class StopAtTheFirstState(Recorded):
        def emit(self, event: api.Event) -> None:
            super().emit(event)
            if isinstance(event, StateEntered):
                stop.set()

    provider, observer, items = Priced(), StopAtTheFirstState(), [Item("item-0", {"topic": "t-0"})]
    store = open_store(str(tmp_path / "runs"))
    try:
        (first,) = _runs_of(twostep, store, provider, max_tokens=15).run(items)
        (again,) = _runs_of(twostep, store, provider, observer=observer, stop=stop, max_tokens=30).run(items)
    finally:
        store.close()
    assert (first.status, first.reason) == ("suspended", "cost-exhausted")
    assert again == Outcome("item-0", "pending", None, None, first.usage) and provider.calls == 1
    assert {event.run for event in observer.events} == {"item-0"}
