"""mklang beside the original mklang 1.4.0, or beside a stated target, in one run; prints ratios.

    python bench/vs_1x.py [resume durability batch yaml fanout rss startup] [--items N]

1. `resume`: a run suspended after 1k / 10k steps of 2 KB outputs, resumed to
   done (one more step); wall time (target: ratio <= 1.0 at 10k steps).
2. `durability`: a judged step of a durable run with `MKLANG_DURABILITY=step`
   in each store: wall and CPU time of the mklang process, medians of 5
   runs of each store interleaved (the machine's load falls on all alike),
   and what a step adds in round trips to the server, commits and flushed
   commits (fsyncs for files); PostgreSQL against the file store (target
   <= 1.3x); skipped with a line when PostgreSQL is not reachable.
3. `batch`: 3,000 items x 3 steps, each call answered after 100 ms, at
   concurrency 32 and 256 in one process, and 256 over 2 (`--processes 2`)
   (SQLite store): wall time and CPU per run, the children's included, the
   model server's CPU per call and the floor that CPU sets on 2 free cores
   (targets: 256 in one process <= 2x ideal and <= 0.5x the wall time of 32,
   over 2 processes <= 1.5x ideal; CPU per run < 8 ms).
4. `yaml`: `mklang check` of a 5,000-state YAML machine (1 MB), as a process.
5. `fanout`: a 2,000-branch fan-out with an instant model at concurrency 8:
   cost per branch and threads started.
6. `rss`: peak memory of a process that runs 100,000 steps.
7. `startup`: `mklang run` of a one-state machine against an HTTP model
   server, as a process; and the time this mklang spends importing its HTTP
   client, and httpx (target: not imported; ADR 0033).

The machines run by both sides are YAML texts in mklang 1.x's layout. Each
figure is taken in a process of its own: this script runs itself with
`--side ours` or, in the venv of the original, `--side 1x`, so it imports
only the standard library at the top. The original is installed with pip
the first time, into a venv under `$MKLANG_BENCH_CACHE` (default
`~/.cache/mklang-bench`). Wall times are the best of a few runs (`durability`: medians); the load
average is printed first and last.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from measure import print_load

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the fake model server: tests/support/fakeserver.py
ORIGINAL = "mklang==1.4.0"
TIERS = {"fast": "m", "balanced": "m", "reasoning": "m"}
OUTPUT = "x" * 2048
REPEATS = 3
DURABLE_REPEATS = 5

# -- machines (mklang 1.x's YAML layout, read by both) ------------------------------


def loop_yaml(budget: int, judged: bool = False, sample: int = 0, then: str = "write") -> str:
    """One state whose `otherwise` leads to `then` (itself by default), after a judged gate
    to END when `judged`; a fan-out of `sample` branches when `sample`."""
    finish = "      - when: the text is finished\n        then: ok\n        to: END\n" if judged else ""
    fan = f"    sample: {sample}\n" if sample else ""
    return (
        f'mklang: "0.2"\nmachine: loop\nentry: write\nbudget: {budget}\nstates:\n  write:\n'
        f"    structure: some text\n    prompt: write more\n{fan}    output: page\n"
        f"    gates:\n{finish}      - when: otherwise\n        then: ok\n        to: {then}\n"
    )


# -- the two sides: each function runs in a process of its own and returns its figures --


def best_times(work, repeats: int = REPEATS) -> dict[str, float]:
    """The least wall and CPU seconds (this process, all threads) of `work` over `repeats`
    runs: other load only ever adds time. On a busy machine CPU time moves less."""
    wall = cpu = float("inf")
    for _ in range(repeats):
        began, began_cpu = time.perf_counter(), time.process_time()
        work()
        wall, cpu = min(wall, time.perf_counter() - began), min(cpu, time.process_time() - began_cpu)
    return {"wall": wall, "cpu": cpu}


def peak_rss() -> int:
    """This process's peak resident memory in bytes. Not `ru_maxrss`, which a child
    process starts with at its parent's size when the parent is the larger."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.M).group(1)) * 1024


def counting_thread_starts() -> list[int]:
    """A one-item list that counts every thread started from now on in this process."""
    started = [0]
    original = threading.Thread.start

    def start(self, *args, **kwargs):
        started[0] += 1
        return original(self, *args, **kwargs)

    threading.Thread.start = start
    return started


