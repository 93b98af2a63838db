"""The spans and metrics of runs, made from their events with the OpenTelemetry SDK (ADR 0034).

Imported only when a process exports (`mklang.telemetry.exporting`). Names and
attributes follow the OpenTelemetry GenAI semantic conventions where they have
one, and are `mklang.*` otherwise; docs/observability.md lists them all.

Spans nest as the run did, by each event's path: the run's `invoke_workflow`
span holds a span per state entered, which holds its paid model calls
(`chat`), tool calls (`execute_tool`), hooks, fan-out branches and called
machines, whose states nest inside them in turn. A call answered from the
checkpoint (replayed) makes no span: the process that paid for it made one.
Prompts, outputs, tool arguments and results, questions and error texts are
attributes only when the run traces content; keys never are.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, MetricExporter, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from mklang.engine import events
from mklang.providers.base import Usage
from mklang.version import __version__

log = logging.getLogger("mklang")

# The bucket boundaries the GenAI conventions advise for gen_ai.client.token.usage and .operation.duration.
TOKEN_BUCKETS = [1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864]
SECOND_BUCKETS = [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92]

Attributes = dict[str, Any]
# A span's place in the run: its parts from the root, ("s", machine, state, step), ("b", index), ("c", machine).
Key = tuple[tuple[Any, ...], ...]
Inner = events.BranchStarted | events.BranchFinished | events.CallStarted | events.CallFinished  # nested spans


def _chosen(variable: str) -> str:
    """Which exporter OTEL_TRACES_EXPORTER or OTEL_METRICS_EXPORTER names: otlp (the default), console
    or none (`telemetry.exporting` refused any other)."""
    return os.environ.get(variable, "").strip().lower() or "otlp"


# `console` writes to stderr: stdout is the run's result (`--format json`).
def _span_exporter() -> SpanExporter | None:
    chosen = _chosen("OTEL_TRACES_EXPORTER")
    if chosen == "otlp":
        return OTLPSpanExporter()
    return ConsoleSpanExporter(out=sys.stderr) if chosen == "console" else None


def _metric_exporter() -> MetricExporter | None:
    chosen = _chosen("OTEL_METRICS_EXPORTER")
    if chosen == "otlp":
        return OTLPMetricExporter()
    return ConsoleMetricExporter(out=sys.stderr) if chosen == "console" else None


class Exporter:
    """The process's tracer and meter, exporting over OTLP/HTTP as the OTEL_* variables say."""

    def __init__(self) -> None:
        resource = Resource.create({"service.version": __version__})
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": "mklang"}))
        self.tracing = TracerProvider(resource=resource)
        span_exporter = _span_exporter()
        if span_exporter is not None:
            self.tracing.add_span_processor(BatchSpanProcessor(span_exporter))
        metric_exporter = _metric_exporter()
        readers = [] if metric_exporter is None else [PeriodicExportingMetricReader(metric_exporter)]
        self.metering = MeterProvider(resource=resource, metric_readers=readers)
        self.tracer = self.tracing.get_tracer("mklang", __version__)
        meter = self.metering.get_meter("mklang", __version__)
        self.tokens = meter.create_histogram(
            "gen_ai.client.token.usage",
            unit="{token}",
            description="Tokens of the model calls a run paid for",
            explicit_bucket_boundaries_advisory=TOKEN_BUCKETS,
        )
        self.duration = meter.create_histogram(
            "gen_ai.client.operation.duration",
            unit="s",
            description="How long the model calls a run paid for took",
            explicit_bucket_boundaries_advisory=SECOND_BUCKETS,
        )
        self.cost = meter.create_counter("mklang.client.cost", unit="USD", description="What model calls cost")

    def run(self, carrier: dict[str, str] | None, run: str | None, content: bool) -> RunSpans:
        return RunSpans(self, carrier, run, content)

    def flush(self) -> None:
        """Send what is pending now (the end of a run), so a process exiting next loses nothing."""
        self.tracing.force_flush()
        self.metering.force_flush()

    def shutdown(self) -> None:
        self.tracing.shutdown()
        self.metering.shutdown()


_lock = threading.Lock()
_exporter: Exporter | None = None


def exporter() -> Exporter:
    """The process's exporter, made on first use and shut down (flushed) at exit."""
    global _exporter
    with _lock:
        if _exporter is None:
            _exporter = Exporter()
            atexit.register(shutdown)
        return _exporter


def shutdown() -> None:
    """Flush and stop the process's exporter; the next run that exports makes a new one."""
    global _exporter
    with _lock:
        done, _exporter = _exporter, None
    if done is not None:
        done.shutdown()


