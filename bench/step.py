"""The cost of a step beside mklang 1.4, and of what a step adds when observed or durable; prints ratios.

    python bench/step.py [step events otel journal listing]

1. `step`: a plain (`otherwise`) and a judged step of a one-state loop with an
   instant model (one object answers every call on both sides, as in
   `vs_1x.py`): in process, 10,000 steps, best of 3 (wall and CPU); and as a
   whole process, the marginal CPU of a step: (CPU of a process running
   12,000 steps - one running 2,000) / 10,000, medians of 3 (targets: plain
   <= 0.6x, judged <= 0.5x the original's).
2. `events`: what `--events FILE` adds to a step (its JSON Lines sink, in
   process), against the floor: `json.dumps` + write + flush of the same
   lines (target <= 1.5x the floor).
3. `otel`: what OpenTelemetry export adds to a step (spans and metrics over
   OTLP/HTTP to a collector in another process that answers 200), against a
   bare step (target <= 2x), and the floor: the SDK alone making the same
   spans and histogram records, exported the same way.
4. `journal`: a judged durable step in the file store, `MKLANG_DURABILITY`
   `call` and `step` (300-step runs, each in a process of its own, medians of
   5 interleaved), against its floor: the bare step plus the syncs the
   durability needs (one a call, or one a step), each an `fdatasync` of a
   journal line written into a preallocated file, as a WAL is (target <=
   1.3x); the syncs a step makes.
5. `listing`: `mklang runs --limit 50` of a SQLite store of 10,000 runs
   against `mklang --version`, as processes, CPU medians of 9 (target <= 2x).

Each figure is taken in a process of its own (`vs_1x.measure`); the load
average is printed first and last.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from measure import print_load
from vs_1x import ROOT, TIERS, best_times, command, loop_yaml, measure, original_venv, side_env, spread

STEPS = 10_000
PROCESS_STEPS = (2_000, 12_000)
OBSERVED_STEPS = 3_000
DURABLE_STEPS, DURABLE_REPEATS = 300, 5
COLLECTOR = """
import http.server, sys
class Answer(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *_):
        pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


class Original:
    """Runs of the original mklang 1.4 (imported only in its own venv)."""

    @staticmethod
    def steps(path: Path) -> dict:
        from mklang.loader import load_machine
        from vs_1x import Original as Side

        from mklang.engine import run

        machine = load_machine(path)

        def once() -> None:
            result = run(machine, {}, {}, Side.llm("ok", finish=False), TIERS)
            assert len(result.trace) == machine.budget, result.error

        return best_times(once)