class Original:
    """Calls into the original mklang 1.4 (imported only in its own venv)."""

    @staticmethod
    def llm(output: str, finish: bool):
        from mklang.llm.base import Produced

        class Fixed:
            """Answers every call at once with `output`; the judge finishes or picks `otherwise`."""

            def produce(self, model, system, user, reason=False, temperature=0.4, params=None, **_):
                return Produced(text=output)

            def judge(self, model, conditions, output, context, reasoning=None, allow_none=False, **_):
                return 0 if finish else len(conditions)

        return Fixed()

    @staticmethod
    def resume(path: Path) -> dict:
        from dataclasses import replace

        from mklang.loader import load_machine

        from mklang.checkpoint import load_checkpoint, save_checkpoint, verify_hash
        from mklang.engine import run

        machine = load_machine(path)
        steps = machine.budget
        suspended = run(machine, {}, {}, Original.llm(OUTPUT, finish=False), TIERS, suspendable=True)
        assert suspended.status == "suspended", suspended.error
        checkpoint = path.with_suffix(".checkpoint.json")
        save_checkpoint(checkpoint, machine.name, path, suspended.error, suspended.frames, None, step_budget=steps)

        def once() -> None:  # what `mklang resume` does before it prints the result
            saved = load_checkpoint(checkpoint)
            assert verify_hash(saved, path)
            longer = replace(load_machine(path), budget=steps + 1)
            done = run(longer, {}, {}, Original.llm("y", finish=True), TIERS, suspendable=True, resume=saved["frames"])
            assert done.status == "done", done.error

        return best_times(once)

    @staticmethod
    def fanout(path: Path, concurrency: int) -> dict:
        from mklang.loader import load_machine

        from mklang.engine import run

        machine = load_machine(path)
        started = counting_thread_starts()
        times = best_times(
            lambda: run(machine, {}, {}, Original.llm("yes", finish=True), TIERS, max_workers=concurrency)
        )
        return {**times, "threads": started[0] // REPEATS}

    @staticmethod
    def rss(path: Path) -> dict:
        from mklang.loader import load_machine

        from mklang.engine import run

        result = run(load_machine(path), {}, {}, Original.llm("ok", finish=False), TIERS)
        return {"steps": len(result.trace), "rss": peak_rss()}


class Ours:
    """Calls into this mklang."""

    @staticmethod
    def resume(path: Path) -> dict:
        from slow_paths import resume_to_done

        return best_times(resume_to_done(path, OUTPUT))

    @staticmethod
    def fanout(path: Path, concurrency: int) -> dict:
        from mklang.engine import run
        from mklang.providers.scripted import ScriptedProvider
        from mklang.syntax import load_file

        machine = load_file(path)
        started = counting_thread_starts()
        times = best_times(
            lambda: run(machine, provider=ScriptedProvider({"produce": ["yes"]}), concurrency=concurrency)
        )
        return {**times, "threads": started[0] // REPEATS}

    @staticmethod
    def rss(path: Path) -> dict:
        from mklang.engine import run
        from mklang.providers.scripted import ScriptedProvider
        from mklang.syntax import load_file

        result = run(load_file(path), provider=ScriptedProvider({"produce": ["ok"]}))
        return {"steps": len(result.trace), "rss": peak_rss()}

    @staticmethod
    def durability(store: Path, steps: int) -> dict:
        from scale import step_figures

        return step_figures(str(store), steps)

    @staticmethod
    def floor() -> dict:
        from scale import flush_floor

        return flush_floor()


SIDES = {"1x": Original, "ours": Ours}


# -- running a side -------------------------------------------------------------------


def cache() -> Path:
    return Path(os.environ.get("MKLANG_BENCH_CACHE") or Path.home() / ".cache" / "mklang-bench")


def original_venv() -> Path:
    """The venv of the original mklang 1.4.0, installed with pip on first use."""
    venv = cache() / "mklang-1.4.0"
    if not (venv / "bin" / "mklang").exists():
        print(f"installing {ORIGINAL} into {venv} (once)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        pip = [venv / "bin" / "python", "-m", "pip", "install", "--quiet", "--disable-pip-version-check", ORIGINAL]
        done = subprocess.run(pip, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"cannot install {ORIGINAL}:\n{done.stderr[-3000:]}")
    return venv


def side_env(side: str) -> dict[str, str]:
    """The original sees none of this checkout; ours runs the code first on PYTHONPATH (this checkout by default)."""
    from scale import env

    clean = env()
    if side == "1x":
        del clean["PYTHONPATH"]
    clean.pop("PYTHONDONTWRITEBYTECODE", None)  # byte-code caches on, as after an install
    return clean


def python(side: str) -> str:
    return sys.executable if side == "ours" else str(original_venv() / "bin" / "python")


def measure(side: str, figure: str, *args: object, env: dict[str, str] | None = None, script: str = __file__) -> dict:
    """The figures `SIDES[side].<figure>(*args)` of `script` (this one by default) returns, taken in a
    fresh process of that side (with `env` added to its environment)."""
    done = subprocess.run(
        [python(side), script, "--side", side, figure, *map(str, args)],
        env={**side_env(side), **(env or {})},
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"{side} {figure} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def ratio(ours: float, original: float) -> str:
    return f"{ours / original:5.2f}x"


def versus(ours: dict[str, float], original: dict[str, float], unit: str, scale: float) -> str:
    """Wall and CPU figures of both sides (seconds times `scale` is `unit`), and their ratios."""
    return "   ".join(
        f"{kind} ours {ours[kind] * scale:8.1f} {unit}, 1.4 {original[kind] * scale:8.1f} {unit}, "
        f"ratio {ratio(ours[kind], original[kind])}"
        for kind in ("wall", "cpu")
    )


def command(side: str) -> list[str]:
    """The command line of mklang. Run it in another folder than the checkout: `python -m`
    puts the current folder first on the import path, before PYTHONPATH."""
    if side == "ours":
        return [sys.executable, "-m", "mklang"]
    return [str(original_venv() / "bin" / "mklang")]


# -- the workloads --------------------------------------------------------------------


def resume(folder: Path, args: argparse.Namespace) -> None:
    """Resume -> done of a run suspended after 1k / 10k steps of 2 KB outputs (best of 3)."""
    ours_ms = {}
    for steps in (1_000, 10_000):
        path = folder / f"resume{steps}.yaml"
        path.write_text(loop_yaml(steps, judged=True))
        ours, original = measure("ours", "resume", path), measure("1x", "resume", path)
        ours_ms[steps] = ours["wall"] * 1e3
        print(f"  {steps:>6} steps: {versus(ours, original, 'ms', 1e3)}")
    print(f"  ours 10k / 1k: {ours_ms[10_000] / ours_ms[1_000]:.1f}x wall (target at 10k steps: ratio <= 1.0)")


def durability(folder: Path, args: argparse.Namespace) -> None:
    """A judged step of a durable run, MKLANG_DURABILITY=step: PostgreSQL against the file store."""
    from scale import reachable, stores

    if not reachable(5432):
        print("  PostgreSQL not reachable on 127.0.0.1:5432: skipped")
        return
    names, steps = ["none", *stores()], 300
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for repeat in range(DURABLE_REPEATS):  # interleaved, each run in a process of its own: load hits all alike
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            runs[name].append(measure("ours", "durability", name, steps, env={"MKLANG_DURABILITY": "step"}))
    print(
        f"  per step of a {steps}-step run, median (least-most) of {DURABLE_REPEATS} runs of each, interleaved; "
        "CPU of the mklang process; round trips, commits and flushed commits (fsyncs) that a step adds"
    )
    for name in names:
        wall, cpu = ([run[kind] * 1e3 for run in runs[name]] for kind in ("wall", "cpu"))
        counts, counted = runs[name][0], ""
        if "exchanges" in counts:
            counted = f"   {counts['exchanges']:4.2f} round trips, {counts['commits']:4.2f} commits "
            counted += f"({counts['flushed']:4.2f} flushed)"
        print(f"  {name:<10} wall {spread(wall, 'ms')}   CPU {spread(cpu, 'ms')}{counted}")
    for kind in ("wall", "cpu"):
        paired = [pg[kind] / file[kind] for pg, file in zip(runs["PostgreSQL"], runs["file"], strict=True)]
        print(f"  PostgreSQL / file, {kind:<4} {spread(paired, 'x', 2)} (target <= 1.3x)")
    floor = measure("ours", "floor")
    print(
        f"  floor, medians of 300 alternated: a file append + fsync {floor['fsync'] * 1e3:.3f} ms; a PostgreSQL "
        f"INSERT that waits for the flush {floor['flushed'] * 1e3:.3f} ms ({floor['flushed'] / floor['fsync']:.2f}x), "
        f"one that does not {floor['unflushed'] * 1e3:.3f} ms"
    )


def spread(values: list[float], unit: str, digits: int = 3) -> str:
    """The median of `values` and their least and most."""
    return f"{statistics.median(values):6.{digits}f} {unit} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def batch(folder: Path, args: argparse.Namespace) -> None:
    """`mklang batch` of N items x 3 steps at 100 ms a call: concurrency 32, 256, 256 over 2 processes (SQLite)."""
    from scale import batch_folder, children_cpu, figure, timed_batch
    from support.fakeserver import FakeServer, answer

    steps, latency = 3, 0.1
    print(f"  {args.items} items x {steps} steps, {latency * 1000:.0f} ms a call")
    walls, cpus = {}, {}
    with FakeServer() as server:
        server.handler = lambda request: answer("ok", input_tokens=10, output_tokens=2, delay=latency)
        batch_folder(folder, server.openai_url, args.items, steps)
        for concurrency, processes in ((32, 1), (256, 1), (256, 2)):
            cpu, served = children_cpu(), time.process_time()  # the model server runs in this process
            store = f"sqlite:///{folder}/runs{concurrency}x{processes}.db"
            options = ("--concurrency", str(concurrency), "--processes", str(processes))
            walls[concurrency, processes], _, summary = timed_batch(folder, store, *options)
            cpus[concurrency, processes] = (children_cpu() - cpu) / args.items  # the children of each process too
            served = time.process_time() - served
            assert summary["done"] == args.items, summary
            ideal = args.items * steps * latency / concurrency
            cpu = cpus[concurrency, processes] * args.items
            shown = f"concurrency {concurrency:>3}, {processes} process{'es' if processes > 1 else '  '}"
            print(f"  {shown}: {figure(walls[concurrency, processes], ideal, cpu, args.items)}")
            # The floor on 2 free cores: a process runs Python on one core at a time, and over 2
            # processes the model server's CPU (this process) shares the 2 cores with them.
            floor = max(ideal, cpu if processes == 1 else (cpu + served) / 2)
            print(
                f"  {'':<26}  model server CPU {served / (args.items * steps) * 1e3:.2f} ms/call; floor on 2 free "
                f"cores {floor:.1f} s = {floor / ideal:.2f} x ideal"
            )
    print(
        f"  wall 256 / 32: {walls[256, 1] / walls[32, 1]:.2f}x in 1 process, {walls[256, 2] / walls[32, 1]:.2f}x "
        f"in 2 (target <= 0.5x); CPU per run at most {max(cpus.values()) * 1e3:.1f} ms (target < 8 ms); "
        f"targets: 256 <= 2x ideal in 1 process, <= 1.5x in 2"
    )


def yaml(folder: Path, args: argparse.Namespace) -> None:
    """`mklang check` of a 5,000-state YAML machine (about 1 MB), as a process (one run each)."""
    from slow_paths import yaml_states

    path = folder / "big.yaml"
    path.write_text(yaml_states(5_000))
    times, refused = {}, []
    for side in ("ours", "1x"):
        before, began = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
        done = subprocess.run(
            [*command(side), "check", str(path)], env=side_env(side), cwd=folder, capture_output=True, text=True
        )
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
        times[side] = {"wall": time.perf_counter() - began, "cpu": cpu}
        if done.returncode != 0:
            refused.append(side)
            print(f"  {side}: refused ({done.returncode}): {(done.stderr or done.stdout).strip().splitlines()[0]}")
    if refused:
        print(
            "  "
            + ", ".join(f"{side} wall {times[side]['wall']:.2f} s, cpu {times[side]['cpu']:.2f} s" for side in times)
        )
    else:
        print(f"  {versus(times['ours'], times['1x'], 's', 1)}")


def fanout(folder: Path, args: argparse.Namespace) -> None:
    """A 2,000-branch fan-out, instant model, concurrency 8: time per branch (best of 3) and threads started."""
    branches, concurrency = 2_000, 8
    fan = folder / "fan.yaml"
    fan.write_text(loop_yaml(branches + 1, sample=branches, then="END"))
    ours, original = measure("ours", "fanout", fan, concurrency), measure("1x", "fanout", fan, concurrency)
    print(f"  per branch: {versus(ours, original, 'us', 1e6 / branches)}")
    print(f"  threads started: ours {ours['threads']}, 1.4 {original['threads']}")


def rss(folder: Path, args: argparse.Namespace) -> None:
    """Peak memory (RSS) of a process that runs 100,000 steps of a one-state loop."""
    path = folder / "rss.yaml"
    path.write_text(loop_yaml(100_000))
    peak = {}
    for side in ("ours", "1x"):
        figures = measure(side, "rss", path)
        peak[side] = figures["rss"] / 2**20
        print(f"  {side:<4}: {peak[side]:6.1f} MiB after {figures['steps']} steps")
    print(f"  ratio: {ratio(peak['ours'], peak['1x'])}")


def import_ms(importtime: str, module: str) -> float:
    """The cumulative import time of `module` in `python -X importtime` output (0 when not imported)."""
    found = re.search(rf"^import time:\s+\d+ \|\s+(\d+) \|\s*{re.escape(module)}$", importtime, re.M)
    return int(found.group(1)) / 1e3 if found else 0.0


def startup(folder: Path, args: argparse.Namespace) -> None:
    """`mklang run` of a one-state machine against an HTTP model server, as a process (median of 7)."""
    from support.fakeserver import FakeServer, answer

    machine = folder / "one.yaml"
    machine.write_text(loop_yaml(2, then="END"))
    with FakeServer() as server:
        server.handler = lambda request: answer("hi")
        (folder / "mklang.toml").write_text(
            '[tiers]\nfast = "local:m"\nbalanced = "local:m"\nreasoning = "local:m"\n\n'
            f'[providers.local]\nkind = "openai"\nbase_url = "{server.openai_url}"\n'
        )
        (folder / "runtime.yaml").write_text(
            "active: local\nproviders:\n  local:\n    protocol: openai_compat\n    api_key_env: LOCAL_API_KEY\n"
            f"    base_url: {server.openai_url}\n    tiers: {{fast: m, balanced: m, reasoning: m}}\n"
        )
        configs = {"ours": "mklang.toml", "1x": "runtime.yaml"}
        runs = {
            side: [*command(side), "run", str(machine), "--config", str(folder / config), "--format", "json"]
            for side, config in configs.items()
        }
        cpu_ms = {}
        for side, args_ in runs.items():
            env = {**side_env(side), "LOCAL_API_KEY": "k"}
            cpus = []
            for attempt in range(9):
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                done = subprocess.run(args_, env=env, cwd=folder, capture_output=True, text=True)
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                if done.returncode != 0:
                    raise SystemExit(f"{side} run over HTTP failed: {done.stderr[-2000:]}")
                if attempt >= 2:  # the first runs write the byte-code caches
                    cpus.append((after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime) * 1e3)
            cpu_ms[side] = statistics.median(cpus)
            print(f"  {side:<4}: {cpu_ms[side]:6.0f} ms CPU")
        print(f"  ratio: {ratio(cpu_ms['ours'], cpu_ms['1x'])}")
        imports = [
            subprocess.run([*runs["ours"][:1], "-X", "importtime", *runs["ours"][1:]], env=side_env("ours"),
                           cwd=folder, capture_output=True, text=True).stderr
            for _ in range(3)
        ]  # fmt: skip
        client = min(import_ms(text, "mklang.providers.http") for text in imports)
        httpx = min(import_ms(text, "httpx") for text in imports)
        print(f"  ours imports its HTTP client in {client:5.1f} ms, httpx in {httpx:5.1f} ms (target: not imported)")


WORKLOADS = {
    "resume": resume,
    "durability": durability,
    "batch": batch,
    "yaml": yaml,
    "fanout": fanout,
    "rss": rss,
    "startup": startup,
}


def main() -> None:
    if sys.argv[1:2] == ["--side"]:  # a side's own process: print its figures as JSON
        side, figure, *args = sys.argv[2:]
        typed = [int(arg) if arg.isdigit() else Path(arg) for arg in args]
        print(json.dumps(getattr(SIDES[side], figure)(*typed)))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workloads", nargs="*", metavar="WORKLOAD", help=f"any of {', '.join(WORKLOADS)} (default all)")
    parser.add_argument("--items", type=int, default=3_000, help="items of the batch (default 3000)")
    args = parser.parse_args()
    unknown = set(args.workloads) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workload {', '.join(sorted(unknown))}")
    print_load()
    original_venv()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.workloads or list(WORKLOADS):
            print(f"{name}: {WORKLOADS[name].__doc__}")
            folder = Path(tmp) / name
            folder.mkdir()
            WORKLOADS[name](folder, args)
    print_load()


if __name__ == "__main__":
    main()
