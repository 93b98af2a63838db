"""Answers read as the server writes them: server-sent events, put back together (ADR 0060).

A wire format streams only when something consumes the answer as it arrives
(`base.delta_consumer`). Its `Stream` reads the events of one attempt and
rebuilds the answer in the shape of a reply not streamed, so the client
checks both the same way; a stream that ends before its last event is a
`StreamCut`, which the transport retries as it retries a broken connection.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import urllib3

from mklang.providers import scratchpad
from mklang.providers.base import Deltas


class StreamCut(urllib3.exceptions.HTTPError):
    """The stream ended, or the server said in it that it failed, before the answer was whole."""


class Stream(Protocol):
    """One attempt's events, read into the answer."""

    def feed(self, event: str, data: str) -> bool:
        """Take one event (its name, or "" when it has none, and its data); True once it was the last."""
        ...

    def answer(self) -> dict[str, Any]:
        """The answer, shaped as the wire format's reply when it is not streamed."""
        ...


class Told:
    """The answer text told to the consumer as it grows. With scratchpad reasoning, what lies in
    a tagged block (or may yet open one) is held back: the consumer sees only the answer."""

    def __init__(self, consumer: Deltas, reasoned: bool):
        self._consumer, self._reasoned = consumer, reasoned
        self._text, self._told = "", 0

    def add(self, piece: str) -> None:
        self._text += piece
        shown = scratchpad.settled(self._text) if self._reasoned else self._text
        if len(shown) > self._told:
            self._consumer(self._told, shown[self._told :])
            self._told = len(shown)


def events(lines: Iterable[bytes]) -> Iterator[tuple[str, str]]:
    """The server-sent events in `lines` (the body split at newlines): each one's name ("" when it
    has none) and its data lines joined; comments and other fields are skipped. An event not ended
    by a blank line is not complete, and is not yielded."""
    name = ""
    data: list[str] = []
    for raw in lines:
        line = raw.decode("utf-8").rstrip("\r")
        if not line:
            if data:
                yield name, "\n".join(data)
            name, data = "", list[str]()
            continue
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "data":
            data.append(value)
        elif field == "event":
            name = value


def lines(response: urllib3.BaseHTTPResponse) -> Iterator[bytes]:
    """The body of `response` split at newlines, each line as soon as it has arrived."""
    pending = b""
    while chunk := response.read1(65536):
        pending += chunk
        *complete, pending = pending.split(b"\n")
        yield from complete
    if pending:
        yield pending
