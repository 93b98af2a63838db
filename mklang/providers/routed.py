"""The real-model `Provider`: routes each tier to its client and model, and prices the usage."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mklang.errors import ProviderError
from mklang.host.config import Price, Route
from mklang.providers import judge as judge_protocol
from mklang.providers import scratchpad
from mklang.providers.base import Produced, Usage, Verdict
from mklang.providers.http import ProviderClient, Reply

FRAMING_TOKENS = 64  # tokens a chat request's framing (roles, separators) may add to its messages


@dataclass(frozen=True)
class Target:
    """Where one tier's calls go: the client of its provider, the model, its price (if known)."""

    route: Route
    client: ProviderClient
    price: Price | None

    def usage(self, input_tokens: int, output_tokens: int) -> Usage:
        cost = self.price.cost(input_tokens, output_tokens) if self.price else 0.0
        return Usage(input_tokens, output_tokens, cost)


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
        reply, usage = self._chat(target, system, user, reason)
        return Produced(reply.text, reply.reasoning, usage)

    def judge(
        self, conditions: list[str], output: Any, reasoning: str | None, context: dict[str, Any], tier: str
    ) -> Verdict:
        target = self._target(tier)
        system, user = judge_protocol.build_prompt(conditions, output, reasoning, context)
        reply, usage = self._chat(target, system, user, False)
        choice, parsed_by = judge_protocol.parse_choice(reply.text, len(conditions))
        return Verdict(choice, usage, parsed_by)

    def worst_case(self, system: str, user: str, tier: str, reason: bool) -> Usage | None:
        """The most one produce call can cost: every byte of its messages a token (a token is at least
        one byte), the wire format's framing and a scratchpad's instruction, plus the provider's answer
        cap, priced; None when nothing caps the answer or the model has no price (ADR 0067)."""
        target = self._target(tier)
        cap = target.client.config.answer_cap(reason)
        if cap is None or target.price is None:
            return None
        scratch = len(scratchpad.INSTRUCTION.encode()) if reason else 0
        prompt = len(system.encode()) + len(user.encode()) + scratch + FRAMING_TOKENS
        return target.usage(prompt, cap)

    def worst_judge(
        self, conditions: list[str], output: Any, reasoning: str | None, context: dict[str, Any], tier: str
    ) -> Usage | None:
        """`worst_case` of one judge call."""
        return self.worst_case(*judge_protocol.build_prompt(conditions, output, reasoning, context), tier, False)

    def route_of(self, tier: str) -> tuple[str | None, str | None]:
        """The provider and model of `tier`, for the run's events (None, None: no route)."""
        target = self._targets.get(tier)
        return (target.route.provider, target.route.model) if target is not None else (None, None)

    def close(self) -> None:
        for client in {id(t.client): t.client for t in self._targets.values()}.values():
            client.close()

    def _target(self, tier: str) -> Target:
        target = self._targets.get(tier)
        if target is None:
            raise ProviderError(f"no model for tier {tier!r}: {self._missing}")
        return target

    @staticmethod
    def _chat(target: Target, system: str, user: str, reason: bool) -> tuple[Reply, Usage]:
        """One call and what it cost. A call the server answered is paid even when it fails here:
        token counts it sent malformed are counted as the UTF-8 bytes of the prompt and of the
        answer (a token is at least one byte, so this never counts less than was used)."""
        reply = target.client.chat(target.route.model, system, user, reason=reason)
        input_tokens = reply.input_tokens
        if input_tokens is None:
            input_tokens = len(system.encode()) + len(user.encode())
        output_tokens = reply.output_tokens
        if output_tokens is None:
            output_tokens = len(reply.text.encode()) + len((reply.reasoning or "").encode())
        usage = target.usage(input_tokens, output_tokens)
        where = f"{target.route.provider} {target.route.model}"
        if reply.usage_problem is not None:
            raise ProviderError(
                f"{where}: {reply.usage_problem}; counted as {input_tokens} input and {output_tokens} output tokens",
                usage,
            )
        if not reply.text.strip():
            raise ProviderError(f"{where}: the model returned an empty answer", usage)
        return reply, usage
