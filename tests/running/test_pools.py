"""Budget pools (docs/pools.md, ADR 0062): runs of many processes drawing from one pool in a SQLite or
PostgreSQL store never spend past its caps, suspend `pool-exhausted` and continue after a top-up, keep
to its calls in flight, and wait together when the model server asks them to."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest
from support.batches import MACHINE, write_items
from support.commands import cli
from support.fakeserver import InFlight, answer, error
from support.fleet import here, start

from mklang.stores import open_store

CALL_COST = 0.02  # each answer: 10 input tokens at $1000/M, 5 output tokens at $2000/M
CALLS = 2  # model calls of one run of MACHINE


def pool_config(url: str, path: Path) -> None:
    """A config whose model is the fake server's, priced, its answers capped at 20 tokens."""
    path.write_text(
        '[tiers]\nfast = "local:m"\nbalanced = "local:m"\nreasoning = "local:m"\n\n'
        f'[providers.local]\nkind = "openai"\nbase_url = "{url}"\nparams = {{max_tokens = 20}}\n\n'
        '[prices."local:m"]\ninput = 1000\noutput = 2000\n',
        encoding="utf-8",
    )


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/runs.db"
    return request.getfixturevalue("postgres_uri")


@pytest.fixture
def project(tmp_path, server) -> Path:
    (tmp_path / "twostep.mk").write_text(MACHINE, encoding="utf-8")
    pool_config(server.openai_url, tmp_path / "mklang.toml")
    server.handler = lambda _request: answer("fine", input_tokens=10, output_tokens=5)
    return tmp_path


def mk(project: Path, *args: str):
    return cli(*args, cwd=project)


