"""Machines and comparisons shared by the tests of runs."""

from __future__ import annotations

import json
from typing import Any

# Two generative states in a row: a then b then END.
TWO_STATES = """
    machine m
    entry a
    budget 5
    state a {
      structure "s"
      prompt "p"
      output x
      otherwise -> b
    }
    state b {
      structure "s"
      prompt "p"
      output y
      otherwise -> END
    }
"""


def outcome(result: Any, fields: tuple[str, ...] = ("status", "result", "context", "trace", "usage")) -> dict[str, Any]:
    """The comparable, JSON-shaped part of a `RunResult`."""
    data = result.to_json()
    return json.loads(json.dumps({key: data[key] for key in fields}))
