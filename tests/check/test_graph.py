"""`mklang graph`: Mermaid and DOT diagrams of machines, with run traces overlaid (SVG: test_diagram.py)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import ROOT
from support.commands import cli
from support.graphs import RUN, triage

from mklang import graph

EXAMPLES = sorted([*ROOT.glob("examples/**/*.mk"), *ROOT.glob("machines/*.mk")])


def example_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


MERMAID_NODE = re.compile(r'^\s*state "[^"\n]*" as (\w+)$')
MERMAID_DESCRIPTION = re.compile(r"^\s*(\w+) : [^\n]+$")
MERMAID_EDGE = re.compile(r"^\s*(\[\*\]|\w+) --> (\w+)(?: : ([^\n]+))?$")
MERMAID_CLASS = re.compile(r"^\s*(classDef \w+ \S+|class (\w+) \w+)$")


def check_mermaid(text: str) -> list[tuple[str, str, str | None]]:
    """Parse the Mermaid subset the renderer emits; every line must be understood and
    every edge must join declared nodes. Returns the edges."""
    lines = text.splitlines()
    assert lines[0] == "stateDiagram-v2"
    declared: set[str] = set()
    edges, described, classed = [], [], []
    for line in lines[1:]:
        if line.strip().startswith("%%"):
            continue
        if node := MERMAID_NODE.match(line):
            declared.add(node.group(1))
        elif edge := MERMAID_EDGE.match(line):
            edges.append(edge.groups())
        elif description := MERMAID_DESCRIPTION.match(line):
            described.append(description.group(1))
        elif styled := MERMAID_CLASS.match(line):
            if styled.group(2):
                classed.append(styled.group(2))
        else:
            pytest.fail(f"unexpected Mermaid line: {line!r}")
    for source, target, label in edges:
        assert source == "[*]" or source in declared, source
        assert target in declared, target
        assert label is None or '"' not in label
    assert set(described) <= declared and set(classed) <= declared
    return edges


def check_dot(text: str) -> None:
    """Validate DOT with Graphviz itself; skipped (never faked) when it is not installed."""
    if shutil.which("dot") is None:
        pytest.skip("Graphviz `dot` is not installed")
    done = subprocess.run(["dot", "-Tcanon"], input=text, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_mermaid_of_model_is_structurally_valid(snapshot):
    text = graph.render(triage(), "mermaid")
    edges = check_mermaid(text)
    assert ("[*]", "s_classify", None) in edges
    assert ("s_draft", "s_draft", "the reply has gaps · repair 2") in edges
    assert ("s_draft", "t_fail", "otherwise · fail") in edges
    assert ("s_per_chunk", "m_summarize_doc", "calls") in edges
    assert "s_per_chunk : over chunks" in text and "s_vote : sample 3" in text
    assert "s_lookup : tool search_kb" in text
    assert text == snapshot


def test_dot_of_model(snapshot):
    text = graph.render(triage(), "dot")
    assert 's_draft -> t_fail [label="otherwise · fail"];' in text
    assert 's_per_chunk -> m_summarize_doc [label="calls", style="dashed", arrowhead="empty"];' in text
    assert text == snapshot
    check_dot(text)


def test_labels_are_escaped():
    machine = triage()
    text = graph.render(machine, "mermaid")
    assert "the category is #quot;billing#quot; · hook amount_ok" in text
    assert "no facts#59; none at all · escalate" in text
    dot = graph.render(machine, "dot")
    assert 'label="the category is \\"billing\\" · hook amount_ok"' in dot
    assert graph.escape_dot('a\\b\n"c"') == 'a\\\\b\\n\\"c\\"'
    check_dot(dot)


def test_trace_counts_visits_and_taken_edges():
    g = graph.build(triage(), graph.trace_of(RUN))
    visits = {node.title: node.visits for node in g.nodes}
    assert visits["classify"] == 1 and visits["draft"] == 2 and visits["lookup"] == 0
    taken = {(e.source, e.label): e.taken for e in g.edges}
    assert taken[("s_classify", "otherwise")] == 1
    assert taken[("s_classify", "the category is bug")] == 0
    assert taken[("s_draft", "the reply has gaps · repair 2")] == 1
    assert taken[("s_draft", "the reply resolves the request")] == 1
    mermaid = graph.to_mermaid(g)
    check_mermaid(mermaid)
    assert "s_draft : visits 2" in mermaid and "class s_draft visited" in mermaid
    assert "s_draft --> t_end : the reply resolves the request (1×)" in mermaid
    assert "class s_lookup visited" not in mermaid
    check_dot(graph.to_dot(g))


def test_checkpoint_uses_root_frame_trace():
    checkpoint = {"format": 1, "frames": [{"trace": RUN["trace"][:1]}, {"trace": [{"state": "x"}]}]}
    assert graph.trace_of(checkpoint) == RUN["trace"][:1]
    with pytest.raises(graph.UsageError):
        graph.trace_of({"status": "done"})


# ---------------------------------------------------------------- the CLI on real files


@pytest.mark.parametrize("path", EXAMPLES, ids=example_id)
def test_graph_of_every_example(path, snapshot):
    outputs = {}
    for fmt in ("mermaid", "dot"):
        result = cli("graph", str(path), "--format", fmt)
        assert result.returncode == 0, result.stderr
        outputs[fmt] = result.stdout
    check_mermaid(outputs["mermaid"])
    assert outputs == snapshot
    check_dot(outputs["dot"])


def write_machine(tmp_path: Path) -> Path:
    source = tmp_path / "loop.mk"
    source.write_text(
        "machine loop\nentry ask\nbudget 5\n\n"
        "state ask {\n"
        '  structure "One line."\n'
        '  prompt "Say it: {{topic}}"\n'
        "  output answer\n"
        '  when "the answer is short" repair 1 -> ask\n'
        "  otherwise -> END\n"
        "}\n"
    )
    return source


def test_cli_trace_and_errors(tmp_path):
    source = write_machine(tmp_path)
    run = tmp_path / "run.json"
    run.write_text(
        json.dumps(
            {
                "trace": [
                    {"state": "ask", "policy": "repair", "to": "ask", "gate": "the answer is short"},
                    {"state": "ask", "policy": "ok", "to": "END", "gate": "otherwise"},
                ]
            }
        )
    )
    done = cli("graph", str(source), "--trace", str(run))
    assert done.returncode == 0, done.stderr
    assert "s_ask : visits 2" in done.stdout
    assert "s_ask --> s_ask : the answer is short · repair 1 (1×)" in done.stdout
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    done = cli("graph", str(source), "--trace", str(bad))
    assert done.returncode == 2
    assert done.stderr.startswith(f"mklang: error: {bad}:1:2: invalid JSON")


def test_authoring_commands_import_their_code_lazily():
    """Registering `graph` and `lsp` loads neither the graph code, its layout, the lexer nor pygls."""
    probe = (
        "import sys, mklang.cli.authoring_cmds; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pygls', 'pygments', 'lsprotocol', 'grandalf') "
        "or m.startswith(('mklang.graph', 'mklang.diagram', 'mklang.lsp', 'mklang.highlight'))))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
