"""A machine's graph as every renderer draws it: its nodes and edges, and how a run overlaid on it went.

`graph.build` makes it from the model; `graph` renders it as Mermaid or DOT and `diagram` as SVG.
A module of its own below both, so that neither renderer needs the other to be read.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class DrawnNode:
    id: str
    title: str
    lines: tuple[str, ...] = ()
    kind: str = "state"  # state | end | fail | machine
    visits: int = 0

    def shown_lines(self, traced: bool) -> list[str]:
        """The lines under the title, with the visit count when a run is overlaid."""
        return [*self.lines, *([f"visits {self.visits}"] if traced and self.visits else [])]


@dataclass(frozen=True)
class DrawnEdge:
    source: str
    target: str
    label: str
    kind: str = "gate"  # gate | start | call
    taken: int = 0

    def shown_label(self, traced: bool) -> str:
        """The label, with how often the run went this way when a run is overlaid."""
        return f"{self.label} ({self.taken}×)" if traced and self.taken and self.label else self.label


@dataclass
class DrawnGraph:
    name: str
    nodes: list[DrawnNode] = field(default_factory=list)
    edges: list[DrawnEdge] = field(default_factory=list)
    traced: bool = False
