"""The Anthropic wire format (`POST {base_url}/v1/messages`).

`reason` maps to extended thinking (`thinking.budget_tokens`) when the
provider's `reasoning` is `native` (the default); `thinking` content blocks
become the reasoning, `text` blocks the answer.
"""

from __future__ import annotations

import json
from typing import Any

from mklang.providers import scratchpad
from mklang.providers.base import delta_consumer
from mklang.providers.http import ProviderClient, Reply, token_counts
from mklang.providers.streaming import StreamCut, Told

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
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": self.config.max_tokens,
            "messages": [{"role": "user", "content": user}],
        }
        if system:
            body["system"] = system
        if native:
            body["thinking"] = {"type": "enabled", "budget_tokens": self.config.thinking_budget}
            body["max_tokens"] = self.config.max_tokens + self.config.thinking_budget
        consumer = delta_consumer()
        if consumer is None:
            data = self._post(body)
        else:
            body["stream"] = True
            data = self._post(body, lambda: _Events(Told(consumer, reason and not native)))
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


class _Events:
    """A streamed message (`message_start`, content block events, `message_delta`, `message_stop`)
    put back together as the message it streams: its text and thinking blocks, its stop reason, and
    its usage (`message_start`'s, with the counts `message_delta` updates)."""

    def __init__(self, told: Told):
        self._told = told
        self._blocks: dict[int, dict[str, Any]] = {}
        self._stop: Any = None
        self._usage: dict[str, Any] | None = None

    def feed(self, event: str, data: str) -> bool:
        message = json.loads(data)
        if not isinstance(message, dict):
            raise ValueError(f"an event is not a JSON object: {data}")
        kind = message.get("type") or event
        if kind == "error":
            raise StreamCut(f"the server failed mid-answer: {json.dumps(message.get('error'))}")
        if kind == "message_start":
            usage = _object(message.get("message")).get("usage")
            self._usage = dict(usage) if isinstance(usage, dict) else usage
        elif kind == "content_block_start":
            block = _object(message.get("content_block"))
            index = message.get("index", len(self._blocks))
            self._blocks[index] = {"type": block.get("type"), "text": "", "thinking": ""}
        elif kind == "content_block_delta":
            self._add(message.get("index"), _object(message.get("delta")))
        elif kind == "message_delta":
            self._stop = _object(message.get("delta")).get("stop_reason") or self._stop
            usage = message.get("usage")
            if isinstance(usage, dict) and isinstance(self._usage, dict):
                self._usage.update(usage)
            elif usage is not None:
                self._usage = usage
        return kind == "message_stop"

    def _add(self, index: Any, delta: dict[str, Any]) -> None:
        block = self._blocks.setdefault(index, {"type": None, "text": "", "thinking": ""})
        if delta.get("type") == "text_delta" and isinstance(delta.get("text"), str):
            block["type"] = block["type"] or "text"
            block["text"] += delta["text"]
            self._told.add(delta["text"])
        elif delta.get("type") == "thinking_delta" and isinstance(delta.get("thinking"), str):
            block["type"] = block["type"] or "thinking"
            block["thinking"] += delta["thinking"]

    def answer(self) -> dict[str, Any]:
        content = list(self._blocks.values())  # in the order they started, as the server numbers them
        answer: dict[str, Any] = {"content": content, "stop_reason": self._stop}
        if self._usage is not None:
            answer["usage"] = self._usage
        return answer


def _object(value: Any) -> dict[str, Any]:
    """`value` when it is a JSON object, else an empty one (a field the server sent malformed)."""
    return value if isinstance(value, dict) else {}
