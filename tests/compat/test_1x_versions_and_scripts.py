"""Machines and scenario scripts written for mklang 1.x, in both dialects.

Language versions 0.2 and 0.3 are subsets of 0.5 and run; only a newer
version is refused, naming both. Scripts keep their 1.x spellings: `status:
halt`, the `error` of a suspended run holding its reason, the 1.x `run:`
settings and `context:` for `input:`. Everything else in a script is still
validated. In process, through the CLI's own
command functions.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from support import commands

from mklang import __version__
from mklang.vocabulary import LANGUAGE_VERSION

ONE_STATE_MK = """\
mklang {version}
machine m
entry a
budget 3
hook sure "True when the answer is sure."
state a {{
  structure "One word."
  prompt "Answer."
  output o
  when "the answer is sure" hook sure -> END
  when "the answer needs a human" escalate -> b ask "Go on?"
  otherwise fail
}}
state b {{
  structure "One word."
  prompt "Finish."
  output p
  otherwise -> END
}}
"""

ONE_STATE_YAML = """\
mklang: "{version}"
machine: m
entry: a
budget: 3
hooks: [{{name: sure, description: "True when the answer is sure."}}]
states:
  a:
    structure: One word.
    prompt: Answer.
    output: o
    gates:
      - {{when: the answer is sure, hook: sure, then: ok, to: END}}
      - {{when: the answer needs a human, escalate: true, to: b, ask: Go on?}}
      - {{when: otherwise, fail: true}}
  b:
    structure: One word.
    prompt: Finish.
    output: p
    gates:
      - {{when: otherwise, then: ok, to: END}}
