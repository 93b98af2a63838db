"""The OpenAI-compatible wire format (`POST {base_url}/chat/completions`).

It covers OpenAI, Ollama, vLLM, llama.cpp, LM Studio and most hosted APIs.
Reasoning comes from `reasoning_content` or `reasoning` in the reply message
when the server offers it (DeepSeek, vLLM, Ollama, OpenRouter); with
`reasoning = "scratchpad"` (the default) the model is also asked to write
its reasoning in tags, which are split from the answer.
"""

from __future__ import annotations

import json
from typing import Any

from mklang.providers import scratchpad
from mklang.providers.base import delta_consumer
from mklang.providers.http import ProviderClient, Reply, token_counts
from mklang.providers.streaming import StreamCut, Told


class OpenAIClient(ProviderClient):
    path = "/chat/completions"

    def headers(self, key: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"} if key else {}

    def chat(self, model: str, system: str, user: str, *, reason: bool) -> Reply:
        use_scratchpad = reason and self.config.reasoning == "scratchpad"
        if use_scratchpad:
            system = scratchpad.with_instruction(system)
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": user})
        body: dict[str, Any] = {"model": model, "messages": messages}
        consumer = delta_consumer()
        if consumer is None:
            data = self._post(body)
        else:
            body.update(stream=True, stream_options={"include_usage": True})
            data = self._post(body, lambda: _Chunks(Told(consumer, reason)))
        message, finish = self._message(model, data)
        if message.get("refusal"):
            raise self._fail(model, f"the model refused: {message['refusal']}")
        if finish == "content_filter":
            raise self._fail(model, "the answer was withheld by the content filter")
        text = message.get("content") or ""
        if not isinstance(text, str):
            raise self._shape_error(model, "text content")
        native = message.get("reasoning_content") or message.get("reasoning")
        reasoning = native if isinstance(native, str) and native else None
        if reason:
            text, tagged = scratchpad.split(text)
            reasoning = reasoning or tagged
        usage = data.get("usage")
        counts, problem = token_counts(usage, {"input": ("prompt_tokens",), "output": ("completion_tokens",)})
        return Reply(text, reasoning if reason else None, counts["input"], counts["output"], problem)

    def _message(self, model: str, data: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
        choices = data.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise self._shape_error(model, "choices")
        message = choices[0].get("message")
        if not isinstance(message, dict):
            raise self._shape_error(model, "message")
        return message, choices[0].get("finish_reason")


class _Chunks:
    """A streamed completion (`chat.completion.chunk` events, then `[DONE]`) put back together as
    the completion it streams: the message's text, reasoning and refusal, the finish reason, and
    the usage of the last chunk (`stream_options.include_usage`; none without it)."""

    def __init__(self, told: Told):
        self._told = told
        self._parts: dict[str, list[str]] = {"content": [], "reasoning_content": [], "refusal": []}
        self._finish: str | None = None
        self._usage: Any = None

    def feed(self, event: str, data: str) -> bool:
        if data.strip() == "[DONE]":
            return True
        chunk = json.loads(data)
        if not isinstance(chunk, dict):
            raise ValueError(f"an event is not a JSON object: {data}")
        if chunk.get("error"):
            raise StreamCut(f"the server failed mid-answer: {json.dumps(chunk['error'])}")
        if chunk.get("usage") is not None:
            self._usage = chunk["usage"]
        choices = chunk.get("choices") or [{}]
        choice = choices[0] if isinstance(choices, list) and isinstance(choices[0], dict) else {}
        given = choice.get("delta")
        delta: dict[str, Any] = given if isinstance(given, dict) else {}
        self._finish = choice.get("finish_reason") or self._finish
        delta = {**delta, "reasoning_content": delta.get("reasoning_content") or delta.get("reasoning")}
        for name, parts in self._parts.items():
            piece = delta.get(name)
            if isinstance(piece, str) and piece:
                parts.append(piece)
        content = delta.get("content")
        if isinstance(content, str) and content:
            self._told.add(content)
        return False

    def answer(self) -> dict[str, Any]:
        message = {name: "".join(parts) or None for name, parts in self._parts.items()}
        answer: dict[str, Any] = {"choices": [{"message": message, "finish_reason": self._finish}]}
        if self._usage is not None:
            answer["usage"] = self._usage
        return answer