class Ours:
    """Runs of this mklang."""

    @staticmethod
    def provider():
        from mklang.providers.base import NONE, Produced, Usage, Verdict

        class Fixed:
            """Answers every call at once: "ok", and the judge picks none (`otherwise`)."""

            def produce(self, system, user, tier, reason):
                return Produced("ok", None, Usage(10, 2))

            def judge(self, conditions, output, reasoning, context, tier):
                return Verdict(NONE, Usage(10, 1))

        return Fixed()

    @staticmethod
    def steps(path: Path, observed: str = "none") -> dict:
        """Best times of runs of `path`; `observed`: none, events (a JSON Lines sink) or otel."""
        from mklang.engine import run
        from mklang.syntax import load_file
        from mklang.telemetry import traced

        machine = load_file(path)
        folder = Path(tempfile.mkdtemp())
        lines = folder / "events.jsonl"

        def once() -> None:
            if observed == "events":
                from mklang.cli.observe import JsonLines

                lines.unlink(missing_ok=True)
                with open(lines, "a", encoding="utf-8") as stream:
                    result = run(machine, provider=Ours.provider(), observer=JsonLines(stream, False))
            else:
                with traced(None, None) as (observer, _):
                    result = run(machine, provider=Ours.provider(), observer=observer)
            assert len(result.trace) == machine.budget, result.error

        figures = best_times(once)
        if observed == "events":
            figures["lines"] = lines.read_text().count("\n") / machine.budget
            figures["floor"] = Ours.write_floor(lines, folder / "again.jsonl")
        return figures

    @staticmethod
    def span_floor(steps: int, judged: int) -> dict:
        """CPU seconds of the OpenTelemetry SDK alone making what a run's spans and metrics are made
        of, `steps` times: a state span holding a chat span a call (one call, two when `judged`),
        with their attributes, and three histogram records a call; exported as a run's are."""
        from opentelemetry import trace

        from mklang.telemetry.otel import exporter

        made = exporter()
        root = made.tracer.start_span("invoke_workflow loop")
        state_attributes = {"mklang.machine": "loop", "mklang.state": "write", "mklang.steps": 1}
        chat = {"gen_ai.operation.name": "chat", "mklang.call": "produce", "mklang.tier": "balanced"}

        def once() -> None:
            for step in range(steps):
                state = made.tracer.start_span("state write", context=trace.set_span_in_context(root))
                state.set_attributes({**state_attributes, "mklang.step": step, "mklang.step_budget": steps})
                for _ in range(1 + judged):
                    tokens = {"gen_ai.usage.input_tokens": 10, "gen_ai.usage.output_tokens": 2}
                    made.tracer.start_span(
                        "chat", context=trace.set_span_in_context(state), attributes={**chat, **tokens}
                    ).end()
                    for kind, count in (("input", 10), ("output", 2)):
                        made.tokens.record(count, {"gen_ai.operation.name": "chat", "gen_ai.token.type": kind})
                    made.duration.record(0.001, {"gen_ai.operation.name": "chat"})
                state.set_attributes({"mklang.gate.index": 0, "mklang.gate.policy": "ok", "mklang.gate.to": "write"})
                state.end()
            made.flush()

        return best_times(once)

    @staticmethod
    def write_floor(lines: Path, again: Path) -> float:
        """CPU seconds of `json.dumps` + write + flush of the lines of `lines`, best of 3."""
        documents = [json.loads(line) for line in lines.read_text().splitlines()]
        best = float("inf")
        for _ in range(3):
            with open(again, "w", encoding="utf-8") as stream:
                began = time.process_time()
                for document in documents:
                    stream.write(json.dumps(document, ensure_ascii=False) + "\n")
                    stream.flush()
                best = min(best, time.process_time() - began)
        return best

    @staticmethod
    def durable(store: Path, steps: int) -> dict:
        """A durable run's step figures, and the sync floor taken in this process just after it
        (the disk is shared: its latency moves with other processes' writes)."""
        from scale import step_figures

        return {**step_figures(str(store), steps), "floor": Ours.sync_floor(500, 100)["preallocated"]}

    @staticmethod
    def sync_floor(line_bytes: int, samples: int = 300) -> dict:
        """Median seconds of a line of `line_bytes` written into a preallocated file and fdatasynced
        (what a WAL costs), and of one appended to a growing file and fsynced."""
        line = b"x" * (line_bytes - 1) + b"\n"
        times: dict[str, list[float]] = {"preallocated": [], "growing": []}
        with tempfile.TemporaryFile() as grown, tempfile.TemporaryFile() as kept:
            kept.write(b"\0" * (len(line) * (samples + 1)))
            kept.flush()
            os.fsync(kept.fileno())
            for sample in range(samples):
                began = time.perf_counter()
                os.pwrite(kept.fileno(), line, sample * len(line))
                os.fdatasync(kept.fileno())
                times["preallocated"].append(time.perf_counter() - began)
                began = time.perf_counter()
                grown.write(line)
                grown.flush()
                os.fsync(grown.fileno())
                times["growing"].append(time.perf_counter() - began)
        return {name: statistics.median(values) for name, values in times.items()}


SIDES = {"1x": Original, "ours": Ours}


def side(name: str, figure: str, *args: object, env: dict[str, str] | None = None) -> dict:
    return measure(name, figure, *args, env=env, script=__file__)


