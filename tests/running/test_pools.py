"""Budget pools (docs/pools.md, ADR 0067): runs of many processes drawing from one pool in a SQLite or
PostgreSQL store never spend past its caps, suspend `pool-exhausted` and continue after a top-up, keep
to its calls in flight, and wait together when the model server asks them to.

The fleet test runs `MKLANG_POOL_TRIALS` trials on each store (2 unless set):
`MKLANG_POOL_TRIALS=20 python -m pytest tests/running/test_pools.py -k eight_processes`."""

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
from support.commands import cli, refused, wait_for
from support.fakeserver import InFlight, answer, error
from support.fleet import RABBITMQ, batch_command, drop_queue, here, home_env, serving, start, stop
from support.fleet import fleet_key as fleet_key  # a fixture, autouse
from support.forks import piped
from support.services import require_server

from mklang.console import reading
from mklang.stores import open_store
from mklang.stores.pools import Hold

CALL_COST = 0.02  # each answer: 10 input tokens at $1000/M, 5 output tokens at $2000/M
CALLS = 2  # model calls of one run of MACHINE
TRIALS = int(os.environ.get("MKLANG_POOL_TRIALS", "2"))


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


def run_args(store: str, run: str) -> tuple[str, ...]:
    """`mklang run` of the project's machine as the run `run` of `store`, drawing from the pool `p`."""
    return ("run", "twostep.mk", "--config", "mklang.toml", "--set", "topic=t", "--checkpoint", f"{store}#{run}")


def run_one(project: Path, store: str, run: str):
    return mk(project, *run_args(store, run), "--pool", "p", "--format", "json")


def test_a_pool_is_made_shown_listed_topped_up_and_removed(project, store):
    made = cli("pool", "create", "p", "--store", store, "--max-cost", "1", "--concurrency", "4", "--format", "json")
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["max_cost"] == 1.0 and json.loads(made.stdout)["concurrency"] == 4
    refused(cli("pool", "create", "p", "--store", store, "--max-cost", "2"), "pool p exists already")
    assert cli("pool", "topup", "p", "--store", store, "--cost", "0.5").returncode == 0
    assert pool_of(store)["max_cost"] == 1.5
    listed = cli("pool", "list", "--store", store, "--format", "text")
    assert listed.stdout.startswith("p: spent $0.0000 of $1.5000, reserved $0.0000")
    refused(cli("pool", "topup", "p", "--store", store, "--tokens", "5"), "has no token cap")
    assert cli("pool", "rm", "p", "--store", store).returncode == 0
    refused(cli("pool", "show", "p", "--store", store), "no pool p")
    refused(cli("pool", "create", "q", "--store", store), "a pool needs a cap")


def test_a_folder_store_says_it_has_no_pools_and_a_run_there_refuses_pool(project):
    (project / "runs").mkdir()
    line = refused(cli("pool", "create", "p", "--store", str(project / "runs"), "--max-cost", "1"))
    assert line.endswith(
        "FileStore has no budget pools: pools live in a SQLite or PostgreSQL "
        "store (sqlite:///runs.db, postgresql://...)"
    )
    ran = mk(project, "run", "twostep.mk", "--config", "mklang.toml", "--checkpoint", "runs/r", "--pool", "p")
    refused(ran, "has no budget pools")
    bare = mk(project, "run", "twostep.mk", "--config", "mklang.toml", "--pool", "p")
    refused(bare, "--pool draws from a pool kept in a store")


def waiting_shown(store: str) -> tuple[int, int, int]:
    """The pool's waiting runs as `pool show`, `mklang runs` and the console's runs page count them."""
    listed = cli("runs", "--store", store, "--format", "json")
    assert listed.returncode == 0, listed.stderr
    [pool] = json.loads(listed.stdout)["pools"]
    opened = open_store(store)
    try:
        [page] = reading.runs_page(opened, 1).pools
    finally:
        opened.close()
    return pool_of(store)["waiting"], pool["waiting"], page.waiting


