"""The console's inbox at 1,000 parked runs: a SQLite store of runs parked on the approval
example's decision, the first page of the inbox rendered through the whole web stack in process.

Prints the best of a few renders against the 300 ms target, the page's size against 200 KB, and
how many envelopes rendering it read (the cards come from the store's summaries: none should).
Needs the console extra.
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

TARGET = 0.300  # seconds for the first page of the inbox
SIZE = 200 * 1024  # bytes of it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=1_000)
    parser.add_argument("--rounds", type=int, default=5)
    options = parser.parse_args()
    print_load()
    from starlette.testclient import TestClient
    from support.console import park_many

    from mklang.console.web import Console, create_app
    from mklang.stores import open_store

    with tempfile.TemporaryDirectory(prefix="mklang-bench-inbox-") as folder:
        os.environ["XDG_STATE_HOME"] = folder
        uri = park_many(Path(folder), options.runs)
        store = open_store(uri, create=False)
        reads = []
        read = store.read
        store.read = lambda run: reads.append(run) or read(run)  # type: ignore[method-assign]
        try:
            with TestClient(create_app(Console(store, uri, "bench"))) as client:
                client.get("/?token=bench")
                page = client.get("/inbox")
                assert page.status_code == 200 and "parked-" in page.text
                reads.clear()
                times = []
                for _ in range(options.rounds):
                    started = time.perf_counter()
                    page = client.get("/inbox")
                    times.append(time.perf_counter() - started)
                seconds, size = min(times), len(page.content)
                cards = page.text.count('class="question-card')
                print(
                    f"inbox of {options.runs:,} parked runs, first page ({cards} cards): {seconds * 1000:.0f} ms "
                    f"({seconds / TARGET:.2f} of the {TARGET * 1000:.0f} ms target), {size / 1024:.1f} KB "
                    f"({size / SIZE:.2f} of the {SIZE // 1024} KB target), "
                    f"{len(reads) // options.rounds} envelopes read per page"
                )
        finally:
            store.close()


if __name__ == "__main__":
    main()
