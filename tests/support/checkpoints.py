"""Checkpoint records written by hand, as a test needs them."""

from __future__ import annotations

from typing import Any


def frame_record(machine: str, state: str, steps: int, budget: int, **fields: Any) -> dict[str, Any]:
    """A frame as an envelope records it: at `state` of `machine`, after `steps` of `budget`."""
    return {
        "machine": machine,
        "path": None,
        "state": state,
        "context": {},
        "tainted": [],
        "steps": steps,
        "budget": budget,
        "usage": {"input_tokens": 0, "output_tokens": 0, "cost_usd": 0.0},
        "feedback": None,
        "repair_left": [],
        "visits": {},
        "trace": [],
        "last_output": None,
        **fields,
    }
