"""Attacks on Celery workers: forged and replayed task messages, forged reports, shared queue names,
machine files that are not where the run was started.

Messages are built with kombu and published on the real RabbitMQ broker, as
anyone who can reach the broker could; workers are real `mklang worker`
processes on the real PostgreSQL (or SQLite) store, and the model is the
fake HTTP server, so every paid call is counted where it is paid.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import shutil
import signal
import threading
import uuid
from typing import Any

from support.batches import CALLS, MACHINE, reply, results, write_items
from support.batches import batch_project as batch_project  # the fixture `project`
from support.batches import batch_server as batch_server  # the fixture `server`
from support.commands import cli, model_config, run_cli, wait_for
from support.examples import HITL
from support.fleet import (
    NO_HANG,
    RABBITMQ,
    Lines,
    batch,
    drop_queue,
    followed,
    here,
    now_and_then,
    queue_of,
    served_batch,
    serving,
    stop,
    worker,
)
from support.fleet import fleet_key as fleet_key  # a fixture, autouse
from support.services import require_server

import mklang as api
from mklang.checkpoint.envelope import parse
from mklang.distributed import TASK, read_note, task_mac
from mklang.scenarios import ScriptedHost, load_script
from mklang.stores import open_store

# A machine an attacker would like a worker to run: it calls the model until a budget stops it.
GREEDY = """\
mklang 0.4
machine greedy
entry ask
budget 1000

