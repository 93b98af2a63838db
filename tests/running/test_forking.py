"""A fork's prefix answered from the source's trace (mklang.forking): the engine, run again with
those answers, reaches every loop-top of the source as the source did, and pays nothing."""

from __future__ import annotations

import json

import pytest
from support import ROOT
from support.examples import HITL, scripted_machines

from mklang.engine import Control
from mklang.forking import PrefixMismatch, PrefixProvider, StopAt, TraceAnswers, prefix_tools
from mklang.model import ToolUse, called_machines
from mklang.runs import start
from mklang.scenarios import load_script
from mklang.session import Host
from mklang.syntax import load_file
from mklang.syntax.machines import MachineLoader


def _cases():
    for machine, script in scripted_machines():
        for scenario in load_script(script):
            if not scenario.resumes and scenario.run.get("budget") is None:
                yield pytest.param(machine, scenario, id=f"{machine.parent.name}/{machine.stem}:{scenario.name}")


def _prefix_host(answers: TraceAnswers, machine, loader, scenario) -> Host:
    """The source's answers for the model and the tools; the scenario's own hooks (they are asked again)."""
    tools = [s.face.tool for m in called_machines(machine, loader) for s in m.states if isinstance(s.face, ToolUse)]
    scripted = Host.for_scenario(scenario)
    return Host(
        PrefixProvider(answers), prefix_tools(answers, tools), scripted.hooks, state=scripted.state, scenario=scenario
    )


@pytest.mark.parametrize(("machine_path", "scenario"), list(_cases()))
def test_a_prefix_answered_from_the_trace_reaches_each_loop_top_as_the_source_did(machine_path, scenario):
    machine = load_file(machine_path)
    loader = MachineLoader()
    loader.add(machine)
    source = json.loads(json.dumps(start(machine, {}, Host.for_scenario(scenario)).trace))
    for step in range(2, len(source) + 2):  # stop at the loop-top of `step`, or let the whole run replay
        answers = TraceAnswers(source, machine, loader)
        control = Control()
        stopped = start(
            machine,
            {},
            _prefix_host(answers, machine, loader, scenario),
            control=control,
            observer=StopAt(control, (step,)),
        )
        replayed = json.loads(json.dumps(stopped.trace))
        if step <= len(source):
            assert stopped.error == "interrupted", step  # in memory an interrupt halts the run there
        assert replayed == source[: step - 1], f"stopped before step {step}"


def test_a_judge_asked_what_the_source_was_not_asked_is_a_mismatch():
    machine = load_file(ROOT / "examples/triage/triage.mk")
    loader = MachineLoader()
    loader.add(machine)
    scenario = load_script(ROOT / "examples/triage/scenarios.yaml")[1]  # bug: judged, looked up, repaired
    source = json.loads(json.dumps(start(machine, {}, Host.for_scenario(scenario)).trace))
    answers = TraceAnswers(source, machine, loader)
    assert answers.judge("r:1.g.1", ["the category is bug"]).choice == 0
    with pytest.raises(PrefixMismatch, match="do not hold the gate the source took"):
        answers.judge("r:1.g.1", ["the category is billing"])
    with pytest.raises(PrefixMismatch, match="step 40 is not in the source's trace"):
        answers.produce("r:40.0.1")
    with pytest.raises(PrefixMismatch, match="the source made no such model call"):
        answers.produce("r:2.0.1")  # step 2 is the KB lookup, a tool
    assert answers.tool("r:2.0.1") == source[1]["output"]


# --- mklang fork, end to end -------------------------------------------------------------------


def _chain(count: int) -> str:
    """A machine of `count` produce states in a row, each writing on the one before."""
    states = []
    for n in range(1, count + 1):
        after = "END" if n == count else f"s{n + 1}"
        prompt = "Begin on {{topic}}." if n == 1 else f"Go on from {{{{o{n - 1}}}}} about {{{{topic}}}}."
        states.append(
            f'state s{n} {{\n  structure "A line."\n  prompt "{prompt}"\n  output o{n}\n  otherwise -> {after}\n}}\n'
        )
    return f"machine chain\nentry s1\nbudget {count + 2}\n" + "".join(states)


def _echo(request):
    from support.fakeserver import answer

    return answer(f"line for: {request.user[-60:]}")


@pytest.fixture
def twelve(tmp_path, server):
    from support.commands import model_config

    (tmp_path / "chain.mk").write_text(_chain(12))
    model_config(server.openai_url, tmp_path / "mklang.toml")
    server.handler = _echo
    return tmp_path