def _ns(seconds: float) -> int:
    return int(seconds * 1_000_000_000)


def _keys(path: tuple[events.PathLevel, ...]) -> Key:
    """The span an event's path is in: each level's state, inside its branch, inside the call
    state that called the level below."""
    key: list[tuple[Any, ...]] = []
    for depth, segment in enumerate(path):
        if depth:
            key.append(("c", segment.machine))
        key.append(("s", segment.machine, segment.state, segment.step))
        if segment.branch is not None:
            key.append(("b", segment.branch))
    return tuple(key)


def _inner(event: Inner) -> tuple[Any, ...]:
    """The last part of the key of the span a fan-out branch or a called machine opens under the
    state it runs in, as `_keys` names it for the events inside."""
    if isinstance(event, events.BranchStarted | events.BranchFinished):
        return ("b", event.index)
    return ("c", event.machine)


def _span_name(part: tuple[Any, ...]) -> str:
    kind, *rest = part
    return {"s": lambda: f"state {rest[1]}", "b": lambda: f"branch {rest[0]}", "c": lambda: f"call {rest[0]}"}[kind]()


def _usage(usage: Usage) -> Attributes:
    return {
        "gen_ai.usage.input_tokens": usage.input_tokens,
        "gen_ai.usage.output_tokens": usage.output_tokens,
        "mklang.cost_usd": usage.cost_usd,
    }


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


def _parts(role: str, text: Any) -> dict[str, Any]:
    return {"role": role, "parts": [{"type": "text", "content": _text(text)}]}


