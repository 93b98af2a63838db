"""Seeded SIGKILL rounds over the golden scenarios: kill, kill the resume, resume, compare.

Each round picks a golden scenario (the approval flow included, continued
with its human reply), runs it as a real `mklang run --checkpoint`
subprocess that SIGKILLs itself at a random crash point (`MKLANG_KILL_AT=*:N`,
mklang.faults), resumes it with a second random kill, then resumes it to the
end, and compares status, error, result, context, trace and usage with the
uninterrupted run. A resume without the reply must suspend again on the
question, having called no tool. Prints one line per failure and a summary;
exits 1 when any round fails.

    python bench/crash_rounds.py [--rounds 200] [--jobs 2] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from support.crashes import finished_outcome  # noqa: E402
from support.examples import scripted_machines  # noqa: E402

from mklang import faults  # noqa: E402
from mklang.runs import open_run, proceed, start  # noqa: E402
from mklang.scenarios import ScriptedHost, load_script  # noqa: E402
from mklang.session import Host  # noqa: E402
from mklang.syntax import load_file  # noqa: E402

COMPARED = ("status", "error", "at", "result", "context", "trace", "usage")
REPLIES = {"ask-then-publish": "approval.answer=yes"}


def _cases() -> list[tuple[Path, Path, Any]]:
    return [
        (machine, script, scenario)
        for machine, script in scripted_machines()
        for scenario in load_script(script)
        if scenario.run.get("budget") is None
    ]


def _host(scenario: Any) -> Host:
    scripted = ScriptedHost(scenario)
    return Host(scripted.provider, scripted.tools.functions(), scripted.hooks.functions(), state=scripted.state)


def _reference(machine: Path, scenario: Any, folder: Path) -> tuple[dict[str, Any], int]:
    """The uninterrupted outcome (after the reply, if any) and how many crash points it reaches."""
    seen = [0]
    faults.watch(lambda point: seen.__setitem__(0, seen[0] + 1))
    try:
        run = scenario.run
        result = start(
            load_file(machine),
            dict(scenario.input),
            _host(scenario),
            checkpoint=folder / "reference.json",
            max_tokens=run.get("max_tokens"),
            max_cost=run.get("max_cost"),
            concurrency=run.get("concurrency", 1),
            hitl=bool(run.get("hitl", False)),
        )
        if scenario.name in REPLIES:
            key, _, value = REPLIES[scenario.name].partition("=")
            result = proceed(open_run(folder / "reference.json"), _host(scenario), reply={key: value})
    finally:
        faults.disarm()
    data = json.loads(json.dumps(result.to_json()))
    return {key: data[key] for key in COMPARED}, seen[0]


def _mklang(args: list[str], kill: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MKLANG_", "OPENAI_", "ANTHROPIC_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    if kill:
        env["MKLANG_KILL_AT"] = kill
    command = [sys.executable, "-m", "mklang", *args, "--format", "json"]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


def one_round(seed: int, case: tuple[Path, Path, Any], reference: dict[str, Any], points: int, folder: Path) -> str:
    """Run one round; '' when it matched, else what went wrong."""
    machine, script, scenario = case
    rng = random.Random(seed)
    checkpoint = folder / f"round-{seed}.json"
    run = ["run", str(machine), "--script", str(script), "--scenario", scenario.name, "--checkpoint", str(checkpoint)]
    kills = [f"*:{rng.randint(1, points)}", f"*:{rng.randint(1, max(1, points // 2))}", None]
    reply = REPLIES.get(scenario.name)
    replied = False
    done = _mklang(run, kills.pop(0))
    while True:
        if done.returncode not in (-9, 0, 1, 3):
            return f"exit {done.returncode}: {done.stderr.strip()[-300:]}"
        if done.returncode == -9:
            if not checkpoint.exists():
                done = _mklang(run, None)  # killed before the first snapshot: start again
                continue
            finished = finished_outcome(checkpoint)
            if finished is not None:
                outcome = finished
                break
            done = _mklang(["resume", str(checkpoint)], kills.pop(0) if kills else None)
            continue
        data = json.loads(done.stdout)
        if "trace" not in data:
            return f"exit {done.returncode}: {done.stdout.strip()[-300:]} {done.stderr.strip()[-300:]}"
        if data["status"] == "suspended" and data["reason"] == "escalated" and reply:
            if "tool" in data.get("calls", {}) and not replied:
                return "a tool ran before the human replied"
            key = reply.partition("=")[0]
            if replied and data["context"].get(key.split(".")[0], {}).get(key.split(".")[1]) == "yes":
                return "suspended again after the reply was durable"
            replied = True
            done = _mklang(["resume", str(checkpoint), "--set", reply], kills.pop(0) if kills else None)
            continue
        outcome = {key: data[key] for key in COMPARED}
        break
    if outcome != reference:
        differing = sorted(key for key in COMPARED if outcome.get(key) != reference.get(key))
        return f"differs from the uninterrupted run in {differing}"
    return ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args()
    print(f"load average: {os.getloadavg()[0]:.2f}", flush=True)
    cases = _cases()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mklang-crash-rounds-") as temp:
        folder = Path(temp)
        references = [
            _reference(machine, scenario, Path(tempfile.mkdtemp(dir=folder))) for machine, _, scenario in cases
        ]
        seeds = range(options.seed, options.seed + options.rounds)
        picks = [random.Random(seed).randrange(len(cases)) for seed in seeds]

        def play(seed_pick: tuple[int, int]) -> tuple[int, str]:
            seed, pick = seed_pick
            reference, points = references[pick]
            return seed, one_round(seed, cases[pick], reference, points, folder)

        failures = 0
        with ThreadPoolExecutor(max_workers=options.jobs) as pool:
            for seed, problem in pool.map(play, zip(seeds, picks, strict=True)):
                if problem:
                    failures += 1
                    machine, _, scenario = cases[picks[seed - options.seed]]
                    print(f"round {seed} ({machine.stem}:{scenario.name}): {problem}", flush=True)
    scenarios = len({picks[i] for i in range(options.rounds)})
    print(
        f"{options.rounds} rounds over {scenarios} golden scenarios: {options.rounds - failures} resumed to the "
        f"uninterrupted run, {failures} failed ({time.monotonic() - started:.0f} s)"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
