"""Static cost bounds of a machine: the fewest and most steps and model calls a run can take,
and at most how many tokens and dollars, before anything is paid.

Every bound is sound: no run of the machine goes past a maximum, and no run that reaches END
comes under a minimum (a run that halts early may spend less). The maxima are the smaller of two
over-approximations (ADR 0047):

- the step budget: a longest-walk recurrence over the steps left, which ignores repair budgets and
  `max_visits` and is exact for cycles that only the budget stops;
- segments: a walk breaks, at each repair transition and each entry into a state with `max_visits`,
  into paths of the graph without those edges; when that graph has no cycle, a walk is at most the
  longest path from the entry plus, for each cut edge, its count times the longest path from where
  it lands.

Judge calls follow gate selection (SPEC section 4): each maximal run of consecutive prose gates
is one call; a gate further down costs every batch before it. A called machine adds its own
bounds under its own budget; a fan-out over a list of unknown length is bounded by the steps left.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from mklang.model import Call, Gate, Machine, Produce, State
from mklang.vocabulary import END

CALL_DEPTH = 8  # SPEC section 4: a call sub-run nests at most this deep

Load = Callable[[str, str | None], Machine | None]


@dataclass(frozen=True)
class Weights:
    """What one model call adds to a metric, by its tier and whether it reasons (a produce call of a
    `reason` state may add a thinking budget to its answer)."""

    per_call: Callable[[str, bool], float]


CALLS = Weights(lambda _tier, _reason: 1.0)


@dataclass(frozen=True)
class Range:
    """The fewest (to END; None when no run reaches END) and the most of one metric."""

    least: float | None
    most: float

    def to_json(self) -> dict[str, float | None]:
        return {"min": _number(self.least), "max": _number(self.most)}


def _number(value: float | None) -> float | None:
    if value is None or math.isinf(value):
        return None
    return int(value) if float(value).is_integer() else value


@dataclass
class MachineCost:
    """The bounds of one machine (its called machines are counted in, and listed apart)."""

    machine: Machine
    steps: Range
    calls: Range
    binds: str  # what stops the longest run: "the step budget", "repair budgets and max_visits"
    unbounded_cycles: list[list[str]] = field(default_factory=list)
    tokens: float | None = None  # at most; None when a tier's prompt or answer size is unknown
    cost: float | None = None  # at most, in USD; None when a tier is unpriced or tokens are unknown

    def to_json(self) -> dict[str, Any]:
        return {
            "machine": self.machine.name,
            "path": self.machine.path,
            "budget": self.machine.budget,
            "steps": self.steps.to_json(),
            "model_calls": self.calls.to_json(),
            "tokens": {"max": _number(self.tokens)},
            "cost": {"max": _number(self.cost)},
            "binds": self.binds,
            "unbounded_cycles": self.unbounded_cycles,
        }


def _times(count: int, weight: float) -> float:
    """`count` calls of `weight` each; no call adds nothing, even of an unbounded weight."""
    return count * weight if count else 0.0


# --- gates -------------------------------------------------------------------------------------


def _prose(gate: Gate) -> bool:
    return gate.when is not None and gate.hook is None


def _batches_through(gates: list[Gate], last: int) -> int:
    """Judge calls made when the scan reaches `gates[last]` and it fires (its own batch included)."""
    count = 0
    for index in range(last + 1):
        if _prose(gates[index]) and (index == 0 or not _prose(gates[index - 1])):
            count += 1
    return count


def judge_calls(gates: list[Gate], index: int) -> tuple[int, int]:
    """(fewest, most) judge calls when gate `index` fires. Spent repair gates leave the scan, which
    can only merge or drop batches, so the fewest count the scan without the other repair gates; an
    unreadable answer falls back to `otherwise` after a single call."""
    most = _batches_through(gates, index)
    kept = [i for i, gate in enumerate(gates) if gate.policy != "repair" or i == index]
    least = _batches_through([gates[i] for i in kept], kept.index(index))
    if gates[index].when is None:
        least = min(least, 1)
    return least, most


# --- one machine -------------------------------------------------------------------------------


class _Bounds:
    """Bounds of a machine and the machines it calls, memoized by (machine, depth, weights)."""

    def __init__(self, load: Load):
        self.load = load
        self.memo: dict[tuple[int, int, int], tuple[float | None, float]] = {}

    def per_branch(self, machine: Machine, state: State, depth: int, weights: Weights) -> tuple[float, float]:
        """(fewest, most) of the metric one branch of `state` adds: its model call or its sub-run."""
        if isinstance(state.face, Produce):
            one = weights.per_call(state.tier or machine.tier, state.face.reason)
            return one, one
        child = self.load(state.face.machine, machine.path) if isinstance(state.face, Call) else None
        if child is None:
            return 0.0, 0.0  # a tool, or a machine that does not load (check reports it)
        if depth + 1 >= CALL_DEPTH:
            return 0.0, 0.0  # the call halts `call-depth-exceeded` before its sub-run starts
        least, most = self.of(child, depth + 1, weights)
        return (math.inf if least is None else least), most

    def of(self, machine: Machine, depth: int, weights: Weights) -> tuple[float | None, float]:
        """(fewest to END or None, most) of the metric for a run of `machine` at call `depth`."""
        key = (id(machine), depth, id(weights))
        if key not in self.memo:
            self.memo[key] = (self._least(machine, depth, weights), self._most(machine, depth, weights))
        return self.memo[key]

    def _visit_least(self, machine: Machine, state: State, depth: int, weights: Weights) -> float:
        """The fewest a visit's branches add: `sample N` runs N, `over` may run none (an empty list)."""
        branch, _ = self.per_branch(machine, state, depth, weights)
        branches = 0 if state.over is not None else (state.sample or 1)
        return _times(branches, branch)

    def _least(self, machine: Machine, depth: int, weights: Weights) -> float | None:
        """Dijkstra to END over the fewest a visit and the gate it leaves by can add."""
        states = {state.name: state for state in machine.states}
        if machine.entry not in states:
            return None
        settled: set[str] = set()
        queue: list[tuple[float, str]] = [(0.0, machine.entry)]
        while queue:
            spent, name = heapq.heappop(queue)
            if name == END:
                return None if math.isinf(spent) else spent
            if name in settled:
                continue
            settled.add(name)
            state = states[name]
            visit = spent + self._visit_least(machine, state, depth, weights)
            judge = weights.per_call(state.tier or machine.tier, False)
            for index, gate in enumerate(state.gates):
                for target in gate.targets:  # a human decision's every choice and its deadline
                    if target == END or (target in states and target not in settled):
                        heapq.heappush(queue, (visit + _times(judge_calls(state.gates, index)[0], judge), target))
        return None

    def _most(self, machine: Machine, depth: int, weights: Weights) -> float:
        states = {state.name: state for state in machine.states}
        if machine.entry not in states:
            return 0.0
        visit = {name: self._visit_most(machine, state, depth, weights) for name, state in states.items()}
        segmented = _segment_bound(machine, states, visit)
        horizon = machine.budget
        if segmented is not None:
            horizon = min(horizon, segmented[1])
        walked = _walk_bound(machine, states, visit, horizon)
        return walked if segmented is None else min(walked, segmented[0])

    def _visit_most(self, machine: Machine, state: State, depth: int, weights: Weights) -> _Visit:
        _, branch = self.per_branch(machine, state, depth, weights)
        judge = weights.per_call(state.tier or machine.tier, False)
        judged = [_times(judge_calls(state.gates, index)[1], judge) for index in range(len(state.gates))]
        return _Visit(state, branch, judged)


