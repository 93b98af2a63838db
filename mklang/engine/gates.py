"""Gate selection (SPEC section 4): the one place that decides where a state goes.

Eligible gates are all gates minus repair gates whose budget is spent. They
are scanned in order: `otherwise` fires at once, a hook gate asks its host
predicate, and each maximal run of consecutive prose gates is judged in one
model call with a "none of the above" option.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mklang.engine import events
from mklang.engine.frame import Frame
from mklang.engine.keys import Calls
from mklang.engine.runtime import Runtime
from mklang.engine.signals import Stop
from mklang.model import Gate, State
from mklang.providers.base import NO_SPEND, NONE, UNPARSEABLE, Usage, Verdict, calling


@dataclass(kw_only=True)
class _Judged:
    """What selecting cost and how the judge answered, whatever the outcome."""

    usage: Usage = field(default_factory=Usage)
    none_batches: int = 0
    parsed_by: str | None = None  # how the last judge answer was read (strict, bare, last)


@dataclass(kw_only=True)
class Selected(_Judged):
    """A gate fired: `index` into `state.gates`."""

    index: int
    gate: Gate
    fallback: bool = False  # the judge's answer was unreadable and `otherwise` caught it


@dataclass(kw_only=True)
class NoGate(_Judged):
    """No gate fired: the run halts with `halt` (`judge-unparseable` or `no-gate-matched`)."""

    halt: str


Choice = Selected | NoGate


def select_gate(
    rt: Runtime,
    frame: Frame,
    state: State,
    output: Any,
    reasoning: str | None,
    context: Callable[[], dict[str, Any]],
    calls: Calls,
) -> Choice:
    """Pick the first true eligible gate. `context` builds the post-deposit context lazily;
    the step's `calls` key and tally the judge's batches (`.g.<n>`) and key the hooks (`.h.<gate>`)."""
    judged: Calls | None = None  # made for the first batch judged: most steps judge none
    gates = state.gates
    eligible: Sequence[int] = range(len(gates))
    if frame.repair_left:  # the machine has repair gates: those whose budget is spent are not eligible
        eligible = [
            index
            for index, gate in enumerate(gates)
            if gate.policy != "repair" or frame.repair_left[(state.name, index)] > 0
        ]
    usage = NO_SPEND
    none_batches = 0
    position = 0
    parsed_by = None
    while position < len(eligible):
        index = eligible[position]
        gate = gates[index]
        if gate.when is None:
            return Selected(index=index, gate=gate, usage=usage, none_batches=none_batches, parsed_by=parsed_by)
        if gate.hook is not None:
            if _ask_hook(rt, state, gate.hook, context(), output, f"{calls.prefix}.h.{index + 1}"):
                return Selected(index=index, gate=gate, usage=usage, none_batches=none_batches, parsed_by=parsed_by)
            position += 1
            continue
        batch_end = position + 1  # the run of prose gates from here: neither `otherwise` nor a hook
        while batch_end < len(eligible):
            next_gate = gates[eligible[batch_end]]
            if next_gate.when is None or next_gate.hook is not None:
                break
            batch_end += 1
        batch = eligible[position:batch_end]
        conditions = [when for i in batch if (when := gates[i].when) is not None]
        judged = judged or calls.part("g")
        verdict = _judge(rt, judged, conditions, output, reasoning, context, state.tier or frame.machine.tier)
        usage = usage + verdict.usage
        parsed_by = verdict.parsed_by or parsed_by
        if verdict.choice == NONE:
            none_batches += 1
            position = batch_end
            continue
        if verdict.choice == UNPARSEABLE or not (0 <= verdict.choice < len(batch)):
            for fallback in eligible:
                if gates[fallback].when is None:
                    return Selected(
                        index=fallback,
                        gate=gates[fallback],
                        usage=usage,
                        fallback=True,
                        none_batches=none_batches,
                        parsed_by=parsed_by,
                    )
            return NoGate(halt="judge-unparseable", usage=usage, none_batches=none_batches, parsed_by=parsed_by)
        chosen = batch[verdict.choice]
        return Selected(index=chosen, gate=gates[chosen], usage=usage, none_batches=none_batches, parsed_by=parsed_by)
    return NoGate(halt="no-gate-matched", usage=usage, none_batches=none_batches, parsed_by=parsed_by)


def _judge(
    rt: Runtime,
    calls: Calls,
    conditions: list[str],
    output: Any,
    reasoning: str | None,
    context: Callable[[], dict[str, Any]],
    tier: str,
) -> Verdict:
    """One judge call, for a batch of prose gates: the context is built only when the journal
    has no answer, and what the call's events tell only when an observer is told of them."""
    verdict: Verdict = rt.call(
        calls,
        "judge",
        lambda: rt.provider.judge(conditions, output, reasoning, context(), tier),
        lambda: events.ModelAbout("judge", tier, *rt.route(tier), {"conditions": conditions}),
    )
    return verdict


def _ask_hook(rt: Runtime, state: State, name: str, context: dict[str, Any], output: Any, key: str) -> bool:
    """A hook is asked again after a crash rather than journaled: its key names it only while it runs."""
    hook = rt.hooks.get(name)
    if hook is None:
        raise Stop("halted", f"state-error: hook: unknown hook '{name}'", state.name)
    began = time.monotonic() if rt.observer is not None else 0.0  # an event nobody is told of is not built
    try:
        with calling(rt.idempotency_key(key)):
            said = bool(hook(context, output))
    except Exception as error:  # a host predicate failed: halt, do not crash
        if rt.observer is not None:
            took = events.ms(time.monotonic() - began)
            rt.emit(events.HookCalled(hook=name, result=None, duration_ms=took, error=str(error)))
        raise Stop("halted", f"state-error: hook: {name}: {error}", state.name) from None
    if rt.observer is not None:
        rt.emit(events.HookCalled(hook=name, result=said, duration_ms=events.ms(time.monotonic() - began), error=None))
    return said
