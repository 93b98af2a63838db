"""Checkpoint records written by hand, as a test needs them."""

from __future__ import annotations

from typing import Any

from mklang.checkpoint.envelope import Envelope, MachineRef


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


def blank_envelope(**fields: Any) -> Envelope:
    """A running envelope of machine `m`, run `r`, without frames; `fields` change what they name."""
    return Envelope(
        **{
            "mklang_version": "test",
            "run_id": "r",
            "status": "running",
            "machine": MachineRef(name="m", path=None, sha256=None),
            "frames": [],
            **fields,
        }
    )
