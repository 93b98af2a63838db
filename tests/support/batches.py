"""A two-step machine whose answers name their item, and the JSONL inputs and results of its batches."""

from __future__ import annotations

import json
from pathlib import Path

from support.fakeserver import answer

MACHINE = """\
mklang 0.4
machine twostep
entry one
budget 10

state one {
  structure "One word."
  prompt "first {{topic}}"
  output a
  otherwise -> two
}

state two {
  structure "One word."
  prompt "second {{topic}}"
  output b
  otherwise -> END
}
"""
CALLS = 2  # model calls of one run


def reply(request):
    """The answer names the item, so results can be compared run by run."""
    topic = request.user.split("t-")[-1].split("<")[0].split()[0]
    return answer(f"answer {topic}", input_tokens=10, output_tokens=5, delay=0.02)


def write_items(folder: Path, count: int) -> Path:
    """`count` inputs of MACHINE in `folder/items.jsonl`."""
    path = folder / "items.jsonl"
    path.write_text("".join(json.dumps({"id": f"item-{n}", "topic": f"t-{n}"}) + "\n" for n in range(count)))
    return path


def results(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]
