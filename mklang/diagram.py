"""A machine's graph drawn as SVG in Python, so that a picture needs no system program (ADR 0049).

grandalf lays the graph out in layers (Sugiyama, as Graphviz's `dot` does) and this module draws
it. Every labelled edge goes through a vertex of its label's size, so that the layout keeps room
for labels and no label lies over a state or another label; a self-loop (a repair) is drawn on
its state's right, in room the state's vertex reserves. The drawing is the same on every machine:
no font metrics, no subprocess. The path a run took is drawn in the highlight colour, with counts.
"""

from __future__ import annotations

import textwrap
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from xml.sax.saxutils import escape, quoteattr

if TYPE_CHECKING:
    from mklang.drawn import DrawnEdge, DrawnGraph, DrawnNode

Point = tuple[float, float]

FONT = "Helvetica, Arial, sans-serif"
TITLE_SIZE, LINE_SIZE, LABEL_SIZE = 13.0, 11.0, 11.0
LEADING = 1.35  # line height over font size
PAD_X, PAD_Y = 12.0, 7.0
LABEL_WRAP = 30  # characters on one line of an edge label
LOOP_REACH = 34.0  # how far a self-loop goes out of its state
MARGIN, COMPONENT_GAP = 16.0, 40.0
INK, MUTED, PAPER = "#263238", "#546e7a", "#ffffff"
TAKEN, VISITED = "#b26a00", "#fff3c4"
NODE_STYLE = {  # kind: (fill, stroke, dash)
    "state": (PAPER, "#455a64", ""),
    "end": ("#e8f5e9", "#2e7d32", ""),
    "fail": ("#ffebee", "#c62828", ""),
    "machine": ("#eceff1", "#455a64", "5,3"),
}
# grandalf numbers vertices in a class attribute while it looks for cycles: one layout at a time.
_LAYOUT = threading.Lock()

_NARROW, _WIDE = set("fijlrt.,:;'|!()[] "), set("mwMW@")


def text_width(text: str, size: float) -> float:
    """An upper estimate of `text`'s width in a sans-serif font, the same on every machine."""
    ems = sum(0.33 if c in _NARROW else 0.9 if c in _WIDE else 0.68 if c.isupper() else 0.58 for c in text)
    return ems * size


@dataclass
class _Box:
    """A vertex's size for grandalf, and where it put the vertex's centre (`xy`)."""

    w: float
    h: float
    xy: Point = (0.0, 0.0)


@dataclass
class _Route:
    """An edge for grandalf: it records the points of the edge's path (through dummy vertices)."""

    points: list[Point] = field(default_factory=list)

    def setpath(self, points: Sequence[Point]) -> None:
        self.points = [(float(x), float(y)) for x, y in points]


@dataclass
class _Placed:
    """A node of the drawing: its box, where it stands, and its self-loops' labels."""

    node: DrawnNode
    w: float
    h: float
    loops: list[DrawnEdge]
    loop_labels: list[list[str]]
    box: _Box = field(init=False)

    def __post_init__(self) -> None:
        reserve = max((LOOP_REACH + 6 + _label_size(lines)[0] for lines in self.loop_labels), default=0.0)
        self.box = _Box(self.w + reserve, max(self.h, sum(_label_size(lines)[1] for lines in self.loop_labels)))

    @property
    def centre(self) -> Point:
        """The centre of the node itself, left of the room its self-loops take."""
        x, y = self.box.xy
        return (x - (self.box.w - self.w) / 2, y)


def _wrapped(label: str) -> list[str]:
    return textwrap.wrap(label, LABEL_WRAP, break_long_words=True) or [label]


def _label_size(lines: list[str]) -> tuple[float, float]:
    width = max((text_width(line, LABEL_SIZE) for line in lines), default=0.0)
    return (width + 8, len(lines) * LABEL_SIZE * LEADING + 4)


def _node_size(node: DrawnNode, traced: bool) -> tuple[float, float]:
    if node.kind == "end":
        return (max(46.0, text_width(node.title, TITLE_SIZE) + 2 * PAD_X), 34.0)
    lines = node.shown_lines(traced)
    width = max([text_width(node.title, TITLE_SIZE), *(text_width(line, LINE_SIZE) for line in lines)])
    height = TITLE_SIZE * LEADING + len(lines) * LINE_SIZE * LEADING
    return (width + 2 * PAD_X, height + 2 * PAD_Y)


