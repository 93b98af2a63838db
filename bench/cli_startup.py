"""Start-up and load figures of the front end (issue 2 targets).

Prints the median wall time of `mklang --version` and of `mklang check` on a
20-state machine, each as a whole process, and of parsing plus checking a
generated 500-state machine in process. Child processes run with bytecode
caching on (as after a normal install), after warm-up runs.

    python bench/cli_startup.py [--runs N]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGETS_MS = {"version": 120, "check": 160, "load500": 200}


def machine_text(states: int) -> str:
    """A chain of generative states with prose, fan-out and repair gates, ending at END."""
    lines = [f"mklang 0.4\nmachine chain{states}\nentry s0\nbudget {states * 3}\n", "context {\n  topic: \"x\"\n}\n"]
    for i in range(states):
        target = f"s{i + 1}" if i + 1 < states else "END"
        sample = "  sample 2\n" if i % 10 == 5 else ""
        lines.append(
            f"state s{i} {{\n  tier fast\n{sample}  structure \"One paragraph about step {i}.\"\n"
            f'  prompt """\n    Write step {i} about {{{{topic}}}}.\n    Keep it short.\n    """\n'
            f"  output out{i}\n  when \"the text is off topic\" repair 2 -> s{i}\n"
            f"  when \"the text is done\" -> {target}\n  otherwise -> {target}\n}}\n"
        )
    return "\n".join(lines)


def command() -> list[str]:
    script = shutil.which("mklang")
    return [script] if script else [sys.executable, "-m", "mklang"]


def wall_ms(args: list[str], runs: int) -> float:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    for _ in range(2):
        subprocess.run(args, env=env, capture_output=True, check=False)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(args, env=env, capture_output=True, check=False)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def load_ms(text: str, runs: int) -> float:
    from mklang.check import check
    from mklang.syntax import parse

    times = []
    for _ in range(runs):
        start = time.perf_counter()
        found = check(parse(text, "chain500.mk"))
        times.append((time.perf_counter() - start) * 1000)
    assert not [d for d in found if d.severity == "error"], found
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    runs = parser.parse_args().runs
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "chain20.mk"
        path.write_text(machine_text(20), encoding="utf-8")
        figures = {
            "version": wall_ms([*command(), "--version"], runs),
            "check": wall_ms([*command(), "check", str(path)], runs),
            "load500": load_ms(machine_text(500), max(5, runs // 3)),
        }
    labels = {
        "version": "mklang --version (process)",
        "check": "mklang check, 20 states (process)",
        "load500": "parse + check, 500 states (in process)",
    }
    for key, value in figures.items():
        verdict = "ok" if value < TARGETS_MS[key] else "over"
        print(f"{labels[key]:<42} {value:7.1f} ms   target < {TARGETS_MS[key]} ms  {verdict}")


if __name__ == "__main__":
    main()
