"""The fast paths keep the results of the slow ones (bench/slow_paths.py measures them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conformance.harness import Recorder, run_mk, write_machines
from support import ROOT
from support.runs import JUDGED_TWO_STATES

from mklang.errors import UsageError
from mklang.runs import start
from mklang.session import Host
from mklang.yaml_composer import compose_yaml

GROWING = """machine grow
entry write
budget 4
state write {
  structure "a line"
  prompt "write"
  output lines
  accumulate
  when "enough" hook enough -> END
  otherwise -> write
}
"""


def test_hooks_see_each_accumulated_output_in_the_runs_own_list_without_a_copy():
    seen: list[tuple[int, list[str]]] = []

    def enough(context, output):
        seen.append((id(context["lines"]), list(context["lines"])))
        return len(context["lines"]) == 3

    result = run_mk(GROWING, llm={"produce": ["a", "b", "c"]}, hooks={"enough": enough})
    assert result.status == "done"
    assert [lines for _, lines in seen] == [["a"], ["a", "b"], ["a", "b", "c"]]
    assert result.context["lines"] == ["a", "b", "c"]  # each output deposited once
    # The hook was shown the run's own list, grown in place, not a copy made for each step.
    assert {identity for identity, _ in seen[1:]} == {id(result.context["lines"])}


def test_a_hook_that_fails_leaves_the_context_without_the_output_it_was_shown():
    def enough(context, output):
        if len(context["lines"]) == 2:
            raise RuntimeError("no")
        return False

    result = run_mk(GROWING, llm={"produce": ["a", "b"]}, hooks={"enough": enough})
    assert (result.status, result.error) == ("halted", "state-error: hook: enough: no")
    assert result.context["lines"] == ["a"]


def yaml_files() -> list[Path]:
    """The YAML machines and scenario scripts of the repository."""
    return sorted(p for folder in ("examples", "machines") for p in (ROOT / folder).rglob("*.y*ml"))


def marks(node) -> list[tuple[int, int, int, int]]:
    """Every node's start and end position, depth first."""
    found = [(node.start_mark.line, node.start_mark.column, node.end_mark.line, node.end_mark.column)]
    children = node.value if isinstance(node.value, list) else []
    for child in children:
        for part in child if isinstance(child, tuple) else (child,):
            found += marks(part)
    return found


@pytest.mark.skipif(not hasattr(yaml, "CSafeLoader"), reason="PyYAML without libyaml: only the pure-Python loader")
@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: p.name)
def test_the_yaml_loader_reports_the_positions_of_the_pure_python_one(path):
    text = path.read_text(encoding="utf-8")
    assert marks(compose_yaml(text)) == marks(yaml.compose(text, Loader=yaml.SafeLoader))


def test_group_commit_fsyncs_the_journal_once_per_step_with_the_steps_calls_in_it(tmp_path, monkeypatch):
    from support.files import FsyncSpy, journal_path

    machine = write_machines(tmp_path, JUDGED_TWO_STATES)
    monkeypatch.setenv("MKLANG_DURABILITY", "step")
    spy = FsyncSpy(monkeypatch)
    result = start(machine, {}, Host(Recorder({"produce": ["1", "2"]})), checkpoint=tmp_path / "cp.json")
    assert result.status == "done"
    journal = str(journal_path(tmp_path / "cp.json"))
    commits = [content.decode().splitlines() for path, content in spy.synced if path == journal and content]
    assert len(commits) == len(result.trace) == 2
    for lines in commits:
        assert json.loads(lines[-1])["k"] == "step"  # the commit is the step line, with the calls before it
    committed_calls = {json.loads(line)["key"] for line in commits[-1] if json.loads(line)["k"] == "call"}
    assert len(committed_calls) == sum(result.calls.values()) == 3


def test_an_unknown_durability_is_a_usage_error(tmp_path, monkeypatch):
    machine = write_machines(tmp_path, JUDGED_TWO_STATES)
    monkeypatch.setenv("MKLANG_DURABILITY", "never")
    with pytest.raises(UsageError, match="MKLANG_DURABILITY must be call or step, not 'never'"):
        start(machine, {}, Host(Recorder({"produce": ["1"]})), checkpoint=tmp_path / "cp.json")


def test_parsing_pauses_the_cycle_collector_only_while_it_runs():
    import gc

    from mklang.errors import MkSyntaxError
    from mklang.syntax import parse

    assert gc.isenabled()
    parse(GROWING)
    assert gc.isenabled()
    with pytest.raises(MkSyntaxError):
        parse("machine m\nentry {\n")
    assert gc.isenabled()
    gc.disable()
    try:
        parse(GROWING)
        assert not gc.isenabled()  # a host that turned it off keeps it off
    finally:
        gc.enable()
