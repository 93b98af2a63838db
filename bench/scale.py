"""Batches at scale against the fake HTTP model; prints its figures with the machine load.

1. 1,000 inputs x 5 steps, every model call answered after 100 ms: wall time
   of `mklang batch` against the ideal (calls x latency / concurrency) for the
   local executor with SQLite and with PostgreSQL (concurrency 32), and for
   2 Celery workers of concurrency 16 each (RabbitMQ); the CPU seconds per
   run of the processes measured (less sensitive than wall time to other work
   on the machine); the batch process's peak memory.
2. The checkpoint cost per step of each store: a 300-step durable run with an
   instant scripted model, (time with the store - time without) / steps.

Needs PostgreSQL and RabbitMQ on 127.0.0.1 for their rows; those rows are
skipped with a note when a server is not reachable. `--items N` shrinks the
batch for a quick look.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from support.fakeserver import FakeServer, answer  # noqa: E402

LATENCY = 0.1
STEPS = 5
POSTGRES = "postgresql://postgres@127.0.0.1:5432/test"
RABBITMQ = "amqp://guest:guest@127.0.0.1:5672//"


def chain_machine(steps: int) -> str:
    """A chain of `steps` generative states, one model call each, ending at END."""
    states = "\n".join(
        f"""state s{n} {{
  structure "One word."
  prompt "step {n} of {{{{topic}}}}"
  output a{n}
  otherwise -> {f"s{n + 1}" if n + 1 < steps else "END"}
}}
"""
        for n in range(steps)
    )
    return f"mklang 0.4\nmachine chain\nentry s0\nbudget {steps + 1}\n\n{states}"


def batch_folder(folder: Path, openai_url: str, items: int, steps: int) -> None:
    """The machine, config and inputs of a batch of `items` runs of `steps` calls against `openai_url`."""
    (folder / "chain.mk").write_text(chain_machine(steps))
    (folder / "mklang.toml").write_text(
        '[tiers]\nfast = "local:m"\nbalanced = "local:m"\nreasoning = "local:m"\n\n'
        f'[providers.local]\nkind = "openai"\nbase_url = "{openai_url}"\n'
    )
    (folder / "items.jsonl").write_text(
        "".join(json.dumps({"id": f"i{n}", "topic": f"t{n}"}) + "\n" for n in range(items))
    )


def reachable(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return True
    except OSError:
        return False


def env() -> dict[str, str]:
    """No mklang settings or keys of the caller; the code first on PYTHONPATH, this checkout by default."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MKLANG_", "OPENAI_", "ANTHROPIC_"))}
    clean["PYTHONPATH"] = os.environ.get("PYTHONPATH") or str(ROOT)
    return clean


