"""The crash journal in process: a run that dies at any loop-top, across compactions.

`Crash` is raised from an event sink at a loop-top: like SIGKILL, it stops the run
with the checkpoint `running` and its journal as the process left them.
The journal's compaction threshold is lowered so that these short runs
rewrite their envelope many times.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.examples import EXAMPLES
from support.runs import LoopTops, outcome

import mklang.checkpoint.journal as journal_module
from mklang.checkpoint.envelope import load
from mklang.scenarios import load_script
from mklang.service import resume, start
from mklang.session import Host
from mklang.syntax import load_file


class Crash(BaseException):
    """Not an Exception: nothing in the engine may catch it, as nothing catches SIGKILL."""


class CrashAt(LoopTops):
    def __init__(self, n: int):
        super().__init__(self.count)
        self.n, self.seen = n, 0

    def count(self, event):
        self.seen += 1
        if self.seen == self.n:
            raise Crash


@pytest.fixture(autouse=True)
def tiny_compaction(monkeypatch):
    monkeypatch.setattr(journal_module, "MIN_COMPACT_BYTES", 512)


@pytest.mark.slow
@pytest.mark.parametrize(
    "example, main, scenario_name",
    [
        ("nested", "brief.mk", None),
        ("map-reduce", "digest.mk", None),
        ("triage", "triage.mk", "bug-answered-from-kb-after-one-repair"),
    ],
)
def test_a_run_that_dies_at_any_loop_top_resumes_to_the_same_run(example, main, scenario_name, tmp_path):
    machine = load_file(EXAMPLES / example / main)
    scenarios = load_script(EXAMPLES / example / "scenarios.yaml")
    scenario = next(s for s in scenarios if scenario_name in (None, s.name))
    counter = CrashAt(0)
    reference = outcome(
        start(machine, None, Host.for_scenario(scenario), checkpoint=tmp_path / "ref.json", observer=counter)
    )
    assert reference["status"] == "done"
    for n in range(2, counter.seen + 1):
        checkpoint = tmp_path / f"cp{n}.json"
        with pytest.raises(Crash):
            start(machine, None, Host.for_scenario(scenario), checkpoint=checkpoint, observer=CrashAt(n))
        assert load(checkpoint).status == "running"
        resumed = resume(checkpoint, Host.for_scenario(scenario))
        assert outcome(resumed) == reference, f"crashed at loop-top {n} of {counter.seen}"


def test_long_runs_compact_their_journal_into_new_envelope_generations(tmp_path):
    machine = load_file(EXAMPLES / "nested" / "brief.mk")
    scenario = load_script(EXAMPLES / "nested" / "scenarios.yaml")[0]
    checkpoint = tmp_path / "cp.json"
    generations = []

    def watch(event):
        generations.append(load(checkpoint).generation)

    start(machine, None, Host.for_scenario(scenario), checkpoint=checkpoint, observer=LoopTops(watch))
    assert generations[-1] > generations[0] + 2, generations  # rewritten several times along the way
    assert load(checkpoint).status == "done"
    assert not Path(f"{checkpoint}.journal").exists()  # a finished run leaves no journal


def test_a_crash_just_after_a_resumed_run_suspends_again_leaves_no_journal_that_applies(tmp_path):
    """A resume journals against the suspended envelope; when it suspends again, a crash between
    writing the new envelope and dropping that journal must not replay the journal onto it."""
    from mklang import faults
    from mklang.providers.scripted import ScriptedProvider
    from mklang.service import open_run, proceed

    machine_file = tmp_path / "loop.mk"
    machine_file.write_text(
        'machine loop\nentry write\nbudget 2\nstate write {\n  structure "a line"\n  prompt "write"\n'
        '  output lines\n  accumulate\n  when "more" -> write\n}\n'
    )
    machine = load_file(machine_file)

    def provider() -> ScriptedProvider:
        return ScriptedProvider({"produce": ["a line"], "judge": [0]})

    def steps(checkpoint: Path, budget: int, crash_at_envelope: bool = False):
        if crash_at_envelope:
            faults.arm("envelope", 1, lambda: (_ for _ in ()).throw(Crash()))
        try:
            return proceed(open_run(checkpoint), Host(provider()), budget=budget)
        finally:
            faults.disarm()

    reference_at, crashed_at = tmp_path / "reference.json", tmp_path / "crashed.json"
    for checkpoint in (reference_at, crashed_at):
        assert start(machine, {}, Host(provider()), checkpoint=checkpoint).status == "suspended"
    assert steps(reference_at, 4).status == "suspended"
    with pytest.raises(Crash):
        steps(crashed_at, 4, crash_at_envelope=True)  # the second suspension is written, its journal not dropped
    assert Path(f"{crashed_at}.journal").exists()
    assert load(crashed_at).status == "suspended"
    assert outcome(steps(crashed_at, 6)) == outcome(steps(reference_at, 6))
    assert len(load(crashed_at).frames[0]["trace"]) == 6