@dataclass
class _Visit:
    """The most one visit of a state adds: per branch, and per gate for its judge calls."""

    state: State
    branch: float
    judged: list[float]

    def steps(self, left: int) -> int:
        """Steps the visit takes at most with `left` steps remaining (unknown width: all of them)."""
        if self.state.over is not None:
            return left
        return self.state.sample or 1

    def width(self, left: int) -> int:
        if self.state.over is not None:
            return left
        return min(self.state.sample or 1, left)


def _walk_bound(machine: Machine, states: dict[str, State], visit: dict[str, _Visit], horizon: int) -> float:
    """The most over walks of at most `horizon` steps: `most[name][left]` with `left` steps left at
    the loop-top entering `name` (0: the run halts there, budget-exhausted)."""
    most: dict[str, list[float]] = {name: [0.0] * (horizon + 1) for name in states}
    after: dict[str, list[float]] = {name: [0.0] * (horizon + 1) for name in states}  # the best gate, by steps left
    ahead: dict[str, float] = {name: -math.inf for name in states}  # max over j < left of after[j] - j * branch
    for left in range(1, horizon + 1):
        for name, seen in visit.items():
            after[name][left - 1] = _best_gate(seen, states, most, left - 1)
        for name, seen in visit.items():
            state = seen.state
            width = state.sample or 1
            if state.over is not None and math.isinf(seen.branch):
                most[name][left] = math.inf  # one branch of it cannot be bounded
            elif state.over is not None:
                # k branches of an unknown list: k * branch + after[left - max(1, k)]; k = 0 costs a step.
                ahead[name] = max(ahead[name], after[name][left - 1] - (left - 1) * seen.branch)
                most[name][left] = max(after[name][left - 1], left * seen.branch + ahead[name])
            elif width > left:
                most[name][left] = left * seen.branch  # the branches that fit, then the run stops
            else:
                most[name][left] = width * seen.branch + after[name][left - width]
    return most[machine.entry][horizon]


