"""The machines and scenario scripts that the published mklang 1.4.0 package ships.

The wheel is fetched with pip, and run by its own interpreter, once per test run
(the xdist workers share what the first of them built). Each of its twelve YAML
machines checks clean, converts with `fmt` to a `.mk` that checks clean and
is a fixed point of `fmt`, and passes its own `.test.yaml` with `mklang
test`, unchanged. The one exception is the 1.x console's own machine
(`agent.mkl`): its scenarios rely on a hook that only the 1.x console
registers (docs/language.md, "Machines and scripts of mklang 1.x"), and the
test pins exactly how they fail, and that scripting that hook makes them
pass. The wheel's own 1.x interpreter runs every scenario too, as the
oracle of what each step must be. Without pip access to the package the
tests skip with one line, except under CI=true, where they fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml
from support import commands
from support.runs import run_scenario
from support.shared import built_once

from mklang.effects import FLOW_POLICIES
from mklang.scenarios import STATUS_1X, load_script
from mklang.session import Host
from mklang.syntax import load_file, parse
from mklang.vocabulary import LANGUAGE_VERSION

RELEASE = "mklang==1.4.0"
INTERPRETER_1X = Path(__file__).with_name("interpreter_1x.py")
MACHINES = [
    "console/agent",
    "init/hello",
    "stdlib/std_cascade",
    "stdlib/std_compress",
    "stdlib/std_cot",
    "stdlib/std_debate",
    "stdlib/std_map_reduce",
    "stdlib/std_plan_execute",
    "stdlib/std_refine",
    "stdlib/std_research",
    "stdlib/std_self_consistency",
    "stdlib/std_tot",
]
# What a step here must share with the same step of the 1.x interpreter.
COMPARED_WITH_1X = (
    "state",
    "policy",
    "to",
    "gate",
    "gate_via",
    "reasoning",
    "decision_tainted",
    "untrusted_control_flow",
)
# The tools of the 1.x console that its host classifies read-only (1.x's TOOL_EFFECTS).
CONSOLE_READ_ONLY = frozenset(
    {"list_machines", "list_workspace", "read_workspace_file", "search_workspace", "ask_user"}
)
# The 1.x console registers `console_workspace_ready` itself; no script can.
CONSOLE_HOOK_FAILURE = "the run ended halted: state-error: hook: unknown hook 'console_workspace_ready' at reply"
AGENT_FAILURES = {
    "workspace-analysis",
    "direct-reply",
    "run-then-reply",
    "clarify-then-reply",
    "discover-then-reply",
    "task-update-then-reply",
    "author-run-reply",
    "author-fails-then-repairs",
}


@pytest.fixture(scope="session")
def wheel_data(request: pytest.FixtureRequest) -> Path:
    """The `mklang/data` folder of the published wheel, fetched with pip once for the test run."""

    def fetch(folder: Path) -> None:
        fetched = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--disable-pip-version-check",
                RELEASE,
                "-d",
                folder,
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        wheels = sorted(folder.glob("mklang-*.whl"))
        if fetched.returncode != 0 or not wheels:
            why = (fetched.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            message = f"pip cannot fetch {RELEASE}: {why}"
            if os.environ.get("CI") == "true":
                pytest.fail(f"{message} (CI must run the 1.x compatibility tests)")
            pytest.skip(message)
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extractall(folder / "wheel")

    return built_once(request, "mklang-1x", fetch) / "wheel" / "mklang" / "data"


def compared_script_paths(folder: Path) -> dict[tuple[str, str], Path]:
    """Where the script each machine is compared with 1.x under each untrusted-flow policy is written."""
    return {
        (name, policy): folder / f"{name.replace('/', '-')}.{policy}.test.yaml"
        for name in MACHINES
        for policy in FLOW_POLICIES
    }


@pytest.fixture(scope="session")
def compared_scripts(wheel_data: Path, request: pytest.FixtureRequest) -> dict[tuple[str, str], Path]:
    """The script each machine is compared with 1.x under each untrusted-flow policy: its
    own, the console's with its hook scripted, and each with `run.on_untrusted_flow`."""

    def write(folder: Path) -> None:
        paths = compared_script_paths(folder)
        for name in MACHINES:
            script = yaml.safe_load((wheel_data / f"{name}.test.yaml").read_text(encoding="utf-8"))
            for scenario in script["scenarios"]:
                if name == "console/agent":
                    scenario.setdefault("hooks", {})["console_workspace_ready"] = [True]
            for policy in FLOW_POLICIES:
                for scenario in script["scenarios"]:
                    scenario.setdefault("run", {})["on_untrusted_flow"] = policy
                paths[(name, policy)].write_text(yaml.safe_dump(script), encoding="utf-8")

    return compared_script_paths(built_once(request, "scripts-1x", write))


@pytest.fixture(scope="session")
def runs_1x(wheel_data: Path, compared_scripts: dict[tuple[str, str], Path], request: pytest.FixtureRequest) -> dict:
    """Every compared scenario as the 1.x interpreter runs it, by "script:scenario"."""

    def run(folder: Path) -> None:
        pairs = [
            str(part) for (name, _), script in compared_scripts.items() for part in (wheel_data / f"{name}.mkl", script)
        ]
        env = {**os.environ, "PYTHONPATH": str(wheel_data.parents[1])}  # the unpacked wheel's `mklang` first
        done = subprocess.run(
            [sys.executable, str(INTERPRETER_1X), *pairs], capture_output=True, text=True, env=env, timeout=300
        )
        assert done.returncode == 0, done.stderr
        (folder / "runs.json").write_text(done.stdout, encoding="utf-8")

    return json.loads((built_once(request, "runs-1x", run) / "runs.json").read_text(encoding="utf-8"))


