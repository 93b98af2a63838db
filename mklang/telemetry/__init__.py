"""OpenTelemetry for every run: spans and metrics made from its events (ADR 0034, docs/observability.md).

A process exports when the `otel` extra is installed and one of `VARIABLES`
is set; the OpenTelemetry SDK then reads every other `OTEL_*` variable itself.
Every run passes through `traced` (the run service calls it for `run`,
`resume`, batches, workers, `mklang test` and the API alike), which joins a
span-making event sink to the run's observer. Without the variables nothing
of OpenTelemetry is imported: this module reads the environment only, and
`telemetry.otel` is imported when a run exports.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mklang.engine.events import EventSink
    from mklang.telemetry.otel import Exporter

# Any of these set (to anything) makes runs export, unless OTEL_SDK_DISABLED=true.
VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_EXPORTER")


# What mklang's exporters can do: a variable asking for anything else could not take effect.
SUPPORTED = {
    "OTEL_TRACES_EXPORTER": ("otlp", "console", "none"),
    "OTEL_METRICS_EXPORTER": ("otlp", "console", "none"),
    "OTEL_EXPORTER_OTLP_PROTOCOL": ("http/protobuf",),
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": ("http/protobuf",),
    "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": ("http/protobuf",),
}


def exporting() -> bool:
    """Whether this process's runs export spans and metrics, by the environment alone.

    Raises UsageError, before the run starts, for an exporter or protocol mklang does not have."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if not any(os.environ.get(name) for name in VARIABLES):
        return False
    for name, known in SUPPORTED.items():
        value = os.environ.get(name, "").strip().lower()
        if value and value not in known:
            from mklang.errors import UsageError

            raise UsageError(f"{name}={value} is not supported: mklang exports with {' or '.join(known)}")
    return True


_missing_told = False


def _exporter() -> Exporter | None:
    """The process's exporter, set up on first use; None (said once on stderr) without the extra."""
    global _missing_told
    try:
        from mklang.telemetry.otel import exporter
    except ImportError:
        if not _missing_told:
            _missing_told = True
            set_ones = ", ".join(name for name in VARIABLES if os.environ.get(name))
            print(
                f"mklang: {set_ones} asks for OpenTelemetry, but the otel extra is not installed "
                "(pip install 'mklang[otel]>=2'): no spans are exported",
                file=sys.stderr,
            )
        return None
    return exporter()


@contextmanager
def traced(
    observer: EventSink | None, carrier: dict[str, str] | None, run: str | None = None
) -> Iterator[tuple[EventSink | None, dict[str, str] | None]]:
    """The observer of a run with its spans joined in, and the trace context its checkpoint
    records: `carrier`, the one it was read with, when that continues a trace, else its own.

    `run` is its name in a store. The run's spans are sent when it ends here, however it ends
    (a suspension included), so a process that exits next loses none. Not exporting, both
    come back as given."""
    exporter = _exporter() if exporting() else None
    if exporter is None:
        yield observer, carrier
        return
    from mklang.engine.events import joined, traces_content

    spans = exporter.run(carrier, run, content=traces_content(observer))
    try:
        yield joined(observer, spans), spans.carrier
    except BaseException as error:
        spans.close(error)
        raise
    else:
        spans.close(None)
    finally:
        exporter.flush()
