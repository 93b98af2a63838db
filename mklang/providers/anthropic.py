"""The Anthropic wire format (`POST {base_url}/v1/messages`).

`reason` maps to extended thinking (`thinking.budget_tokens`) when the
provider's `reasoning` is `native` (the default); `thinking` content blocks
become the reasoning, `text` blocks the answer.
"""

from __future__ import annotations

from mklang.providers import scratchpad
from mklang.providers.http import ProviderClient, Reply, token_counts

API_VERSION = "2023-06-01"


class AnthropicClient(ProviderClient):
    path = "/v1/messages"

    def headers(self, key: str | None) -> dict[str, str]:
        headers = {"anthropic-version": API_VERSION}
        if key:
            headers["x-api-key"] = key
        return headers

    def chat(self, model: str, system: str, user: str, *, reason: bool) -> Reply:
        native = reason and self.config.reasoning == "native"
        if reason and not native:
            system = scratchpad.with_instruction(system)
        body = {
            "model": model,
            "max_tokens": self.config.max_tokens,
            "messages": [{"role": "user", "content": user}],
        }
        if system:
            body["system"] = system
        if native:
            body["thinking"] = {"type": "enabled", "budget_tokens": self.config.thinking_budget}
            body["max_tokens"] = self.config.max_tokens + self.config.thinking_budget
        data = self._post(body)
        if data.get("stop_reason") == "refusal":
            raise self._fail(model, "the model refused to answer (stop_reason: refusal)")
        blocks = data.get("content")
        if not isinstance(blocks, list):
            raise self._shape_error(model, "content")
        text = "".join(b.get("text", "") for b in blocks if isinstance(b, dict) and b.get("type") == "text")
        thinking = "".join(b.get("thinking", "") for b in blocks if isinstance(b, dict) and b.get("type") == "thinking")
        reasoning = thinking or None
        if reason:
            text, tagged = scratchpad.split(text)
            reasoning = reasoning or tagged
        counts, problem = token_counts(
            data.get("usage"),
            {
                "input": ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens"),
                "output": ("output_tokens",),
            },
        )
        return Reply(text, reasoning if reason else None, counts["input"], counts["output"], problem)
