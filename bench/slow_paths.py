"""Six paths once slow, each as per-step (or per-state) figures and a growth ratio.

    python bench/slow_paths.py [accumulate resume yaml parse durability startup]

Every figure is CPU time of this process (or of the child process) per unit
of work, the best of a few runs, so a loaded machine changes it little; the
load average is printed first. A ratio near 1.0 between the small and the
large size means the cost is linear (flat per step); 4x more work at a
quadratic cost shows as a ratio near 4.
"""

from __future__ import annotations

import gc
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from measure import print_load

REPEATS = 3


def cpu(work: Callable[[], object], repeats: int = REPEATS) -> float:
    """The least CPU seconds `work` took in this process over `repeats` runs."""
    best = float("inf")
    for _ in range(repeats):
        gc.collect()
        began = time.process_time()
        work()
        best = min(best, time.process_time() - began)
    return best


def loop_machine(steps: int, gate: str, accumulate: bool) -> str:
    return (
        f"machine grow\nentry write\nbudget {steps}\nstate write {{\n"
        f'  structure "a line"\n  prompt "write"\n  output lines\n'
        f"{'  accumulate' if accumulate else ''}\n  {gate}\n}}\n"
    )


def accumulate() -> None:
    """A judged gate on an `accumulate` output: engine time per step at 1k and 4k steps."""
    from mklang.engine import run
    from mklang.providers.scripted import ScriptedProvider
    from mklang.syntax import parse

    per_step = {}
    for steps in (1_000, 4_000):
        machine = parse(loop_machine(steps, 'when "more" -> write', accumulate=True), "grow.mk")

        def once(machine=machine) -> None:
            result = run(machine, provider=ScriptedProvider({"produce": ["a line of text"], "judge": [0]}))
            assert result.error == "budget-exhausted"

        per_step[steps] = cpu(once) / steps * 1e6
        print(f"  accumulate + judged gate, {steps:>5} steps: {per_step[steps]:7.1f} us/step")
    print(f"  ratio 4k / 1k: {per_step[4_000] / per_step[1_000]:.2f}x (flat = 1.0)")


def resume_to_done(path: Path, output: str) -> Callable[[], None]:
    """Suspends a run of the machine at `path` (its step budget spent, every output
    `output`) and returns a function that resumes it to done, one more step: each
    call starts again from the same suspended checkpoint. The machine's first gate
    is a judged one that leads to END, its last `otherwise` leads back."""
    from mklang.providers.scripted import ScriptedProvider
    from mklang.runs import open_run, proceed, start
    from mklang.session import Host
    from mklang.syntax import load_file

    machine = load_file(path)
    checkpoint = path.with_suffix(".checkpoint.json")
    running = ScriptedProvider({"produce": [output], "judge": ["none"]})
    suspended = start(machine, {}, Host(running), checkpoint=checkpoint)
    assert suspended.status == "suspended", suspended.error
    saved, steps = checkpoint.read_bytes(), len(suspended.trace)

    def once() -> None:
        checkpoint.write_bytes(saved)
        finishing = ScriptedProvider({"produce": ["y"], "judge": [0]})
        # The same suspended generation each time: a rollback, allowed as for `resume --allow-rollback`.
        done = proceed(open_run(checkpoint, allow_rollback=True), Host(finishing), budget=steps + 1)
        assert done.status == "done", done.error

    return once


def resume() -> None:
    """Resume of a suspended run that then finishes (one step) after 1k and 10k steps of trace.

    Its cost should not grow with the trace already written (ADR 0040): the
    ratio of the two resumes is near 1.0 when it does not, near 10 when it
    grows linearly with the trace.
    """
    total = {}
    with tempfile.TemporaryDirectory() as folder:
        for steps in (1_000, 10_000):
            path = Path(folder) / f"m{steps}.mk"
            path.write_text(loop_machine(steps, 'when "finished" -> END\n  otherwise -> write', accumulate=False))
            total[steps] = cpu(resume_to_done(path, "x" * 100)) * 1e3
            print(
                f"  resume -> done, {steps:>6} steps of trace: {total[steps]:6.1f} ms "
                f"({total[steps] / steps * 1e3:6.2f} us per trace step)"
            )
    print(f"  ratio 10k / 1k: {total[10_000] / total[1_000]:.2f}x (flat = 1.0; growing with the trace = 10)")


def yaml_states(states: int) -> str:
    """A chain of `states` generative states in mklang 1.x's YAML layout (1.x checks it too)."""
    lines = [f'mklang: "0.4"\nmachine: y{states}\nentry: s0\nbudget: {states * 2}\ncontext:\n  topic: x\nstates:']
    for i in range(states):
        target = f"s{i + 1}" if i + 1 < states else "END"
        lines.append(
            f"  s{i}:\n    structure: One paragraph.\n    prompt: Write step {i} about {{{{topic}}}}.\n"
            f"    output: out{i}\n    gates:\n      - when: the text is done\n        then: ok\n        to: {target}\n"
            f"      - when: otherwise\n        then: ok\n        to: {target}"
        )
    return "\n".join(lines) + "\n"


