"""The console's runs list of a large store: a SQLite store of 10,000 runs, the first and the last
page of the list (50 runs each, newest first) rendered through the whole web stack in process.

The store is filled with copies of two real runs' envelopes (one parked on a question, one done),
written under 10,000 names. Prints the best of a few renders of each page against the 300 ms
target, and the store's summaries of one page alone. Needs the console extra.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from measure import print_load  # noqa: E402

TARGET = 0.300  # seconds for one page of the runs list


def fill(folder: Path, runs: int) -> str:
    """A SQLite store of `runs` runs, alternately parked and done."""
    from support.console import make_runs

    from mklang.stores import RunQuery, open_store

    make_runs(folder)
    uri = f"sqlite:///{folder}/runs.db"
    store = open_store(uri)
    try:
        made = {summary.run: summary for summary in store.summaries(RunQuery())}
        copied = [(store.read(run), made[run]) for run in ("ask", "echo")]
        for number in range(runs - 2):
            envelope, summary = copied[number % 2]
            store.write(f"run-{number:05d}", envelope or b"", generation=0)
            store.summarize(f"run-{number:05d}", summary)
    finally:
        store.close()
    return uri


def best(render, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        render()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=5)
    options = parser.parse_args()
    print_load()
    from starlette.testclient import TestClient

    from mklang.console.reading import PAGE
    from mklang.console.web import Console, create_app
    from mklang.stores import RunQuery, open_store

    with tempfile.TemporaryDirectory(prefix="mklang-bench-console-") as folder:
        os.environ["XDG_STATE_HOME"] = folder
        uri = fill(Path(folder), options.runs)
        store = open_store(uri, create=False)
        try:
            with TestClient(create_app(Console(store, uri, "bench"))) as client:
                client.get("/?token=bench")
                last = -(-options.runs // PAGE)
                for name, path in (("first page", "/"), (f"last page ({last})", f"/?page={last}")):
                    assert client.get(path).status_code == 200
                    seconds = best(lambda path=path: client.get(path), options.rounds)
                    print(
                        f"runs list of {options.runs:,} runs, {name}: {seconds * 1000:.0f} ms "
                        f"({seconds / TARGET:.2f} of the {TARGET * 1000:.0f} ms target)"
                    )
            alone = best(lambda: store.summaries(RunQuery(limit=PAGE + 1)), options.rounds)
            print(f"the store's summaries of one page alone: {alone * 1000:.1f} ms")
        finally:
            store.close()


if __name__ == "__main__":
    main()
