"""A machine as a diagram: Mermaid state diagram, Graphviz DOT, or SVG drawn here (`mklang.diagram`).

The renderers walk one neutral description (`DrawnGraph`) built from the model,
so the formats always show the same nodes, edges and labels and differ
only in syntax and escaping. A run trace (or a checkpoint's root frame)
overlays visit counts on the states and edges the run went through.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mklang.diagram import to_svg
from mklang.drawn import DrawnEdge, DrawnGraph, DrawnNode
from mklang.errors import UsageError
from mklang.model import Gate, Machine, State
from mklang.vocabulary import END

FORMATS = ("mermaid", "dot", "svg")
_START, _END, _FAIL = "start", "t_end", "t_fail"


def _state_id(name: str) -> str:
    """A node id safe in both formats; the `s_` prefix keeps states apart from terminals."""
    return "s_" + re.sub(r"[^A-Za-z0-9_]", lambda m: f"_{ord(m.group()):x}_", name)


def _machine_id(name: str) -> str:
    return "m" + _state_id(name)[1:]


def face_text(state: State) -> str:
    """What produces the output: `generative`, `call NAME` or `tool NAME`."""
    face = state.face
    if face.kind == "call":
        return f"call {face.machine}"
    if face.kind == "tool":
        return f"tool {face.tool}"
    return "generative"


def fan_out_text(state: State) -> str | None:
    if state.sample is not None:
        return f"sample {state.sample}"
    if state.over is not None:
        return f"over {state.over}"
    return None


def condition_text(gate: Gate) -> str:
    """`otherwise`, the `when` text, or the `when` text plus the hook deciding it."""
    if gate.when is None:
        return "otherwise"
    return f"{gate.when} · hook {gate.hook}" if gate.hook else gate.when


def policy_text(gate: Gate) -> str | None:
    """The policy as written, except `ok`, which is what an unlabelled arrow means."""
    if gate.policy == "repair":
        return f"repair {gate.repair}"
    return None if gate.policy == "ok" else gate.policy


def gate_label(gate: Gate) -> str:
    return " · ".join(part for part in (condition_text(gate), policy_text(gate)) if part)


def _node_of(target: str | None) -> str:
    """The node a transition goes to: a state, END, or fail (None)."""
    if target is None:
        return _FAIL
    return _END if target == END else _state_id(target)


def _transitions(gate: Gate) -> list[tuple[str | None, str, str | None]]:
    """Each transition of a gate as (target, label, answer): one for a plain gate, one per
    choice and one for the deadline of a human decision (the answer the trace records)."""
    if not gate.decides:
        return [(None if gate.policy == "fail" else gate.target, gate_label(gate), None)]
    found: list[tuple[str | None, str, str | None]] = [
        (c.target, f"{gate_label(gate)} · {c.label}", c.label) for c in gate.choices
    ]
    if gate.timeout is not None:
        found.append((gate.timeout.target, f"{gate_label(gate)} · within {gate.timeout.within}", None))
    return found


def _takes(step: dict, state: State, gate: Gate, target: str | None, answer: str | None) -> bool:
    """Whether a trace step went through this transition (its `gate` text disambiguates twins)."""
    decided = step.get("decision")
    return (
        step.get("state") == state.name
        and step.get("to") == target
        and step.get("gate", gate.label) == gate.label
        and (decided.get("choice") == answer if decided else step.get("policy") == gate.policy)
    )


def build(machine: Machine, trace: list[dict] | None = None) -> DrawnGraph:
    """The neutral graph of `machine`, with visit counts when a trace is given."""
    steps = trace or []
    visits = Counter(step.get("state") for step in steps)
    graph = DrawnGraph(machine.name, traced=trace is not None)
    graph.edges.append(DrawnEdge(_START, _state_id(machine.entry), "", "start"))
    uses_end = uses_fail = False
    called: list[str] = []
    for state in machine.states:
        lines = [face_text(state)]
        lines += [text for text in (fan_out_text(state),) if text]
        lines.append(f"output {state.output}")
        graph.nodes.append(DrawnNode(_state_id(state.name), state.name, tuple(lines), visits=visits[state.name]))
        for gate in state.gates:
            for to, label, answer in _transitions(gate):
                target = _node_of(to)
                uses_end |= target == _END
                uses_fail |= target == _FAIL
                taken = sum(_takes(step, state, gate, to, answer) for step in steps)
                graph.edges.append(DrawnEdge(_state_id(state.name), target, label, taken=taken))
        if state.face.kind == "call":
            if state.face.machine not in called:
                called.append(state.face.machine)
            graph.edges.append(DrawnEdge(_state_id(state.name), _machine_id(state.face.machine), "calls", "call"))
    graph.nodes += [DrawnNode(_machine_id(name), name, ("machine",), "machine") for name in called]
    if uses_end:
        graph.nodes.append(DrawnNode(_END, END, kind="end"))
    if uses_fail:
        graph.nodes.append(DrawnNode(_FAIL, "fail", kind="fail"))
    return graph


# ---------------------------------------------------------------- Mermaid

_MERMAID_ENTITIES = {
    '"': "#quot;",
    "#": "#35;",
    ";": "#59;",
    "<": "#lt;",
    ">": "#gt;",
    "{": "#123;",
    "}": "#125;",
    ":": "#58;",
}


def escape_mermaid(text: str) -> str:
    """Mermaid label text: entity codes for the characters its grammar treats specially."""
    text = " ".join(text.split())
    return "".join(_MERMAID_ENTITIES.get(char, char) for char in text)


def to_mermaid(graph: DrawnGraph) -> str:
    out = ["stateDiagram-v2", f"    %% machine {escape_mermaid(graph.name)}"]
    for node in graph.nodes:
        out.append(f'    state "{escape_mermaid(node.title)}" as {node.id}')
        for line in node.shown_lines(graph.traced):
            out.append(f"    {node.id} : {escape_mermaid(line)}")
    for edge in graph.edges:
        source = "[*]" if edge.source == _START else edge.source
        label = edge.shown_label(graph.traced)
        suffix = f" : {escape_mermaid(label)}" if label else ""
        out.append(f"    {source} --> {edge.target}{suffix}")
    out += [
        "    classDef terminal fill:#e8f5e9,stroke:#2e7d32",
        "    classDef failed fill:#ffebee,stroke:#c62828",
        "    classDef machine fill:#eceff1,stroke:#455a64,stroke-dasharray:4",
        "    classDef visited fill:#fff3c4,stroke:#b26a00,stroke-width:3px",
    ]
    classes = {"end": "terminal", "fail": "failed", "machine": "machine"}
    for node in graph.nodes:
        css = "visited" if graph.traced and node.visits else classes.get(node.kind)
        if css:
            out.append(f"    class {node.id} {css}")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- DOT


def escape_dot(text: str) -> str:
    """A DOT double-quoted string body: backslash and quote escaped, newlines as `\\n`."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _dot_attrs(**attrs: str) -> str:
    return "[" + ", ".join(f'{key}="{escape_dot(value)}"' for key, value in attrs.items()) + "]"


