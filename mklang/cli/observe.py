"""`--events PATH`: a run's events as JSON Lines (docs/events.md), for `run`, `resume`, `batch`,
`worker` and `test`."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, TYPE_CHECKING

import typer

from mklang.cli.app import fail, finite
from mklang.telemetry import exporting
from mklang.terminal import printable

if TYPE_CHECKING:
    from mklang.engine.events import Event

EventsOpt = typer.Option(
    None,
    "--events",
    metavar="PATH",
    help="Append one JSON line per run event to PATH (- for stderr); schema: docs/events.schema.json.",
)
TraceContentOpt = typer.Option(
    False,
    "--trace-content",
    help="Include prompts, model outputs and tool arguments and results in the events and spans.",
)

StreamOpt = typer.Option(
    False,
    "--stream",
    help="Write each model answer to stderr as it arrives (the openai and anthropic providers stream it).",
)


class JsonLines:
    """An event sink writing each event as one JSON line, flushed as it is written, so a reader
    following the file sees every event as it happens. Thread-safe: a batch's runs share it."""

    def __init__(self, stream: IO[str], trace_content: bool):
        self._stream = stream
        self.trace_content = trace_content
        self._lock = threading.Lock()

    def emit(self, event: Event) -> None:
        try:
            line = event.to_line(self.trace_content)  # content only when asked, whatever else watches
        except ValueError:  # a NaN or an infinity, which only a host's value brings: walked only then
            from mklang.engine.events import json_text

            line = json_text(finite(event.to_json(self.trace_content)))
        with self._lock:
            self._stream.write(line + "\n")
            self._stream.flush()


class AnswerStream:
    """`--stream`: the answer of each produce call written to a terminal (stderr) as the provider
    streams it, and a newline when it ends. It shows what the run's result shows anyway and
    records nothing, so it asks for the text of the deltas, not for content (`--events` still
    writes content only with `--trace-content`). A call retried after its stream was cut
    starts its answer anew on a line of its own; answers of fan-out branches interleave."""

    stream_text = True

    def __init__(self, stream: IO[str]):
        self._stream = stream
        self._open: set[str] = set()  # the calls whose answer has begun and not ended
        self._lock = threading.Lock()

    def emit(self, event: Event) -> None:
        from mklang.engine.events import ModelDelta, ModelFinished

        if isinstance(event, ModelDelta) and event.text is not None:
            with self._lock:
                if event.offset == 0 and event.key in self._open:
                    self._stream.write("\n(the stream was cut; the answer again:)\n")
                self._open.add(event.key)
                self._stream.write(printable(event.text))
                self._stream.flush()
        elif isinstance(event, ModelFinished) and event.key in self._open:
            with self._lock:
                self._open.discard(event.key)
                self._stream.write("\n")
                self._stream.flush()


class AskContent:
    """No sink of its own: `--trace-content` without `--events` asks the run's spans for content."""

    trace_content = True

    def emit(self, event: Event) -> None:
        pass


@contextmanager
def event_stream(path: str | None, trace_content: bool) -> Iterator[JsonLines | AskContent | None]:
    """The sink of `--events PATH` (None without it), opened for appending before the run
    spends anything, so a path that cannot be written is a usage error (exit 2)."""
    if path is None:
        if trace_content and not exporting():
            raise fail(
                "--trace-content adds content to the events or spans: it needs --events PATH, "
                "or OpenTelemetry export (docs/observability.md)"
            )
        yield AskContent() if trace_content else None
        return
    if path == "-":
        yield JsonLines(sys.stderr, trace_content)
        return
    try:
        stream = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed below, after the run
    except OSError as error:
        raise fail(f"--events {path}: cannot write there: {error.strerror or error}") from None
    with stream:
        yield JsonLines(stream, trace_content)