state ask {
  structure "One word."
  prompt "again"
  output a
  otherwise -> ask
}
"""


def publish(
    queue: str,
    args: Any,
    kwargs: Any,
    *,
    task: str = TASK,
    body: bytes | None = None,
    content_type: str = "application/json",
    broker: str = RABBITMQ,
) -> None:
    """A Celery (protocol 2) task message built by hand and published on the store's queue
    (`body`: raw bytes in place of the JSON of the arguments)."""
    from kombu import Connection, Exchange, Queue

    task_id = str(uuid.uuid4())
    headers = {
        "lang": "py", "task": task, "id": task_id, "root_id": task_id, "parent_id": None, "group": None,
        "retries": 0, "eta": None, "expires": None, "timelimit": [None, None],
        "argsrepr": repr(args), "kwargsrepr": repr(kwargs), "origin": "attacker@elsewhere",
    }  # fmt: skip
    payload = body if body is not None else json.dumps([args, kwargs, {"callbacks": None, "errbacks": None}])
    with Connection(broker) as connection:
        connection.Producer().publish(
            payload,
            exchange="",
            routing_key=queue,
            content_type=content_type,
            content_encoding="utf-8",
            headers=headers,
            delivery_mode=2,
            declare=[Queue(queue, Exchange(queue), routing_key=queue)],
        )


def signed_task(store_uri: str, run: str) -> tuple[list[str], dict[str, str]]:
    """The message an honest `mklang batch` sends for `run` (what a replay repeats)."""
    identity = queue_of(store_uri).removeprefix("mklang-")
    return [run], {"store": identity, "mac": task_mac(identity, run)}


def test_forged_task_messages_reach_no_run_and_a_replayed_one_pays_nothing(project, server, postgres_uri):
    require_server("RabbitMQ")
    (project / "greedy.mk").write_text(GREEDY, encoding="utf-8")
    write_items(project, 1)
    one = worker(project, postgres_uri, RABBITMQ)
    said = Lines(one)
    queue = queue_of(postgres_uri)
    identity = queue.removeprefix("mklang-")
    other_key_mac = hmac.new(b"another key", f"mklang task\n{identity}\nevil-4".encode(), hashlib.sha256).hexdigest()
    forged = [
        # The message of the past, field by field: a machine of its choosing, no budget, its own context.
        (["evil-1", {"topic": "t-9"}, str(project / "greedy.mk"), {}], {"batch": None}),
        (["evil-2"], {"store": identity}),  # no MAC
        (["evil-3"], {"store": identity, "mac": "0" * 64}),
        (["evil-4"], {"store": identity, "mac": other_key_mac}),  # signed with another key
        (["\x1b[31mred\x1b[0m"], {"store": identity, "mac": task_mac(identity, "\x1b[31mred\x1b[0m")}),
        (["../x"], {"store": identity, "mac": task_mac(identity, "../x")}),  # signed, and still no run name
        (["item-0"], {"store": "0" * 32, "mac": task_mac("0" * 32, "item-0")}),  # for another store
        ("item-0", "not a map"),
    ]
    try:
        for args, kwargs in forged:
            publish(queue, args, kwargs)
        # Messages Celery itself discards: an unknown task, pickle, a body that is no JSON.
        publish(queue, ["item-0"], {}, task="\x1b[2Jevil")
        publish(queue, [], {}, body=b"\x80\x04\x1b[2J", content_type="application/x-python-serialize")
        publish(queue, [], {}, body=b"{not json \x1b[2J")
        refusals = len(forged) + 3
        try:
            wait_for(lambda: len(said.having("refused a task message")) >= refusals, one, "every refusal", 60)
        except AssertionError:
            raise AssertionError(said.lines) from None
        assert server.count == 0  # no forged message made a call
        done = followed(project, postgres_uri, RABBITMQ)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["done"] == 1 and server.count == CALLS
        store = open_store(postgres_uri)

        def reported_again(run: str, before: dict[str, Any] | None) -> None:
            """Wait until the worker replaced `run`'s report `before` (None: there was none)."""
            wait_for(now_and_then(lambda: read_note(store, run) != before), one, f"{run} was reported", 120)

        try:
            first = read_note(store, "item-0")
            for _ in range(2):  # a replayed honest message: the run is finished, nothing is paid again
                publish(queue, *signed_task(postgres_uri, "item-0"))
            reported_again("item-0", first)
            assert read_note(store, "item-0")["outcome"]["status"] == "done"
            assert parse(store.read("item-0"), "item-0").status == "done"
            # A record written by someone without the fleet key (the database is reachable, the key is not):
            # even a replayed honest message for it runs nothing.
            store.write_note(
                "record:item-1",
                json.dumps(
                    {"run": "item-1", "machine": str(project / "greedy.mk"), "context": {}, "budgets": {}}
                ).encode(),
            )
            publish(queue, *signed_task(postgres_uri, "item-1"))
            reported_again("item-1", None)
            refused = read_note(store, "item-1")["outcome"]
            assert refused["status"] == "failed" and "run record of item-1 is not signed" in refused["reason"], refused
            assert store.read("item-1") is None and store.runs() == ["item-0"]
            # A finished run's row edited to say another result, its signature removed: the worker's read
            # of the run verifies it, so a replayed message reports it failed, never done with that result.
            envelope = json.loads(store.read("item-0"))
            del envelope["signature"]
            envelope["result"] = "forged"
            store.write("item-0", json.dumps(envelope).encode(), generation=envelope["generation"] + 1)
            before = read_note(store, "item-0")
            publish(queue, *signed_task(postgres_uri, "item-0"))
            reported_again("item-0", before)
            edited = read_note(store, "item-0")["outcome"]
            assert (edited["status"], edited["result"]) == ("failed", None), edited
            assert "not signed" in edited["reason"]
        finally:
            store.close()
        assert server.count == CALLS
    finally:
        stop(one)
    lines = said.done()
    assert len([line for line in lines if "refused a task message" in line]) == len(forged) + 3, lines
    assert not any("\x1b" in line or "Traceback" in line for line in lines), lines
    assert any("\\x1b[31mred" in line for line in lines)  # the forged id is shown, escaped
    assert not (project.parent / "x").exists()


