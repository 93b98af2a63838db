"""The real-model `Provider`: routes each tier to its client and model, and prices the usage."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mklang.errors import ProviderError
from mklang.host.config import Price, Route
from mklang.providers import judge as judge_protocol
from mklang.providers.base import Produced, Usage, Verdict
from mklang.providers.http import ProviderClient, Reply


@dataclass(frozen=True)
class Target:
    """Where one tier's calls go: the client of its provider, the model, its price (if known)."""

    route: Route
    client: ProviderClient
    price: Price | None

    def usage(self, reply: Reply) -> Usage:
        cost = self.price.cost(reply.input_tokens, reply.output_tokens) if self.price else 0.0
        return Usage(reply.input_tokens, reply.output_tokens, cost)


class RoutedProvider:
    """Answers `produce` and `judge` over HTTP. Stateless per call, hence thread-safe."""

    def __init__(self, targets: dict[str, Target], missing: str):
        self._targets = targets
        self._missing = missing  # why a tier has no target, for the error

    def __repr__(self) -> str:
        routes = ", ".join(f"{tier}={target.route.key}" for tier, target in self._targets.items())
        return f"RoutedProvider({routes})"

    def produce(self, system: str, user: str, tier: str, reason: bool) -> Produced:
        target = self._target(tier)
        reply = self._chat(target, system, user, reason)
        return Produced(reply.text, reply.reasoning, target.usage(reply))

    def judge(
        self, conditions: list[str], output: Any, reasoning: str | None, context: dict[str, Any], tier: str
    ) -> Verdict:
        target = self._target(tier)
        system, user = judge_protocol.build_prompt(conditions, output, reasoning, context)
        reply = self._chat(target, system, user, False)
        choice, parsed_by = judge_protocol.parse_choice(reply.text, len(conditions))
        return Verdict(choice, target.usage(reply), parsed_by)

    def close(self) -> None:
        for client in {id(t.client): t.client for t in self._targets.values()}.values():
            client.close()

    def _target(self, tier: str) -> Target:
        target = self._targets.get(tier)
        if target is None:
            raise ProviderError(f"no model for tier {tier!r}: {self._missing}")
        return target

    @staticmethod
    def _chat(target: Target, system: str, user: str, reason: bool) -> Reply:
        reply = target.client.chat(target.route.model, system, user, reason=reason)
        if not reply.text.strip():
            raise ProviderError(f"{target.route.provider} {target.route.model}: the model returned an empty answer")
        return reply
