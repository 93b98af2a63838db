"""The example and standard-library machines with their scenario scripts."""

from __future__ import annotations

from pathlib import Path

from support import ROOT

EXAMPLES = ROOT / "examples"
STDLIB = ROOT / "machines"
KILL_9 = EXAMPLES / "kill-9-resume"  # a scripted model that takes 60 ms per call
# A run that parks on a free-text human reply (`escalate -> decide ask ... reply_to approval.answer`,
# `--hitl`, answered with `resume --set`): the approval flow as it was before human decisions.
HITL = ROOT / "tests" / "support" / "hitl"

# The machine each example's `scenarios.yaml` drives; the other `.mk` files
# of a folder are the sub-machines it calls.
EXAMPLE_MAIN = {
    "approval": "approval.mk",
    "kill-9-resume": "report.mk",
    "map-reduce": "digest.mk",
    "nested": "brief.mk",
    "plan-execute": "research.mk",
    "repair-loop": "headline.mk",
    "self-consistency": "word_problem.mk",
    "triage": "triage.mk",
}


def scripted_machines() -> list[tuple[Path, Path]]:
    """Each scripted machine with its scenario script: the examples' main machines, then the standard library."""
    pairs = [(EXAMPLES / folder / main, EXAMPLES / folder / "scenarios.yaml") for folder, main in EXAMPLE_MAIN.items()]
    pairs += [(path, path.with_suffix(".scenarios.yaml")) for path in sorted(STDLIB.glob("*.mk"))]
    return pairs