def test_a_run_whose_call_does_not_fit_suspends_pool_exhausted_and_finishes_after_a_top_up(project, store, server):
    # A call's worst case is a few tenths of a dollar (its prompt's bytes as tokens, 20 answer tokens),
    # ten times what it costs: runs go on while one more worst case fits beside what was spent.
    assert cli("pool", "create", "p", "--store", store, "--max-cost", "0.5").returncode == 0
    outcomes = [run_one(project, store, f"r{n}") for n in range(8)]
    codes = [done.returncode for done in outcomes]
    assert codes[0] == 0 and 3 in codes, codes
    stopped = codes.index(3)
    assert codes[stopped:] == [3] * (8 - stopped)  # once one does not fit, none does
    suspended = json.loads(outcomes[stopped].stdout)
    assert (suspended["status"], suspended["reason"]) == ("suspended", "pool-exhausted")
    assert suspended["detail"].startswith("pool p: a call's worst case $")
    assert suspended["detail"].endswith(" of $0.5000")
    pool = pool_of(store)
    assert pool["spent"]["cost_usd"] == pytest.approx(server.count * CALL_COST) and server.count >= CALLS
    assert pool["spent"]["cost_usd"] <= 0.5 and pool["reserved"]["cost_usd"] == 0
    waiting = 8 - stopped
    assert waiting_shown(store) == (waiting,) * 3
    paid = server.count
    again = mk(project, "resume", f"{store}#r{stopped}", "--format", "json")
    assert again.returncode == 3 and server.count == paid  # nothing topped up: suspends again, pays nothing
    assert waiting_shown(store) == (waiting,) * 3  # a run waiting twice is one run waiting
    assert cli("pool", "topup", "p", "--store", store, "--cost", "10").returncode == 0
    assert waiting_shown(store) == (waiting,) * 3  # topped up, they wait to be resumed still
    for n in range(stopped, 8):
        resumed = mk(project, "resume", f"{store}#r{n}", "--format", "json")
        assert resumed.returncode == 0 and json.loads(resumed.stdout)["status"] == "done", resumed.stderr
        waiting -= 1
        assert waiting_shown(store) == (waiting,) * 3
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
    refused(cli("pool", "show", "p", "--store", store), "its row is malformed (spent_cost -5")
    refused(run_one(project, store, "r"), "pool p: its row is malformed (spent_cost -5.0)")
    assert server.count == 0


def batch_of(project: Path, store: str, name: str, count: int, *options: str) -> list[str]:
    """A local `mklang batch` of `count` runs named `NAME-N` drawing from the pool `p`."""
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


def launched(project: Path, *args: str, **env: str):
    """`mklang ARGS` in a process of its own with a home of its own and `env` (MKLANG_ variables too)."""
    return piped(list(args), {**home_env(project), **env}, project)


class Watch:
    """The most the pool ever held (spent plus reserved) and the server ever billed, read every 20 ms
    in this process while the fleet runs."""

    def __init__(self, store: str, server) -> None:
        self.store, self.server = open_store(store), server
        self.held = self.billed = 0.0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.done.wait(0.02):
            pool = self.store.pool("p")  # type: ignore[attr-defined]
            self.held = max(self.held, pool.spent_cost + pool.reserved_cost)
            self.billed = max(self.billed, self.server.count * CALL_COST)

    def close(self) -> None:
        self.done.set()
        self.thread.join()
        self.store.close()


