"""`mklang graph --format svg`: a drawing made in Python (no Graphviz), every state a node, every
transition an edge, the path a run took highlighted, nothing drawn over anything else."""

from __future__ import annotations

import json
import threading
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from support import ROOT
from support.commands import cli
from support.graphs import RUN, big_machine, triage

from mklang import graph
from mklang.diagram import to_svg
from mklang.syntax import load_file, parse

SVG = "{http://www.w3.org/2000/svg}"
Box = tuple[float, float, float, float]  # left, top, right, bottom


def parts(svg: str) -> tuple[ET.Element, dict[str, ET.Element], list[ET.Element]]:
    """The parsed drawing, its nodes by id and its edges."""
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG}svg"
    groups = list(root.iter(f"{SVG}g"))
    nodes = {g.attrib["data-id"]: g for g in groups if "node" in g.attrib["class"].split() and "data-id" in g.attrib}
    edges = [g for g in groups if "edge" in g.attrib["class"].split()]
    return root, nodes, edges


def title(group: ET.Element) -> str:
    return group.findtext(f"{SVG}title") or ""


def words(group: ET.Element) -> str:
    """The text drawn in a group, its lines joined by spaces."""
    return " ".join(text.text or "" for text in group.iter(f"{SVG}text"))


def box(shape: ET.Element) -> Box:
    """The bounding box of a `<rect>` or `<polygon>`."""
    if shape.tag == f"{SVG}polygon":
        points = [tuple(map(float, pair.split(","))) for pair in shape.attrib["points"].split()]
        xs, ys = [x for x, _ in points], [y for _, y in points]
        return (min(xs), min(ys), max(xs), max(ys))
    x, y = float(shape.attrib["x"]), float(shape.attrib["y"])
    return (x, y, x + float(shape.attrib["width"]), y + float(shape.attrib["height"]))


def overlap(a: Box, b: Box) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def check_drawing(svg: str, machine_graph: graph._Graph) -> tuple[dict[str, ET.Element], list[ET.Element]]:
    """Every node and edge of the neutral graph is drawn once, inside the picture, and no node or
    label lies over another one."""
    root, nodes, edges = parts(svg)
    assert {node.id: node.title for node in machine_graph.nodes} == {key: title(g) for key, g in nodes.items()}
    drawn = sorted((g.attrib["data-source"], g.attrib["data-target"]) for g in edges)
    assert drawn == sorted((edge.source, edge.target) for edge in machine_graph.edges)
    _, _, width, height = map(float, root.attrib["viewBox"].split())
    shapes = [box(next(s for s in g if s.tag in (f"{SVG}rect", f"{SVG}polygon"))) for g in nodes.values()]
    shapes += [box(rect) for g in edges for rect in g.iter(f"{SVG}rect")]  # the labels' backgrounds
    for number, shape in enumerate(shapes):
        assert shape[0] >= 0 and shape[1] >= 0 and shape[2] <= width and shape[3] <= height, shape
        assert not [other for other in shapes[number + 1 :] if overlap(shape, other)], shape
    return nodes, edges


@pytest.mark.parametrize(
    "path", sorted([*ROOT.glob("examples/**/*.mk"), *ROOT.glob("machines/*.mk")]), ids=lambda p: p.name
)
def test_every_example_is_drawn_whole_and_readable(path):
    built = graph.build(load_file(path))
    check_drawing(to_svg(built), built)


def test_a_big_machine_with_loops_jumps_and_fail_is_drawn_whole(tmp_path):
    machine = parse(big_machine(), "big.mk")
    built = graph.build(machine)
    nodes, edges = check_drawing(to_svg(built), built)
    assert len(nodes) == 55 + 2  # the states, END and fail
    assert sum(g.attrib["data-source"] == g.attrib["data-target"] for g in edges) == 8  # repairs
    assert len(edges) == sum(len(state.gates) for state in machine.states) + 1  # and the entry


