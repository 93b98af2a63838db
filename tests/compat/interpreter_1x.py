"""Run scenario scripts with the mklang 1.x interpreter itself and print each run as JSON.

Started by test_wheel_1x.py in its own process, with the unpacked 1.4.0 wheel
first on PYTHONPATH, so `mklang` here is the 1.x package. Arguments: pairs
of a YAML machine and a scenario script. Output: one JSON map of
"script path:scenario name" to the run's status, error and trace.
"""

import json
import sys
from pathlib import Path

import yaml
from mklang.loader import load_machine
from mklang.registry import base_registry, load_path_registry
from mklang.scripttest import run_scenario

runs = {}
for path, script in zip(sys.argv[1::2], sys.argv[2::2], strict=True):
    machine = load_machine(path)
    registry = {**base_registry(), **load_path_registry(path, validate=False), machine.name: machine}
    for scenario in yaml.safe_load(Path(script).read_text(encoding="utf-8"))["scenarios"]:
        result = run_scenario(machine, registry, scenario)
        runs[f"{script}:{scenario['name']}"] = {"status": result.status, "error": result.error, "trace": result.trace}
print(json.dumps(runs, default=str))
