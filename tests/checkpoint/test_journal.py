"""The crash journal in process: a run that dies at any loop-top, across compactions.

`Crash` is raised from an event sink at a loop-top: like SIGKILL, it stops the run
with the checkpoint `running` and its journal as the process left them.
The journal's compaction threshold is lowered so that these short runs
rewrite their envelope many times.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from conformance.harness import Recorder, write_machines
from support.crashes import Crash
from support.examples import EXAMPLES
from support.files import holder
from support.runs import LoopTops, outcome

import mklang.checkpoint.journal as journal_module
from mklang.checkpoint.envelope import load, save
from mklang.errors import CheckpointError
from mklang.scenarios import load_script
from mklang.service import resume, start
from mklang.session import Host
from mklang.syntax import load_file


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


# --- a resume that died: what it changed comes back from its journal ---------------


@pytest.mark.parametrize("crash_at", [0, 1])
def test_a_resume_that_died_is_reopened_with_the_reply_and_settings_it_was_given(tmp_path, crash_at):
    import shutil

    from support import ROOT
    from support.runs import outcome

    from mklang.scenarios import load_script
    from mklang.service import open_run
    from mklang.service import resume as resume_run
    from mklang.service import start as start_run
    from mklang.session import Host

    shutil.copytree(ROOT / "examples" / "approval", tmp_path / "approval")
    machine = load_file(tmp_path / "approval" / "approval.mk")
    scenario = next(s for s in load_script(tmp_path / "approval" / "scenarios.yaml") if s.name == "ask-then-publish")
    settings = {"max_tokens": 10**6, "max_cost": 2.5, "hitl": False, "concurrency": 3}
    reply = {"approval.answer": "yes"}
    reference_at = tmp_path / "reference.json"
    start_run(machine, None, Host.for_scenario(scenario), checkpoint=reference_at)
    reference = outcome(resume_run(reference_at, Host.for_scenario(scenario), reply=reply, **settings))
    assert reference["status"] == "done"

    path = tmp_path / "cp.json"
    start_run(machine, None, Host.for_scenario(scenario), checkpoint=path)
    tops = iter(range(9))

    def crash(event: Any) -> None:
        if next(tops) == crash_at:
            raise Crash

    with pytest.raises(Crash):
        resume_run(path, Host.for_scenario(scenario), reply=reply, observer=LoopTops(crash), **settings)
    reopened = open_run(path, lock=False)
    envelope, innermost = reopened.envelope, reopened.chain[-1]
    assert (envelope.status, envelope.reason, envelope.ask, envelope.reply_to) == ("running", None, None, None)
    assert (envelope.budgets.max_tokens, envelope.budgets.max_cost, envelope.hitl, envelope.concurrency) == (
        10**6,
        2.5,
        False,
        3,
    )
    assert (innermost.context["approval"], innermost.ask, "approval" in innermost.tainted) == (
        {"answer": "yes"},
        None,
        True,
    )
    assert (reopened.crashed, reopened.trusted) == (True, True)
    assert outcome(resume_run(path, Host.for_scenario(scenario))) == reference  # nothing given again


def test_a_checkpoint_is_opened_locked_and_each_refusal_is_one_line_that_releases_the_lock(tmp_path, monkeypatch):
    import shutil

    from support import ROOT

    from mklang.scenarios import load_script
    from mklang.service import open_run
    from mklang.service import start as start_run
    from mklang.session import Host

    shutil.copytree(ROOT / "examples" / "approval", tmp_path / "approval")
    source = tmp_path / "approval" / "approval.mk"
    scenario = next(s for s in load_script(tmp_path / "approval" / "scenarios.yaml") if s.name == "ask-then-publish")
    path = tmp_path / "cp.json"
    start_run(load_file(source), None, Host.for_scenario(scenario), checkpoint=path)

    def refusal(**options: Any) -> str:
        with pytest.raises(CheckpointError) as caught:
            open_run(path, **options)
        assert holder(path) is None  # the refusal released its lock
        return str(caught.value)

    held = open_run(path)  # locked by default
    with pytest.raises(CheckpointError) as busy:
        open_run(path)
    assert str(busy.value) == (
        f"{path}: the run is still going in process {os.getpid()}; "
        "wait for it, or stop it (Ctrl-C suspends it) before resuming"
    )
    held.lock.release()
    suspended = load(path)
    for changed, message in [
        ({"status": "done"}, "the run already finished; a finished run cannot be resumed"),
        (
            {"status": "halted", "error": "gate-fail"},
            "the run already halted (gate-fail); a finished run cannot be resumed",
        ),
        ({"frames": []}, "the checkpoint holds no frames"),
    ]:
        save(path, suspended.model_copy(update=changed))
        assert refusal() == f"{path}: {message}"
    save(path, suspended)
    source.write_text(source.read_text(encoding="utf-8") + "# edited\n", encoding="utf-8")
    assert refusal() == (
        f"{source}: machine file changed since the checkpoint was written (resume with --force to accept the change)"
    )
    open_run(path, force=True).lock.release()
    source.rename(tmp_path / "moved.mk")
    kept = open_run(path)  # a missing file: the text the store keeps, which the signature covers
    assert kept.machines_note is not None
    assert kept.machines_note.startswith(f"{source} is missing; running the machine texts the store keeps")
    kept.release()
    (tmp_path / "moved.mk").rename(source)
    monkeypatch.setenv("MKLANG_CHECKPOINT_KEY", "another user's checkpoint key, 32 bytes or more")
    assert refusal(force=True) == (
        f"{path}: the checkpoint is signed with another checkpoint key; resume it with --trust to run it "
        "as untrusted data (host settings from your command line only)"
    )
    opened = open_run(path, force=True, trust=True)
    assert opened.trusted is False
    opened.lock.release()


# --- a halt journaled before the envelope says so ------------------------------


def test_a_run_that_dies_after_journaling_a_halt_resumes_to_the_same_halt(tmp_path):
    from support.runs import outcome

    from mklang import faults
    from mklang.service import resume as resume_run
    from mklang.service import start as start_run
    from mklang.session import Host

    class Crash(BaseException):
        pass

    def crash() -> None:
        raise Crash

    machine = write_machines(
        tmp_path,
        """
        machine m
        entry a
        budget 5
        tool risky "fails"
        state a {
          structure "s"
          prompt "p"
          output x
          otherwise -> b
        }
        state b {
          tool risky { q: "{{x}}" }
          output y
          otherwise -> END
        }
    """,
    )

    calls = []

    def risky(args: dict[str, Any]) -> Any:
        calls.append(args)
        raise RuntimeError("exploded")

    def host() -> Host:
        return Host(
            provider=Recorder({"produce": ["one"], "tokens": [2, 3]}),
            tools={"risky": risky},
        )

    reference = outcome(start_run(machine, None, host(), checkpoint=tmp_path / "ref.json"))
    assert (reference["status"], reference["usage"]["input_tokens"]) == ("halted", 2)
    faults.arm("journal.halt", 1, crash)
    try:
        with pytest.raises(Crash):
            start_run(machine, None, host(), checkpoint=tmp_path / "cp.json")
    finally:
        faults.disarm()
    assert load(tmp_path / "cp.json").status == "running"
    calls.clear()
    resumed = resume_run(tmp_path / "cp.json", host())
    assert calls == []  # the journaled halt ends the level: the state does not run again
    assert outcome(resumed) == reference
    assert (resumed.error, resumed.at) == ("state-error: tool risky: exploded", "b")