"""

DIALECTS = {"m.mk": ONE_STATE_MK, "m.mkl": ONE_STATE_YAML}


def cli(*args: str) -> tuple[int, str, str]:
    done = commands.cli(*args)
    return done.returncode, done.stdout, done.stderr


def machine(folder: Path, name: str, version: str) -> str:
    path = folder / name
    path.write_text(DIALECTS[name].format(version=version), encoding="utf-8")
    return str(path)


def script(folder: Path, *scenarios: dict) -> str:
    path = folder / "s.test.yaml"
    path.write_text(yaml.safe_dump({"scenarios": list(scenarios)}, sort_keys=False), encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("name", DIALECTS)
@pytest.mark.parametrize("version", ["0.2", "0.3", LANGUAGE_VERSION])
def test_this_and_earlier_language_versions_check_and_run(tmp_path, name, version):
    path = machine(tmp_path, name, version)
    assert cli("check", path)[0] == 0
    code, out, _ = cli("run", path, "--script", script(tmp_path, {"name": "s", "hooks": {"sure": [True]}}))
    assert (code, json.loads(out)["status"]) == (0, "done")


@pytest.mark.parametrize("name", DIALECTS)
@pytest.mark.parametrize("version", ["0.6", "1.0", "0.50"])
def test_a_newer_language_version_is_refused_naming_both(tmp_path, name, version):
    path = machine(tmp_path, name, version)
    refusal = f"this is mklang {__version__}: it runs language version {LANGUAGE_VERSION} and earlier, not the newer {version}"
    code, _, err = cli("check", path)
    assert code == 2 and f"{path}:1:1: error: {refusal} [unsupported-version]" in err
    code, out, _ = cli("run", path, "--script", script(tmp_path, {"name": "s"}))
    assert code == 2 and json.loads(out)["error"] == f"{path}:1:1: {refusal}"


def test_a_yaml_version_with_a_patch_level_reads_as_its_language_version(tmp_path):
    path = machine(tmp_path, "m.mkl", "0.2.0")
    assert cli("check", path)[0] == 0
    code, printed, _ = cli("fmt", path)
    assert code == 0 and printed.startswith("mklang 0.2\n")


def test_a_version_line_that_is_no_version_number_is_refused(tmp_path):
    path = tmp_path / "m.mk"
    path.write_text(ONE_STATE_MK.format(version="1e5"), encoding="utf-8")
    code, _, err = cli("check", str(path))
    assert code == 2 and f"1e5 is not a language version (like {LANGUAGE_VERSION}) [unsupported-version]" in err


def test_status_halt_is_read_as_halted(tmp_path):
    path = machine(tmp_path, "m.mkl", "0.2")
    halts = {"name": "halts", "hooks": {"sure": [False]}, "llm": {"judge": ["none"]}, "expect": {"status": "halt"}}
    assert cli("test", path, "--script", script(tmp_path, halts))[0] == 0
    finishes = {**halts, "hooks": {"sure": [True]}}
    code, out, _ = cli("test", path, "--script", script(tmp_path, finishes))
    assert code == 1 and 'status: expected "halted", got "done"' in out


def test_the_error_of_a_suspended_run_is_its_reason(tmp_path):
    path = machine(tmp_path, "m.mkl", "0.3")
    asks = {
        "name": "asks",
        "hooks": {"sure": [False]},
        "llm": {"judge": [0]},
        "run": {"hitl": True, "checkpoint": True},
        "expect": {"status": "suspended", "error": "escalated", "error_prefix": "escal", "at": "b"},
    }
    assert cli("test", path, "--script", script(tmp_path, asks))[0] == 0
    wrong = {**asks, "expect": {"status": "suspended", "error": "budget-exhausted"}}
    code, out, _ = cli("test", path, "--script", script(tmp_path, wrong))
    assert code == 1 and 'error: expected "budget-exhausted", got "escalated"' in out


def test_1x_run_settings_and_context_read_as_this_projects(tmp_path):
    path = machine(tmp_path, "m.mkl", "0.2")
    parks = {
        "name": "parks",
        "context": {"topic": "from context", "other": 1},
        "input": {"topic": "from input"},
        "hooks": {"sure": [False]},
        "llm": {"judge": [0]},
        "run": {"escalate_suspend": True, "max_workers": 2},
        "expect": {"status": "suspended", "error": "escalated", "context": {"topic": "from input", "other": 1}},
    }
    spends = {
        "name": "spends",
        "hooks": {"sure": [False]},
        "llm": {"judge": [0], "tokens": [3, 2]},
        "run": {"suspendable": True, "cost_budget": 5},
        "expect": {"status": "suspended", "error": "cost-exhausted", "at": "b"},
    }
    code, out, _ = cli("test", path, "--script", script(tmp_path, parks, spends))
    assert code == 0, out


@pytest.mark.parametrize(
    ("run", "message"),
    [
        ({"cost_budget": 5, "max_tokens": 5}, "'run.cost_budget' is the mklang 1.x name of 'run.max_tokens'"),
        ({"cost_budget": "lots"}, "'run.cost_budget' expects a whole number of at least 0, got \"lots\""),
        ({"suspendable": "yes"}, "'run.suspendable' expects true or false, got \"yes\""),
        ({"on_truncate": "halt"}, "unknown key 'run.on_truncate'"),
    ],
)
def test_1x_run_settings_are_validated(tmp_path, run, message):
    code, _, err = cli(
        "test", machine(tmp_path, "m.mkl", "0.2"), "--script", script(tmp_path, {"name": "s", "run": run})
    )
    assert code == 2 and message in err and err.count("\n") == 1


def test_a_halted_run_still_compares_its_error(tmp_path):
    path = machine(tmp_path, "m.mk", "0.4")
    fails = {"name": "fails", "hooks": {"sure": [False]}, "llm": {"judge": ["none"]}}
    right = {**fails, "expect": {"status": "halt", "error": "gate-fail", "at": "a"}}
    assert cli("test", path, "--script", script(tmp_path, right))[0] == 0
    wrong = {**fails, "expect": {"status": "halt", "error": "escalated"}}
    code, out, _ = cli("test", path, "--script", script(tmp_path, wrong))
    assert code == 1 and 'error: expected "escalated", got "gate-fail"' in out


@pytest.mark.parametrize(
    ("scenario", "message"),
    [
        (
            {"name": "s", "expect": {"status": "halts"}},
            "'expect.status' is \"halts\", not one of done | halted | suspended",
        ),
        ({"name": "s", "expect": {"eror": "escalated"}}, "unknown key 'expect.eror'; did you mean \"expect.error\"?"),
        ({"name": "s", "resumes": [{"expect": {"status": "hald"}}]}, "'resumes[1].expect.status' is \"hald\""),
    ],
)
def test_everything_else_in_a_script_is_still_validated(tmp_path, scenario, message):
    code, _, err = cli("test", machine(tmp_path, "m.mkl", "0.2"), "--script", script(tmp_path, scenario))
    assert code == 2 and message in err and err.count("\n") == 1