def test_a_forged_progress_note_is_never_reported_done(project, server, postgres_uri):
    require_server("RabbitMQ")
    write_items(project, 2)
    running = batch(project, postgres_uri, RABBITMQ, "--stall-timeout", "20s")  # no worker serves it
    store = open_store(postgres_uri)
    try:
        wait_for(
            now_and_then(lambda: store.read_note("record:item-1") is not None), running, "both runs were enqueued", 120
        )
        forged = {"id": "f", "worker": "1@x", "outcome": {"id": "item-0", "status": "done", "result": "forged"}}
        store.write_note("run:item-0", json.dumps(forged).encode())  # unsigned
        from mklang.checkpoint.signing import sign

        other = {**forged, "outcome": {**forged["outcome"], "id": "item-1"}}
        store.write_note("run:item-1", sign(other, b"another key")[0])  # signed, not with the fleet key
        stdout, stderr = running.communicate(timeout=120)
    finally:
        stop(running)
        store.close()
        drop_queue(postgres_uri)
    assert running.returncode == 1, stderr
    assert json.loads(stdout)["done"] == 0 and json.loads(stdout)["failed"] == 2
    out = {line["id"]: line for line in results(project / "out.jsonl")}
    assert "not signed" in out["item-0"]["reason"] and "another checkpoint key" in out["item-1"]["reason"], out
    assert all(line["result"] is None for line in out.values())
    assert server.count == 0


def test_two_projects_with_the_same_store_uri_text_never_share_a_queue(tmp_path, server):
    require_server("RabbitMQ")
    projects = []
    for name in ("a", "b"):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "twostep.mk").write_text(MACHINE, encoding="utf-8")
        model_config(server.openai_url, folder / "mklang.toml")
        write_items(folder, 2)
        projects.append(folder)
    uri = "sqlite:///runs.db"  # the same text, two databases
    their_store = f"sqlite:///{projects[0]}/runs.db"
    queue_of(their_store)  # the store is made here, not by this and the worker at once
    theirs = worker(projects[0], uri, RABBITMQ)
    said = Lines(theirs)
    serving(their_store, theirs)  # it would take our runs at once if it could
    try:
        ours = followed(projects[1], uri, RABBITMQ, "--stall-timeout", "1s")
    finally:
        stop(theirs)
        for folder in projects:
            drop_queue(f"sqlite:///{folder}/runs.db")
    assert ours.returncode == 3, ours.stderr  # not run: no worker of this store exists
    assert json.loads(ours.stdout)["pending"] == 2
    assert server.count == 0 and not [line for line in said.done() if "item-" in line]  # it took none of ours
    assert queue_of(f"sqlite:///{projects[0]}/runs.db") != queue_of(f"sqlite:///{projects[1]}/runs.db")


def test_a_worker_in_another_folder_without_the_machine_files_runs_the_texts_the_store_keeps(
    project, server, postgres_uri
):
    require_server("RabbitMQ")
    write_items(project, 3)
    elsewhere = project / "elsewhere"  # the worker's folder: a config, no machine file
    elsewhere.mkdir()
    shutil.copy(project / "mklang.toml", elsewhere / "mklang.toml")
    one = worker(elsewhere, postgres_uri, RABBITMQ)
    said = Lines(one)
    code, stdout, stderr = served_batch(project, postgres_uri, RABBITMQ, one)
    assert code == 0, (stderr, said.lines)
    assert json.loads(stdout)["done"] == 3 and server.count == 3 * CALLS
    assert [line["result"] for line in results(project / "out.jsonl")] == [f"answer {n}" for n in range(3)]