def _layout(boxes: list[_Box], links: list[tuple[int, int, _Route]], roots: set[int]) -> None:
    """Place `boxes` in layers, each connected part apart, left to right; `links` get their paths."""
    from grandalf.graphs import Edge, Graph, Vertex
    from grandalf.layouts import SugiyamaLayout

    vertices = [Vertex(index) for index in range(len(boxes))]
    for vertex, box in zip(vertices, boxes, strict=True):
        vertex.view = box
    edges = []
    for source, target, route in links:
        edge = Edge(vertices[source], vertices[target])
        edge.view = route
        edges.append(edge)
    left = 0.0
    with _LAYOUT:
        for part in Graph(vertices, edges).C:
            layout = SugiyamaLayout(part)
            layout.xspace, layout.yspace = 24, 30
            layout.init_all(roots=[vertex for vertex in part.sV if vertex.data in roots] or None)
            layout.draw(3)
            members = [boxes[vertex.data] for vertex in part.sV]
            bends = [x for edge in part.sE for x, _ in edge.view.points]
            low = min([*(box.xy[0] - box.w / 2 for box in members), *bends])
            high = max([*(box.xy[0] + box.w / 2 for box in members), *bends])
            for box in members:
                box.xy = (box.xy[0] - low + left, box.xy[1])
            for edge in part.sE:
                edge.view.setpath([(x - low + left, y) for x, y in edge.view.points])
            left += high - low + COMPONENT_GAP


def _clip(centre: Point, half: Point, towards: Point) -> Point:
    """Where the segment from a box's centre towards a point leaves the box."""
    (cx, cy), (hw, hh), (tx, ty) = centre, half, towards
    dx, dy = tx - cx, ty - cy
    if dx == 0 and dy == 0:
        return centre
    scale = min(hw / abs(dx) if dx else float("inf"), hh / abs(dy) if dy else float("inf"))
    return (cx + dx * min(scale, 1.0), cy + dy * min(scale, 1.0))


def _smooth(points: list[Point]) -> str:
    """An SVG path through `points`: straight for two, a Catmull-Rom curve for more."""
    head = f"M{points[0][0]:.1f},{points[0][1]:.1f}"
    if len(points) == 2:
        return f"{head} L{points[1][0]:.1f},{points[1][1]:.1f}"
    parts = [head]
    padded = [points[0], *points, points[-1]]
    for i in range(1, len(padded) - 2):
        (x0, y0), (x1, y1), (x2, y2), (x3, y3) = padded[i - 1 : i + 3]
        c1 = (x1 + (x2 - x0) / 6, y1 + (y2 - y0) / 6)
        c2 = (x2 - (x3 - x1) / 6, y2 - (y3 - y1) / 6)
        parts.append(f"C{c1[0]:.1f},{c1[1]:.1f} {c2[0]:.1f},{c2[1]:.1f} {x2:.1f},{y2:.1f}")
    return " ".join(parts)


def _text(lines: Iterable[tuple[str, float, str]], x: float, top: float, anchor: str = "middle") -> list[str]:
    """`<text>` elements, one per (text, size, weight), stacked from `top`."""
    out, y = [], top
    for line, size, weight in lines:
        y += size * LEADING
        bold = ' font-weight="bold"' if weight == "bold" else ""
        fill = INK if weight else MUTED
        out.append(
            f'<text x="{x:.1f}" y="{y - size * 0.3:.1f}" font-size="{size:g}" text-anchor="{anchor}"'
            f' fill="{fill}"{bold}>{escape(line)}</text>'
        )
    return out


