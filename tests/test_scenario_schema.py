"""docs/scenarios.schema.json says what `mklang test` accepts: every shipped script validates, every
script the loader refuses the schema refuses too; and a list under a keyed answer is pointed out."""

from __future__ import annotations

import json

import jsonschema
import pytest
import yaml
from support import ROOT
from support.commands import cli

from mklang.errors import UsageError
from mklang.scenario_schema import script_schema
from mklang.scenarios import load_script

SCHEMA = json.loads((ROOT / "docs" / "scenarios.schema.json").read_text(encoding="utf-8"))
SCRIPTS = sorted(
    path
    for pattern in ("examples/**/*.yaml", "machines/*.yaml", "tests/**/*.yaml")
    for path in ROOT.glob(pattern)
    if path.read_text(encoding="utf-8").lstrip().startswith(("scenarios:", "#")) and "scenarios:" in path.read_text()
)


def test_the_published_schema_is_the_one_the_loader_tables_make():
    assert script_schema() == SCHEMA


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_script_the_loader_reads_validates_against_the_schema(path):
    try:
        load_script(path)
    except UsageError:
        pytest.skip("a script the tests mean to be wrong")
    jsonschema.validate(yaml.safe_load(path.read_text(encoding="utf-8")), SCHEMA)


BAD = {
    "typo": {"name": "a", "llm": {"prodcue": ["x"]}},
    "status": {"name": "a", "expect": {"status": "finished"}},
    "budget": {"name": "a", "run": {"max_tokens": -1}},
    "flag": {"name": "a", "run": {"checkpoint": "yes"}},
    "policy": {"name": "a", "run": {"on_untrusted_flow": "maybe"}},
    "unnamed": {"input": {}},
    "resumes": {"name": "a", "resumes": {"set": {}}},
    "trace-key": {"name": "a", "expect": {"trace": [{"stat": "x"}]}},
    "resume-key": {"name": "a", "resumes": [{"sett": {}}]},
}


@pytest.mark.parametrize("scenario", BAD.values(), ids=BAD.keys())
def test_what_the_loader_refuses_the_schema_refuses(tmp_path, scenario):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"scenarios": [scenario]}))
    with pytest.raises(UsageError):
        load_script(path)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"scenarios": [scenario]}, SCHEMA)


TRAP = """scenarios:
  - name: in-turn
    input: {ticket: {body: "I was charged twice", amount: 42}}
    llm:
      produce: {"Classify": ["billing", "bug"]}
      judge: [0]
    hooks: {amount_ok: [true]}
"""
TRAP_NOTE = (
    """note: 'llm.produce."Classify"' is a list under a key: that is one structured answer (sent as the JSON """
    "array), not answers in turn; for answers in turn give 'llm.produce' a list, or a key of its own to each"
)


def test_a_failing_scenario_with_a_list_under_a_keyed_answer_says_it_is_one_answer(tmp_path):
    (tmp_path / "trap.yaml").write_text(TRAP)
    machine = ROOT / "examples" / "triage" / "triage.mk"
    done = cli("test", str(machine), "--script", "trap.yaml", cwd=tmp_path)
    assert done.returncode == 1
    assert TRAP_NOTE in [line.strip() for line in done.stdout.splitlines()], done.stdout
    shown = json.loads(cli("test", str(machine), "--script", "trap.yaml", "--format", "json", cwd=tmp_path).stdout)
    assert TRAP_NOTE in shown[0]["problems"]


def test_a_passing_scenario_is_not_told_of_its_keyed_list_answers(tmp_path):
    script = TRAP.replace('{"Classify": ["billing", "bug"]}', '{"Classify": "billing", "Reply": ["a", "b"]}')
    (tmp_path / "meant.yaml").write_text(
        script.replace("name: in-turn", "name: meant") + """    expect: {result: '["a", "b"]'}\n"""
    )
    done = cli("test", str(ROOT / "examples" / "triage" / "triage.mk"), "--script", "meant.yaml", cwd=tmp_path)
    assert done.returncode == 0 and "note:" not in done.stdout, done.stdout
