"""A two-step machine whose answers name their item, and the JSONL inputs and results of its batches."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.commands import model_config
from support.fakeserver import FakeServer, answer

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


# The fixtures of the batch tests: a module takes them with
# `from support.batches import batch_project, batch_server


@pytest.fixture(name="server")
def batch_server() -> Iterator[FakeServer]:
    """The fake model server answering each item as `reply` does (in place of the suite's `server`)."""
    with FakeServer() as running:
        running.handler = reply
        yield running


@pytest.fixture(name="project")
def batch_project(tmp_path: Path, server: FakeServer) -> Path:
    """A folder with MACHINE as twostep.mk and a config whose model is the fake server."""
    (tmp_path / "twostep.mk").write_text(MACHINE, encoding="utf-8")
    model_config(server.openai_url, tmp_path / "mklang.toml")
    return tmp_path
