"""Streamed answers (ADR 0060) against a real HTTP server on 127.0.0.1 that streams server-sent events
in both wire formats: a call streams only when something consumes its answer, the answer and its
usage are the ones a call not streamed gets, and a stream cut short is a provider error, retried,
never a partial answer."""

from __future__ import annotations

import json

import pytest
from support.fakeserver import answer, raw, refusal
from support.providers import provider_config, provider_error

from mklang.providers.anthropic import AnthropicClient
from mklang.providers.base import make_call
from mklang.providers.http import ProviderClient
from mklang.providers.openai import OpenAIClient

TEXT = "The answer is forty-two, as the book says."


@pytest.fixture(params=["openai", "anthropic"])
def kind(request):
    return request.param


def client(server, kind, **options) -> ProviderClient:
    config = provider_config(server, kind, **options)
    return (OpenAIClient if kind == "openai" else AnthropicClient)(config, sleep=lambda seconds: None)


class Pieces:
    """A consumer of deltas that keeps them, (offset, text) each."""

    def __init__(self) -> None:
        self.told: list[tuple[int, str]] = []

    def __call__(self, offset: int, text: str) -> None:
        self.told.append((offset, text))

    @property
    def text(self) -> str:
        return "".join(text for _, text in self.told)


def streamed(call, consumer):
    return make_call("run/r:1", None, consumer, call)


def test_an_answer_streams_in_pieces_when_consumed_and_ends_whole_with_its_usage(server, kind):
    server.add(answer(TEXT, input_tokens=321, output_tokens=17))
    pieces = Pieces()
    reply = streamed(lambda: client(server, kind).chat("m", "be brief", "why?", reason=False), pieces)
    assert (reply.text, reply.input_tokens, reply.output_tokens) == (TEXT, 321, 17)
    assert pieces.text == TEXT and len(pieces.told) == len(TEXT.split())
    offsets = [offset for offset, _ in pieces.told]
    assert offsets == [sum(len(text) for _, text in pieces.told[:i]) for i in range(len(pieces.told))]
    body = server.requests[0].body
    assert body["stream"] is True
    if kind == "openai":
        assert body["stream_options"] == {"include_usage": True}


def test_without_a_consumer_nothing_streams(server, kind):
    server.add(answer(TEXT))
    assert client(server, kind).chat("m", "", "why?", reason=False).text == TEXT
    assert "stream" not in server.requests[0].body and "stream_options" not in server.requests[0].body


def test_a_stream_without_usage_counts_as_an_answer_without_usage(server, kind):
    usage_free = (
        {"choices": [{"message": {"content": TEXT}}]}
        if kind == "openai"
        else {"content": [{"type": "text", "text": TEXT}]}
    )
    server.add(raw(json.dumps(usage_free)), answer(TEXT, stream_usage=False))
    whole = client(server, kind).chat("m", "", "why?", reason=False)
    reply = streamed(lambda: client(server, kind).chat("m", "", "why?", reason=False), Pieces())
    assert reply == whole
    assert (reply.input_tokens, reply.output_tokens, reply.usage_problem) == (0, 0, None)


def test_a_stream_cut_mid_answer_is_retried_and_the_answer_told_anew(server, kind):
    server.add(answer(TEXT, stream_cut=4), answer(TEXT, input_tokens=8, output_tokens=9))
    pieces = Pieces()
    reply = streamed(lambda: client(server, kind, retries=1).chat("m", "", "why?", reason=False), pieces)
    assert (reply.text, reply.input_tokens, reply.output_tokens) == (TEXT, 8, 9)
    assert server.count == 2
    restart = [i for i, (offset, _) in enumerate(pieces.told) if offset == 0]
    assert restart[0] == 0 and len(restart) == 2  # the first attempt's pieces, then the whole answer again
    assert "".join(text for _, text in pieces.told[restart[1] :]) == TEXT
    assert 0 < len("".join(text for _, text in pieces.told[: restart[1]])) < len(TEXT)


def test_a_stream_always_cut_is_a_provider_error_never_a_partial_answer(server, kind):
    server.add(*[answer(TEXT, stream_cut=3)] * 2)
    message = provider_error(
        streamed, lambda: client(server, kind, retries=1).chat("m", "", "why?", reason=False), Pieces()
    )
    assert message.startswith("p connection-error: ") and message.endswith("(after 2 attempts)")
    assert server.count == 2


def test_a_stream_that_ends_before_its_last_event_is_cut_too(server, kind):
    first = (
        {"choices": [{"delta": {"content": "The answer"}}]}
        if kind == "openai"
        else {"type": "message_start", "message": {}}
    )
    server.add(raw(f"data: {json.dumps(first)}\n\n"))
    message = provider_error(streamed, lambda: client(server, kind).chat("m", "", "why?", reason=False), Pieces())
    assert message == "p connection-error: the stream ended before the answer was complete (after 1 attempt)"


def test_an_error_the_server_sends_mid_stream_is_retried(server):
    failed = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    server.add(raw(f"event: error\ndata: {json.dumps(failed)}\n\n"), answer(TEXT))
    reply = streamed(lambda: client(server, "anthropic", retries=1).chat("m", "", "why?", reason=False), Pieces())
    assert reply.text == TEXT and server.count == 2


@pytest.mark.parametrize("body", ["data: {not json\n\n", "data: [1, 2]\n\n"])
def test_a_stream_that_is_not_events_of_an_answer_fails_at_once(server, kind, body):
    server.add(raw(body))
    message = provider_error(
        streamed, lambda: client(server, kind, retries=2).chat("m", "", "why?", reason=False), Pieces()
    )
    assert message.startswith("p 200: the stream is not the events of an answer: ")
    assert server.count == 1


def test_reasoning_streams_beside_the_answer_never_into_it(server, kind):
    server.add(answer(TEXT, reasoning="first I think, then I answer"))
    pieces = Pieces()
    reply = streamed(lambda: client(server, kind, reasoning="native").chat("m", "", "why?", reason=True), pieces)
    assert (reply.text, reply.reasoning) == (TEXT, "first I think, then I answer")
    assert pieces.text == TEXT


def test_scratchpad_reasoning_is_held_back_from_the_consumer(server, kind):
    server.add(answer(f"<reasoning>the private part</reasoning> {TEXT}"))
    pieces = Pieces()
    config = {"reasoning": "scratchpad"}
    reply = streamed(lambda: client(server, kind, **config).chat("m", "", "why?", reason=True), pieces)
    assert (reply.text, reply.reasoning) == (TEXT, "the private part")
    assert "private" not in pieces.text and pieces.text.strip() == TEXT


def test_a_refusal_streamed_is_an_error_as_it_is_whole(server, kind):
    server.add(refusal("no"), refusal("no"))
    whole = provider_error(client(server, kind).chat, "m", "", "why?", reason=False)
    assert provider_error(streamed, lambda: client(server, kind).chat("m", "", "why?", reason=False), Pieces()) == whole
