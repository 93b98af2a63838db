"""A scriptable model server on 127.0.0.1 for tests: OpenAI and Anthropic wire formats.

It is a real HTTP server (stdlib `ThreadingHTTPServer`) in a background
thread, so the code under test goes through its HTTP client, sockets, kept-alive
connections, timeouts and retries exactly as in production; `FakeServer(tls=True)`
serves HTTPS with the self-signed certificate `CERTIFICATE` (for 127.0.0.1).
Usage::

    from support.fakeserver import FakeServer, answer, error, raw, refusal

    with FakeServer() as server:
        server.add(error(429, retry_after="0"), answer("hello", input_tokens=7, output_tokens=3))
        # OpenAI clients use server.openai_url    (POST .../v1/chat/completions)
        # Anthropic clients use server.anthropic_url (POST .../v1/messages)
        ...
        assert server.count == 2
        assert server.requests[-1].body["model"] == "m"

Each request takes the next scripted reply from the queue (`add`); when the
queue is empty it gets `server.fallback` (default: a 500 saying the script
ran out, so a test that under-scripts fails loudly). Set `server.handler`
to a function `(Request) -> Reply` to decide per request instead (it wins
over the queue). A reply is format-neutral: the server renders it in the
wire format of the path that was called; asked to stream (`"stream": true`), it
sends the reply as that format's server-sent events, a chunk an event (`answer(...,
stream_cut=N)` cuts the stream after N events, `stream_usage=False` leaves usage out). Every request is recorded
(`requests`, `count`) with its path, lower-cased headers and parsed body, and
the connections it accepted and closed are counted (`connections`, `closed`).
"""

from __future__ import annotations

import json
import re
import ssl
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

OPENAI_PATH = "/v1/chat/completions"
ANTHROPIC_PATH = "/v1/messages"
TLS = Path(__file__).parent / "tls"
CERTIFICATE = TLS / "cert.pem"  # self-signed, for 127.0.0.1 and localhost; its key is TLS / "key.pem"


@dataclass(frozen=True)
class Reply:
    """What the server sends for one request. Build it with `answer`, `refusal`, `error` or `raw`."""

    text: str = ""
    reasoning: str | None = None
    input_tokens: int = 10
    output_tokens: int = 5
    status: int = 200
    refuse: str | None = None  # a refusal message: OpenAI `refusal`, Anthropic `stop_reason: refusal`
    finish_reason: str | None = None  # OpenAI `finish_reason` / Anthropic `stop_reason` override
    body: str | None = None  # sent verbatim instead of a rendered body
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0  # seconds to wait before answering
    close: bool = False  # close the connection after the reply, without saying so (an idle keep-alive timeout)
    cut: int | None = None  # send only this many bytes of the body, then close (a server dying mid-response)
    stream_cut: int | None = None  # streamed: send only this many events, then close (a stream cut mid-answer)
    stream_usage: bool = True  # streamed: say the usage (OpenAI's last chunk, Anthropic's message events)
    stream_pause: float = 0.0  # streamed: seconds between two events (an answer written slowly)


def answer(
    text: str,
    *,
    reasoning: str | None = None,
    input_tokens: int = 10,
    output_tokens: int = 5,
    finish_reason: str | None = None,
    delay: float = 0.0,
    stream_cut: int | None = None,
    stream_usage: bool = True,
    stream_pause: float = 0.0,
) -> Reply:
    """A successful completion; `reasoning` goes to `reasoning_content` / a `thinking` block.
    Asked to stream (`"stream": true`), the server sends it as server-sent events, a word an
    event, cut after `stream_cut` events when given, with no usage when `stream_usage` is False,
    `stream_pause` seconds between two events."""
    return Reply(
        text=text,
        reasoning=reasoning,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        finish_reason=finish_reason,
        delay=delay,
        stream_cut=stream_cut,
        stream_usage=stream_usage,
        stream_pause=stream_pause,
    )


def refusal(message: str = "I can't help with that.") -> Reply:
    return Reply(refuse=message)


def error(
    status: int, message: str = "scripted failure", *, retry_after: str | None = None, delay: float = 0.0
) -> Reply:
    """An error status with the API's JSON error body and an optional `Retry-After` header."""
    headers = {"Retry-After": retry_after} if retry_after is not None else {}
    return Reply(status=status, text=message, headers=headers, delay=delay)


def raw(body: str, *, status: int = 200, headers: dict[str, str] | None = None, delay: float = 0.0) -> Reply:
    """Exactly `body` (for malformed responses)."""
    return Reply(status=status, body=body, headers=dict(headers or {}), delay=delay)