class _Drawing:
    """One SVG drawing of a neutral graph."""

    def __init__(self, graph: DrawnGraph) -> None:
        self.graph = graph
        self.placed: dict[str, _Placed] = {}
        self.reached = {edge.target for edge in graph.edges if edge.taken}
        for node in graph.nodes:
            loops = [edge for edge in graph.edges if edge.source == node.id == edge.target]
            labels = [_wrapped(edge.shown_label(graph.traced)) for edge in loops]
            self.placed[node.id] = _Placed(node, *_node_size(node, graph.traced), loops, labels)
        self.starts = {edge.source for edge in graph.edges if edge.kind == "start"}
        self.start_box = {source: _Box(14.0, 14.0) for source in self.starts}
        self.labels: dict[int, tuple[list[str], _Box]] = {}
        self.routes: dict[int, list[_Route]] = {}
        self._lay_out()

    def box_of(self, node_id: str) -> _Box:
        return self.start_box[node_id] if node_id in self.start_box else self.placed[node_id].box

    def _lay_out(self) -> None:
        boxes = [*self.start_box.values(), *(placed.box for placed in self.placed.values())]
        index = {id(box): number for number, box in enumerate(boxes)}
        links: list[tuple[int, int, _Route]] = []
        for number, edge in enumerate(self.graph.edges):
            if edge.source == edge.target:
                continue
            source, target = index[id(self.box_of(edge.source))], index[id(self.box_of(edge.target))]
            if not edge.label:
                self.routes[number] = [_Route()]
                links.append((source, target, self.routes[number][0]))
                continue
            lines = _wrapped(edge.shown_label(self.graph.traced))
            label = _Box(*_label_size(lines))
            self.labels[number] = (lines, label)
            index[id(label)] = len(boxes)
            boxes.append(label)
            self.routes[number] = [_Route(), _Route()]
            links += [
                (source, index[id(label)], self.routes[number][0]),
                (index[id(label)], target, self.routes[number][1]),
            ]
        _layout(boxes, links, {index[id(box)] for box in self.start_box.values()})
        routes = [route for pair in self.routes.values() for route in pair]
        low_y = min(box.xy[1] - box.h / 2 for box in boxes)
        for box in boxes:
            box.xy = (box.xy[0] + MARGIN, box.xy[1] - low_y + MARGIN)
        for route in routes:
            route.setpath([(x + MARGIN, y - low_y + MARGIN) for x, y in route.points])
        for edge in self.graph.edges:  # the entry arrow straight down, not to the room of the entry's loops
            if edge.kind == "start":
                start = self.start_box[edge.source]
                start.xy = (self.placed[edge.target].centre[0], start.xy[1])
        bends = [point for route in routes for point in route.points]
        self.width = max([*(box.xy[0] + box.w / 2 for box in boxes), *(x for x, _ in bends)]) + MARGIN
        self.height = max([*(box.xy[1] + box.h / 2 for box in boxes), *(y for _, y in bends)]) + MARGIN

    def _ends(self, node_id: str) -> tuple[Point, Point]:
        """The centre and half-size of what an edge touches at `node_id`: the node, not its loops' room."""
        if node_id in self.start_box:
            box = self.start_box[node_id]
            return box.xy, (7.0, 7.0)
        placed = self.placed[node_id]
        return placed.centre, (placed.w / 2, placed.h / 2)

    def _edge_path(self, number: int, edge: DrawnEdge) -> list[Point]:
        points = [point for route in self.routes[number] for point in route.points]
        points = [p for i, p in enumerate(points) if i == 0 or p != points[i - 1]]
        (source, source_half), (target, target_half) = self._ends(edge.source), self._ends(edge.target)
        points[0], points[-1] = source, target
        if len(points) == 2 and edge.kind != "start" and number not in self.labels:
            points.insert(1, ((source[0] + target[0]) / 2, (source[1] + target[1]) / 2))
        points[0] = _clip(source, source_half, points[1])
        points[-1] = _clip(target, target_half, points[-2])
        return points

    def svg(self) -> str:
        out = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width:.0f}" height="{self.height:.0f}"'
            f' viewBox="0 0 {self.width:.1f} {self.height:.1f}" font-family="{FONT}" role="img">',
            f"<title>machine {escape(self.graph.name)}</title>",
            "<defs>",
            *(
                f'<marker id="arrow-{name}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="9" markerHeight="9"'
                f' markerUnits="userSpaceOnUse" orient="auto-start-reverse">'
                f'<path d="M0,0 L10,5 L0,10 z" fill="{colour}"/></marker>'
                for name, colour in (("plain", MUTED), ("taken", TAKEN))
            ),
            "</defs>",
            f'<rect width="100%" height="100%" fill="{PAPER}"/>',
        ]
        for number, edge in enumerate(self.graph.edges):
            if edge.source != edge.target:
                out += self._edge(number, edge)
        for placed in self.placed.values():
            out += self._loops(placed)
        for source in self.starts:
            x, y = self.start_box[source].xy
            out.append(f'<g class="node start"><circle cx="{x:.1f}" cy="{y:.1f}" r="7" fill="{INK}"/></g>')
        for placed in self.placed.values():
            out += self._node(placed)
        out.append("</svg>")
        return "\n".join(out) + "\n"

    def _edge(self, number: int, edge: DrawnEdge) -> list[str]:
        taken = bool(edge.taken) or (edge.kind == "start" and edge.target in self._visited())
        out = [self._open_edge(edge, taken), self._stroke(_smooth(self._edge_path(number, edge)), edge, taken)]
        if number in self.labels:
            lines, box = self.labels[number]
            out += self._label(lines, box.xy, taken)
        out.append("</g>")
        return out

    def _visited(self) -> set[str]:
        return {node.id for node in self.graph.nodes if node.visits}

    def _open_edge(self, edge: DrawnEdge, taken: bool) -> str:
        names = {node.id: node.title for node in self.graph.nodes}
        title = f"{names.get(edge.source, 'start')} → {names[edge.target]}"
        classes = " ".join(["edge", edge.kind, *(["taken"] if taken else [])])
        return (
            f"<g class={quoteattr(classes)} data-source={quoteattr(edge.source)} data-target={quoteattr(edge.target)}>"
            f"<title>{escape(title)}</title>"
        )

    def _stroke(self, path: str, edge: DrawnEdge, taken: bool) -> str:
        colour, width = (TAKEN, 2.5) if taken else (MUTED, 1.3)
        dash = ' stroke-dasharray="5,3"' if edge.kind == "call" else ""
        return (
            f'<path d="{path}" fill="none" stroke="{colour}" stroke-width="{width}"{dash}'
            f' marker-end="url(#arrow-{"taken" if taken else "plain"})"/>'
        )

    def _label(self, lines: list[str], centre: Point, taken: bool) -> list[str]:
        width, height = _label_size(lines)
        x, y = centre
        weight = "bold" if taken else ""
        return [
            f'<rect x="{x - width / 2:.1f}" y="{y - height / 2:.1f}" width="{width:.1f}" height="{height:.1f}"'
            f' rx="3" fill="{PAPER}" fill-opacity="0.9"/>',
            *_text(((line, LABEL_SIZE, weight) for line in lines), x, y - height / 2 + 2),
        ]

    def _node(self, placed: _Placed) -> list[str]:
        node, traced = placed.node, self.graph.traced
        visited = bool(node.visits) or (node.kind in ("end", "fail") and node.id in self.reached)
        fill, stroke, dash = NODE_STYLE[node.kind]
        if visited:
            fill, stroke = VISITED, TAKEN
        (x, y), w, h = placed.centre, placed.w, placed.h
        classes = " ".join(["node", node.kind, *(["visited"] if visited else [])])
        out = [f"<g class={quoteattr(classes)} data-id={quoteattr(node.id)}><title>{escape(node.title)}</title>"]
        look = f'fill="{fill}" stroke="{stroke}" stroke-width="{2.5 if visited else 1.3}"'
        look += f' stroke-dasharray="{dash}"' if dash else ""
        left, top = x - w / 2, y - h / 2
        if node.kind == "fail":
            cut = min(10.0, h / 3)
            corners = [(left + cut, top), (left + w - cut, top), (left + w, top + cut), (left + w, top + h - cut)]
            corners += [(left + w - cut, top + h), (left + cut, top + h), (left, top + h - cut), (left, top + cut)]
            out.append(f'<polygon points="{" ".join(f"{a:.1f},{b:.1f}" for a, b in corners)}" {look}/>')
        else:
            radius = h / 2 if node.kind == "end" else 6
            out.append(
                f'<rect x="{left:.1f}" y="{top:.1f}" width="{w:.1f}" height="{h:.1f}" rx="{radius:.1f}" {look}/>'
            )
        if node.kind == "end":
            out.append(
                f'<rect x="{left + 3:.1f}" y="{top + 3:.1f}" width="{w - 6:.1f}" height="{h - 6:.1f}"'
                f' rx="{h / 2 - 3:.1f}" fill="none" stroke="{stroke}"/>'
            )
        lines = [(node.title, TITLE_SIZE, "bold"), *((line, LINE_SIZE, "") for line in node.shown_lines(traced))]
        block = TITLE_SIZE * LEADING + (len(lines) - 1) * LINE_SIZE * LEADING
        out += _text(lines, x, y - block / 2)
        out.append("</g>")
        return out

    def _loops(self, placed: _Placed) -> list[str]:
        """Each self-loop: out of the state's right side and back in, its label beyond it."""
        y, right = placed.centre[1], placed.centre[0] + placed.w / 2
        count, out = len(placed.loops), []
        heights = [_label_size(lines)[1] for lines in placed.loop_labels]
        top = y - sum(heights) / 2
        for edge, lines, height in zip(placed.loops, placed.loop_labels, heights, strict=True):
            middle = top + height / 2
            top += height
            spread = min(placed.h / (2 * count + 2), 9.0)
            low, high = y - placed.h / 2 + 2, y + placed.h / 2 - 2  # the loop leaves and enters the box
            out_y, in_y = min(max(middle - spread, low), high), min(max(middle + spread, low), high)
            reach = right + LOOP_REACH
            curve = f"C{reach:.1f},{out_y - 14:.1f} {reach:.1f},{in_y + 14:.1f} {right + 1:.1f},{in_y:.1f}"
            path = f"M{right:.1f},{out_y:.1f} {curve}"
            taken = bool(edge.taken)
            out += [self._open_edge(edge, taken), self._stroke(path, edge, taken)]
            width = _label_size(lines)[0]
            out += self._label(lines, (right + LOOP_REACH + 4 + width / 2, middle), taken)
            out.append("</g>")
        return out


def to_svg(graph: DrawnGraph) -> str:
    """The SVG drawing of a neutral graph (`mklang.graph.build`)."""
    return _Drawing(graph).svg()
