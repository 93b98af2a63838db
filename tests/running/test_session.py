"""One way to build a run: `mklang.session` under the CLI, the Python API and the tests."""

from __future__ import annotations

import ast
from pathlib import Path

from support.examples import EXAMPLES

import mklang
from mklang.checkpoint.envelope import load
from mklang.scenarios import load_script
from mklang.service import start
from mklang.session import Host

PACKAGE = Path(mklang.__file__).parent


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_the_host_package_stays_below_the_engine_and_the_checkpoint():
    upward = ("mklang.engine", "mklang.checkpoint", "mklang.session", "mklang.cli")
    for path in sorted((PACKAGE / "host").glob("*.py")):
        bad = sorted(name for name in _imports(path) if name.startswith(upward))
        assert not bad, f"{path.name} imports {bad}"


def test_the_python_api_runs_durably_with_a_checkpoint(tmp_path):
    machine = mklang.load(EXAMPLES / "approval" / "approval.mk")
    checkpoint = tmp_path / "cp.json"
    first = mklang.run(
        machine,
        script=EXAMPLES / "approval" / "scenarios.yaml",
        scenario="ask-then-publish",
        checkpoint=checkpoint,
        hitl=True,
    )
    assert (first.status, first.reply_to) == ("suspended", "approval.answer")
    assert load(checkpoint).status == "suspended"


def test_a_scenario_host_supplies_input_and_run_settings_under_the_callers(tmp_path):
    machine = mklang.load(EXAMPLES / "approval" / "approval.mk")
    scenario = next(s for s in load_script(EXAMPLES / "approval" / "scenarios.yaml") if s.name == "ask-then-publish")
    assert scenario.run.get("hitl") is True
    parked = start(machine, None, Host.for_scenario(scenario), checkpoint=tmp_path / "cp.json")
    assert parked.status == "suspended"  # hitl from the scenario's run settings
    direct = start(machine, None, Host.for_scenario(scenario), hitl=False)
    assert direct.status != "suspended"  # the caller's setting wins
