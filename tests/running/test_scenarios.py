"""`mklang test` and scenario scripts: a scenario passes only when the run did what it says.

Real subprocesses of this tree's CLI on real files; exit codes and streams
are what a CI script sees.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import yaml
from support.commands import cli
from support.examples import HITL

APPROVAL = HITL / "approval"

GREET = """\
machine greet
entry hello
budget 5

context {
  name: "<who>"
}

hook polite "True when the greeting is polite."

state hello {
  structure "One line."
  prompt "Greet {{name}}."
  output greeting
  when "the greeting is polite" -> END
  otherwise fail
}
"""

FAN_OUT = """\
machine fan
entry ask
budget 10

state ask {
  sample 4
  structure "One word."
  prompt "Say a word."
  output words
  otherwise -> END
}
"""

TWO_STEPS = """\
machine two
entry hello
budget 5

state hello {
  structure "One line."
  prompt "Greet {{name}}."
  output greeting
  otherwise -> bye
}

state bye {
  structure "One line."
  prompt "Say goodbye."
  output farewell
  otherwise -> END
}
"""

NO_MODEL = """\
machine count
entry count
budget 3

tool word_count "Count the words of {text}."

state count {
  tool word_count { text: "{{text}}" }
  output n
  otherwise -> END
}
"""


def write(folder: Path, machine: str, scenarios: list[dict]) -> tuple[str, str]:
    (folder / "m.mk").write_text(machine, encoding="utf-8")
    (folder / "s.yaml").write_text(yaml.safe_dump({"scenarios": scenarios}, sort_keys=False), encoding="utf-8")
    return str(folder / "m.mk"), str(folder / "s.yaml")


def test_a_scenario_without_expect_fails_when_the_run_halts(tmp_path):
    """Item 1: no `expect.status` means `done`; a halt is a failure, not a PASS."""
    machine, script = write(tmp_path, GREET, [{"name": "silent", "input": {"name": "Ada"}, "llm": {"judge": ["none"]}}])
    done = cli("test", machine, "--script", script, cwd=tmp_path)
    assert done.returncode == 1, done.stdout
    assert "FAIL silent" in done.stdout
    assert 'status: expected "done", got "halted"' in done.stdout


def test_a_failing_scenario_says_why_the_run_ended(tmp_path):
    """Item 2: the error, where, and the state error text, not only the status."""
    over = 'machine o\nentry e\nbudget 3\n\nstate e {\n  over items\n  structure "x"\n  prompt "{{item}}"\n'
    over += "  output outs\n  otherwise -> END\n}\n"
    machine, script = write(tmp_path, over, [{"name": "no-items", "expect": {"status": "done"}}])
    done = cli("test", machine, "--script", script, cwd=tmp_path)
    assert done.returncode == 1
    assert "the run ended halted: state-error: over: 'items' is missing at e" in done.stdout
    as_json = cli("test", machine, "--script", script, "--format", "json", cwd=tmp_path)
    (outcome,) = json.loads(as_json.stdout)
    assert outcome["at"] == "e" and outcome["error"].startswith("state-error: over:")


@pytest.mark.parametrize(
    ("scenario", "message"),
    [
        (
            {"name": "typo", "llm": {"prodcue": ["x"]}},
            "scenario 'typo': unknown key 'llm.prodcue'; did you mean \"llm.produce\"?",
        ),
        (
            {"name": "halt", "expect": {"status": "halts"}},
            "scenario 'halt': 'expect.status' is \"halts\", not one of done | halted | suspended; "
            'did you mean "halted"?',
        ),
        (
            {"name": "deep", "expect": {"trace": [{"stat": "hello"}]}},
            "scenario 'deep': unknown key 'expect.trace[1].stat'; did you mean \"expect.trace[1].state\"?",
        ),
        (
            {"name": "hooked", "hooks": {"polit": [True]}},
            "scenario 'hooked': 'hooks.polit': the machine declares no hook named 'polit'; did you mean \"polite\"?",
        ),
        (
            {"name": "tooled", "tools": {"search": ["x"]}},
            "scenario 'tooled': 'tools.search': the machine declares no tool named 'search'",
        ),
        ({"name": "budget", "run": {"max_tokens": "abc"}}, "'run.max_tokens' expects a whole number"),
        ({"name": "resumed", "resumes": [{"sett": {}}]}, "unknown key 'resumes[1].sett'; did you mean"),
    ],
    ids=["llm-key", "status", "trace-key", "hook-name", "tool-name", "run-value", "resume-key"],
)
def test_a_bad_scenario_is_a_usage_error_naming_file_scenario_and_key(tmp_path, scenario, message):
    """Item 3: exit 2 before anything runs, one line, with a did-you-mean."""
    machine, script = write(tmp_path, GREET, [scenario])
    for command in (["test", machine, "--script", script], ["run", machine, "--script", script, "--format", "text"]):
        done = cli(*command, cwd=tmp_path)
        assert done.returncode == 2, (command, done.stdout, done.stderr)
        assert done.stderr.startswith(f"mklang: error: {script}: "), done.stderr
        assert message in done.stderr, done.stderr
        assert done.stderr.count("\n") == 1


def test_an_empty_produce_list_is_valid(tmp_path):
    """Item 4: a machine that never calls a model scripts no answers."""
    scenario = {"name": "tool-only", "input": {"text": "a b c"}, "llm": {"produce": []}, "expect": {"result": "3"}}
    machine, script = write(tmp_path, NO_MODEL, [scenario])
    done = cli("test", machine, "--script", script, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS tool-only" in done.stdout


def test_scripted_fan_out_runs_branches_concurrently_by_default(tmp_path):
    """Item 5: the four branches are in flight together (a barrier of four only opens then),
    and still get the answers of their index; `run.concurrency: 1` stays available."""
    from mklang.runs import start
    from mklang.scenarios import load_script
    from mklang.session import Host
    from mklang.syntax import load_file

    scenario = {"name": "four", "llm": {"produce": ["a", "b", "c", "d"]}, "expect": {"status": "done"}}
    machine, script = write(tmp_path, FAN_OUT, [scenario, dict(scenario, name="serial", run={"concurrency": 1})])
    concurrent, serial = load_script(script)

    def run_behind_barrier(item, wait: float) -> list:
        host = Host.for_scenario(item)
        barrier = threading.Barrier(4, timeout=wait)
        answer = host.provider.produce

        def produce_together(*args):
            barrier.wait()
            return answer(*args)

        host.provider.produce = produce_together
        return start(load_file(machine), {}, host).context["words"]

    assert run_behind_barrier(concurrent, 30) == ["a", "b", "c", "d"]
    with pytest.raises(threading.BrokenBarrierError):  # one at a time, the first waits alone
        run_behind_barrier(serial, 0.2)


def test_branch_answers_do_not_depend_on_which_branch_asks_first():
    """Item 5, without timing: branches that reach a list in reverse order get their own answers."""
    from mklang.providers.base import branch_part, calling
    from mklang.providers.scripted import ScriptedProvider

    provider = ScriptedProvider({"produce": ["zero", "one", "two", "three", "after"]})
    answers = {}
    for index in (2, 0, 1):  # the order concurrent branches happened to arrive in
        with calling(f"r:4.{branch_part(index, 3)}.1"):
            answers[index] = provider.produce("", "p", "fast", False).text
    assert answers == {0: "zero", 1: "one", 2: "two"}
    assert provider.produce("", "p", "fast", False).text == "three"  # the next call after the fan-out


def test_the_approval_example_asks_suspends_resumes_and_finishes_in_one_test_run():
    """Item 6: ask, suspend (a real checkpoint), resume with a reply, finish: one invocation."""
    script = yaml.safe_load((APPROVAL / "scenarios.yaml").read_text(encoding="utf-8"))
    flow = next(s for s in script["scenarios"] if s["name"] == "ask-then-publish")
    assert flow["expect"]["status"] == "suspended"
    assert flow["resumes"][0]["set"] == {"approval.answer": "yes, ship it"}
    assert flow["resumes"][0]["expect"]["status"] == "done"
    done = cli("test", str(APPROVAL / "approval.mk"), "--script", str(APPROVAL / "scenarios.yaml"), "--format", "json")
    assert done.returncode == 0, done.stdout
    outcome = next(o for o in json.loads(done.stdout) if o["name"] == "ask-then-publish")
    assert [(p["part"], p["status"], p["error"], p["reason"]) for p in outcome["parts"]] == [
        ("run", "suspended", None, "escalated"),
        ("resumes[1]", "done", None, None),
    ]


def test_a_resume_expectation_that_does_not_hold_fails(tmp_path):
    """Item 6: each part is compared; a wrong expectation after the resume fails the scenario."""
    script = yaml.safe_load((APPROVAL / "scenarios.yaml").read_text(encoding="utf-8"))
    flow = next(s for s in script["scenarios"] if s["name"] == "ask-then-publish")
    flow["resumes"][0]["set"] = {"approval.answer": "no"}
    flow["llm"]["judge"] = [2]  # the reviewer rejects the announcement
    flow["llm"]["produce"][1] = "reject"
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"scenarios": [flow]}), encoding="utf-8")
    done = cli("test", str(APPROVAL / "approval.mk"), "--script", str(path))
    assert done.returncode == 1
    assert 'resumes[1]: status: expected "done", got "halted"' in done.stdout
    assert "resumes[1]: the run ended halted: gate-fail at decide" in done.stdout


def test_resumes_go_through_the_checkpoint_with_budgets_of_their_own(tmp_path):
    """Item 6: a budget suspension resumed with a raised `max_tokens`, like `resume --max-tokens`."""
    scenario = {
        "name": "raise",
        "input": {"name": "Ada"},
        "llm": {"produce": ["Hello, Ada.", "Goodbye."], "tokens": [30, 20]},
        "run": {"max_tokens": 10},
        "expect": {"status": "suspended", "reason": "cost-exhausted", "at": "bye"},
        "resumes": [{"max_tokens": 1000, "expect": {"status": "done", "context": {"farewell": "Goodbye."}}}],
    }
    machine, script = write(tmp_path, TWO_STEPS, [scenario])
    done = cli("test", machine, "--script", script, "--format", "json", cwd=tmp_path)
    (outcome,) = json.loads(done.stdout)
    assert outcome["passed"], outcome
    assert [p["status"] for p in outcome["parts"]] == ["suspended", "done"]