@dataclass(frozen=True)
class Request:
    path: str
    headers: dict[str, str]
    body: Any  # parsed JSON, or the raw text when it was not JSON

    @property
    def wire(self) -> str:
        return "anthropic" if self.path == ANTHROPIC_PATH else "openai"

    @property
    def user(self) -> str:
        """The last user message's text, in either wire format."""
        return self.body["messages"][-1]["content"]

    @property
    def system(self) -> str:
        if self.wire == "anthropic":
            return self.body.get("system", "")
        first = self.body["messages"][0]
        return first["content"] if first["role"] == "system" else ""


class FakeServer:
    """See the module docstring. Start with `with FakeServer() as server:` (or `start()`/`stop()`)."""

    def __init__(self, *, tls: bool = False) -> None:
        self.requests: list[Request] = []
        self.fallback: Reply = error(500, "fake server: no scripted reply left")
        self.handler: Callable[[Request], Reply] | None = None
        self._queue: list[Reply] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._httpd = _Server(("127.0.0.1", 0), _handler_class(self))
        self._httpd.daemon_threads = True
        self._tls = tls
        if tls:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(CERTIFICATE, TLS / "key.pem")
            self._httpd.socket = context.wrap_socket(self._httpd.socket, server_side=True)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.01}, name="fakeserver", daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"{'https' if self._tls else 'http'}://{host}:{port}"

    @property
    def openai_url(self) -> str:
        """The OpenAI-style base URL (it includes `/v1`)."""
        return f"{self.url}/v1"

    @property
    def anthropic_url(self) -> str:
        """The Anthropic-style base URL (without `/v1`)."""
        return self.url

    @property
    def count(self) -> int:
        with self._lock:
            return len(self.requests)

    @property
    def connections(self) -> int:
        """Connections accepted so far."""
        return self._httpd.accepted

    @property
    def closed(self) -> int:
        """Connections closed so far, by either side."""
        return self._httpd.finished

    def add(self, *replies: Reply) -> FakeServer:
        """Queue replies, answered in order."""
        with self._lock:
            self._queue.extend(replies)
        return self

    def start(self) -> FakeServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()  # wakes delayed replies
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> FakeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _next(self, request: Request) -> Reply:
        with self._lock:
            self.requests.append(request)
            if self.handler is None:
                return self._queue.pop(0) if self._queue else self.fallback
        return self.handler(request)


def render(reply: Reply, path: str, model: str) -> dict[str, Any]:
    """The JSON body of `reply` in the wire format of `path`."""
    anthropic = path == ANTHROPIC_PATH
    if reply.status != 200:
        if anthropic:
            return {"type": "error", "error": {"type": "api_error", "message": reply.text}}
        return {"error": {"message": reply.text, "type": "server_error", "code": None}}
    if anthropic:
        content = []
        if reply.reasoning is not None:
            content.append({"type": "thinking", "thinking": reply.reasoning, "signature": "sig"})
        if reply.refuse is None:
            content.append({"type": "text", "text": reply.text})
        return {
            "id": "msg_fake",
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": content,
            "stop_reason": "refusal" if reply.refuse is not None else reply.finish_reason or "end_turn",
            "usage": {"input_tokens": reply.input_tokens, "output_tokens": reply.output_tokens},
        }
    message: dict[str, Any] = {"role": "assistant", "content": None if reply.refuse else reply.text}
    if reply.refuse is not None:
        message["refusal"] = reply.refuse
    if reply.reasoning is not None:
        message["reasoning_content"] = reply.reasoning
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": reply.finish_reason or "stop"}],
        "usage": {
            "prompt_tokens": reply.input_tokens,
            "completion_tokens": reply.output_tokens,
            "total_tokens": reply.input_tokens + reply.output_tokens,
        },
    }


def words(text: str) -> list[str]:
    """`text` in the pieces a streamed answer sends it in: a word and the space after it each."""
    return re.findall(r"\s*\S+\s*", text) or [text]


def render_stream(reply: Reply, path: str, model: str, usage: bool) -> list[dict[str, Any] | str]:
    """The server-sent events' data of `reply` streamed in the wire format of `path` (OpenAI's
    `[DONE]` as text); `usage`: the client asked for it (OpenAI's `stream_options.include_usage`)."""
    usage = usage and reply.stream_usage
    if path == ANTHROPIC_PATH:
        counts = {"input_tokens": reply.input_tokens, "output_tokens": 1}
        start = {"id": "msg_fake", "type": "message", "role": "assistant", "model": model, "content": []}
        events: list[dict[str, Any] | str] = [
            {"type": "message_start", "message": start | ({"usage": counts} if usage else {})}
        ]
        blocks = [("thinking", reply.reasoning)] if reply.reasoning is not None else []
        blocks += [("text", reply.text)] if reply.refuse is None else []
        for index, (kind, text) in enumerate(blocks):
            events.append({"type": "content_block_start", "index": index, "content_block": {"type": kind, kind: ""}})
            events += [
                {"type": "content_block_delta", "index": index, "delta": {"type": f"{kind}_delta", kind: piece}}
                for piece in words(text)
            ]
            events.append({"type": "content_block_stop", "index": index})
        stop = "refusal" if reply.refuse is not None else reply.finish_reason or "end_turn"
        ending: dict[str, Any] = {"type": "message_delta", "delta": {"stop_reason": stop}}
        if usage:
            ending["usage"] = {"output_tokens": reply.output_tokens}
        return [*events, ending, {"type": "message_stop"}]

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "model": model, "choices": [choice]}

    events = [chunk({"role": "assistant", "content": ""})]
    if reply.reasoning is not None:
        events += [chunk({"reasoning_content": piece}) for piece in words(reply.reasoning)]
    if reply.refuse is not None:
        events.append(chunk({"refusal": reply.refuse}))
    else:
        events += [chunk({"content": piece}) for piece in words(reply.text)]
    events.append(chunk({}, reply.finish_reason or "stop"))
    if usage:
        counts = {"prompt_tokens": reply.input_tokens, "completion_tokens": reply.output_tokens}
        events.append({"id": "chatcmpl-fake", "object": "chat.completion.chunk", "choices": [], "usage": counts})
    return [*events, "[DONE]"]