@pytest.mark.slow
@pytest.mark.crash
@pytest.mark.parametrize("trial", range(TRIALS))
def test_eight_processes_on_one_pool_never_spend_past_it_and_finish_after_a_top_up(project, store, server, trial):
    """Four local batches (6 runs each) and a Celery batch (12 runs) served by three workers: 8 processes
    on a $1.00 pool that 36 runs' calls would pass. A batch and a worker are killed (SIGKILL) as the
    server answers a chosen call, their holds charged when their runs are opened again or their 3 s lease
    expires: the server's bill never passes $1.00, nor does what the pool spent and reserved. Runs that
    did not fit are suspended `pool-exhausted`; after a top-up each batch re-run finishes them all, each
    call billed once, but those the kills cut."""
    require_server("RabbitMQ")
    rng = random.Random(trial)
    assert cli("pool", "create", "p", "--store", store, "--max-cost", "1.00").returncode == 0
    write_items(project, 12)  # the Celery batch's items.jsonl: runs item-0 .. item-11
    lease = {"MKLANG_POOL_LEASE": "3"}
    serve = ("worker", "--store", store, "--broker", RABBITMQ, "--concurrency", "4", "--config", "mklang.toml")
    workers = [launched(project, *serve, "--pool", "p", **lease) for _ in range(3)]
    locals_ = [batch_of(project, store, f"b{n}", 6, "--concurrency", "2") for n in range(4)]
    celery = batch_command(store, RABBITMQ, "--stall-timeout", "60s")
    watch = Watch(store, server)
    try:
        serving(store, *workers)
        killed_batch, killed_worker = rng.randrange(4), rng.randrange(3)
        # Both at once, as the server answers call `kill_at`: no batch has ended by then (each makes 12
        # calls), and the holds the kills leave may take the rest of the pool, so no later call may come.
        kill_at = rng.randrange(2, 12)
        kills: list = []
        processes: list = []
        lock = threading.Lock()

        def killing(_request):
            with lock:
                if not kills and server.count >= kill_at and len(processes) == len(locals_):
                    kills.extend((processes[killed_batch], workers[killed_worker]))
                    for victim in kills:
                        os.kill(victim.pid, signal.SIGKILL)
            return answer("fine", input_tokens=10, output_tokens=5)

        server.handler = killing
        for command in locals_:
            processes.append(launched(project, *command, **lease))
        follower = launched(project, *celery, **lease)
        codes = [process.wait(180) for process in processes]
        followed = follower.communicate(180)
        assert follower.returncode in (0, 3), followed
        assert codes[killed_batch] == -signal.SIGKILL and kills, codes
        assert {code for n, code in enumerate(codes) if n != killed_batch} <= {0, 3}, codes
        assert workers[killed_worker].wait(5) == -signal.SIGKILL
        assert watch.billed <= 1.00 + 1e-9 and watch.held <= 1.00 + 1e-9, (watch.billed, watch.held)
        pool = pool_of(store)
        assert server.count * CALL_COST <= pool["spent"]["cost_usd"] + pool["reserved"]["cost_usd"] + 1e-9
        exhausted = [
            run
            for run in json.loads(cli("runs", "--store", store, "--format", "json").stdout)["runs"]
            if run["reason"] == "pool-exhausted"
        ]
        assert exhausted and pool["waiting"] == len(exhausted)
        paid = server.count
        assert cli("pool", "topup", "p", "--store", store, "--cost", "100").returncode == 0
        for command in locals_:
            done = here(project, *command)
            assert done.returncode == 0, done.stdout[-500:] + done.stderr[-500:]
        done = here(project, *celery)
        assert done.returncode == 0, done.stdout[-500:] + done.stderr[-500:]
    finally:
        watch.close()
        stop(*workers)
        drop_queue(store)
    runs = json.loads(cli("runs", "--store", store, "--format", "json").stdout)["runs"]
    assert len(runs) == 36 and {run["status"] for run in runs} == {"done"}
    # Every call paid once, but those in flight in a killed process (2 in a batch, 4 in a worker).
    assert 36 * CALLS <= server.count <= 36 * CALLS + 2 + 4 and paid <= server.count
    pool = pool_of(store)
    assert (pool["reserved"]["cost_usd"], pool["in_flight"], pool["waiting"]) == (0, 0, 0)


@pytest.mark.slow
def test_a_pool_of_four_calls_in_flight_holds_across_processes(project, store, server):
    held = InFlight(lambda _request: answer("fine", input_tokens=10, output_tokens=5))
    server.handler = held
    assert cli("pool", "create", "p", "--store", store, "--concurrency", "4").returncode == 0
    processes = [start(project, *batch_of(project, store, f"c{n}", 3, "--concurrency", "3")) for n in range(8)]
    assert [process.wait(120) for process in processes] == [0] * 8
    assert server.count == 8 * 3 * CALLS
    assert held.peak == 4  # reached, never passed: 24 calls could be in flight at once without the pool


class Storm:
    """429 with `Retry-After: 2` for 2 s after the first request, then answers; records when (epoch
    seconds) each request came and how many 429s it sent."""

    def __init__(self) -> None:
        self.began: float | None = None
        self.times: list[float] = []
        self.refused = 0
        self.lock = threading.Lock()

    def __call__(self, _request):
        now = time.time()
        with self.lock:
            self.began = self.began or now
            self.times.append(now)
            if now - self.began < 2.0:
                self.refused += 1
                return error(429, retry_after="2")
        return answer("fine", input_tokens=10, output_tokens=5)


