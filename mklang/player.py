"""The scenario player behind `mklang test`: a scenario run as `mklang run` and `mklang resume` would."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from mklang.engine import RunResult
from mklang.engine.events import EventSink, Named
from mklang.model import Machine
from mklang.runs import resume, start
from mklang.scenarios import Scenario, judged
from mklang.session import Host


@dataclass
class Part:
    """One run of a scenario (the first, or a resume) with its expectation and what differed."""

    label: str  # "run", "resumes[1]", ...
    result: RunResult
    problems: list[str]


def play(
    machine: Machine, scenario: Scenario, untrusted_flow: str | None = None, observer: EventSink | None = None
) -> list[Part]:
    """Run a scenario as `mklang run` and `mklang resume` would, and compare every part;
    `untrusted_flow` overrides the scenario's `run.on_untrusted_flow`; `observer` is told of
    the events of every part, each carrying the scenario's name.

    A durable scenario runs with a real checkpoint in a temporary folder; each
    of its `resumes` continues that checkpoint through `resume`,
    the code path of `mklang resume`, with a fresh scripted host whose state
    comes from the checkpoint.
    """
    observer = None if observer is None else Named(observer, scenario.name)
    if not scenario.durable:
        with Host.for_scenario(scenario) as host:
            result = start(machine, {}, host, untrusted_flow=untrusted_flow, observer=observer)
        return [Part("run", result, judged(scenario, scenario.expect, result))]
    with tempfile.TemporaryDirectory(prefix="mklang-test-") as folder:
        checkpoint = Path(folder) / "checkpoint.json"
        with Host.for_scenario(scenario) as host:
            result = start(machine, {}, host, checkpoint=checkpoint, untrusted_flow=untrusted_flow, observer=observer)
        parts = [Part("run", result, judged(scenario, scenario.expect, result))]
        for number, step in enumerate(scenario.resumes, 1):
            label = f"resumes[{number}]"
            if result.status != "suspended":
                parts.append(Part(label, result, [f"nothing to resume: the run ended {result.status}"]))
                break
            with Host.for_scenario(scenario) as host:
                result = resume(checkpoint, host, untrusted_flow=untrusted_flow, observer=observer, **step.continuing())
            parts.append(Part(label, result, judged(scenario, step.expect, result)))
    return parts