class InFlight:
    """A handler (`server.handler = InFlight(respond)`) that holds each request 50 ms before it
    answers as `respond` does, and counts the most requests it held at once (`peak`)."""

    def __init__(self, respond: Callable[[Request], Reply]):
        self.respond = respond
        self.active = self.peak = 0
        self._lock = threading.Lock()

    def __call__(self, request: Request) -> Reply:
        with self._lock:
            self.active += 1
            self.peak = max(self.peak, self.active)
        time.sleep(0.05)
        with self._lock:
            self.active -= 1
        return self.respond(request)


_counting = threading.Lock()


class _Server(ThreadingHTTPServer):
    """The HTTP server under the fake: a deep listen backlog, and quiet about clients a test killed."""

    # Hundreds of clients may connect at once (a batch at high concurrency); with the
    # default listen backlog of 5 the kernel refuses or delays them, which looks like
    # a slow client.
    request_queue_size = 1024
    accepted = finished = 0  # connections: accepted by the serving thread, closed by the handlers' (under a lock)

    def get_request(self) -> Any:
        request = super().get_request()  # a TLS handshake a client refuses raises here, and is not counted
        self.accepted += 1
        return request

    def shutdown_request(self, request: Any) -> None:
        super().shutdown_request(request)
        with _counting:
            self.finished += 1

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A killed client resets its connections; printed, that would read as the traceback
        # of a CLI run in the test process.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


def _handler_class(server: FakeServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # The headers and the body go out in two writes: with Nagle's algorithm the body
        # waits for the client's delayed ACK of the headers, 40 ms a reply. Real servers
        # do not stall so; neither does this one.
        disable_nagle_algorithm = True

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            if len(raw) < length:  # the client died mid-request (a test killed it): nothing to answer
                self.close_connection = True
                return
            text = raw.decode("utf-8")
            try:
                body: Any = json.loads(text)
            except ValueError:
                body = text
            headers = {key.lower(): value for key, value in self.headers.items()}
            request = Request(self.path, headers, body)
            if self.path not in (OPENAI_PATH, ANTHROPIC_PATH):
                self._send(Reply(status=404, text=f"no route {self.path}"), request)
                return
            reply = server._next(request)
            if reply.delay and server._stopping.wait(reply.delay):
                return
            self._send(reply, request)

        def _send(self, reply: Reply, request: Request) -> None:
            model = request.body.get("model", "") if isinstance(request.body, dict) else ""
            if (
                reply.status == 200
                and reply.body is None
                and isinstance(request.body, dict)
                and request.body.get("stream")
            ):
                self._stream(reply, request, model)
                return
            payload = reply.body if reply.body is not None else json.dumps(render(reply, request.path, model))
            data = payload.encode("utf-8")
            try:
                self.send_response(reply.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for key, value in reply.headers.items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(data[: reply.cut])
                if reply.close or reply.cut is not None:
                    self.close_connection = True
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (a timeout test)

        def _stream(self, reply: Reply, request: Request, model: str) -> None:
            """The reply as server-sent events, an event a chunk of a chunked body, as APIs stream."""
            asked = request.body.get("stream_options", {}).get("include_usage", False)
            events = render_stream(reply, request.path, model, asked or request.wire == "anthropic")
            try:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for data in events[: reply.stream_cut]:
                    event = data.get("type") if isinstance(data, dict) and request.wire == "anthropic" else None
                    text = data if isinstance(data, str) else json.dumps(data)
                    frame = (f"event: {event}\n" if event else "") + f"data: {text}\n\n"
                    encoded = frame.encode("utf-8")
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(encoded), encoded))
                    self.wfile.flush()
                    time.sleep(reply.stream_pause)
                if reply.stream_cut is not None:
                    self.close_connection = True  # no last chunk: the body ends mid-stream
                    return
                self.wfile.write(b"0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler
