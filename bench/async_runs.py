"""Awaited runs (`mklang.arun`, ADR 0063): what a run costs to start, and many at once in a uvicorn host.

    python bench/async_runs.py [start] [host] [--runs 50 500] [--rounds 3]

- `start`: CPU per awaited run of a one-state machine, the run's host built from `config=` each run
  (as a web host serving each request with its settings does), beside the same runs sharing one
  provider object built once (`provider=`), the floor of what building the host costs. The model
  server, in a process of its own, answers at once; 300 runs in a row, best of the rounds.
- `host`: the starlette app under uvicorn of `tests/support/runs_app.py`, in a process of its own,
  awaits a run of three model calls per request; the model server (a process of its own) answers each
  call in 100 ms. Per round: one run's wall time, then N runs requested at once: their wall time
  against one run's, the host loop's 10 ms ticker's latest wake-up, the most threads the host had,
  and the host's CPU per run. `MKLANG_LANES` is passed on to the host.

The machine's load is printed first; with other work on the 2 cores, compare the CPU figures first.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from measure import print_load

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
sys.path.insert(0, str(TESTS))

SERVER = """
import sys
sys.path.insert(0, {tests!r})
from support.fakeserver import FakeServer, answer
with FakeServer() as server:
    server.handler = lambda request: answer("ok", delay={latency})
    print(server.openai_url, flush=True)
    sys.stdin.read()
"""
STATES = {"one": ("first",), "three": ("first", "second", "third")}


def machine_text(states: tuple[str, ...]) -> str:
    following = [*states[1:], "END"]
    return "mklang 0.4\nmachine bench\nentry first\nbudget 10\n" + "".join(
        f'\nstate {name} {{\n  structure "One word."\n  prompt "{name} {{{{topic}}}}"\n'
        f"  output {name}\n  otherwise -> {after}\n}}\n"
        for name, after in zip(states, following, strict=True)
    )


def model_server(latency: float) -> tuple[subprocess.Popen[str], str]:
    code = SERVER.format(tests=str(TESTS), latency=latency)
    process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    return process, process.stdout.readline().strip()


def write_files(folder: Path, url: str, states: str) -> tuple[Path, Path]:
    from support.commands import model_config

    machine = folder / f"{states}.mk"
    machine.write_text(machine_text(STATES[states]), encoding="utf-8")
    return machine, model_config(url, folder / "mklang.toml")


def start(rounds: int) -> None:
    import mklang
    from mklang.host.config import load_config
    from mklang.providers.factory import build_routed

    server, url = model_server(0.0)
    try:
        with tempfile.TemporaryDirectory() as folder:
            path, config = write_files(Path(folder), url, "one")
            machine = mklang.load(path)
            provider = build_routed(load_config(config))
            ways = {
                "config= (the run's host built each run)": {"config": config},
                "provider= (one provider built once)": {"provider": provider},
            }

            async def runs(count: int, options: dict[str, Any]) -> None:
                for _ in range(count):
                    await mklang.arun(machine, {"topic": "x"}, **options)

            figures: dict[str, list[float]] = {name: [] for name in ways}
            for _ in range(rounds):
                for name, options in ways.items():
                    asyncio.run(runs(20, options))
                    cpu = time.process_time()
                    asyncio.run(runs(300, options))
                    figures[name].append((time.process_time() - cpu) / 300 * 1000)
            provider.close()
    finally:
        server.communicate("")
    print("CPU per awaited run of a one-state machine, 300 in a row (best, median of the rounds):")
    for name, values in figures.items():
        print(f"  {name:42s} {min(values):.2f} ms, {statistics.median(values):.2f} ms")


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=120) as response:
        return json.loads(response.read())


def host(counts: list[int], rounds: int) -> None:
    server, url = model_server(0.1)
    try:
        with tempfile.TemporaryDirectory() as folder:
            machine, config = write_files(Path(folder), url, "three")
            app = [sys.executable, str(TESTS / "support" / "runs_app.py"), str(machine), str(config)]
            with subprocess.Popen(app, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as process:
                assert process.stdin is not None and process.stdout is not None
                base = f"http://127.0.0.1:{process.stdout.readline().strip()}"
                get(f"{base}/run?topic=warm")
                lanes = os.environ.get("MKLANG_LANES", "64 (default)")
                print(f"uvicorn host, runs of 3 model calls of 100 ms each, MKLANG_LANES={lanes}:")
                for count in counts:
                    for number in range(rounds):
                        print("  " + many(base, count, number), flush=True)
                process.stdin.close()
    finally:
        server.communicate("")


def many(base: str, count: int, number: int) -> str:
    started = time.perf_counter()
    get(f"{base}/run?topic=alone")
    alone = time.perf_counter() - started
    get(f"{base}/stats")
    together = threading.Barrier(count)

    def one(n: int) -> None:
        together.wait()
        assert get(f"{base}/run?topic=r{number}x{n}")["status"] == "done"

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(count) as clients:
        list(clients.map(one, range(count)))
    wall = time.perf_counter() - started
    seen = get(f"{base}/stats")
    return (
        f"{count:4d} runs at once: {wall:.3f} s against one run's {alone:.3f} s ({wall / alone:.2f}x); "
        f"ticker late at most {seen['late_ms']:.0f} ms; {seen['threads']} threads at most; "
        f"host CPU {seen['cpu'] / count * 1000:.2f} ms a run"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workloads", nargs="*", choices=["start", "host"], default=[])
    parser.add_argument("--runs", type=int, nargs="+", default=[50, 500], help="runs at once in the host")
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args()
    print_load()
    for workload in options.workloads or ["start", "host"]:
        start(options.rounds) if workload == "start" else host(options.runs, options.rounds)
    print_load()


if __name__ == "__main__":
    main()