def cli(*args: str) -> tuple[int, str, str]:
    done = commands.cli(*args)
    return done.returncode, done.stdout, done.stderr


def test_the_wheel_ships_the_twelve_machines_with_their_scripts(wheel_data):
    shipped = sorted(str(path.relative_to(wheel_data).with_suffix("")) for path in wheel_data.rglob("*.mkl"))
    assert shipped == MACHINES
    assert all((wheel_data / f"{name}.test.yaml").is_file() for name in MACHINES)


@pytest.mark.parametrize("name", MACHINES)
def test_a_1x_machine_checks_and_converts_to_canonical_mk(wheel_data, name, tmp_path):
    source = wheel_data / f"{name}.mkl"
    code, _, err = cli("check", str(source))
    assert code == 0 and "0 errors" in err, err
    code, printed, err = cli("fmt", str(source))
    assert code == 0, err
    assert parse(printed) == load_file(source)
    # Every comment is kept (the header documents the machine's inputs), and stderr says the version is kept.
    comments = [
        line.strip() for line in source.read_text(encoding="utf-8").splitlines() if line.strip().startswith("#")
    ]
    assert comments and all(comment in printed for comment in comments)
    version = load_file(source).version
    upgrade = "" if version == LANGUAGE_VERSION else f"; this release's is {LANGUAGE_VERSION}: edit the line to upgrade"
    assert err == f"{source}: printed as .mk with its language version kept: mklang {version}{upgrade}\n"
    converted = tmp_path / f"{source.stem}.mk"
    converted.write_text(printed, encoding="utf-8")
    code, _, err = cli("check", str(converted))
    assert code == 0 and "0 errors" in err, err
    assert cli("fmt", "--check", str(converted))[0] == 0


def hooked_agent_script(wheel_data: Path, folder: Path) -> Path:
    """The console machine's script with the console's hook scripted true."""
    script = yaml.safe_load((wheel_data / "console" / "agent.test.yaml").read_text(encoding="utf-8"))
    for scenario in script["scenarios"]:
        scenario.setdefault("hooks", {})["console_workspace_ready"] = [True]
    hooked = folder / "agent.test.yaml"
    hooked.write_text(yaml.safe_dump(script), encoding="utf-8")
    return hooked


def run_script(source: Path, script: Path) -> tuple[int, list[dict], str]:
    code, out, err = cli("test", str(source), "--script", str(script), "--format", "json")
    return code, json.loads(out), err


@pytest.mark.parametrize("name", MACHINES)
def test_a_1x_machine_passes_its_own_script(wheel_data, name):
    source = wheel_data / f"{name}.mkl"
    code, outcomes, err = run_script(source, source.with_suffix(".test.yaml"))
    failed = {outcome["name"]: outcome for outcome in outcomes if not outcome["passed"]}
    if name != "console/agent":
        assert (code, failed) == (0, {}), err
        return
    assert code == 1 and set(failed) == AGENT_FAILURES
    assert len(outcomes) == len(AGENT_FAILURES) + 1  # `malformed-decision-halts` needs no hook and passes
    for outcome in failed.values():
        assert outcome["ended"] == CONSOLE_HOOK_FAILURE


def test_the_console_machine_lacks_only_the_console_hook(wheel_data, tmp_path):
    source = wheel_data / "console" / "agent.mkl"
    code, outcomes, err = run_script(source, hooked_agent_script(wheel_data, tmp_path))
    assert code == 0 and len(outcomes) == len(AGENT_FAILURES) + 1 and all(o["passed"] for o in outcomes), err


@pytest.mark.parametrize("policy", FLOW_POLICIES)
@pytest.mark.parametrize("name", MACHINES)
def test_a_1x_machine_takes_the_steps_the_1x_interpreter_takes(wheel_data, compared_scripts, runs_1x, name, policy):
    """Each scenario, run here and by 1.x itself under each untrusted-flow policy: the same
    outcome and, step by step, the same states, gates, policies, targets, reasoning and
    control-flow taint. By design, and invisible to the scripts, a state that fails
    (`state-error`) makes no step here, where 1.x recorded one, and its error is worded
    differently. The console machine runs with its hook scripted and the console's
    read-only tools named by the host, as the 1.x console names them."""
    machine = load_file(wheel_data / f"{name}.mkl")
    script = compared_scripts[(name, policy)]
    host_read_only = CONSOLE_READ_ONLY if name == "console/agent" else frozenset()
    for scenario in load_script(script):
        ran_1x = runs_1x[f"{script}:{scenario.name}"]
        host = Host.for_scenario(scenario)
        host.read_only_tools = host_read_only
        result = run_scenario(machine, scenario, host)
        assert result.status == STATUS_1X.get(ran_1x["status"], ran_1x["status"]), scenario.name
        steps_1x = [step for step in ran_1x["trace"] if step["policy"] != "state-error"]
        assert [step_keys(step) for step in result.trace] == [step_keys(step) for step in steps_1x], scenario.name
        if not str(result.error).startswith("state-error"):
            assert result.error == ran_1x["error"], scenario.name


def step_keys(step: dict) -> dict:
    return {key: step.get(key) for key in COMPARED_WITH_1X}
