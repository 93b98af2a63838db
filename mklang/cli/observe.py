"""`--events PATH`: a run's events as JSON Lines (docs/events.md), for `run`, `resume`, `batch`,
`worker` and `test`."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, TYPE_CHECKING

import typer

from mklang.cli.app import fail, finite
from mklang.telemetry import exporting

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


_LINE = json.JSONEncoder(ensure_ascii=False, default=str, allow_nan=False)  # made once, not per event


class JsonLines:
    """An event sink writing each event as one JSON line, flushed as it is written, so a reader
    following the file sees every event as it happens. Thread-safe: a batch's runs share it."""

    def __init__(self, stream: IO[str], trace_content: bool):
        self._stream = stream
        self.trace_content = trace_content
        self._lock = threading.Lock()

    def emit(self, event: Event) -> None:
        document = event.to_json()
        try:
            line = _LINE.encode(document)
        except ValueError:  # a NaN or an infinity, which only a host's value brings: walked only then
            line = _LINE.encode(finite(document))
        with self._lock:
            self._stream.write(line + "\n")
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