def test_the_cli_draws_svg_without_graphviz_on_the_path(tmp_path, monkeypatch):
    """No `dot` anywhere: the CLI draws the path a run took (its visits and the gates it went through)."""
    source = tmp_path / "big.mk"
    source.write_text(big_machine())
    steps = [{"state": f"s{i}", "policy": "ok", "to": f"s{i + 1}", "gate": "otherwise"} for i in range(5)]
    steps.insert(4, {"state": "s3", "policy": "repair", "to": "s3", "gate": "it is still bad 3"})
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"trace": steps}))
    monkeypatch.setenv("PATH", str(tmp_path))
    done = cli("graph", str(source), "--format", "svg", "--trace", str(run))
    assert done.returncode == 0, done.stderr
    nodes, edges = check_drawing(done.stdout, graph.build(load_file(source), steps))
    visited = {key for key, g in nodes.items() if "visited" in g.attrib["class"].split()}
    assert visited == {f"s_s{i}" for i in range(5)}
    taken = {(g.attrib["data-source"], g.attrib["data-target"]) for g in edges if "taken" in g.attrib["class"]}
    assert taken == {("start", "s_s0"), ("s_s3", "s_s3"), *((f"s_s{i}", f"s_s{i + 1}") for i in range(5))}
    repair = next(g for g in edges if g.attrib["data-source"] == g.attrib["data-target"] == "s_s3")
    assert "it is still bad 3 · repair 2 (1×)" in words(repair)
    assert 'stroke="#b26a00"' in ET.tostring(repair, encoding="unicode")


def test_the_trace_overlay_marks_visits_terminals_and_counts():
    built = graph.build(triage(), RUN["trace"])
    nodes, edges = check_drawing(to_svg(built), built)
    visited = {title(g) for g in nodes.values() if "visited" in g.attrib["class"].split()}
    assert visited == {"classify", "draft", "END"}
    assert "visits 2" in words(nodes["s_draft"])
    taken = sorted(title(g) for g in edges if "taken" in g.attrib["class"].split())
    assert taken == ["classify → draft", "draft → END", "draft → draft", "start → classify"]
    untraced = to_svg(graph.build(triage()))
    assert "visited" not in untraced and "taken" not in untraced.replace("arrow-taken", "")


def test_calls_fan_out_and_fail_are_drawn_as_such():
    _, nodes, edges = parts(to_svg(graph.build(triage())))
    assert nodes["m_summarize_doc"].attrib["class"] == "node machine"
    assert nodes["t_fail"].find(f"{SVG}polygon") is not None and nodes["t_end"].attrib["class"] == "node end"
    call = next(g for g in edges if g.attrib["data-target"] == "m_summarize_doc")
    assert "call" in call.attrib["class"].split() and call.find(f"{SVG}path").attrib["stroke-dasharray"]
    assert words(nodes["s_per_chunk"]) == "per_chunk call summarize_doc over chunks output summaries"
    assert "sample 3" in words(nodes["s_vote"])


def test_hostile_labels_stay_text():
    """Names and conditions are the machine author's: markup in them is escaped, never drawn."""
    text = (
        'machine x\nentry a\nbudget 3\nstate a {\n  structure "s"\n  prompt "p"\n  output o\n'
        '  when "</text><script>alert(1)</script> & \\"q\\"" -> END\n  otherwise fail\n}\n'
    )
    svg = to_svg(graph.build(parse(text, "x.mk")))
    root, _, edges = parts(svg)
    assert root.find(f".//{SVG}script") is None
    assert any('</text><script>alert(1)</script>&"q"' in words(g).replace(" ", "") for g in edges)


def test_drawings_made_at_once_in_threads_are_the_drawings_made_alone():
    """grandalf counts vertices in a class attribute: the layout is serialised, not interleaved."""
    built = graph.build(parse(big_machine(20), "big.mk"))
    alone = to_svg(built)
    drawn: list[str] = []
    threads = [threading.Thread(target=lambda: drawn.append(to_svg(built))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert drawn == [alone] * 4


def test_the_same_machine_is_drawn_the_same_every_time(tmp_path: Path):
    source = tmp_path / "big.mk"
    source.write_text(big_machine(30))
    first = cli("graph", str(source), "--format", "svg").stdout
    assert first == cli("graph", str(source), "--format", "svg").stdout and first.startswith("<svg")
