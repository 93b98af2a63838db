"""What a budget pool adds to each model call, in a SQLite and a PostgreSQL store, beside the plain
step of mklang 1.4; prints figures.

    python bench/pool.py [--calls 2000]

1. `store`: one hold reserved and settled (`PoolStore.reserve` then `settle`),
   back to back on a pool with a dollar cap and a concurrency cap: wall and
   CPU (this process) per call, best of 3. A SQLite reservation and settle are
   each a synced transaction; a PostgreSQL one each a committed statement.
2. `wrapped`: a produce call through the pool's wrapper of the run's provider
   (`runs.pooling.PooledProvider`: the worst case, the reservation, the call,
   the settle) around a provider that answers at once, less that provider
   called alone: what a run's model call pays for its pool.

Each is printed beside the plain step of mklang 1.4 in process (its CPU per
step, as `bench/step.py step` measures it), the cost of a step the pool's
call is added to. The SQLite store is a file under the system's temporary
folder (`TMPDIR`); PostgreSQL is `MKLANG_BENCH_POSTGRES` (default
postgresql://postgres@127.0.0.1:5432/test) in a schema of its own, dropped
after, and skipped when it is not reachable.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from measure import print_load
from step import STEPS, side
from vs_1x import loop_yaml

POSTGRES = os.environ.get("MKLANG_BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
REPEATS = 3


def best(work: Callable[[int], None], calls: int) -> tuple[float, float]:
    """The least wall and CPU seconds per call of `work(calls)` over `REPEATS` runs."""
    wall = cpu = float("inf")
    for _ in range(REPEATS):
        began, began_cpu = time.perf_counter(), time.process_time()
        work(calls)
        wall = min(wall, (time.perf_counter() - began) / calls)
        cpu = min(cpu, (time.process_time() - began_cpu) / calls)
    return wall, cpu


@contextmanager
def stores(folder: Path) -> Iterator[list[tuple[str, Any]]]:
    """(name, opened store) of SQLite, then PostgreSQL when it is reachable, each with the pool `p`."""
    from mklang.stores import open_store
    from mklang.stores.pools import Caps

    opened = []
    try:
        sqlite = open_store(f"sqlite:///{folder}/runs.db")
        opened.append(("sqlite", sqlite, None))
        schema = _schema()
        if schema is not None:
            opened.append(("postgresql", open_store(f"{POSTGRES}?options=-csearch_path%3D{schema}"), schema))
        for _, store, _ in opened:
            store.create_pool("p", Caps(max_cost=1e9, concurrency=4))  # type: ignore[attr-defined]
        yield [(name, store) for name, store, _ in opened]
    finally:
        for _, store, schema in opened:
            store.close()
            if schema is not None:
                _drop(schema)


def _schema() -> str | None:
    try:
        import psycopg

        with psycopg.connect(POSTGRES, autocommit=True, connect_timeout=3) as connection:
            schema = f"bench_pool_{uuid.uuid4().hex[:8]}"
            connection.execute(f"CREATE SCHEMA {schema}")
            return schema
    except Exception as error:  # any reason PostgreSQL cannot be used: said, and skipped
        print(f"  postgresql: skipped ({str(error).splitlines()[0]})")
        return None


def _drop(schema: str) -> None:
    import psycopg

    with psycopg.connect(POSTGRES, autocommit=True) as connection:
        connection.execute(f"DROP SCHEMA {schema} CASCADE")


def reserve_and_settle(store: object) -> Callable[[int], None]:
    from mklang.stores.pools import Hold

    def work(calls: int) -> None:
        for n in range(calls):
            now = time.time()
            key = f"bench/{uuid.uuid4().hex}/{n}"
            assert store.reserve(Hold("p", key, "bench", 0.01, 100, now + 300), now)  # type: ignore[attr-defined]
            assert store.settle("p", key, 0.001, 20)  # type: ignore[attr-defined]

    return work


class Instant:
    """A provider that answers every call at once, with a price, so a pool can bound its calls."""

    def produce(self, system: str, user: str, tier: str, reason: bool) -> object:
        from mklang.providers.base import Produced, Usage

        return Produced("ok", None, Usage(10, 2, 0.0001))

    def worst_case(self, system: str, user: str, tier: str, reason: bool) -> object:
        from mklang.providers.base import Usage

        return Usage(len(system) + len(user) + 64, 20, 0.001)


def calls_of(provider: object) -> Callable[[int], None]:
    from mklang.providers.base import make_call

    def work(calls: int) -> None:
        for n in range(calls):
            make_call(f"bench/{uuid.uuid4().hex}/{n}", None, None, lambda: provider.produce("s", "u", "fast", False))  # type: ignore[attr-defined]

    return work


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls a run of each figure makes")
    args = parser.parse_args()
    from mklang.runs.pooling import PooledProvider

    print_load()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        path = folder / "plain.yaml"
        path.write_text(loop_yaml(STEPS))
        step_1x = side("1x", "steps", path)["cpu"] / STEPS
        step_ours = side("ours", "steps", path)["cpu"] / STEPS
        print(f"plain step, in process, CPU: mklang 1.4 {step_1x * 1e6:6.1f} us, this mklang {step_ours * 1e6:6.1f} us")
        alone = best(calls_of(Instant()), args.calls)
        with stores(folder) as opened:
            for name, store in opened:
                wall, cpu = best(reserve_and_settle(store), args.calls)
                print(
                    f"store   {name:<10} reserve+settle per call: wall {wall * 1e6:7.1f} us, CPU {cpu * 1e6:6.1f} us "
                    f"= {cpu / step_1x:5.2f}x the CPU of mklang 1.4's plain step"
                )
                wrapped = PooledProvider(Instant(), store, "p", "bench", threading.Event())  # type: ignore[arg-type]
                wall, cpu = best(calls_of(wrapped), args.calls)
                wall, cpu = wall - alone[0], cpu - alone[1]
                print(
                    f"wrapped {name:<10} a call's pool, per call:   wall {wall * 1e6:7.1f} us, CPU {cpu * 1e6:6.1f} us "
                    f"= {cpu / step_1x:5.2f}x the CPU of mklang 1.4's plain step"
                )
    print_load()


if __name__ == "__main__":
    main()