def process_cpu(name: str, path: Path) -> float:
    """CPU seconds of a whole process of side `name` running the machine at `path` once."""
    args = [sys.executable if name == "ours" else str(original_venv() / "bin" / "python"), __file__]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([*args, "--once", name, str(path)], env=side_env(name), capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{name} run failed:\n{done.stderr[-3000:]}")
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def once(name: str, path: str) -> None:
    """One run of `path` by side `name`, then exit: what `process_cpu` measures."""
    if name == "ours":
        from mklang.engine import run
        from mklang.syntax import load_file

        machine = load_file(path)
        result = run(machine, provider=Ours.provider())
    else:
        from mklang.loader import load_machine
        from vs_1x import Original as Side

        from mklang.engine import run

        machine = load_machine(Path(path))
        result = run(machine, {}, {}, Side.llm("ok", finish=False), TIERS)
    assert len(result.trace) == machine.budget, result.error


def ratio_line(ours: float, original: float, target: float) -> str:
    shown = f"ours {ours * 1e6:6.1f} us, 1.4 {original * 1e6:6.1f} us"
    return f"{shown}, ratio {ours / original:4.2f}x (target <= {target}x)"


def step(folder: Path) -> None:
    """A plain and a judged step, in process and as a whole process, beside mklang 1.4."""
    for kind, judged, target in (("plain", False, 0.6), ("judged", True, 0.5)):
        path = folder / f"{kind}.yaml"
        path.write_text(loop_yaml(STEPS, judged=judged))
        ours, original = side("ours", "steps", path), side("1x", "steps", path)
        print(f"  {kind:<6} in process, CPU  {ratio_line(ours['cpu'] / STEPS, original['cpu'] / STEPS, target)}")
        print(f"  {kind:<6} in process, wall {ratio_line(ours['wall'] / STEPS, original['wall'] / STEPS, target)}")
        marginal = {}
        for name in ("ours", "1x"):
            cpus = {}
            for steps in PROCESS_STEPS:
                sized = folder / f"{kind}{steps}.yaml"
                sized.write_text(loop_yaml(steps, judged=judged))
                cpus[steps] = statistics.median(process_cpu(name, sized) for _ in range(3))
            short, long = PROCESS_STEPS
            marginal[name] = (cpus[long] - cpus[short]) / (long - short)
        print(f"  {kind:<6} whole process, CPU {ratio_line(marginal['ours'], marginal['1x'], target)}")


def events(folder: Path) -> None:
    """What `--events FILE` adds to a step, against json.dumps + write + flush of the same lines."""
    for kind, judged in (("plain", False), ("judged", True)):
        path = folder / f"{kind}.yaml"
        path.write_text(loop_yaml(OBSERVED_STEPS, judged=judged))
        bare, seen = side("ours", "steps", path), side("ours", "steps", path, "events")
        added, floor = (seen["cpu"] - bare["cpu"]) / OBSERVED_STEPS, seen["floor"] / OBSERVED_STEPS
        print(
            f"  {kind:<6} bare {bare['cpu'] / OBSERVED_STEPS * 1e6:6.1f} us CPU, --events adds {added * 1e6:6.1f} us "
            f"for {seen['lines']:.1f} lines; floor {floor * 1e6:5.1f} us: {added / floor:4.2f}x (target <= 1.5x)"
        )


def otel(folder: Path) -> None:
    """What OpenTelemetry export adds to a step, against a bare step."""
    collector = subprocess.Popen([sys.executable, "-c", COLLECTOR], stdout=subprocess.PIPE, text=True)
    try:
        port = int(collector.stdout.readline())  # type: ignore[union-attr]
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
            "OTEL_BSP_MAX_QUEUE_SIZE": "1000000",  # every span exported, none dropped
        }
        for kind, judged in (("plain", False), ("judged", True)):
            path = folder / f"{kind}.yaml"
            path.write_text(loop_yaml(OBSERVED_STEPS, judged=judged))
            bare, seen = side("ours", "steps", path), side("ours", "steps", path, "otel", env=env)
            floor = side("ours", "span_floor", OBSERVED_STEPS, int(judged), env=env)["cpu"] / OBSERVED_STEPS
            bare_cpu = bare["cpu"] / OBSERVED_STEPS
            added = seen["cpu"] / OBSERVED_STEPS - bare_cpu
            print(
                f"  {kind:<6} bare {bare_cpu * 1e6:6.1f} us CPU, export adds {added * 1e6:6.1f} us: "
                f"{added / bare_cpu:4.2f}x a bare step (target <= 2x); the SDK alone making the same spans "
                f"and records: {floor * 1e6:6.1f} us ({floor / bare_cpu:4.2f}x a bare step)"
            )
    finally:
        collector.kill()
        collector.wait()


