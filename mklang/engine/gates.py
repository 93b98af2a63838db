"""Gate selection (SPEC section 4): the one place that decides where a state goes.

Eligible gates are all gates minus repair gates whose budget is spent. They
are scanned in order: `otherwise` fires at once, a hook gate asks its host
predicate, and each maximal run of consecutive prose gates is judged in one
model call with a "none of the above" option.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mklang.engine.frame import Frame
from mklang.engine.keys import Calls
from mklang.engine.signals import Halt
from mklang.model import Gate, State
from mklang.providers.base import NONE, UNPARSEABLE, Usage

if TYPE_CHECKING:
    from mklang.engine.runner import Runtime


@dataclass
class Choice:
    """The outcome of gate selection: a gate (by index into `state.gates`) or a halt kind."""

    index: int | None = None
    gate: Gate | None = None
    usage: Usage = field(default_factory=Usage)
    fallback: bool = False
    none_batches: int = 0
    halt: str | None = None
    parsed_by: str | None = None  # how the last judge answer was read (strict, bare, last)


def _is_prose(gate: Gate) -> bool:
    return gate.when is not None and gate.hook is None


def select_gate(
    rt: Runtime,
    frame: Frame,
    state: State,
    output: Any,
    reasoning: str | None,
    context: Callable[[], dict],
    call_prefix: str,
) -> Choice:
    """Pick the first true eligible gate. `context` builds the post-deposit context lazily;
    judge calls get idempotency keys under `call_prefix`."""
    calls = None
    gates = state.gates
    eligible = [
        index
        for index, gate in enumerate(gates)
        if gate.policy != "repair" or frame.repair_left[(state.name, index)] > 0
    ]
    usage = Usage()
    none_batches = 0
    position = 0
    parsed_by = None
    while position < len(eligible):
        index = eligible[position]
        gate = gates[index]
        if gate.when is None:
            return Choice(index, gate, usage, none_batches=none_batches, parsed_by=parsed_by)
        if gate.hook is not None:
            try:
                holds = _ask_hook(rt, state, gate, context(), output)
            except Halt as halted:
                halted.usage = usage  # judge batches before this hook were paid for
                raise
            if holds:
                return Choice(index, gate, usage, none_batches=none_batches, parsed_by=parsed_by)
            position += 1
            continue
        batch_end = position
        while batch_end < len(eligible) and _is_prose(gates[eligible[batch_end]]):
            batch_end += 1
        batch = eligible[position:batch_end]
        tier = state.tier or frame.machine.tier
        calls = calls or Calls(call_prefix)
        verdict = rt.call(
            calls.next(),
            "judge",
            lambda batch=batch, tier=tier: rt.provider.judge(
                [gates[i].when for i in batch], output, reasoning, context(), tier
            ),
        )
        usage = usage + verdict.usage
        parsed_by = verdict.parsed_by or parsed_by
        if verdict.choice == NONE:
            none_batches += 1
            position = batch_end
            continue
        if verdict.choice == UNPARSEABLE or not (0 <= verdict.choice < len(batch)):
            for fallback in eligible:
                if gates[fallback].when is None:
                    return Choice(
                        fallback, gates[fallback], usage, fallback=True, none_batches=none_batches, parsed_by=parsed_by
                    )
            return Choice(usage=usage, none_batches=none_batches, halt="judge-unparseable", parsed_by=parsed_by)
        chosen = batch[verdict.choice]
        return Choice(chosen, gates[chosen], usage, none_batches=none_batches, parsed_by=parsed_by)
    return Choice(usage=usage, none_batches=none_batches, halt="no-gate-matched", parsed_by=parsed_by)


def _ask_hook(rt: Runtime, state: State, gate: Gate, context: dict, output: Any) -> bool:
    hook = rt.hooks.get(gate.hook)
    if hook is None:
        raise Halt(f"state-error: hook: unknown hook '{gate.hook}'", state.name)
    try:
        return bool(hook(context, output))
    except Exception as error:  # a host predicate failed: halt, do not crash
        raise Halt(f"state-error: hook: {gate.hook}: {error}", state.name) from None
