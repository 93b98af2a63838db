"""Every crash point of every golden scenario, in process: the run resumes to the same run.

`mklang verify-resume`'s check (mklang.verification) over the examples and the standard library:
each scenario is suspended at every loop-top it passes and resumed; and crashed at each point it
reaches (mklang.faults: every journal line, every envelope and journal-generation write before and
after its rename, every trace segment written before the envelope naming it, before every model
and tool call and after it returns), at every nesting level, recovered as `mklang resume cp.json`
would with a second crash injected into that recovery, and recovered again. The final trace,
usage, context and result must equal the uninterrupted run's; the calls answered across all
processes must equal the uninterrupted run's plus only those that had returned but were not yet
journaled when a crash hit; a tool the uninterrupted run calls only after a human's reply never
runs in a process without it.

The crash is a BaseException raised from the crash point: like SIGKILL, nothing in the engine
catches it, and once it has fired every later point (in any thread) raises too, so nothing is
written after it. The real SIGKILL of real subprocesses is tests/crash/test_crash.py.
"""

from __future__ import annotations

import functools
import os
from collections import Counter

import pydantic
import pytest
from support.examples import scripted_machines

import mklang.checkpoint.envelope as envelope_module
import mklang.checkpoint.journal as journal_module
import mklang.checkpoint.segments as segments_module
import mklang.syntax
from mklang import faults
from mklang.runs import start
from mklang.scenarios import load_script
from mklang.session import Host
from mklang.syntax import load_file
from mklang.verification import verify


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


def _without_delays(scenario):
    from mklang.scenarios import Scenario

    llm = {key: value for key, value in scenario.llm.items() if key != "delay_ms"}
    return Scenario(**{**scenario.__dict__, "llm": llm})


@pytest.mark.parametrize(("machine_path", "scenario"), list(_cases()))
def test_a_suspension_or_a_crash_at_any_point_then_another_during_the_resume_gives_the_uninterrupted_run(
    machine_path, scenario
):
    checked = verify(
        load_file(machine_path), _without_delays(scenario), every=os.environ.get("MKLANG_CRASH_FULL") == "1"
    )
    assert checked.divergence is None, checked.text()
    assert checked.suspensions >= 1 and checked.crashes >= 1


def test_the_golden_scenarios_reach_every_documented_crash_point(tmp_path):
    """A point that is renamed or no longer reached would silently drop out of the sweep."""
    reached: Counter = Counter()
    for machine_path, scenario in [case.values for case in _cases()]:
        if machine_path.stem in ("brief", "plan_execute"):  # nesting; a halt before any step
            faults.watch(lambda point: reached.update([point]))
            try:
                start(
                    load_file(machine_path),
                    {},
                    Host.for_scenario(scenario),
                    checkpoint=tmp_path / f"{scenario.name}.json",
                )
            finally:
                faults.disarm()
    documented = {"journal.gen", "journal.enter", "journal.step", "journal.halt", "journal.call", "envelope.temp"}
    documented |= {"envelope", "journal.gen.temp", "call.before", "call.returned", "segment"}
    assert documented <= set(reached), documented - set(reached)
    assert os.environ.get(faults.ENV) is None
