"""An OTLP/HTTP receiver on 127.0.0.1 for tests: it decodes what the SDK's real exporter sends.

A stdlib HTTP server in a background thread accepts `POST /v1/traces` and
`POST /v1/metrics` (protobuf, optionally gzipped) and decodes them with
`opentelemetry-proto` into `ExportTraceServiceRequest` and
`ExportMetricsServiceRequest`. Usage::

    with Receiver() as receiver:
        env = receiver.env()            # OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:PORT, ...
        ...                             # run mklang with it
        spans = receiver.spans()        # every span received, as `Span` records
        assert b"sk-secret" not in receiver.raw()
"""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def value_of(value: AnyValue) -> Any:
    """The Python value of an OTLP attribute value."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [value_of(item) for item in value.array_value.values]
    return None if kind is None else getattr(value, kind)


@dataclass
class Span:
    """A received span: ids as hex, its attributes as a dict, its status code (0 unset, 1 ok, 2 error)."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    start: int
    end: int
    attributes: dict[str, Any]
    status: int
    resource: dict[str, Any] = field(default_factory=dict)


class Receiver:
    """The OTLP/HTTP endpoint: every request body, decoded, in the order received."""

    def __init__(self) -> None:
        self.traces: list[ExportTraceServiceRequest] = []
        self.metrics: list[ExportMetricsServiceRequest] = []
        self.bodies: list[bytes] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path == "/v1/traces":
                    request, reply = ExportTraceServiceRequest(), ExportTraceServiceResponse()
                    kept: list[Any] = receiver.traces
                elif self.path == "/v1/metrics":
                    request, reply = ExportMetricsServiceRequest(), ExportMetricsServiceResponse()
                    kept = receiver.metrics
                else:
                    self.send_response(404)
                    self.end_headers()
                    return
                request.ParseFromString(body)
                with receiver._lock:
                    receiver.bodies.append(body)
                    kept.append(request)
                answer = reply.SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        # Shutting down waits for the server's next look at its socket: every 10 ms, not the default 500.
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)

    def __enter__(self) -> Receiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def env(self) -> dict[str, str]:
        """The OTEL_* variables that send a process's spans and metrics here, quickly."""
        return {
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.url,
            "OTEL_SERVICE_NAME": "mklang-tests",
            "OTEL_BSP_SCHEDULE_DELAY": "50",
            "OTEL_METRIC_EXPORT_INTERVAL": "60000",
        }

    def raw(self) -> bytes:
        """Every request body received, decompressed, joined."""
        with self._lock:
            return b"".join(self.bodies)

    def spans(self) -> list[Span]:
        with self._lock:
            requests = list(self.traces)
        found = []
        for request in requests:
            for resource_spans in request.resource_spans:
                resource = {item.key: value_of(item.value) for item in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        found.append(
                            Span(
                                name=span.name,
                                trace_id=span.trace_id.hex(),
                                span_id=span.span_id.hex(),
                                parent_id=span.parent_span_id.hex(),
                                kind=span.kind,
                                start=span.start_time_unix_nano,
                                end=span.end_time_unix_nano,
                                attributes={item.key: value_of(item.value) for item in span.attributes},
                                status=span.status.code,
                                resource=resource,
                            )
                        )
        return found

    def metric_points(self, name: str) -> list[tuple[dict[str, Any], Any]]:
        """The data points of the metric `name` in the last export that has it (metrics are
        cumulative, so those are the totals): (attributes, point) pairs."""
        with self._lock:
            requests = list(self.metrics)
        for request in reversed(requests):
            points = [
                ({item.key: value_of(item.value) for item in point.attributes}, point)
                for resource_metrics in request.resource_metrics
                for scope_metrics in resource_metrics.scope_metrics
                for metric in scope_metrics.metrics
                if metric.name == name
                for point in getattr(metric, metric.WhichOneof("data")).data_points
            ]
            if points:
                return points
        return []


def tree(spans: list[Span]) -> list[str]:
    """The spans as an indented outline, children in start order (for assertions and reports)."""
    by_parent: dict[str, list[Span]] = {}
    ids = {span.span_id for span in spans}
    for span in spans:
        by_parent.setdefault(span.parent_id if span.parent_id in ids else "", []).append(span)
    lines: list[str] = []

    def walk(parent: str, depth: int) -> None:
        for span in sorted(by_parent.get(parent, []), key=lambda s: (s.start, s.name)):
            lines.append("  " * depth + span.name)
            walk(span.span_id, depth + 1)

    walk("", 0)
    return lines