class RunSpans:
    """The spans of one run in this process: an event sink (`emit`), one per run, so the run's
    events come one at a time. It never stops a run: an error of its own is logged and dropped."""

    def __init__(self, exporter: Exporter, carrier: dict[str, str] | None, run: str | None, content: bool):
        self.exporter = exporter
        self.trace_content = content
        propagator = TraceContextTextMapPropagator()
        parent = propagator.extract(carrier) if carrier else None
        continues = parent is not None and trace.get_current_span(parent).get_span_context().is_valid
        attributes: Attributes = {"gen_ai.operation.name": "invoke_workflow"}
        if run is not None:
            attributes["mklang.run.name"] = run
        self.root = exporter.tracer.start_span("invoke_workflow", context=parent if continues else None)
        self.root.set_attributes(attributes)
        if continues:
            self.carrier = dict(carrier or {})
        else:  # the run's first process (or a checkpoint without a usable context): the trace starts here
            self.carrier = {}
            propagator.inject(self.carrier, context=trace.set_span_in_context(self.root))
        self.open: dict[Key, Span] = {(): self.root}
        self.started: dict[str, Any] = {}  # a call's prompt or arguments, by key, until it finishes (content only)
        self.now = 0  # the time of the event being recorded (ns), and the span its path is in
        self.key: Key = ()
        self._lock = threading.Lock()
        self._ended = False
        self._handlers: dict[type[events.Event], Callable[[Any], None]] = {
            events.RunStarted: self._begun,
            events.RunResumed: self._begun,
            events.StateEntered: self._state,
            events.GateDecided: self._gate,
            events.ModelStarted: self._call_started,
            events.ToolStarted: self._call_started,
            events.ModelFinished: self._model,
            events.ToolFinished: self._tool,
            events.HookCalled: self._hook,
            events.BranchStarted: self._branch_started,
            events.BranchFinished: self._inner_finished,
            events.CallStarted: self._call_machine,
            events.CallFinished: self._inner_finished,
            events.RunSuspended: self._suspended,
            events.RunHalted: self._halted,
            events.RunFinished: self._finished,
        }

    def emit(self, event: events.Event) -> None:
        handler = self._handlers.get(type(event))
        if handler is None:
            return
        try:
            with self._lock:
                if not self._ended:
                    self.now = _ns(event.time)
                    self.key = _keys(event.path)
                    handler(event)
        except Exception:  # a span that cannot be made must not stop the run
            log.warning("mklang: OpenTelemetry: cannot record %s", event.kind, exc_info=True)

    def close(self, error: BaseException | None) -> None:
        """End what the run's events left open: at its end, or (`error`) when it ended by an exception."""
        with self._lock:
            if self._ended:
                return
            self._ended = True
            if error is not None:
                self.root.set_attribute("error.type", type(error).__name__)
                self.root.set_status(Status(StatusCode.ERROR, type(error).__name__))
            self._end_under((), None)
            self.root.end()

    # --- the tree of spans --------------------------------------------------------------

    def _span(self, key: Key) -> Span:
        """The open span at `key`, started now (with its parents) when no event opened it."""
        span = self.open.get(key)
        if span is None:
            span = self._start(key, {})
        return span

    def _start(self, key: Key, attributes: Attributes) -> Span:
        parent = trace.set_span_in_context(self._span(key[:-1]))
        span = self.exporter.tracer.start_span(
            _span_name(key[-1]), context=parent, attributes=attributes, start_time=self.now
        )
        self.open[key] = span
        return span

    def _end_under(self, key: Key, end: int | None) -> None:
        """End every open span below `key`, the deepest first."""
        below = [k for k in self.open if len(k) > len(key) and k[: len(key)] == key]
        for k in sorted(below, key=len, reverse=True):
            self.open.pop(k).end(end_time=end)

    def _end(self, key: Key, attributes: Attributes, failed: bool = False) -> None:
        span = self._span(key)
        span.set_attributes(attributes)
        if failed:
            span.set_status(Status(StatusCode.ERROR))
        self._close(key)

    def _close(self, key: Key) -> None:
        """End the open span at `key` now, after every open span below it."""
        self._end_under(key, self.now)
        self.open.pop(key).end(end_time=self.now)

    def _leaf(self, name: str, event: Any, attributes: Attributes, kind: SpanKind = SpanKind.INTERNAL) -> Span:
        """A span of a call that took `event.duration_ms` up to now, under the state it ran in."""
        start = self.now - int(event.duration_ms * 1_000_000)
        parent = trace.set_span_in_context(self._span(self.key))
        span = self.exporter.tracer.start_span(name, context=parent, kind=kind, attributes=attributes, start_time=start)
        if event.error is not None:
            span.set_attribute("error.type", "mklang.call_failed")
            span.set_status(Status(StatusCode.ERROR, event.error if self.trace_content else None))
        span.end(end_time=self.now)
        return span

    # --- the events ---------------------------------------------------------------------

    def _begun(self, event: events.RunStarted | events.RunResumed) -> None:
        self.root.update_name(f"invoke_workflow {event.machine}")
        attributes: Attributes = {
            "gen_ai.workflow.name": event.machine,
            "mklang.run_id": event.run_id,
            "mklang.run.resumed": isinstance(event, events.RunResumed),
            "mklang.run.concurrency": event.concurrency,
            "mklang.run.hitl": event.hitl,
        }
        if event.max_tokens is not None:
            attributes["mklang.budget.max_tokens"] = event.max_tokens
        if event.max_cost is not None:
            attributes["mklang.budget.max_cost_usd"] = event.max_cost
        if isinstance(event, events.RunResumed):
            attributes["mklang.run.recovered"] = event.recovered
        self.root.set_attributes(attributes)

    def _state(self, event: events.StateEntered) -> None:
        level, here = self.key[:-1], self.key[-1]
        for other in [k for k in self.open if len(k) > len(level) and k[: len(level)] == level]:
            if other in self.open and other[len(level)] != here:  # the level's previous state ends here
                self._close(other)
        self._span(self.key).set_attributes(
            {
                "mklang.machine": event.machine,
                "mklang.state": event.state,
                "mklang.step": event.step,
                "mklang.steps": event.steps,
                "mklang.step_budget": event.budget,
            }
        )

    def _gate(self, event: events.GateDecided) -> None:
        decided: Attributes = {
            "mklang.gate.index": event.gate,
            "mklang.gate.label": event.label,
            "mklang.gate.decided_by": event.decided_by,
            "mklang.gate.policy": event.policy,
            "mklang.gate.to": event.to,
            "mklang.gate.judge_fallback": event.judge_fallback,
            "mklang.decision_tainted": event.decision_tainted,
        }
        self._span(self.key).set_attributes({name: value for name, value in decided.items() if value is not None})

    def _call_started(self, event: events.ModelStarted | events.ToolStarted) -> None:
        given = event.prompt if isinstance(event, events.ModelStarted) else event.arguments
        if self.trace_content and given is not None:
            self.started[event.key] = given

    def _model(self, event: events.ModelFinished) -> None:
        given = self.started.pop(event.key, None)
        if event.outcome == "replayed":
            return
        named: Attributes = {"gen_ai.operation.name": "chat"}
        if event.provider is not None:
            named["gen_ai.provider.name"] = event.provider
        if event.model is not None:
            named["gen_ai.request.model"] = event.model
        attributes = {**named, **_usage(event.usage), "mklang.call": event.call, "mklang.tier": event.tier}
        if event.choice is not None:  # which gate a judge chose: an index, none or unparseable
            attributes["mklang.judge.choice"] = event.choice
        if self.trace_content:
            attributes.update(_messages(given, event))
        name = f"chat {event.model}" if event.model else "chat"
        self._leaf(name, event, attributes, SpanKind.CLIENT)
        self._measure(named, event)

    def _measure(self, named: Attributes, event: events.ModelFinished) -> None:
        for kind, tokens in (("input", event.usage.input_tokens), ("output", event.usage.output_tokens)):
            self.exporter.tokens.record(tokens, {**named, "gen_ai.token.type": kind})
        failed = {"error.type": "mklang.call_failed"} if event.error is not None else {}
        self.exporter.duration.record(event.duration_ms / 1000, {**named, **failed})
        if event.usage.cost_usd:
            self.exporter.cost.add(event.usage.cost_usd, named)

    def _tool(self, event: events.ToolFinished) -> None:
        given = self.started.pop(event.key, None)
        if event.outcome == "replayed":
            return
        attributes: Attributes = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": event.tool,
            "gen_ai.tool.type": "function",
            "gen_ai.tool.call.id": event.key,
            "mklang.tool.read_only": event.read_only,
        }
        if self.trace_content:
            if given is not None:
                attributes["gen_ai.tool.call.arguments"] = _text(given)
            if event.output is not None:
                attributes["gen_ai.tool.call.result"] = event.output
        self._leaf(f"execute_tool {event.tool}", event, attributes)

    def _hook(self, event: events.HookCalled) -> None:
        attributes: Attributes = {"mklang.hook.name": event.hook}
        if event.result is not None:
            attributes["mklang.hook.result"] = event.result
        self._leaf(f"hook {event.hook}", event, attributes)

    def _branch_started(self, event: events.BranchStarted) -> None:
        attributes = {"mklang.branch.index": event.index, "mklang.branch.count": event.count}
        self._start((*self.key, _inner(event)), attributes)

    def _call_machine(self, event: events.CallStarted) -> None:
        attributes = {"mklang.machine": event.machine, "mklang.call.resumed": event.resumed}
        self._start((*self.key, _inner(event)), attributes)

    def _inner_finished(self, event: events.BranchFinished | events.CallFinished) -> None:
        """A branch or a called machine ended: its span gets its status and spend, and an error
        status when the branch failed or the machine halted."""
        kind, failure = ("branch", "failed") if isinstance(event, events.BranchFinished) else ("call", "halted")
        attributes = {f"mklang.{kind}.status": event.status, **_usage(event.usage)}
        self._end((*self.key, _inner(event)), attributes, failed=event.status == failure)

    def _suspended(self, event: events.RunSuspended) -> None:
        attributes: Attributes = {"mklang.run.suspend_reason": event.reason}
        if event.at is not None:
            attributes["mklang.run.at"] = event.at
        if self.trace_content and event.ask is not None:
            attributes["mklang.run.ask"] = event.ask
        self.root.set_attributes(attributes)

    def _halted(self, event: events.RunHalted) -> None:
        if event.at is not None:
            self.root.set_attribute("mklang.run.at", event.at)
        self.root.set_attribute("error.type", "mklang.halted")
        self.root.set_status(Status(StatusCode.ERROR, event.error if self.trace_content else "halted"))

    def _finished(self, event: events.RunFinished) -> None:
        attributes: Attributes = {"mklang.run.status": event.status, **_usage(event.usage)}
        attributes.update({f"mklang.run.paid_calls.{kind}": count for kind, count in event.calls.items()})
        self.root.set_attributes(attributes)
        self._end_under((), self.now)
        self._ended = True
        self.root.end(end_time=self.now)


def _messages(prompt: Any, event: events.ModelFinished) -> Iterator[tuple[str, str]]:
    """The content attributes of a chat span: the prompt as the conventions' input messages
    (a judge's conditions as its user message) and the answer as the output message."""
    if isinstance(prompt, dict) and "user" in prompt:
        yield "gen_ai.system_instructions", json.dumps([{"type": "text", "content": _text(prompt.get("system"))}])
        yield "gen_ai.input.messages", json.dumps([_parts("user", prompt["user"])], ensure_ascii=False)
    elif prompt is not None:
        yield "gen_ai.input.messages", json.dumps([_parts("user", prompt)], ensure_ascii=False)
    if event.output is not None:
        yield "gen_ai.output.messages", json.dumps([_parts("assistant", event.output)], ensure_ascii=False)