def journal(folder: Path) -> None:
    """A judged durable step in the file store against the bare step plus the syncs it needs."""
    names = [("none", "call"), ("file", "call"), ("file", "step")]
    runs: dict[tuple[str, str], list[dict]] = {name: [] for name in names}
    for repeat in range(DURABLE_REPEATS):  # interleaved: the machine's load falls on all alike
        for store, durability in names[repeat % 3 :] + names[: repeat % 3]:
            figures = side("ours", "durable", store, DURABLE_STEPS, env={"MKLANG_DURABILITY": durability})
            runs[store, durability].append(figures)
    bare = statistics.median(run["wall"] for run in runs["none", "call"])
    floor = side("ours", "sync_floor", 500)
    print(
        f"  a 500-byte line fdatasynced in a preallocated file {floor['preallocated'] * 1e3:.3f} ms, appended to a "
        f"growing file and fsynced {floor['growing'] * 1e3:.3f} ms (medians of 300, alternated); "
        f"bare judged step {bare * 1e3:.3f} ms wall"
    )
    for durability, syncs in (("call", 2), ("step", 1)):  # a judged step makes two calls
        kept = runs["file", durability]
        wall, cpu = [run["wall"] * 1e3 for run in kept], [run["cpu"] * 1e3 for run in kept]
        ratios = [run["wall"] / (bare + syncs * run["floor"]) for run in kept]  # each against its own floor
        print(
            f"  file, {durability}: wall {spread(wall, 'ms')}, CPU {spread(cpu, 'ms')}, "
            f"{kept[0]['commits']:4.2f} syncs a step; against the bare step + {syncs} preallocated fdatasync "
            f"taken just after each run: {spread(ratios, 'x', 2)} (target <= 1.3x)"
        )


def listing(folder: Path) -> None:
    """`mklang runs --limit 50` of a 10,000-run SQLite store against `mklang --version`."""
    sys.path.insert(0, str(ROOT / "tests"))
    os.environ["XDG_STATE_HOME"] = str(folder)
    from console import fill

    uri = fill(folder, 10_000)
    cpus = {}
    typer = [sys.executable, "-c", "import typer"]  # every command line but --version parses with it (ADR 0035)
    for name, args in (("version", [*command("ours"), "--version"]), ("runs", [*command("ours"), "runs", "--store",
                       uri, "--limit", "50"]), ("typer", typer)):  # fmt: skip
        times = []
        for attempt in range(11):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            done = subprocess.run(args, env=side_env("ours"), cwd=folder, capture_output=True)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            assert done.returncode == 0, done.stderr
            if attempt >= 2:  # the first runs write the byte-code caches
                times.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
        cpus[name] = statistics.median(times)
    print(
        f"  mklang runs --limit 50: {cpus['runs'] * 1e3:5.0f} ms CPU, "
        f"mklang --version {cpus['version'] * 1e3:5.0f} ms: "
        f"{cpus['runs'] / cpus['version']:4.2f}x (target <= 2x); importing typer alone {cpus['typer'] * 1e3:5.0f} ms "
        f"({cpus['typer'] / cpus['version']:4.2f}x)"
    )


WORKLOADS = {"step": step, "events": events, "otel": otel, "journal": journal, "listing": listing}


def main() -> None:
    if sys.argv[1:2] == ["--side"]:  # a side's own process: print its figures as JSON
        name, figure, *args = sys.argv[2:]
        typed = [int(arg) if arg.isdigit() else Path(arg) if "/" in arg else arg for arg in args]
        print(json.dumps(getattr(SIDES[name], figure)(*typed)))
        return
    if sys.argv[1:2] == ["--once"]:
        once(*sys.argv[2:4])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workloads", nargs="*", metavar="WORKLOAD", help=f"any of {', '.join(WORKLOADS)} (default all)")
    args = parser.parse_args()
    unknown = set(args.workloads) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workload {', '.join(sorted(unknown))}")
    print_load()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.workloads or list(WORKLOADS):
            print(f"{name}: {WORKLOADS[name].__doc__}", flush=True)
            folder = Path(tmp) / name
            folder.mkdir()
            WORKLOADS[name](folder)
    print_load()


if __name__ == "__main__":
    main()