@pytest.mark.slow
def test_a_429_storm_makes_every_run_of_the_pool_wait_and_none_halts(project, store, server):
    """One batch meets the 429 and the pool records the pause; three batches started during it ask the
    server nothing until the pause ends, and every run finishes: one 429 slowed the whole pool."""
    storm = Storm()
    server.handler = storm
    assert cli("pool", "create", "p", "--store", store, "--max-cost", "10").returncode == 0
    first = start(project, *batch_of(project, store, "s0", 1))
    opened = open_store(store)
    try:
        wait_for(lambda: opened.pool("p").paused_until > 0, first, "the pool is paused")  # type: ignore[attr-defined]
        paused_until = opened.pool("p").paused_until  # type: ignore[attr-defined]
    finally:
        opened.close()
    others = [start(project, *batch_of(project, store, f"s{n}", 2)) for n in range(1, 4)]
    outcomes = [process.communicate(120) for process in [first, *others]]
    assert [process.returncode for process in [first, *others]] == [0] * 4, outcomes
    assert storm.began is not None and storm.refused == 1
    assert paused_until >= storm.began + 2.0 - 0.05
    assert all(t >= paused_until - 0.01 for t in storm.times[1:]), (paused_until, storm.times)
    assert len(storm.times) == 1 + 7 * CALLS  # the one refused, then every call once


@pytest.mark.slow
@pytest.mark.crash
def test_an_interrupt_while_a_call_waits_for_room_suspends_the_run_at_once(project, store, server):
    """The pool's one call in flight is held (a hold of another process, leased for a minute): the run
    waits for room; SIGINT suspends it `interrupted` in well under a second, no call made; once the slot
    is free it resumes and finishes."""
    assert cli("pool", "create", "p", "--store", store, "--concurrency", "1").returncode == 0
    opened = open_store(store)
    try:
        now = time.time()
        assert opened.reserve(Hold("p", "other/1", "other", 0.0, 0, now + 60), now)  # type: ignore[attr-defined]
        process = launched(project, *run_args(store, "r"), "--pool", "p", "--format", "json")
        wait_for(lambda: opened.read("r") is not None, process, "the run starts")
        time.sleep(0.5)  # its first call waits for room by now; the detail below says it did
        asked = time.monotonic()
        os.kill(process.pid, signal.SIGINT)
        out, err = process.communicate(30)
        took = time.monotonic() - asked
        assert process.returncode == 3, (out, err)
        suspended = json.loads(out)
        assert (suspended["status"], suspended["reason"]) == ("suspended", "interrupted"), suspended
        assert suspended["detail"] == "pool p: interrupted while waiting for room for a call"
        assert took < 1.0 and server.count == 0
        assert opened.settle("p", "other/1", 0.0, 0)  # type: ignore[attr-defined]
    finally:
        opened.close()
    resumed = here(project, "resume", f"{store}#r", "--format", "json")
    assert resumed.returncode == 0 and json.loads(resumed.stdout)["status"] == "done", resumed.stderr
    assert server.count == CALLS and pool_of(store)["in_flight"] == 0


def test_every_command_hosting_runs_refuses_a_pool_it_cannot_draw_from(project, tmp_path):
    """`--pool` with a folder store, or naming a pool the store lacks, is refused by batch, worker and
    serve before any run starts, in one line."""
    folder = tmp_path / "runs"
    folder.mkdir()
    sqlite = f"sqlite:///{tmp_path}/runs.db"
    assert cli("pool", "create", "p", "--store", sqlite, "--max-cost", "1").returncode == 0
    write_items(project, 1)
    for store, why in ((str(folder), "has no budget pools"), (sqlite, "--pool q: no such pool")):
        pool = "p" if why == "has no budget pools" else "q"
        for command in (
            ("batch", "twostep.mk", "--inputs", "items.jsonl", "--store", store, "--config", "mklang.toml"),
            ("worker", "--store", store, "--broker", RABBITMQ, "--config", "mklang.toml"),
            ("serve", "--store", store, "--port", "0", "--config", "mklang.toml"),
        ):
            if command[0] == "worker" and store == str(folder):
                continue  # a worker refuses a folder store whatever its options
            refused(mk(project, *command, "--pool", pool), why)