def _best_gate(seen: _Visit, states: dict[str, State], most: dict[str, list[float]], left: int) -> float:
    best = 0.0
    for index, gate in enumerate(seen.state.gates):
        ahead = [most[target][left] for target in gate.targets if target in states]
        best = max(best, seen.judged[index] + max(ahead, default=0.0))
    return best


def _cut(gate: Gate, target: str, states: dict[str, State]) -> bool:
    """Whether a transition to `target` is counted apart: a repair, or an entry into a state with `max_visits`."""
    entered = states.get(target)
    return gate.policy == "repair" or (entered is not None and entered.max_visits is not None)


def _segment_bound(machine: Machine, states: dict[str, State], visit: dict[str, _Visit]) -> tuple[float, int] | None:
    """(the metric, steps) a walk takes at most, counted in segments between cut edges; None when
    the graph without them still has a cycle (only the step budget stops it)."""
    order = _topological(states)
    if order is None:
        return None
    budget = machine.budget
    longest: dict[str, tuple[float, int]] = {}
    for name in reversed(order):
        seen = visit[name]
        steps = seen.steps(budget)
        here = seen.width(budget) * seen.branch
        best = (0.0, 0)
        for index, gate in enumerate(seen.state.gates):
            for tail in [longest[t] for t in gate.targets if t in states and not _cut(gate, t, states)] or [(0.0, 0)]:
                best = (max(best[0], seen.judged[index] + tail[0]), max(best[1], tail[1]))
        longest[name] = (here + best[0], steps + best[1])
    # A walk's segments start at the entry and wherever a cut edge lands. A state with `max_visits`
    # starts at most that many (the entry's first visit among them); a repair edge elsewhere, at most
    # its budget.
    metric, steps = (0.0, 0) if states[machine.entry].max_visits is not None else longest[machine.entry]
    for name, state in states.items():
        if state.max_visits is not None:
            metric += state.max_visits * longest[name][0]
            steps += state.max_visits * longest[name][1]
        for gate in state.gates:
            target = states.get(gate.target or "")
            if gate.policy == "repair" and target is not None and target.max_visits is None:
                metric += (gate.repair or 0) * longest[target.name][0]
                steps += (gate.repair or 0) * longest[target.name][1]
    return metric, steps


def _edges(states: dict[str, State]) -> Iterator[tuple[str, str]]:
    for name, state in states.items():
        for gate in state.gates:
            for target in gate.targets:
                if target in states and not _cut(gate, target, states):
                    yield name, target


def _topological(states: dict[str, State]) -> list[str] | None:
    """The states in an order where every uncut edge goes forward, or None when they form a cycle."""
    incoming = {name: 0 for name in states}
    for _, target in _edges(states):
        incoming[target] += 1
    ready = [name for name, count in incoming.items() if count == 0]
    order: list[str] = []
    outgoing: dict[str, list[str]] = {name: [] for name in states}
    for source, target in _edges(states):
        outgoing[source].append(target)
    while ready:
        name = ready.pop()
        order.append(name)
        for target in outgoing[name]:
            incoming[target] -= 1
            if incoming[target] == 0:
                ready.append(target)
    return order if len(order) == len(states) else None


