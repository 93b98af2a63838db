"""Runs every case of `tests/conformance/*.yaml` (format: tests/conformance/README.md).

Each case is a scenario of `mklang test` plus its machine source: it is
written to disk, loaded through `mklang.scenarios.load_script` (the same
validation `mklang test` applies), run through the run service as `mklang
test` runs it (`mklang.runs.start` with the scenario's scripted host, a
durable one with a real checkpoint) and compared with `mklang.scenarios.compare`.
Unlike `mklang test`, it does not check the root machine first: many cases pin
a halt of a root with no way to END (README.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conformance.harness import write_machines

from mklang.runs import start
from mklang.scenarios import SCENARIO_KEYS, compare, load_script
from mklang.session import Host

HERE = Path(__file__).parent
CASE_KEYS = SCENARIO_KEYS | {"source", "machines", "calls", "skip", "xfail"}


def _cases():
    for path in sorted(HERE.glob("*.yaml")):
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
        for case in document["cases"]:
            marks = []
            if "skip" in case:
                marks.append(pytest.mark.skip(reason=case["skip"]))
            if "xfail" in case:
                marks.append(pytest.mark.xfail(strict=True, reason=case["xfail"]))
            yield pytest.param(case, id=f"{path.stem}/{case['name']}", marks=marks)


CASES = list(_cases())


def test_every_feature_file_has_cases_with_unique_names():
    ids = [param.id for param in CASES]
    assert len(ids) == len(set(ids))
    assert {i.split("/")[0] for i in ids} == {p.stem for p in HERE.glob("*.yaml")}


@pytest.mark.parametrize("case", CASES)
def test_conformance(case, tmp_path):
    unknown = set(case) - CASE_KEYS
    assert not unknown, f"unknown case keys {sorted(unknown)}"
    machine = write_machines(tmp_path, case["source"], *case.get("machines", []))
    scenario_doc = {"scenarios": [{k: v for k, v in case.items() if k in SCENARIO_KEYS}]}
    script = tmp_path / "scenarios.yaml"
    script.write_text(yaml.safe_dump(scenario_doc, sort_keys=False), encoding="utf-8")
    (scenario,) = load_script(script)
    checkpoint = tmp_path / "checkpoint.json" if scenario.durable else None
    with Host.for_scenario(scenario) as host:
        result = start(machine, {}, host, checkpoint=checkpoint)
    problems = compare(scenario.expect, result)
    for kind, count in case.get("calls", {}).items():
        if host.provider.calls[kind] != count:
            problems.append(f"calls.{kind}: expected {count}, got {host.provider.calls[kind]}")
    assert not problems, "\n".join(problems)