def test_a_call_that_costs_more_than_its_worst_case_leaves_the_pool_full_never_past_it(project, store, server):
    """A server billing 100,000 prompt tokens for a prompt of a few hundred bytes (past the bound a call
    reserves): the settle charges what the cap leaves, so the pool is full, not past it; the run says
    so, keeps its own true spend, and its next call does not fit: it suspends `pool-exhausted`."""
    server.handler = lambda _request: answer("fine", input_tokens=100_000, output_tokens=5)
    made = cli("pool", "create", "p", "--store", store, "--max-cost", "0.5", "--max-tokens", "1000")
    assert made.returncode == 0
    ran = run_one(project, store, "r")
    assert ran.returncode == 3 and server.count == 1, ran.stderr
    outcome = json.loads(ran.stdout)
    assert (outcome["status"], outcome["reason"]) == ("suspended", "pool-exhausted")
    assert outcome["usage"]["cost_usd"] == pytest.approx(100.01)  # the run's spend is what it was billed
    assert "warning: pool p: a call of tier balanced cost $100.0100 (100,005 tokens), more than its worst case" in (
        ran.stderr
    )
    pool = pool_of(store)
    assert (pool["spent"]["cost_usd"], pool["spent"]["tokens"]) == (pytest.approx(0.5), 1000)
    assert (pool["reserved"]["cost_usd"], pool["reserved"]["tokens"], pool["in_flight"]) == (0, 0, 0)


DECIDED = """\
mklang 0.5
machine decided
entry draft
budget 6

state draft {
  structure "One word."
  prompt "first {{topic}}"
  output a
  otherwise escalate ask "Go on?" show a reply_to approval {
    choice "approve" -> finish
    choice "reject" fail
  }
}

state finish {
  structure "One word."
  prompt "second {{a}}"
  output b
  otherwise -> END
}
"""


@pytest.mark.slow
def test_serve_with_a_pool_draws_the_calls_of_the_runs_its_answers_resume(project, tmp_path, server):
    """`mklang serve --pool p` in a process of its own: a run parked on a decision (started with no pool)
    is answered over HTTP, and the call it makes next is reserved and settled in the pool."""
    import httpx

    store = f"sqlite:///{tmp_path}/runs.db"
    (project / "decided.mk").write_text(DECIDED, encoding="utf-8")
    parked = here(
        project, "run", "decided.mk", "--config", "mklang.toml", "--set", "topic=t", "--checkpoint", f"{store}#d"
    )
    assert parked.returncode == 3 and server.count == 1, parked.stderr
    assert cli("pool", "create", "p", "--store", store, "--max-cost", "1").returncode == 0
    serving_ = launched(project, "serve", "--store", store, "--port", "0", "--config", "mklang.toml", "--pool", "p")
    try:
        address = serving_.stdout.readline().split(": ", 1)[1].strip()
        base = address.split("/?", 1)[0]
        with httpx.Client(base_url=base, follow_redirects=False, timeout=30) as client:
            assert client.get(address.removeprefix(base)).status_code == 303
            page = client.get("/inbox").text
            pick = page[page.index('name="pick" value="d ') :].split('value="', 1)[1].split('"', 1)[0]
            csrf = page[page.index('name="csrf" value="') :].split('value="', 1)[1].split('"', 1)[0]
            answered = client.post("/inbox/answer", data={"csrf": csrf, "choice": "approve", "pick": pick})
            assert answered.status_code == 303, answered.text
            opened = open_store(store)
            try:
                wait_for(
                    lambda: json.loads(opened.read("d") or b"{}").get("status") == "done", serving_, "the run ends"
                )
            finally:
                opened.close()
    finally:
        stop(serving_)
    assert server.count == 2
    pool = pool_of(store)
    assert pool["spent"]["cost_usd"] == pytest.approx(CALL_COST) and pool["in_flight"] == 0


def test_the_api_draws_from_a_pool_suspends_pool_exhausted_and_finishes_after_a_top_up(project, store, server):
    import mklang

    assert cli("pool", "create", "p", "--store", store, "--max-cost", "0.3").returncode == 0
    config = project / "mklang.toml"
    suspended = mklang.run(
        project / "twostep.mk", {"topic": "t"}, config=config, pool="p", checkpoint=f"{store}#api"
    )  # a call's worst case is a few tenths of a dollar: the second call does not fit
    assert (suspended.status, suspended.reason) == ("suspended", "pool-exhausted")
    assert server.count < CALLS and pool_of(store)["waiting"] == 1
    assert cli("pool", "topup", "p", "--store", store, "--cost", "10").returncode == 0
    finished = mklang.resume(f"{store}#api", config=config, pool="p")
    assert finished.status == "done" and server.count == CALLS  # no call paid twice
    assert pool_of(store)["spent"]["cost_usd"] == pytest.approx(CALLS * CALL_COST)
    with pytest.raises(mklang.UsageError, match="q: no such pool in the run"):
        mklang.run(project / "twostep.mk", {"topic": "t"}, config=config, pool="q", checkpoint=f"{store}#other")
