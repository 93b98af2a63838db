"""Golden traces: every example and standard-library machine against its scenario script.

Each scenario must meet its own `expect:` block, and the run it produces
(status, error, where it stopped, result, trace) is a syrupy snapshot, so any
change in engine behaviour shows up as a reviewed diff. The same machines
must also be clean under `mklang check` and canonical under `mklang fmt`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from support.commands import cli
from support.examples import EXAMPLE_MAIN, EXAMPLES, STDLIB, scripted_machines
from support.runs import run_scenario, steady

from mklang.player import play
from mklang.scenarios import compare, load_script
from mklang.syntax import load_file


def _cases():
    for machine, script in scripted_machines():
        for scenario in load_script(script):
            label = f"{machine.parent.name}/{machine.stem}:{scenario.name}"
            yield pytest.param(machine, scenario, id=label)


def _without_nonces(value):
    """Data-fence nonces are random per call by design; snapshots name them NONCE."""
    return json.loads(re.sub(r"data-[0-9a-f]{8,}", "data-NONCE", json.dumps(value)))


def _all_machine_files() -> list[Path]:
    return sorted(STDLIB.glob("*.mk")) + sorted(
        path for folder in EXAMPLE_MAIN for path in (EXAMPLES / folder).glob("*.mk")
    )


@pytest.mark.parametrize(("machine_path", "scenario"), list(_cases()))
def test_scenario_meets_its_expectations(machine_path, scenario, snapshot):
    result = run_scenario(load_file(machine_path), scenario)
    assert compare(scenario.expect, result) == []
    assert (
        _without_nonces(
            {
                "status": result.status,
                "error": result.error,
                "at": result.at,
                "ask": result.ask,
                "reply_to": result.reply_to,
                "result": result.result,
                "usage": result.usage.to_json(),
                "trace": result.trace,
            }
        )
        == snapshot
    )


def _resumed_cases():
    for machine, script in scripted_machines():
        for scenario in load_script(script):
            if scenario.resumes:
                yield pytest.param(machine, scenario, id=f"{machine.parent.name}/{machine.stem}:{scenario.name}")


@pytest.mark.parametrize(("machine_path", "scenario"), list(_resumed_cases()))
def test_scenario_resumes_meet_their_expectations(machine_path, scenario, snapshot):
    """A scenario answered through `resumes:` (a human decision): each resume's run is a
    snapshot too, the decision's random question id and times left out (`steady`)."""
    parts = play(load_file(machine_path), scenario)
    assert [part.problems for part in parts] == [[] for _ in parts]
    assert [
        {
            "part": part.label,
            "status": part.result.status,
            "error": part.result.error,
            "at": part.result.at,
            "result": part.result.result,
            "context": part.result.context,
            "trace": steady(part.result.trace),
        }
        for part in parts[1:]
    ] == snapshot


def test_every_script_has_a_success_and_a_stop():
    """Each machine's script shows the happy path and at least one halt or suspension (a run
    answered by a human reaches its happy path through its `resumes`)."""
    for machine, script in scripted_machines():
        statuses = {
            part.get("status")
            for scenario in load_script(script)
            for part in (scenario.expect, *(resumed.expect for resumed in scenario.resumes))
        }
        assert "done" in statuses, machine
        assert statuses & {"halted", "suspended"}, machine


def test_every_example_folder_has_a_scripted_main_machine():
    folders = {path.parent.name for path in EXAMPLES.glob("*/scenarios.yaml")}
    assert folders == set(EXAMPLE_MAIN)
    for folder, main in EXAMPLE_MAIN.items():
        assert (EXAMPLES / folder / main).is_file()
        assert (EXAMPLES / folder / "README.md").is_file()


def test_machines_check_clean():
    """No errors and no warnings either: these machines are what users copy first.

    The one warning they keep is true of every fan-out over a run-time list:
    only budgets bound it (ADR 0012), which the machine cannot change. The
    approval example publishes on a human's typed decision, so it has no
    control-flow warning (ADR 0059).
    """
    files = [str(path) for path in _all_machine_files()]
    done = cli("check", "--format", "json", *files)
    assert done.returncode == 0, done.stdout + done.stderr
    findings = {(Path(finding["file"]).name, finding["code"]) for finding in json.loads(done.stdout)}
    assert {code for _, code in findings} <= {"over-unbounded"}
    assert not any(name == "approval.mk" for name, _ in findings)


def test_machines_are_canonically_formatted():
    files = [str(path) for path in _all_machine_files()]
    done = cli("fmt", "--check", *files)
    assert done.returncode == 0, done.stdout + done.stderr
