"""`mklang check --cost`: each machine's static bounds (mklang.costs) priced with the host config.

A call's tokens are bounded by `--prompt-tokens` plus the answer cap of the provider that answers
its tier (Anthropic's `max_tokens`, plus the thinking budget for a natively reasoning state; an
OpenAI-compatible provider's `max_tokens` or `max_completion_tokens` param); its dollars by the
route's price at those token counts. What cannot be bounded is said, never guessed.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mklang import exitcodes
from mklang.costs import MachineCost, machine_costs
from mklang.host.config import HostConfig, load_config


def answer_cap(config: HostConfig, tier: str, reason: bool) -> int | None:
    """The most tokens an answer of `tier` may take, or None when nothing caps it."""
    route = config.route(tier)
    return None if route is None else config.provider(route.provider).answer_cap(reason)


def call_bounds(
    config: HostConfig, prompt_tokens: int | None
) -> tuple[Callable[[str, bool], float | None], Callable[[str, bool], float | None], dict[str, str]]:
    """The most tokens and dollars one call of a tier takes, and (filled as they are asked) why a
    tier has no bound."""
    unbounded: dict[str, str] = {}

    def tokens(tier: str, reason: bool) -> float | None:
        cap = answer_cap(config, tier, reason)
        if prompt_tokens is None:
            unbounded.setdefault(
                "prompt",
                "tokens and dollars need a bound on each call's prompt: --prompt-tokens or [limits] prompt_tokens",
            )
            return None
        if cap is None:
            unbounded.setdefault(tier, f"tier {tier}: no answer cap (no route, or no max_tokens for its provider)")
            return None
        return prompt_tokens + cap

    def dollars(tier: str, reason: bool) -> float | None:
        route = config.route(tier)
        price = None if route is None else config.price(route)
        cap = answer_cap(config, tier, reason)
        if route is not None and price is None:
            unbounded.setdefault(f"price:{route.key}", f"{route.key} has no price (config [prices] or genai-prices)")
        if price is None or cap is None or prompt_tokens is None:
            return None
        return price.cost(prompt_tokens, cap)

    return tokens, dollars, unbounded


def report(
    paths: list[Path],
    as_json: bool,
    prompt_tokens: int | None,
    config_path: Path | None,
    provider: str | None,
    model: str | None,
) -> int:
    """Print the bounds of every machine file (and the machines each calls), priced with the host
    config as `run` would route it."""
    from mklang.syntax.machines import MachineLoader

    config = load_config(config_path, provider=provider, model=model)
    tokens, dollars, notes = call_bounds(config, prompt_tokens or config.prompt_tokens)
    found: list[dict[str, Any]] = []
    for path in paths:
        loader = MachineLoader()
        root = loader.load_path(path)

        def load(name: str, near: str | None, loader: MachineLoader = loader) -> Any:
            from mklang.errors import MklangError

            try:
                return loader(name, near)
            except MklangError:
                return None  # `check` reports the call it cannot resolve

        costs = machine_costs(root, load, tokens, dollars)
        found.append({"file": str(path), "machines": [cost.to_json() for cost in costs]})
        if not as_json:
            for cost in costs:
                print(_text(cost))
    if as_json:
        print(json.dumps({"files": found, "notes": list(notes.values())}, indent=2))
    else:
        for note in notes.values():
            print(f"note: {note}", file=sys.stderr)
    return exitcodes.OK


def _text(cost: MachineCost) -> str:
    data = cost.to_json()

    def span(values: dict[str, Any]) -> str:
        least = "none reach END" if values["min"] is None else f"{values['min']:,}"
        most = "unbounded" if values["max"] is None else f"{values['max']:,}"
        return f"min {least}, max {most}"

    lines = [
        f"{cost.machine.name} (budget {cost.machine.budget}): the longest run is bounded by {cost.binds}",
        f"  steps        {span(data['steps'])}",
        f"  model calls  {span(data['model_calls'])}",
        f"  tokens       max {'unbounded' if cost.tokens is None else f'{cost.tokens:,.0f}'}",
        f"  dollars      max {'unbounded' if cost.cost is None else f'${cost.cost:,.4f}'}",
    ]
    lines += [f"  a cycle only the step budget stops: {' <-> '.join(cycle)}" for cycle in cost.unbounded_cycles]
    return "\n".join(lines)


def batch_preflight(machine: Any, items: int, host_settings: dict[str, Any], batch_cost: float | None) -> str:
    """The line a batch prints before it starts: its items times one run's worst case, and how many
    items `--batch-max-cost` covers if every run costs that much."""
    from mklang.errors import MklangError
    from mklang.syntax.machines import MachineLoader

    loader = MachineLoader()
    loader.add(machine)

    def load(name: str, near: str | None) -> Any:
        try:
            return loader(name, near)
        except MklangError:
            return None

    offline = any(host_settings.get(name) is not None for name in ("script", "replay"))
    config = load_config(
        host_settings.get("config"), provider=host_settings.get("provider"), model=host_settings.get("model")
    )
    _, dollars, _ = call_bounds(config, config.prompt_tokens)
    (cost, *_) = machine_costs(machine, load, call_price=None if offline else dollars)
    calls = cost.calls.most
    line = f"{items:,} items x at most {calls:,.0f} model calls = at most {items * calls:,.0f} model calls"
    if offline:
        return line + " (answered offline, at no cost)"
    if cost.cost is None:
        return line + "; dollars unbounded (a tier without a price or answer cap, or no [limits] prompt_tokens)"
    line += f"; {items:,} x at most ${cost.cost:,.4f} = at most ${items * cost.cost:,.2f}"
    if batch_cost is not None and cost.cost > 0:
        line += f"; --batch-max-cost ${batch_cost:,.2f} covers {min(items, int(batch_cost // cost.cost)):,} at worst"
    return line