def mklang(folder: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "mklang", *args],
        cwd=folder,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def children_cpu() -> float:
    """CPU seconds (user + system) of the child processes that ended so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed_batch(folder: Path, store: str, *options: str) -> tuple[float, float, dict]:
    """Wall seconds, peak memory (MiB) and JSON summary of one `mklang batch`."""
    started = time.monotonic()
    process = mklang(
        folder, "batch", "chain.mk", "--inputs", "items.jsonl", "--store", store, "--config", "mklang.toml",
        "--format", "json", *options,
    )  # fmt: skip
    stdout, stderr = process.communicate()
    elapsed = time.monotonic() - started
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    if process.returncode != 0:
        raise SystemExit(f"batch failed ({process.returncode}): {stderr}")
    return elapsed, peak, json.loads(stdout)


def postgres_schema(cleanup: contextlib.ExitStack) -> str:
    """A store URI into a fresh schema of database `test`, dropped when `cleanup` closes."""
    import psycopg

    schema = f"bench_{uuid.uuid4().hex[:10]}"

    def run(sql: str) -> None:
        with psycopg.connect(POSTGRES, autocommit=True) as db:
            db.execute(sql)

    run(f"CREATE SCHEMA {schema}")
    cleanup.callback(run, f"DROP SCHEMA {schema} CASCADE")
    return f"{POSTGRES}?options=-csearch_path%3D{schema}"


def figure(elapsed: float, ideal: float, cpu: float, items: int) -> str:
    """Wall time against the ideal, and CPU per run (less sensitive to other load on the machine)."""
    return f"{elapsed:6.1f} s = {elapsed / ideal:4.2f} x ideal ({ideal:.1f} s); CPU {cpu / items * 1e3:5.1f} ms/run"


def batch_rows(items: int) -> None:
    calls = items * STEPS
    with FakeServer() as server, tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as schemas:
        server.handler = lambda request: answer("ok", input_tokens=10, output_tokens=2, delay=LATENCY)
        folder = Path(tmp)
        batch_folder(folder, server.openai_url, items, STEPS)
        print(f"{items} inputs x {STEPS} steps, {LATENCY * 1000:.0f} ms a call ({calls} calls)")
        ideal = calls * LATENCY / 32
        rows = [("local, SQLite, concurrency 32", f"sqlite:///{folder}/runs.db", ())]
        if reachable(5432):
            rows.append(("local, PostgreSQL, concurrency 32", postgres_schema(schemas), ()))
        else:
            print("  (PostgreSQL not reachable on 127.0.0.1:5432: its rows are skipped)")
        for name, store, options in rows:
            cpu = children_cpu()
            elapsed, peak, summary = timed_batch(folder, store, "--concurrency", "32", *options)
            cpu = children_cpu() - cpu
            assert summary["done"] == items, summary
            print(f"  {name:<38} {figure(elapsed, ideal, cpu, items)}; batch peak {peak:.0f} MiB")
        if reachable(5432) and reachable(5672):
            store = postgres_schema(schemas)
            workers = [
                mklang(folder, "worker", "--store", store, "--broker", RABBITMQ, "--concurrency", "16",
                       "--config", "mklang.toml")
                for _ in range(2)
            ]  # fmt: skip
            cpu = children_cpu()
            try:
                time.sleep(3)  # let the workers connect before the clock starts
                elapsed, peak, summary = timed_batch(folder, store, "--executor", "celery", "--broker", RABBITMQ)
            finally:
                for worker in workers:
                    worker.kill()
                    worker.communicate()
            cpu = children_cpu() - cpu  # the batch and both workers, their start included
            assert summary["done"] == items, summary
            print(f"  {'2 Celery workers x 16, PostgreSQL':<38} {figure(elapsed, ideal, cpu, items)}")
        else:
            print("  (RabbitMQ or PostgreSQL not reachable: the Celery row is skipped)")


JUDGED = 'when "again" -> s\n  otherwise -> s'  # a produce call and a judge call a step


def looping(gate: str = "otherwise -> s") -> Callable[[int, str | None], object]:
    """Run a one-state loop of `steps` steps with an instant scripted model: `go(steps, target)`
    makes it durable at checkpoint `target`, or runs it without a store when `target` is None."""
    from mklang.engine import run
    from mklang.providers.scripted import ScriptedProvider
    from mklang.runs import start
    from mklang.session import Host
    from mklang.syntax import parse

    def go(steps: int, target: str | None) -> object:
        machine = parse(
            f"machine loop\nentry s\nbudget {steps}\n"
            f'state s {{\n  structure "x"\n  prompt "again"\n  output o\n  {gate}\n}}\n'
        )
        provider = ScriptedProvider({"produce": ["ok"] * steps, "judge": [0]})
        if target is None:
            result = run(machine, {}, provider=provider)
        else:
            result = start(machine, {}, Host(provider), checkpoint=target)
        assert len(result.trace) == steps, result.status
        return result

    return go


def stores() -> list[str]:
    """The stores a run can be made durable in here."""
    return ["file", "SQLite", *(["PostgreSQL"] if reachable(5432) else [])]


def store_target(store: str, tmp: str, cleanup: contextlib.ExitStack) -> str | None:
    """The checkpoint target of a run in `store` (None for "none"), `{}` standing for the run's name."""
    if store == "none":
        return None
    if store == "file":
        return f"{tmp}/cp{{}}.json"
    if store == "SQLite":
        return f"sqlite:///{tmp}/runs.db#r{{}}"
    return f"{postgres_schema(cleanup)}#r{{}}"