def test_resume_store_run_from_another_folder_runs_the_kept_machine_text(project, server, postgres_uri):
    """A run suspended by a batch is resumed from a folder holding no machine file: said on stderr."""
    write_items(project, 1)
    first = cli(
        "batch", "twostep.mk", "--inputs", "items.jsonl", "--config", "mklang.toml", "--store", postgres_uri,
        "--max-tokens", "1", "--format", "json", cwd=project,
    )  # fmt: skip
    assert first.returncode == 3, first.stderr
    elsewhere = project / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(project / "mklang.toml", elsewhere / "mklang.toml")
    done = cli(
        "resume", f"{postgres_uri}#item-0", "--max-tokens", "100", "--config", "mklang.toml", "--format", "json",
        cwd=elsewhere,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["result"] == "answer 0"
    assert "twostep.mk is missing; running the machine texts the store keeps" in done.stderr
    assert server.count == CALLS


# --- a batch does what a run does: human approvals --------------------------------------------

APPROVAL = HITL / "approval" / "approval.mk"
REVIEW = """\
scenarios:
  - name: review
    llm:
      produce: ["Maintenance on Saturday\\nLogins may fail from 02:00 to 04:00 UTC.", approve]
      judge: [0]
    tools:
      publish: ["https://status.example.com/posts/118"]
"""
ASK = "Publish this announcement? Answer yes, or say what to change."


def test_the_approval_example_parks_in_a_hitl_batch_and_is_answered_from_another_folder(tmp_path, capsys, monkeypatch):
    (tmp_path / "review.yaml").write_text(REVIEW, encoding="utf-8")
    (tmp_path / "items.jsonl").write_text('{"id": "post-1"}\n{"id": "post-2"}\n', encoding="utf-8")
    store = f"sqlite:///{tmp_path}/runs.db"
    monkeypatch.chdir(tmp_path)
    options = ("--inputs", "items.jsonl", "--store", store, "--script", "review.yaml", "--scenario", "review")
    code, out, err = run_cli(capsys, "batch", str(APPROVAL), *options, "--hitl", "--format", "json")
    assert (code, json.loads(out)["suspended"]) == (3, 2), err  # nothing published without a human answer
    code, out, err = run_cli(capsys, "runs", "--store", store, "--status", "suspended", "--format", "json")
    assert [(run["status"], run["reason"]) for run in json.loads(out)["runs"]] == [("suspended", ASK)] * 2, err
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    code, out, err = run_cli(
        capsys, "resume", f"{store}#post-1", "--set", "approval.answer=yes, ship it", "--format", "json"
    )
    assert (code, json.loads(out)["result"]) == (0, "https://status.example.com/posts/118"), err
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(
        capsys, "batch", str(APPROVAL), *options, "--hitl", "--format", "json", "--out", "out.jsonl"
    )
    assert (code, json.loads(out)["done"], json.loads(out)["suspended"]) == (3, 1, 1), err
    assert [line["status"] for line in results(tmp_path / "out.jsonl")] == ["done", "suspended"]


def test_the_python_batch_parks_escalations_with_hitl(tmp_path):
    (tmp_path / "runs").mkdir()
    (tmp_path / "review.yaml").write_text(REVIEW, encoding="utf-8")
    scripted = ScriptedHost(load_script(tmp_path / "review.yaml")[0])
    outcomes = api.batch(
        APPROVAL, [{"id": "post-1"}], store=str(tmp_path / "runs"), provider=scripted.provider,
        tools=scripted.tools.functions(), hitl=True,
    )  # fmt: skip
    assert [(done.status, done.reason) for done in outcomes] == [("suspended", "escalated")]


# --- the batch's side of workers ---------------------------------------------------------------


def test_a_celery_batch_needs_no_provider_here_and_says_a_given_one_is_not_used(project, server, postgres_uri):
    require_server("RabbitMQ")
    write_items(project, 2)
    (project / "mklang.toml").rename(project / "worker.toml")  # only the worker has a model configured
    one = worker(project, postgres_uri, RABBITMQ, config="worker.toml")
    try:
        plain = here(
            project, "batch", "twostep.mk", "--inputs", "items.jsonl", "--store", postgres_uri,
            "--executor", "celery", "--broker", RABBITMQ, "--format", "json", *NO_HANG,
        )  # fmt: skip
        assert plain.returncode == 0, plain.stderr
        assert json.loads(plain.stdout)["done"] == 2 and "not used" not in plain.stderr
        given = here(
            project, "batch", "twostep.mk", "--inputs", "items.jsonl", "--store", postgres_uri,
            "--executor", "celery", "--broker", RABBITMQ, "--format", "json", "--provider", "anthropic", *NO_HANG,
        )  # fmt: skip
        assert given.returncode == 0, given.stderr
        assert "--provider not used with --executor celery" in given.stderr
    finally:
        stop(one)
    assert server.count == 2 * CALLS


def test_a_batch_dollar_ceiling_a_workers_model_has_no_price_for_fails_its_runs_unpaid(project, server, postgres_uri):
    require_server("RabbitMQ")
    write_items(project, 2)
    (project / "mklang.toml").rename(project / "worker.toml")  # the worker's model has no price
    one = worker(project, postgres_uri, RABBITMQ, config="worker.toml")
    try:
        done = here(
            project, "batch", "twostep.mk", "--inputs", "items.jsonl", "--store", postgres_uri,
            "--executor", "celery", "--broker", RABBITMQ, "--format", "json", "--out", "out.jsonl",
            "--batch-max-cost", "1", *NO_HANG,
        )  # fmt: skip
    finally:
        stop(one)
    assert done.returncode == 1, done.stderr
    assert json.loads(done.stdout)["failed"] == 2
    reasons = {line["reason"] for line in results(project / "out.jsonl")}
    assert len(reasons) == 1 and "--batch-max-cost needs a price for local:m" in reasons.pop()
    assert server.count == 0  # refused before any call: a ceiling that cannot hold runs nothing


def test_a_worker_stopped_with_sigterm_says_so_in_lines_without_tracebacks(project, server, postgres_uri, capsys):
    require_server("RabbitMQ")
    release = threading.Event()

    def held(request):
        release.wait(timeout=120)
        return reply(request)

    server.handler = held
    write_items(project, 1)
    one = worker(project, postgres_uri, RABBITMQ)
    said = Lines(one)
    running = batch(project, postgres_uri, RABBITMQ, "--stall-timeout", "30s")
    try:
        wait_for(lambda: server.count >= 1, running, "the run's first call", timeout=120)
        one.send_signal(signal.SIGTERM)
        wait_for(lambda: said.having("stopping"), running, "the worker heard SIGTERM", timeout=60)
        release.set()
        one.wait(timeout=120)
    finally:
        release.set()
        stop(running, one)
        drop_queue(postgres_uri)
    lines = said.done()
    assert said.having("run item-0: suspended by the worker's shutdown, back to the queue"), lines
    assert not [line for line in lines if "Traceback" in line or "Reject" in line], "\n".join(lines)
    assert run_cli(capsys, "worker", "--help")[1].count("Runs this worker runs at once") == 1


def test_a_project_folder_moved_with_its_checkpoint_resumes_with_its_scenario_script(tmp_path, capsys, monkeypatch):
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(APPROVAL, project / "approval.mk")
    (project / "review.yaml").write_text(REVIEW, encoding="utf-8")
    monkeypatch.chdir(project)
    code, _, err = run_cli(
        capsys, "run", "approval.mk", "--script", "review.yaml", "--scenario", "review", "--checkpoint", "cp.json",
        "--hitl", "--format", "json",
    )  # fmt: skip
    assert code == 3, err
    shutil.move(project, tmp_path / "moved")
    monkeypatch.chdir(tmp_path / "moved")
    code, out, err = run_cli(capsys, "resume", "cp.json", "--set", "approval.answer=yes", "--format", "json")
    assert (code, json.loads(out)["result"]) == (0, "https://status.example.com/posts/118"), err


def test_a_report_copied_from_another_run_is_not_its_result(project, server, postgres_uri):
    """Someone who can write the store but has no key copies one run's signed report onto another's."""
    require_server("RabbitMQ")
    write_items(project, 1)
    one = worker(project, postgres_uri, RABBITMQ)
    store = open_store(postgres_uri)
    try:
        first = followed(project, postgres_uri, RABBITMQ)
        assert first.returncode == 0, first.stderr
        copied = store.read_note("run:item-0")  # signed by the worker, about item-0
        stop(one)
        write_items(project, 2)
        second = batch(project, postgres_uri, RABBITMQ, "--stall-timeout", "20s")
        wait_for(now_and_then(lambda: store.read_note("record:item-1") is not None), second, "item-1 was enqueued", 120)
        store.write_note("run:item-1", copied)
        _, stderr = second.communicate(timeout=120)
    finally:
        stop(one)
        store.close()
        drop_queue(postgres_uri)
    out = {line["id"]: line for line in results(project / "out.jsonl")}
    assert out["item-0"]["status"] == "done"
    assert (out["item-1"]["status"], out["item-1"]["result"]) == ("failed", None), out["item-1"]
    assert "about another run" in out["item-1"]["reason"]
    assert second.returncode == 1 and server.count == CALLS, stderr