def _envelope(path) -> dict:
    return json.loads(path.read_text())


def test_a_fork_pays_only_for_the_steps_from_its_start_and_keeps_the_source_untouched(twelve, server):
    from support.commands import cli

    host = ("--config", "mklang.toml")
    source = cli(
        "run", "chain.mk", "--set", "topic=tides", "--checkpoint", "src.json", *host, "--format", "json", cwd=twelve
    )
    assert source.returncode == 0, source.stderr
    assert server.count == 12
    before = (twelve / "src.json").read_bytes()
    forked = cli(
        "fork",
        "src.json",
        "--at",
        "7",
        "--set",
        "topic=storms",
        "--checkpoint",
        "fork.json",
        *host,
        "--format",
        "json",
        cwd=twelve,
    )
    assert forked.returncode == 0, forked.stderr
    assert server.count == 12 + 6  # steps 7 to 12 paid; 1 to 6 answered from the source's trace
    # the edit reached step 7, and every paid call has it: none was for steps 1 to 6 (they read "tides")
    assert all("storms" in request.body["messages"][-1]["content"] for request in server.requests[-6:])
    source_trace, fork_trace = json.loads(source.stdout)["trace"], json.loads(forked.stdout)["trace"]
    assert fork_trace[:6] == source_trace[:6] and fork_trace[6:] != source_trace[6:]
    assert (twelve / "src.json").read_bytes() == before  # the source is never changed
    (ancestor,) = _envelope(twelve / "fork.json")["lineage"]
    assert ancestor["run_id"] == _envelope(twelve / "src.json")["run_id"] and ancestor["step"] == "7"
    spent = [step["usage"] for step in source_trace[:6]]
    assert ancestor["inherited"]["input_tokens"] == sum(usage["input_tokens"] for usage in spent)
    shown = json.loads(cli("show", "fork.json", "--summary", "--format", "json", cwd=twelve).stdout)
    assert [(a["run_id"], a["step"], a["inherited"]) for a in shown["lineage"]] == [
        (ancestor["run_id"], "7", ancestor["inherited"])
    ]
    assert "forked from" in cli("show", "fork.json", "--summary", "--format", "text", cwd=twelve).stdout

    again = cli("fork", "fork.json", "--at", "10", "--checkpoint", "fork2.json", *host, "--format", "json", cwd=twelve)
    assert again.returncode == 0, again.stderr
    assert server.count == 18 + 3
    lineage = _envelope(twelve / "fork2.json")["lineage"]
    assert [(a["run_id"], a["step"]) for a in lineage] == [
        (ancestor["run_id"], "7"),
        (_envelope(twelve / "fork.json")["run_id"], "10"),
    ]


def test_a_tampered_parent_reference_is_refused_and_a_foreign_source_too(twelve, server):
    from support.commands import cli, refused

    host = ("--config", "mklang.toml")
    assert cli("run", "chain.mk", "--set", "topic=a", "--checkpoint", "src.json", *host, cwd=twelve).returncode == 0
    assert cli("fork", "src.json", "--at", "3", "--checkpoint", "fork.json", *host, cwd=twelve).returncode == 0
    paid = server.count
    forged = _envelope(twelve / "fork.json")
    forged["lineage"][0]["run_id"] = "0" * 32
    (twelve / "fork.json").write_text(json.dumps(forged))
    for command in (["fork", "fork.json", "--at", "5", "--checkpoint", "f2.json"], ["resume", "fork.json"]):
        refused(cli(*command, *host, cwd=twelve), "signed")
    assert server.count == paid and not (twelve / "f2.json").exists()


def test_a_fork_says_what_it_may_run_again_before_anything_is_paid(tmp_path):
    import shutil

    from support.commands import cli, refused

    shutil.copytree(HITL / "approval", tmp_path / "approval")
    folder = tmp_path / "approval"
    ran = cli(
        "run",
        "approval.mk",
        "--script",
        "scenarios.yaml",
        "--scenario",
        "approved-answer-given-up-front",
        "--checkpoint",
        "src.json",
        cwd=folder,
    )
    assert ran.returncode == 0, ran.stderr
    shown = cli("fork", "src.json", "--at", "2", "--dry-run", "--format", "json", cwd=folder)
    assert json.loads(shown.stdout) == {"step": "2", "state": "decide", "effects": ["approval:publish (publish)"]}
    refused(cli("fork", "src.json", "--at", "9", "--dry-run", cwd=folder), "the source's trace has 3 steps")


