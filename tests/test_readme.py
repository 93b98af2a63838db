"""README.md keeps its promises: the Python example runs and prints what it says."""

from __future__ import annotations

import contextlib
import io
import os
import re

from support import ROOT

README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_python_api_example_runs_as_shown():
    api = README[README.index("## Python API") :]
    code = re.search(r"```python\n(.*?)```", api, re.S).group(1)
    promised = re.search(r"# (.+)$", code.strip().splitlines()[-1]).group(1)
    output = io.StringIO()
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(output):
            exec(compile(code, "README.md", "exec"), {})
    finally:
        os.chdir(cwd)
    assert output.getvalue().strip() == promised


SH_BLOCKS = re.findall(r"```sh\n(.*?)```", README, re.S)


def test_the_first_command_makes_a_venv_installs_the_runtime_only_and_runs_an_example_offline():
    first = SH_BLOCKS[0]
    assert first.startswith("python3 -m venv .venv && . .venv/bin/activate && ")
    assert "pip install -e . &&" in first and "[dev]" not in first
    assert "mklang run examples/" in first and "--script" in first and "--scenario" in first


def test_the_second_command_activates_the_venv_of_the_first_and_installs_the_test_tools():
    """.ci/run runs each command in a bash of its own: the second activates the venv again."""
    second = SH_BLOCKS[1]
    assert second.startswith(". .venv/bin/activate && pip install -e '.[dev]' && python -m pytest")


def test_ci_runs_the_gates_inside_the_readme_venv():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    gates = [line for line in ci.splitlines() if re.match(r'run ".*\b(ruff|mypy)\b', line)]
    assert len(gates) == 4 and all(line.startswith('run "$in_venv ') for line in gates)
    assert 'in_venv=". .venv/bin/activate &&"' in ci
