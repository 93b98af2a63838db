"""kill -9 a run in the middle, resume it, and get the run that was never killed.

1. Run report.mk once without interruption (the reference).
2. Start the same run with `--checkpoint cp.json` in the background and
   SIGKILL it while its sections are being drafted.
3. `mklang show cp.json`: the checkpoint says the run was interrupted.
4. `mklang resume cp.json`: the run continues from its last durable state
   and answers the model calls that had completed from the journal.
5. Compare the resumed result with the reference and count the model
   calls each part paid for.

Usage: python examples/kill-9-resume/demo.py   (exit 0 when the results match)
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MACHINE = HERE / "report.mk"
SCRIPT = HERE / "scenarios.yaml"
SCENARIO = "slow-model"
MODEL_KINDS = ("produce", "judge")
# Kill once this many model calls are durable: the outline and its judge,
# plus the first two of the four drafted sections.
KILL_AFTER_CALLS = 4
COMPARED = ("status", "result", "context", "trace", "usage")


def mklang(*args: str) -> list[str]:
    return [sys.executable, "-m", "mklang", *args]


def show(command: list[str]) -> None:
    print("$ mklang " + " ".join(command[3:]), flush=True)


def run_json(*args: str) -> tuple[int, dict]:
    command = mklang(*args, "--format", "json")
    show(command)
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if not done.stdout.strip():
        sys.exit(f"demo: mklang printed no result (exit {done.returncode}): {done.stderr.strip()}")
    return done.returncode, json.loads(done.stdout)


def model_calls(output: dict) -> int:
    """The model calls a process paid for, from the `calls` field of its JSON output."""
    return sum(output.get("calls", {}).get(kind, 0) for kind in MODEL_KINDS)


def journaled_model_calls(checkpoint: Path) -> int:
    """Model calls whose answers reached the journal before the kill (completed and paid)."""
    journal = Path(f"{checkpoint}.journal")
    if not journal.exists():
        return 0
    count = 0
    for line in journal.read_bytes().split(b"\n")[:-1]:  # a torn last line is no call
        record = json.loads(line)
        count += record.get("k") == "call" and record.get("kind") in MODEL_KINDS
    return count


def kill_mid_run(checkpoint: Path) -> int:
    """Start the run in the background; SIGKILL it once KILL_AFTER_CALLS model calls are durable."""
    command = mklang(
        "run",
        str(MACHINE),
        "--script",
        str(SCRIPT),
        "--scenario",
        SCENARIO,
        "--checkpoint",
        str(checkpoint),
        "--format",
        "json",
    )
    show(command)
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while journaled_model_calls(checkpoint) < KILL_AFTER_CALLS:
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            sys.exit("demo: the run ended before it could be killed")
        time.sleep(0.002)
    process.send_signal(signal.SIGKILL)
    process.wait()
    print(f"   ... killed with SIGKILL (exit {process.returncode})")
    return journaled_model_calls(checkpoint)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="mklang-kill-9-") as folder:
        checkpoint = Path(folder) / "cp.json"

        print("1. The reference: one run, never interrupted.")
        code, reference = run_json("run", str(MACHINE), "--script", str(SCRIPT), "--scenario", SCENARIO)
        print(f"   exit {code}, {model_calls(reference)} model calls\n")

        print("2. The same run with a checkpoint, killed in the middle.")
        killed_calls = kill_mid_run(checkpoint)
        print()

        print("3. What the checkpoint says.")
        command = mklang("show", str(checkpoint), "--format", "text")
        show(command)
        print(subprocess.run(command, capture_output=True, text=True, timeout=60).stdout)

        print("4. Resume it.")
        code, resumed = run_json("resume", str(checkpoint))
        print(f"   exit {code}, {model_calls(resumed)} model calls\n")

        same = all(resumed[key] == reference[key] for key in COMPARED)
        print("5. Result")
        print(f"   resumed result equals the uninterrupted run's ({', '.join(COMPARED)}): {'yes' if same else 'NO'}")
        print(
            f"   model calls: uninterrupted run {model_calls(reference)}; "
            f"killed run {killed_calls} (completed before the kill); resumed run {model_calls(resumed)}; "
            f"killed + resumed = {killed_calls + model_calls(resumed)}"
        )
        return 0 if same and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
