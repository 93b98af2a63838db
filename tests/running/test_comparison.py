"""`mklang diff`: the first step where two runs part ways, every differing step, the outcomes."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from support.commands import cli

MACHINE = """machine pipeline
entry outline
budget 10
state outline {
  structure "An outline."
  prompt "Outline the report."
  output outline
  otherwise -> write
}
state write {
  structure "A report."
  prompt "Write it from {{outline}}."
  output report
  when "the report needs sources" -> cite
  otherwise -> END
}
state cite {
  call cite_sources { text: "{{report}}" }
  output report
  otherwise -> END
}
"""
CITE = """machine cite_sources
entry find
budget 3
state find {
  structure "Sources."
  prompt "Find sources for {{text}}."
  output sources
  otherwise -> END
}
"""


def _run(folder: Path, name: str, produce: list[str], judge: list[object]) -> Path:
    """A run of the pipeline kept in `name`.json, answered by a script."""
    script = folder / f"{name}.yaml"
    script.write_text(
        yaml.safe_dump({"scenarios": [{"name": name, "llm": {"produce": produce, "judge": judge, "tokens": [10, 5]}}]})
    )
    checkpoint = folder / f"{name}.json"
    ran = cli(
        "run", "pipeline.mk", "--script", script.name, "--checkpoint", checkpoint.name, "--format", "json", cwd=folder
    )
    assert ran.returncode == 0, ran.stderr
    return checkpoint


def _project(tmp_path: Path) -> Path:
    (tmp_path / "pipeline.mk").write_text(MACHINE)
    (tmp_path / "cite_sources.mk").write_text(CITE)
    return tmp_path


def test_diff_finds_the_first_step_where_two_runs_part_at_one_gate(tmp_path):
    folder = _project(tmp_path)
    plain = _run(folder, "plain", ["1. intro", "The report."], ["none"])
    cited = _run(folder, "cited", ["1. intro", "The report.", "Three sources."], [0])
    found = cli("diff", plain.name, cited.name, "--format", "json", cwd=folder)
    assert found.returncode == 1, found.stderr
    difference = json.loads(found.stdout)
    assert difference["first_difference"] == "2"  # the outline is the same; `write`'s gate is not
    (write, only) = difference["steps"]
    assert write["state"] == "write" and write["fields"]["to"] == ["END", "cite"]
    assert write["fields"]["gate"] == ["otherwise", "the report needs sources"]
    assert only == {"step": "3", "only_in": "second", "state": "cite"}
    assert difference["outcome"]["result"] == ["The report.", "Three sources."]
    text = cli("diff", plain.name, cited.name, "--format", "text", cwd=folder)
    assert text.stdout.splitlines()[:3] == ["first difference at step 2", "step 2 (write):", "  to: END | cite"]


def test_diff_of_a_run_with_itself_or_its_twin_finds_nothing(tmp_path):
    folder = _project(tmp_path)
    first = _run(folder, "first", ["1. intro", "The report.", "Sources."], [0])
    twin = _run(folder, "twin", ["1. intro", "The report.", "Sources."], [0])
    same = cli("diff", first.name, twin.name, "--format", "json", cwd=folder)
    assert same.returncode == 0 and json.loads(same.stdout) == {
        "same": True,
        "first_difference": None,
        "steps": [],
        "outcome": {},
    }


def test_diff_names_a_difference_inside_a_called_machine_by_its_path(tmp_path):
    folder = _project(tmp_path)
    one = _run(folder, "one", ["1. intro", "The report.", "Sources A."], [0])
    other = _run(folder, "other", ["1. intro", "The report.", "Sources B."], [0])
    difference = json.loads(cli("diff", one.name, other.name, "--format", "json", cwd=folder).stdout)
    assert difference["first_difference"] == "3"  # the call step's output (its result) differs
    assert [step["step"] for step in difference["steps"]] == ["3", "3.sub_trace.1"]
    assert difference["steps"][1]["fields"]["output"] == ["Sources A.", "Sources B."]


def test_diff_refuses_a_run_it_cannot_trust_and_prints_no_escape(tmp_path):
    folder = _project(tmp_path)
    mine = _run(folder, "mine", ["1. intro", "\x1b[2Jcleared"], ["none"])
    other = _run(folder, "other", ["1. intro", "fine"], ["none"])
    text = cli("diff", mine.name, other.name, "--format", "text", cwd=folder)
    assert "\x1b" not in text.stdout and "cleared" in text.stdout
    tampered = json.loads(other.read_text())
    tampered["result"] = "forged"
    other.write_text(json.dumps(tampered))
    refused = cli("diff", mine.name, other.name, "--format", "text", cwd=folder)
    assert refused.returncode == 2 and "nothing to compare" in refused.stderr, refused.stderr