@contextlib.contextmanager
def counted_fsyncs() -> Iterator[list[int]]:
    """A one-item list that counts this process's `os.fsync` and `os.fdatasync` calls in the block."""
    calls, synced = [0], {name: getattr(os, name) for name in ("fsync", "fdatasync")}

    def counting(sync: Callable[[int], None]) -> Callable[[int], None]:
        def counted(fd: int) -> None:
            calls[0] += 1
            sync(fd)

        return counted

    for name, sync in synced.items():
        setattr(os, name, counting(sync))
    try:
        yield calls
    finally:
        for name, sync in synced.items():
            setattr(os, name, sync)


def step_counts(store: str, once: Callable[[str, int], object]) -> dict[str, float]:
    """What one more step adds to a run in `store`: the difference between a 40- and a 20-step run,
    over 20. PostgreSQL: exchanges with the server (round trips), commits and those that wait for the
    flush, read from libpq's protocol trace; the file store: fsyncs, its flushed commits."""
    figures = []
    for steps in (20, 40):
        with contextlib.ExitStack() as counting:
            fsyncs = counting.enter_context(counted_fsyncs())
            if store == "PostgreSQL":
                from support.pgtrace import counted

                trace = counting.enter_context(counted())
            once(f"n{steps}", steps)
        if store == "PostgreSQL":
            figures.append({"exchanges": trace.exchanges, "commits": trace.commits, "flushed": trace.flushed})
        elif store == "file":
            figures.append({"exchanges": 0, "commits": fsyncs[0], "flushed": fsyncs[0]})
        else:  # the store's flushes are not this process's to count
            figures.append({})
    short, long = figures
    return {name: (long[name] - short[name]) / 20 for name in long}


def step_figures(store: str, steps: int = 300, gate: str = JUDGED) -> dict[str, float]:
    """Per step of a `steps`-step run durable in `store` ("none": no store): wall and CPU seconds of
    this process (all threads) after a warm-up run, and the step's `step_counts`."""
    go = looping(gate)
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as cleanup:
        target = store_target(store, tmp, cleanup)

        def once(name: str, count: int) -> object:
            return go(count, None if target is None else target.format(name))

        once("warm", 5)  # imports, tables, connections
        began, began_cpu = time.perf_counter(), time.process_time()
        once("timed", steps)
        figures = {"wall": (time.perf_counter() - began) / steps, "cpu": (time.process_time() - began_cpu) / steps}
        return {**figures, **step_counts(store, once)}


def flush_floor(samples: int = 300) -> dict[str, float]:
    """What a durable step cannot go below, alternated so that load hits both alike: median seconds of
    a journal-sized append with fsync to a file, and of an INSERT that waits for PostgreSQL's flush
    (one round trip), and of one that does not."""
    import psycopg

    line, times = b"x" * 400 + b"\n", {"fsync": [], "flushed": [], "unflushed": []}
    flushed = "INSERT INTO t (line) VALUES (%s)"
    unflushed = (
        "WITH off AS (SELECT set_config('synchronous_commit', 'off', true)) INSERT INTO t (line) SELECT %s FROM off"
    )
    with tempfile.TemporaryFile() as file, contextlib.ExitStack() as cleanup:
        db = cleanup.enter_context(psycopg.connect(postgres_schema(cleanup), autocommit=True))
        db.execute("CREATE TABLE t (seq BIGSERIAL PRIMARY KEY, line BYTEA NOT NULL)")
        steps = {
            "fsync": lambda: (file.write(line), file.flush(), os.fsync(file.fileno())),
            "flushed": lambda: db.execute(flushed, (line,), prepare=True),
            "unflushed": lambda: db.execute(unflushed, (line,), prepare=True),
        }
        for _ in range(samples):
            for name, step in steps.items():
                began = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - began)
    return {name: statistics.median(values) for name, values in times.items()}


def store_rows(steps: int = 300) -> None:
    bare = step_figures("none", steps, "otherwise -> s")
    print(f"checkpoint cost per step, {steps}-step run (instant model):")
    for name in stores():
        per_step = step_figures(name, steps, "otherwise -> s")
        print(f"  {name:<12} {(per_step['wall'] - bare['wall']) * 1e3:6.2f} ms/step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=1000)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    store_rows()
    batch_rows(args.items)
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
