"""Helpers shared by the engine tests and the conformance runner.

Machines come from inline `.mk` text; calls need files on disk (a `call`
resolves beside the calling machine), so `write_machines` puts sources in a
directory and loads the first one. `Recorder` is the scripted provider of
SPEC section 5 that also remembers every request, so tests can read the
system and user messages and the judge batches the engine sent.
"""

from __future__ import annotations

import textwrap
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mklang.engine import run
from mklang.model import Machine
from mklang.providers.base import Usage, Verdict
from mklang.providers.scripted import ScriptedProvider
from mklang.syntax import load_file, parse


def mk(source: str) -> Machine:
    """Parse an inline machine (indentation of the test source removed)."""
    return parse(textwrap.dedent(source), "inline.mk")


def write_machines(directory: Path, *sources: str) -> Machine:
    """Write each source as `<machine name>.mk` in `directory`; load the first."""
    paths = []
    for source in sources:
        text = textwrap.dedent(source)
        path = directory / f"{parse(text, 'inline.mk').name}.mk"
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return load_file(paths[0])


@dataclass
class Produce:
    system: str
    user: str
    tier: str
    reason: bool


@dataclass
class Judge:
    conditions: list[str]
    output: Any
    reasoning: str | None
    context: dict[str, Any]
    tier: str


class Recorder(ScriptedProvider):
    """Scripted answers (`llm` as in a scenario), every request kept in order.

    `judge_usage` is charged per judge call (the scripted judge charges nothing).
    """

    def __init__(self, llm: dict[str, Any] | None = None, judge_usage: Usage | None = None):
        super().__init__(llm)
        self.judge_usage = judge_usage if judge_usage is not None else Usage()
        self.produced: list[Produce] = []
        self.judged: list[Judge] = []
        self._record = threading.Lock()

    def produce(self, system, user, tier, reason):
        with self._record:
            self.produced.append(Produce(system, user, tier, reason))
        return super().produce(system, user, tier, reason)

    def judge(self, conditions, output, reasoning, context, tier):
        with self._record:
            self.judged.append(Judge(list(conditions), output, reasoning, context, tier))
        return Verdict(super().judge(conditions, output, reasoning, context, tier).choice, self.judge_usage)


def run_mk(
    machine: Machine | str,
    context: dict[str, Any] | None = None,
    *,
    provider=None,
    llm: dict[str, Any] | None = None,
    **options,
):
    """Run a machine (or inline source) with a scripted provider unless one is given."""
    if isinstance(machine, str):
        machine = mk(machine)
    return run(machine, context, provider=provider or Recorder(llm), **options)


def steps(result) -> list[tuple[str, str, str | None]]:
    """The trace as (state, policy, to) triples: the route a run took."""
    return [(step["state"], step["policy"], step["to"]) for step in result.trace]
