"""The OpenAI-compatible wire format (`POST {base_url}/chat/completions`).

It covers OpenAI, Ollama, vLLM, llama.cpp, LM Studio and most hosted APIs.
Reasoning comes from `reasoning_content` or `reasoning` in the reply message
when the server offers it (DeepSeek, vLLM, Ollama, OpenRouter); with
`reasoning = "scratchpad"` (the default) the model is also asked to write
its reasoning in tags, which are split from the answer.
"""

from __future__ import annotations

from typing import Any

from mklang.providers import scratchpad
from mklang.providers.http import ProviderClient, Reply, token_counts


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
        data = self._post({"model": model, "messages": messages})
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