_DOT_NODE_STYLE = {
    "state": {"shape": "box", "style": "rounded"},
    "end": {"shape": "doublecircle", "style": "filled", "fillcolor": "#e8f5e9"},
    "fail": {"shape": "octagon", "style": "filled", "fillcolor": "#ffebee", "color": "#c62828"},
    "machine": {"shape": "component", "style": "dashed"},
}


def to_dot(graph: DrawnGraph) -> str:
    out = [
        f'digraph "{escape_dot(graph.name)}" {{',
        '    graph [rankdir="TB", fontname="Helvetica"];',
        '    node [fontname="Helvetica"];',
        '    edge [fontname="Helvetica", fontsize="10"];',
        f'    {_START} [shape="point"];',
    ]
    for node in graph.nodes:
        attrs = dict(_DOT_NODE_STYLE[node.kind], label="\n".join([node.title, *node.shown_lines(graph.traced)]))
        if graph.traced and node.visits:
            attrs.update(style="rounded,filled,bold", fillcolor="#fff3c4", penwidth="2")
        out.append(f"    {node.id} {_dot_attrs(**attrs)};")
    for edge in graph.edges:
        attrs = {"label": edge.shown_label(graph.traced)} if edge.label else {}
        if edge.kind == "call":
            attrs.update(style="dashed", arrowhead="empty")
        if graph.traced and edge.taken:
            attrs.update(color="#b26a00", penwidth="2.5")
        out.append(f"    {edge.source} -> {edge.target}" + (f" {_dot_attrs(**attrs)}" if attrs else "") + ";")
    out.append("}")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- traces


def trace_of(document: Any, sealed: Callable[[dict], list[dict]] | None = None) -> list[dict]:
    """The root trace of a run result (`trace`) or of a checkpoint (`frames[0].trace`).

    A checkpoint's root frame that names trace segments (format 3) holds only the
    steps after them: `sealed(frame)` gives its whole trace, read through its store.
    """
    if isinstance(document, dict):
        if isinstance(document.get("trace"), list):
            return document["trace"]
        frames = document.get("frames")
        if (
            isinstance(frames, list)
            and frames
            and isinstance(frames[0], dict)
            and isinstance(frames[0].get("trace"), list)
        ):
            if frames[0].get("segments") and sealed is not None:
                return sealed(frames[0])
            return frames[0]["trace"]
    raise UsageError("not the JSON of a run (`trace`) or of a checkpoint (`frames`)")


def load_trace(path: Path, machine: Machine, sealed: Callable[[dict], list[dict]] | None = None) -> list[dict]:
    """The trace in a run's JSON or a checkpoint (`sealed`: see `trace_of`); refused unless a run of `machine`."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise UsageError(f"{path}: cannot read: {error.strerror}") from error
    except json.JSONDecodeError as error:
        raise UsageError(f"{path}:{error.lineno}:{error.colno}: invalid JSON: {error.msg}") from error
    try:
        steps = trace_of(document, sealed)
    except UsageError as error:
        raise UsageError(f"{path}: {error}") from error
    owner = document.get("machine") if isinstance(document.get("machine"), dict) else {}
    if owner.get("name") not in (None, machine.name):
        raise UsageError(f"{path} is a run of machine '{owner['name']}', not of '{machine.name}'")
    unknown = sorted({str(step.get("state")) for step in steps} - {state.name for state in machine.states})
    if unknown:
        raise UsageError(f"{path} is not a run of '{machine.name}': it has no state {', '.join(unknown)}")
    return steps


RENDERERS: dict[str, Callable[[DrawnGraph], str]] = {"mermaid": to_mermaid, "dot": to_dot, "svg": to_svg}


def render(machine: Machine, fmt: str = "mermaid", trace: list[dict] | None = None) -> str:
    """The diagram of `machine` in `fmt` (one of FORMATS)."""
    return RENDERERS[fmt](build(machine, trace))
