"""Every crash point of every golden scenario, in process: the run resumes to the same run.

A run is crashed at each point it reaches (mklang.faults: every journal
line, every envelope and journal-generation write before and after its
rename, every trace segment written before the envelope naming it, before
every model and tool call and after it returns), at every
nesting level, and resumed as `mklang resume cp.json` would; a second
crash is injected into that resume, which is resumed again. The final
trace, usage, context and result must equal the uninterrupted run's, and
the calls paid across all processes must equal the uninterrupted run's plus
only those that had returned but were not yet journaled when a crash hit.
HITL scenarios are continued with the human's reply: no tool of the
uninterrupted run's later phases may run before the reply is given.

`Crash` is a BaseException raised from the crash point: like SIGKILL,
nothing in the engine catches it, and once it has fired every later point
(in any thread) raises too, so nothing is written after it. The real
SIGKILL of real subprocesses is tests/crash/test_crash.py.
"""

from __future__ import annotations

import functools
import os
from collections import Counter
from functools import partial

import pydantic
import pytest
from support.crashes import CRASHED, REPLIES, Attempt, Points, counts, outcome
from support.examples import scripted_machines

import mklang.checkpoint.envelope as envelope_module
import mklang.checkpoint.journal as journal_module
import mklang.checkpoint.segments as segments_module
import mklang.syntax
from mklang import faults
from mklang.scenarios import Scenario, load_script
from mklang.syntax import load_file


def _cases():
    for machine, script in scripted_machines():
        for scenario in load_script(script):
            if scenario.run.get("budget") is None:
                yield pytest.param(machine, scenario, id=f"{machine.parent.name}/{machine.stem}:{scenario.name}")


@pytest.fixture(autouse=True)
def fast(monkeypatch):
    """Each machine file is parsed once (thousands of resumes reload the same files); the
    thousands of envelopes of the same shapes are not each held to the schema
    (conftest), which every other checkpoint test does."""
    monkeypatch.setattr(envelope_module.Envelope, "model_dump", pydantic.BaseModel.model_dump)
    monkeypatch.setattr(mklang.syntax, "load_file", functools.cache(mklang.syntax.load_file))
    monkeypatch.setattr(journal_module, "MIN_COMPACT_BYTES", 2048)  # compactions happen too
    monkeypatch.setattr(segments_module, "SEGMENT_BYTES", 1)  # and every snapshot seals its trace into a segment


def _without_delays(scenario: Scenario) -> Scenario:
    llm = {key: value for key, value in scenario.llm.items() if key != "delay_ms"}
    return Scenario(**{**scenario.__dict__, "llm": llm})


@pytest.mark.parametrize(("machine_path", "scenario"), list(_cases()))
def test_a_crash_at_any_point_then_another_during_the_resume_gives_the_uninterrupted_run(
    machine_path, scenario, tmp_path
):
    machine = load_file(machine_path)
    scenario = _without_delays(scenario)
    phases = 2 if scenario.name in REPLIES else 1
    reference = Attempt(machine, scenario, tmp_path / "reference")
    outcomes, reached = [], []
    for number in range(phases):
        points = Points()
        faults.watch(points)
        try:
            outcomes.append(outcome(reference.phase(number)))
        finally:
            faults.disarm()
        reached.append(points)
        if number == 0:
            before_reply = set(reference.paid)
    gated = set(reference.paid) - before_reply - {"produce", "judge"}

    attempts = 0
    for number in range(phases):
        for point, total in sorted(reached[number].seen.items()):
            for count in counts(total):
                attempts += 1
                label = f"phase {number}, crash at {point}:{count}"
                attempt = Attempt(machine, scenario, tmp_path / f"{number}-{point}-{count}", gated)
                for earlier in range(number):
                    attempt.phase(earlier)
                assert attempt.crashing(partial(attempt.phase, number), point, count) is CRASHED, label
                # A second crash during the resume, at a point that moves with each attempt over the
                # points the run had left (the resume reaches those, and its own start's); then a resume.
                second = 1 + attempts * 7 % (reached[number].left_after(point, count) + 3)
                resumed = attempt.crashing(attempt.recover, "*", second)
                if resumed is CRASHED:
                    resumed = attempt.recover()
                result = outcome(resumed)
                if number > 0 and result == outcomes[number - 1]:
                    # Crashed before the reply was durable: the run waits for it still; give it again.
                    result = outcome(attempt.phase(number))
                assert result == outcomes[number], label
                for later in range(number + 1, phases):
                    result = outcome(attempt.phase(later))
                assert result == outcomes[-1], label
                assert sum(attempt.paid.values()) == sum(reference.paid.values()) + attempt.lost, (
                    label,
                    attempt.paid,
                    reference.paid,
                )
    assert attempts == sum(len(counts(total)) for points in reached for total in points.seen.values())


def test_the_golden_scenarios_reach_every_documented_crash_point(tmp_path):
    """A point that is renamed or no longer reached would silently drop out of the sweep."""
    reached: Counter = Counter()
    for machine_path, scenario in [case.values for case in _cases()]:
        if machine_path.stem in ("brief", "plan_execute"):  # nesting; a halt before any step
            faults.watch(lambda point: reached.update([point]))
            try:
                Attempt(load_file(machine_path), scenario, tmp_path / scenario.name).phase(0)
            finally:
                faults.disarm()
    documented = {"journal.gen", "journal.enter", "journal.step", "journal.halt", "journal.call", "envelope.temp"}
    documented |= {"envelope", "journal.gen.temp", "call.before", "call.returned", "segment"}
    assert documented <= set(reached), documented - set(reached)
    assert os.environ.get(faults.ENV) is None
