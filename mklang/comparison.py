"""`mklang diff`: where two runs of a machine part ways, step by step.

A run is read as `mklang show` reads it (`inspection.run_document`: a checkpoint file or
`STORE-URI#RUN`, signed with this user's key, a dead run brought up to date from its journal), so
diff compares what the runs did, never what a foreign file claims. Steps are paired by their
position in the root trace; a call step's sub-trace is compared the same way, one level down, and
a difference inside it is named by its path (`4.sub_trace.2.output`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# What a step is compared on, in the order a reader looks for it: where it went, then what it made.
STEP_KEYS = (
    "state",
    "policy",
    "to",
    "gate",
    "gate_via",
    "judge_fallback",
    "judge_none",
    "decision_tainted",
    "untrusted_control_flow",
    "output",
    "branches",
    "reasoning",
    "usage",
)
OUTCOME_KEYS = ("status", "error", "at", "result", "usage")


def run_of(target: str | Path) -> dict[str, Any]:
    """The document of a run, refused when it is not one this user can read as its own."""
    from mklang.errors import CheckpointError
    from mklang.runs.inspection import run_document

    document = run_document(target)
    if document.get("status") == "failed":
        raise CheckpointError(f"{target}: {document.get('reason', 'cannot be read')}: nothing to compare")
    return document


def compare(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """The first step where two run documents differ (None when their traces agree), each differing
    step with its differing fields as [first, second], and how their outcomes differ."""
    steps = _steps("", first.get("trace", []), second.get("trace", []))
    outcome = {key: [first.get(key), second.get(key)] for key in OUTCOME_KEYS if first.get(key) != second.get(key)}
    return {
        "same": not steps and not outcome,
        "first_difference": steps[0]["step"] if steps else None,
        "steps": steps,
        "outcome": outcome,
    }


def _steps(prefix: str, first: list[dict[str, Any]], second: list[dict[str, Any]]) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    shared = min(len(first), len(second))
    for index, (one, other) in enumerate(zip(first[:shared], second[:shared], strict=True)):
        where = f"{prefix}{index + 1}"
        fields = {key: [one.get(key), other.get(key)] for key in STEP_KEYS if one.get(key) != other.get(key)}
        if fields:
            found.append({"step": where, "state": one.get("state"), "fields": fields})
        found += _steps(f"{where}.sub_trace.", one.get("sub_trace") or [], other.get("sub_trace") or [])
    for index in range(shared, max(len(first), len(second))):
        only, side = (first[index], "first") if index < len(first) else (second[index], "second")
        found.append({"step": f"{prefix}{index + 1}", "only_in": side, "state": only.get("state")})
    return found


def render(difference: dict[str, Any], first: str, second: str) -> str:
    """The comparison as text: the first difference, then every differing step and the outcomes."""
    if difference["same"]:
        return f"{first} and {second} took the same steps to the same outcome"
    lines = []
    if difference["first_difference"] is not None:
        lines.append(f"first difference at step {difference['first_difference']}")
    for step in difference["steps"]:
        if "only_in" in step:
            lines.append(f"step {step['step']} ({step['state']}): only in the {step['only_in']} run")
            continue
        lines.append(f"step {step['step']} ({step['state']}):")
        for key, (one, other) in step["fields"].items():
            lines.append(f"  {key}: {one_line(one)} | {one_line(other)}")
    for key, (one, other) in difference["outcome"].items():
        lines.append(f"{key}: {one_line(one)} | {one_line(other)}")
    return "\n".join(lines)


def one_line(value: Any, width: int = 100) -> str:
    """A value on one line, cut at `width`, with nothing a terminal would act on (a run's outputs
    are outside data)."""
    import json

    from mklang.terminal import printable

    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    text = printable(text.replace("\n", "\\n"))
    return text if len(text) <= width else text[: width - 1] + "…"
