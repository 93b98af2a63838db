"""Checkpoint costs, measured on the real file system; prints its figures.

1. Suspend and resume at 10, 100 and 1,000 steps of trace with 2 KB outputs:
   envelope size, time to write the suspended envelope, and time for
   `resume` to verify, load and re-suspend (unchanged budget), each per
   step of trace.
2. Checkpoint cost per step of a durable run (`--checkpoint`: journal
   appends with fsync plus occasional compaction) at 100, 1,000 and 10,000
   steps: (time with checkpoint - time without) / steps. It must stay flat.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from measure import print_load

from mklang.checkpoint.envelope import load, save
from mklang.engine import run
from mklang.providers.scripted import ScriptedProvider
from mklang.runs import open_run, proceed, start
from mklang.session import Host
from mklang.syntax import load_file

OUTPUT = "x" * 2048
MACHINE = """machine grow
entry write
budget {budget}
state write {{
  structure "2 KB of text"
  prompt "write more"
  output page
  accumulate
  otherwise -> write
}}
"""


def machine_file(folder: Path, steps: int) -> Path:
    path = folder / f"grow{steps}.mk"
    path.write_text(MACHINE.format(budget=steps))
    return path


def provider() -> ScriptedProvider:
    return ScriptedProvider({"produce": [OUTPUT], "tokens": [10, 500]})


def suspend_and_resume(folder: Path, steps: int) -> tuple[int, float, float]:
    machine = load_file(machine_file(folder, steps))
    checkpoint = folder / f"suspend{steps}.json"
    result = start(machine, {}, Host(provider()), checkpoint=checkpoint)
    assert result.status == "suspended" and len(result.trace) == steps
    envelope = load(checkpoint)
    began = time.perf_counter()
    save(checkpoint, envelope)
    write = time.perf_counter() - began
    began = time.perf_counter()
    again = proceed(open_run(checkpoint), Host(provider()))
    resume = time.perf_counter() - began
    assert again.status == "suspended" and len(again.trace) == steps
    return checkpoint.stat().st_size, write, resume


def per_step_cost(folder: Path, steps: int, repeats: int = 3) -> float:
    """The best of `repeats`: other processes on the machine only ever add time."""
    machine = load_file(machine_file(folder, steps))
    costs = []
    for attempt in range(repeats):
        began = time.perf_counter()
        plain = run(machine, provider=provider())
        without = time.perf_counter() - began
        began = time.perf_counter()
        durable = start(machine, {}, Host(provider()), checkpoint=folder / f"durable{steps}-{attempt}.json")
        with_checkpoint = time.perf_counter() - began
        assert plain.trace == durable.trace
        costs.append((with_checkpoint - without) / steps)
    return min(costs)


def main() -> None:
    print_load()
    sizes = [int(arg) for arg in sys.argv[1:]] or [100, 1_000, 10_000]
    with tempfile.TemporaryDirectory(dir=".") as folder:
        folder = Path(folder)
        print("suspend / resume with 2 KB outputs")
        for steps in (10, 100, 1_000):
            size, write, resume = suspend_and_resume(folder, steps)
            print(
                f"  {steps:>6} steps: envelope {size / steps / 1024:6.2f} KiB/step   suspend write "
                f"{write / steps * 1e6:7.1f} us/step   resume (verify, load, re-suspend) "
                f"{resume / steps * 1e6:7.1f} us/step"
            )
        print("checkpoint cost per step of a durable run (journal + compaction)")
        costs = {}
        for steps in sizes:
            costs[steps] = per_step_cost(folder, steps)
            print(f"  {steps:>6} steps: {costs[steps] * 1e6:8.1f} us per step")
        first, last = costs[sizes[0]], costs[sizes[-1]]
        print(f"  ratio {sizes[-1]} / {sizes[0]}: {last / first:.2f}x (target <= 2x)")


if __name__ == "__main__":
    main()
