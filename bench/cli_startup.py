"""Start-up and load figures of the front end, against their targets.

Prints the median wall time of `mklang --version`, of `mklang check` on a
20-state machine, of `mklang run` on the triage example with its scripted
scenario and of `mklang resume --check` of a suspended approval run, each as
a whole process, and of parsing plus checking a
generated 500-state machine in process; CPU time is shown beside wall time,
since a busy machine inflates wall time. Child processes run with bytecode
caching on (as after a normal install), after warm-up runs.

    python bench/cli_startup.py [--runs N]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from measure import print_load

TARGETS_MS = {"version": 120, "check": 160, "run": 250, "resume": 250, "load500": 200}
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
EXAMPLE = EXAMPLES / "triage"
APPROVAL = EXAMPLES / "approval"


def machine_text(states: int) -> str:
    """A chain of generative states with prose, fan-out and repair gates, ending at END."""
    lines = [f"mklang 0.4\nmachine chain{states}\nentry s0\nbudget {states * 3}\n", 'context {\n  topic: "x"\n}\n']
    for i in range(states):
        target = f"s{i + 1}" if i + 1 < states else "END"
        sample = "  sample 2\n" if i % 10 == 5 else ""
        lines.append(
            f'state s{i} {{\n  tier fast\n{sample}  structure "One paragraph about step {i}."\n'
            f'  prompt """\n    Write step {i} about {{{{topic}}}}.\n    Keep it short.\n    """\n'
            f'  output out{i}\n  when "the text is off topic" repair 2 -> s{i}\n'
            f'  when "the text is done" -> {target}\n  otherwise -> {target}\n}}\n'
        )
    return "\n".join(lines)


def command() -> list[str]:
    script = shutil.which("mklang")
    return [script] if script else [sys.executable, "-m", "mklang"]


def process_ms(args: list[str], runs: int) -> tuple[float, float]:
    """Median wall time and median CPU time (user + system) of a whole process."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    for _ in range(2):
        subprocess.run(args, env=env, capture_output=True, check=False)
    walls, cpus = [], []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run(args, env=env, capture_output=True, check=False)
        walls.append((time.perf_counter() - start) * 1000)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append((after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime) * 1000)
    return statistics.median(walls), statistics.median(cpus)


def suspended_run(checkpoint: Path) -> list[str]:
    """Suspend the approval example at its question into `checkpoint`; the options its resume takes."""
    script = ["--script", str(APPROVAL / "scenarios.yaml"), "--scenario", "ask-then-publish"]
    run = [*command(), "run", str(APPROVAL / "approval.mk"), *script, "--checkpoint", str(checkpoint), "--hitl"]
    done = subprocess.run([*run, "--format", "json"], capture_output=True, text=True, check=False)
    assert '"suspended"' in done.stdout, done.stdout + done.stderr
    return script


def load_ms(text: str, runs: int) -> tuple[float, float]:
    """Median wall time and median CPU time of parsing and checking `text` in this process."""
    from mklang.checker import check
    from mklang.syntax import parse

    walls, cpus = [], []
    for _ in range(runs):
        start, cpu = time.perf_counter(), time.process_time()
        found = check(parse(text, "chain500.mk"))
        walls.append((time.perf_counter() - start) * 1000)
        cpus.append((time.process_time() - cpu) * 1000)
    assert not [d for d in found if d.severity == "error"], found
    return statistics.median(walls), statistics.median(cpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    runs = parser.parse_args().runs
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "chain20.mk"
        path.write_text(machine_text(20), encoding="utf-8")
        checkpoint = Path(folder) / "approval.cp.json"
        resume_options = suspended_run(checkpoint)
        bare_wall, bare_cpu = process_ms([sys.executable, "-c", "pass"], runs)
        figures = {
            "version": process_ms([*command(), "--version"], runs),
            "check": process_ms([*command(), "check", str(path)], runs),
            "run": process_ms(
                [
                    *command(),
                    "run",
                    str(EXAMPLE / "triage.mk"),
                    "--script",
                    str(EXAMPLE / "scenarios.yaml"),
                    "--scenario",
                    "small-refund-answered-directly",
                ],
                runs,
            ),
            "resume": process_ms([*command(), "resume", str(checkpoint), "--check", *resume_options], runs),
            "load500": load_ms(machine_text(500), max(5, runs // 3)),
        }
    labels = {
        "version": "mklang --version (process)",
        "check": "mklang check, 20 states (process)",
        "run": "mklang run, scripted triage (process)",
        "resume": "mklang resume --check, approval (process)",
        "load500": "parse + check, 500 states (in process)",
    }
    print_load()
    print(f"median of {runs} runs; a bare `python -c pass` takes {bare_cpu:.1f} ms cpu ({bare_wall:.1f} ms wall)")
    for key, (wall, cpu) in figures.items():
        verdict = "ok" if wall < TARGETS_MS[key] else "over"
        ratio = f"{cpu / bare_cpu:5.1f}x bare" if key != "load500" else f"{cpu / 500 * 1000:5.0f} us/state"
        print(
            f"{labels[key]:<42} {ratio}  {wall / TARGETS_MS[key]:5.2f}x target ({wall:7.1f} ms wall, "
            f"{cpu:7.1f} ms cpu, target < {TARGETS_MS[key]} ms: {verdict})"
        )


if __name__ == "__main__":
    main()