def _prompt(request) -> str:
    return request.body["messages"][-1]["content"]


def test_a_fork_replays_the_values_a_resume_of_its_source_set_at_the_loop_top_they_were_set(twelve, server):
    from support.commands import cli, refused

    host = ("--config", "mklang.toml")
    ran = cli(
        "run", "chain.mk", "--set", "topic=tides", "--max-tokens", "75", "--checkpoint", "src.json", *host, cwd=twelve
    )
    assert ran.returncode == 3, ran.stderr  # suspended at the loop-top of step 6: 5 answers of 15 tokens spent
    resumed = cli(
        "resume", "src.json", "--max-tokens", "1000", "--set", "topic=storms", *host, "--format", "json", cwd=twelve
    )
    assert resumed.returncode == 0, resumed.stderr
    assert server.count == 12 and "storms" in _prompt(server.requests[5]) and "tides" in _prompt(server.requests[4])
    source = _envelope(twelve / "src.json")
    assert source["edits"] == [{"at": "6", "set": {"topic": "storms"}, "budget": None}]

    forked = cli("fork", "src.json", "--at", "9", "--checkpoint", "fork.json", *host, "--format", "json", cwd=twelve)
    assert forked.returncode == 0, forked.stderr
    assert server.count == 12 + 4  # steps 9 to 12 paid
    assert all("storms" in _prompt(request) for request in server.requests[-4:])  # the resume's value, replayed
    source_trace, fork_trace = json.loads(resumed.stdout)["trace"], json.loads(forked.stdout)["trace"]
    assert fork_trace[:8] == source_trace[:8]
    fork = _envelope(twelve / "fork.json")
    assert fork["edits"] == source["edits"]  # replayed where the source had them, so a fork of it does too
    assert "topic" in fork["frames"][0]["tainted"]  # set on resume: host data, in the fork as in the source

    early = cli("fork", "src.json", "--at", "4", "--checkpoint", "early.json", *host, cwd=twelve)
    assert early.returncode == 0, early.stderr  # an edit after the fork's start is not the fork's
    assert server.count == 16 + 9 and all("tides" in _prompt(request) for request in server.requests[-9:])

    forged = dict(source, edits=[{"at": "6", "set": {"topic": "calm"}, "budget": None}])
    (twelve / "src.json").write_text(json.dumps(forged))
    refused(cli("fork", "src.json", "--at", "9", "--checkpoint", "f2.json", *host, cwd=twelve), "signed")
    assert server.count == 25 and not (twelve / "f2.json").exists()


def test_a_fork_past_a_human_reply_replays_the_reply_where_the_source_was_parked(tmp_path):
    import shutil

    from support.commands import cli

    shutil.copytree(HITL / "approval", tmp_path / "approval")
    folder, host = tmp_path / "approval", ("--script", "scenarios.yaml", "--scenario", "ask-then-publish")
    assert cli("run", "approval.mk", *host, "--hitl", "--checkpoint", "src.json", cwd=folder).returncode == 3
    answered = cli("resume", "src.json", "--set", "approval.answer=yes, ship it", "--format", "json", cwd=folder)
    assert answered.returncode == 0, answered.stderr
    forked = cli("fork", "src.json", "--at", "3", "--checkpoint", "fork.json", *host, "--format", "json", cwd=folder)
    assert forked.returncode == 0, forked.stderr  # its prefix parks where the source did, and is answered there
    fork, source = json.loads(forked.stdout), json.loads(answered.stdout)
    assert fork["trace"][:2] == source["trace"][:2] and fork["context"]["approval"] == {"answer": "yes, ship it"}


def test_a_run_begun_before_resume_edits_were_recorded_loads_and_is_not_forked(twelve, server):
    from support.commands import cli, refused

    from mklang.checkpoint.envelope import load, save

    host = ("--config", "mklang.toml")
    assert cli("run", "chain.mk", "--set", "topic=a", "--checkpoint", "src.json", *host, cwd=twelve).returncode == 0
    older = load(twelve / "src.json")
    older.edits = None  # signed with the user's key, as a run of the release before wrote it
    save(twelve / "src.json", older)
    assert cli("show", "src.json", "--summary", cwd=twelve).returncode == 0
    refused(cli("fork", "src.json", "--at", "3", "--checkpoint", "f.json", *host, cwd=twelve), "no resume edits")
    assert server.count == 12 and not (twelve / "f.json").exists()