def unbounded_cycles(machine: Machine) -> list[list[str]]:
    """The cycles no repair budget or `max_visits` stops (one per strongly connected set)."""
    states = {state.name: state for state in machine.states}
    outgoing: dict[str, list[str]] = {name: [] for name in states}
    for source, target in _edges(states):
        outgoing[source].append(target)
    return [sorted(group) for group in _components(outgoing) if len(group) > 1 or group[0] in outgoing[group[0]]]


def _components(outgoing: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in outgoing:
        if root in index:
            continue
        work = [(root, iter(outgoing[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            advanced = False
            for target in targets:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(outgoing[target])))
                    advanced = True
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                found.append(group)
    return found


def visit_calls(machine: Machine, state: State, load: Load) -> tuple[float | None, float]:
    """(fewest, most) model calls one visit of `state` takes, its judge included (for a hover):
    the fewest of a visit that leaves by a transition, the most of any visit."""
    bounds = _Bounds(load)
    least = bounds._visit_least(machine, state, 0, CALLS)
    leaving = [judge_calls(state.gates, index)[0] for index, gate in enumerate(state.gates) if gate.policy != "fail"]
    seen = bounds._visit_most(machine, state, 0, CALLS)
    most = seen.width(machine.budget) * seen.branch + max(seen.judged, default=0.0)
    return (None if not leaving or math.isinf(least) else least + min(leaving)), most


# --- the whole report --------------------------------------------------------------------------


def machine_costs(
    root: Machine,
    load: Load,
    call_tokens: Callable[[str, bool], float | None] | None = None,
    call_price: Callable[[str, bool], float | None] | None = None,
) -> list[MachineCost]:
    """The bounds of `root` and of each machine it calls. `call_tokens(tier, reason)` is the most
    tokens one call takes (its prompt bound plus its answer cap), `call_price` the most it costs;
    either answers None for a tier it cannot bound, and the metric is then unbounded."""
    from mklang.model import called_machines

    bounds = _Bounds(load)
    tokens = _optional_weights(call_tokens)
    dollars = _optional_weights(call_price)
    found = []
    for machine in called_machines(root, load):
        found.append(
            MachineCost(
                machine=machine,
                steps=_steps(machine),
                calls=Range(*bounds.of(machine, 0, CALLS)),
                binds=_binds(machine),
                unbounded_cycles=unbounded_cycles(machine),
                tokens=None if tokens is None else _finite(bounds.of(machine, 0, tokens)[1]),
                cost=None if dollars is None else _finite(bounds.of(machine, 0, dollars)[1]),
            )
        )
    return found


def _optional_weights(per_call: Callable[[str, bool], float | None] | None) -> Weights | None:
    """Weights from a per-call bound (None for a call it cannot bound: infinite, so unbounded)."""
    if per_call is None:
        return None

    def bounded(tier: str, reason: bool) -> float:
        value = per_call(tier, reason)
        return math.inf if value is None else float(value)

    return Weights(bounded)


def _finite(value: float) -> float | None:
    return None if math.isinf(value) else value


def _steps(machine: Machine) -> Range:
    """Steps: the fewest to END (the checker's shortest path) and at most the budget or the segments."""
    from mklang.checker import shortest_steps

    states = {state.name: state for state in machine.states}
    if machine.entry not in states:
        return Range(None, 0)
    visit = {name: _Visit(state, 1.0, [0.0] * len(state.gates)) for name, state in states.items()}
    segmented = _segment_bound(machine, states, visit)
    most = machine.budget if segmented is None else min(machine.budget, segmented[1])
    return Range(shortest_steps(machine), most)


def _binds(machine: Machine) -> str:
    states = {state.name: state for state in machine.states}
    visit = {name: _Visit(state, 1.0, [0.0] * len(state.gates)) for name, state in states.items()}
    segmented = _segment_bound(machine, states, visit)
    if segmented is None or segmented[1] >= machine.budget:
        return "the step budget"
    return "repair budgets and max_visits"
