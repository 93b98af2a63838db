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


def test_the_first_command_runs_an_example_offline_from_its_scenario_script():
    first = re.findall(r"```sh\n(.*?)```", README, re.S)[0]
    assert "mklang run examples/" in first and "--script" in first and "--scenario" in first