def yaml() -> None:
    """Loading a 500-state YAML machine: time per state, against composing it with PyYAML's pure-Python loader."""
    import yaml as pyyaml

    from mklang.syntax import load_file

    text = yaml_states(500)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "m.yaml"
        path.write_text(text)
        ours = cpu(lambda: load_file(path)) / 500 * 1e6
    pure = cpu(lambda: pyyaml.compose(text, Loader=pyyaml.SafeLoader)) / 500 * 1e6
    print(f"  YAML machine load, 500 states: {ours:7.1f} us/state (pure-Python compose alone {pure:7.1f} us/state)")
    print(f"  ratio load / pure-Python compose: {ours / pure:.2f}x")


def parse() -> None:
    """`.mk` parse + check, with comments: time per state at 500 and 5,000 states, and per KB of a 5 MB file."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cli_startup import machine_text

    from mklang.checker import check
    from mklang.syntax import parse as parse_mk

    def commented(text: str) -> str:
        """Comments above every state, inside it and at the end of a line, as authors write them."""
        return text.replace("state s", "# the next step\nstate s").replace(
            "  tier fast\n", "  tier fast  # cheap\n  # what it writes\n"
        )

    per_state = {}
    for states in (500, 5_000):
        text = commented(machine_text(states))
        per_state[states] = cpu(lambda text=text: check(parse_mk(text, "m.mk")), repeats=2) / states * 1e6
        print(f"  parse + check, {states:>5} states: {per_state[states]:7.1f} us/state")
    print(f"  ratio 5k / 500: {per_state[5_000] / per_state[500]:.2f}x (flat = 1.0)")
    big = commented(machine_text(5_000))
    while len(big) < 5_000_000:
        big += big[big.index("state s") :].replace("state s", "state t" + str(len(big)) + "_")
    kb = len(big) / 1024
    seconds = cpu(lambda: check(parse_mk(big, "big.mk")), repeats=1)
    print(f"  parse + check, {kb / 1024:.1f} MB file: {seconds / kb * 1e3:7.2f} ms per KB ({seconds:.1f} s)")


def durability() -> None:
    """The checkpoint's cost per step of a durable run, per-call fsync against one group commit per step."""
    from mklang.engine import run
    from mklang.providers.scripted import ScriptedProvider
    from mklang.runs import start
    from mklang.session import Host
    from mklang.syntax import load_file

    steps = 1_000
    with tempfile.TemporaryDirectory(dir=".") as folder:
        path = Path(folder) / "d.mk"
        path.write_text(loop_machine(steps, 'when "more" -> write', accumulate=False))
        machine = load_file(path)
        provider = lambda: ScriptedProvider({"produce": ["x" * 200], "judge": [0]})  # noqa: E731
        plain = min(_wall(lambda: run(machine, provider=provider())) for _ in range(REPEATS))
        for mode in ("call", "step"):
            os.environ["MKLANG_DURABILITY"] = mode
            durable = min(
                _wall(lambda cp=Path(folder) / f"{mode}{i}.json": start(machine, {}, Host(provider()), checkpoint=cp))
                for i in range(REPEATS)
            )
            print(f"  durability {mode:<4}: {(durable - plain) / steps * 1e6:7.1f} us/step of checkpoint work (wall)")
        os.environ.pop("MKLANG_DURABILITY")


def _wall(work: Callable[[], object]) -> float:
    """Wall time: fsync waits for the disk, which CPU time does not see."""
    began = time.perf_counter()
    work()
    return time.perf_counter() - began


def startup() -> None:
    """`mklang run` of a one-state scripted machine, as a whole process, against the 0.25 s target."""
    with tempfile.TemporaryDirectory() as folder:
        machine = Path(folder) / "one.mk"
        machine.write_text('machine one\nentry a\nbudget 2\nstate a {\n  structure "a word"\n  prompt "say hi"\n'
                           "  output n\n  otherwise -> END\n}\n")  # fmt: skip
        script = Path(folder) / "s.yaml"
        script.write_text("scenarios:\n  - name: one\n    llm: {produce: [hi]}\n    expect: {status: done}\n")
        args = [sys.executable, "-m", "mklang", "run", str(machine), "--script", str(script), "--format", "json"]
        # Bytecode caching on, as after a normal install; warm-up runs write the caches.
        env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
        for _ in range(2):
            subprocess.run(args, env=env, capture_output=True, check=True)
        bare = [sys.executable, "-c", "pass"]
        walls, cpus, bares = [], [], []
        for _ in range(7):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            subprocess.run(bare, env=env, check=True)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            bares.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            began = time.perf_counter()
            done = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
            walls.append(time.perf_counter() - began)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
            assert done.returncode == 0, done.stderr
        cpu_s, wall_s, bare_s = (sorted(times)[len(times) // 2] for times in (cpus, walls, bares))
        print(f"  mklang run, one scripted state: {cpu_s * 1000:6.0f} ms cpu, {wall_s * 1000:6.0f} ms wall (median)")
        print(f"  ratio cpu / 250 ms target: {cpu_s / 0.25:.2f}x (under 1.0 meets it)")
        print(f"  ratio to a bare `python -c pass` ({bare_s * 1000:.0f} ms cpu): {cpu_s / bare_s:.1f}x")


WORKLOADS = {
    "accumulate": accumulate,
    "resume": resume,
    "yaml": yaml,
    "parse": parse,
    "durability": durability,
    "startup": startup,
}


def main() -> None:
    chosen = sys.argv[1:] or list(WORKLOADS)
    print_load()
    print("CPU time unless marked")
    for name in chosen:
        print(f"{name}: {WORKLOADS[name].__doc__.splitlines()[0]}")
        WORKLOADS[name]()


if __name__ == "__main__":
    main()