def pool_of(store: str, name: str = "p") -> dict:
    done = cli("pool", "show", name, "--store", store, "--format", "json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def run_one(project: Path, store: str, run: str, *options: str):
    return mk(
        project,
        "run",
        "twostep.mk",
        "--config",
        "mklang.toml",
        "--set",
        "topic=t",
        "--checkpoint",
        f"{store}#{run}",
        "--pool",
        "p",
        "--format",
        "json",
        *options,
    )


def test_a_pool_is_made_shown_listed_topped_up_and_removed(project, store):
    made = cli("pool", "create", "p", "--store", store, "--max-cost", "1", "--concurrency", "4", "--format", "json")
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["max_cost"] == 1.0 and json.loads(made.stdout)["concurrency"] == 4
    again = cli("pool", "create", "p", "--store", store, "--max-cost", "2")
    assert again.returncode == 2 and "pool p exists already" in again.stderr
    assert cli("pool", "topup", "p", "--store", store, "--cost", "0.5").returncode == 0
    assert pool_of(store)["max_cost"] == 1.5
    listed = cli("pool", "list", "--store", store, "--format", "text")
    assert listed.stdout.startswith("p: spent $0.0000 of $1.5000, reserved $0.0000")
    no_tokens = cli("pool", "topup", "p", "--store", store, "--tokens", "5")
    assert no_tokens.returncode == 2 and "has no token cap" in no_tokens.stderr
    assert cli("pool", "rm", "p", "--store", store).returncode == 0
    gone = cli("pool", "show", "p", "--store", store)
    assert gone.returncode == 2 and "no pool p" in gone.stderr
    capless = cli("pool", "create", "q", "--store", store)
    assert capless.returncode == 2 and "a pool needs a cap" in capless.stderr


def test_a_folder_store_says_it_has_no_pools_and_a_run_there_refuses_pool(project):
    (project / "runs").mkdir()
    refused = cli("pool", "create", "p", "--store", str(project / "runs"), "--max-cost", "1")
    assert refused.returncode == 2
    assert refused.stderr.strip().endswith(
        "FileStore has no budget pools: pools live in a SQLite or PostgreSQL "
        "store (sqlite:///runs.db, postgresql://...)"
    )
    ran = mk(project, "run", "twostep.mk", "--config", "mklang.toml", "--checkpoint", "runs/r", "--pool", "p")
    assert ran.returncode == 2 and "has no budget pools" in ran.stderr and "Traceback" not in ran.stderr
    bare = mk(project, "run", "twostep.mk", "--config", "mklang.toml", "--pool", "p")
    assert bare.returncode == 2 and "--pool draws from a pool kept in a store" in bare.stderr


def test_a_run_whose_call_does_not_fit_suspends_pool_exhausted_and_finishes_after_a_top_up(project, store, server):
    # A call's worst case is a few tenths of a dollar (its prompt's bytes as tokens, 20 answer tokens),
    # ten times what it costs: runs go on while one more worst case fits beside what was spent.
    assert cli("pool", "create", "p", "--store", store, "--max-cost", "0.5").returncode == 0
    outcomes = [run_one(project, store, f"r{n}") for n in range(8)]
    codes = [done.returncode for done in outcomes]
    assert codes[0] == 0 and 3 in codes, codes
    stopped = codes.index(3)
    suspended = json.loads(outcomes[stopped].stdout)
    assert (suspended["status"], suspended["reason"]) == ("suspended", "pool-exhausted")
    assert suspended["detail"].startswith("pool p: a call's worst case $")
    assert suspended["detail"].endswith(" of $0.5000")
    pool = pool_of(store)
    assert pool["spent"]["cost_usd"] == pytest.approx(server.count * CALL_COST) and server.count >= CALLS
    assert pool["spent"]["cost_usd"] <= 0.5 and pool["reserved"]["cost_usd"] == 0
    assert pool["waiting"] == codes.count(3)
    paid = server.count
    again = mk(project, "resume", f"{store}#r{stopped}", "--format", "json")
    assert again.returncode == 3 and server.count == paid  # nothing topped up: suspends again, pays nothing
    assert cli("pool", "topup", "p", "--store", store, "--cost", "10").returncode == 0
    for n in range(stopped, 8):
        resumed = mk(project, "resume", f"{store}#r{n}", "--format", "json")
        assert resumed.returncode == 0 and json.loads(resumed.stdout)["status"] == "done", resumed.stderr
    assert server.count == 8 * CALLS  # every call paid once: none that did not fit was made
    pool = pool_of(store)
    assert pool["spent"]["cost_usd"] == pytest.approx(8 * CALLS * CALL_COST)
    assert (pool["reserved"]["cost_usd"], pool["in_flight"], pool["waiting"]) == (0, 0, 0)


def test_a_tampered_pool_row_is_refused_and_never_drawn_from(project, store, server):
    assert cli("pool", "create", "p", "--store", store, "--max-cost", "1").returncode == 0
    opened = open_store(store)
    try:
        opened._rows("UPDATE mklang_pools SET spent_cost = -5 WHERE name = 'p'")  # type: ignore[attr-defined]
    finally:
        opened.close()
    shown = cli("pool", "show", "p", "--store", store)
    assert shown.returncode == 2 and "its row is malformed (spent_cost -5" in shown.stderr
    ran = run_one(project, store, "r")
    assert ran.returncode == 2 and "pool p: its row is malformed (spent_cost -5.0)" in ran.stderr
    assert server.count == 0


def batch_of(project: Path, store: str, name: str, count: int, *options: str) -> list[str]:
    folder = project / name
    folder.mkdir(exist_ok=True)
    items = write_items(folder, count)
    lines = items.read_text().splitlines()
    items.write_text("".join(line.replace('"item-', f'"{name}-') + "\n" for line in lines))
    return [
        "batch",
        "twostep.mk",
        "--inputs",
        str(items),
        "--store",
        store,
        "--config",
        "mklang.toml",
        "--pool",
        "p",
        "--format",
        "json",
        *options,
    ]


@pytest.mark.slow
@pytest.mark.crash
@pytest.mark.parametrize("trial", range(2))
def test_eight_processes_on_one_pool_never_spend_past_it_and_finish_after_a_top_up(project, store, server, trial):
    """8 `mklang batch` processes, 6 runs each, on a $1.00 pool: at most 25 runs' worth of calls fit. Some
    processes are killed mid-way; the server's bill never passes the pool's cap, and once topped up every
    run finishes (each batch re-run), each call billed once more at most for a kill."""
    rng = random.Random(trial)
    assert cli("pool", "create", "p", "--store", store, "--max-cost", "1.00").returncode == 0
    commands = [batch_of(project, store, f"b{n}", 6) for n in range(8)]
    processes = [start(project, *command) for command in commands]
    time.sleep(rng.uniform(0.2, 0.6))
    killed = rng.sample(range(8), 3)
    for n in killed:
        os.kill(processes[n].pid, signal.SIGKILL)
    for process in processes:
        process.wait(120)
    billed = server.count * CALL_COST
    pool = pool_of(store)
    assert billed <= 1.00 + 1e-9
    assert pool["spent"]["cost_usd"] + pool["reserved"]["cost_usd"] <= 1.00 + 1e-9
    assert pool["spent"]["cost_usd"] >= billed - 1e-9 or pool["reserved"]["cost_usd"] > 0  # a kill's holds
    assert cli("pool", "topup", "p", "--store", store, "--cost", "100").returncode == 0
    for command in commands:
        done = here(project, *command)
        assert done.returncode == 0, done.stdout[-500:] + done.stderr[-500:]
    assert server.count >= 48 * CALLS
    pool = pool_of(store)
    assert (pool["in_flight"], pool["waiting"]) == (0, 0)


@pytest.mark.slow
def test_a_pool_of_four_calls_in_flight_holds_across_processes(project, store, server):
    held = InFlight(lambda _request: answer("fine", input_tokens=10, output_tokens=5))
    server.handler = held
    assert cli("pool", "create", "p", "--store", store, "--concurrency", "4").returncode == 0
    processes = [start(project, *batch_of(project, store, f"c{n}", 3, "--concurrency", "3")) for n in range(8)]
    assert [process.wait(120) for process in processes] == [0] * 8
    assert server.count == 8 * 3 * CALLS
    assert held.peak == 4  # reached, never passed


class Storm:
    """429 with `Retry-After: 1` for 0.8 s after the first request, then answers; records when
    each request came."""

    def __init__(self) -> None:
        self.began: float | None = None
        self.times: list[float] = []
        self.lock = threading.Lock()

    def __call__(self, _request):
        now = time.monotonic()
        with self.lock:
            self.began = self.began or now
            self.times.append(now)
        if now - self.began < 0.8:
            return error(429, retry_after="1")
        return answer("fine", input_tokens=10, output_tokens=5)


@pytest.mark.slow
def test_a_429_storm_makes_every_run_of_the_pool_wait_and_none_halts(project, store, server):
    storm = Storm()
    server.handler = storm
    assert cli("pool", "create", "p", "--store", store, "--max-cost", "10").returncode == 0
    processes = [start(project, *batch_of(project, store, f"s{n}", 2)) for n in range(4)]
    outcomes = [process.communicate(120) for process in processes]
    assert [process.returncode for process in processes] == [0] * 4, outcomes
    assert storm.began is not None
    during = [t - storm.began for t in storm.times if 0.05 < t - storm.began < 0.8]
    assert during == []  # after the first 429, no run of the pool asked again before its Retry-After
