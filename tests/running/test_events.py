"""The run events (docs/events.md): what the engine emits at each boundary, in which order and
nesting, what they say of spend and replays, and the `--events` JSON Lines against the schema."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from conformance.harness import run_mk, write_machines
from support import ROOT
from support.commands import cli, refused
from support.crashes import Crash, crash
from support.examples import EXAMPLES, HITL

import mklang as api
from mklang import faults
from mklang.engine import events
from mklang.providers.base import Produced, Usage, Verdict
from mklang.scenarios import load_script

SCHEMA = json.loads((ROOT / "docs" / "events.schema.json").read_text(encoding="utf-8"))
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA, format_checker=jsonschema.FormatChecker())


class Sink:
    """Every event, in the order the sink was told of it."""

    def __init__(self, trace_content: bool = False):
        self.trace_content = trace_content
        self.events: list[events.Event] = []

    def emit(self, event: events.Event) -> None:
        self.events.append(event)

    def of(self, kind: type[events.Event]) -> list[Any]:
        return [event for event in self.events if isinstance(event, kind)]


class Slow:
    """A provider answering each produce with its prompt; every call costs 3 + 2 tokens. Given
    `release`, the call of item 0 waits for it, so concurrent branches finish out of order
    however the machine schedules them."""

    def __init__(self, release: threading.Event | None = None):
        self.release = release

    def produce(self, system: str, user: str, tier: str, reason: bool) -> Produced:
        if self.release is not None and "item 0" in user:
            assert self.release.wait(30), "the other branches did not finish while the first one ran"
        return Produced(user, None, Usage(3, 2, 0.25))

    def judge(self, conditions: list[str], output: Any, reasoning: Any, context: Any, tier: str) -> Verdict:
        return Verdict(0, Usage(1, 1, 0.125))


FAN = """
    machine fan
    entry each
    budget 10
    context { items: [] }
    state each {
      over items
      call item { it: "{{item}}", at: "{{index}}" }
      output outs
      otherwise -> check
    }
    state check {
      structure "s"
      prompt "all done"
      output verdict
      when "it is fine" -> END
      otherwise fail
    }
"""
ITEM = """
    machine item
    entry say
    budget 3
    context { it: "", at: "" }
    state say {
      structure "s"
      prompt "item {{at}}: {{it}}"
      output said
      otherwise -> END
    }
"""


def test_events_of_concurrent_branches_nest_under_the_branch_they_ran_in(tmp_path):
    machine = write_machines(tmp_path, FAN, ITEM)
    others_finished = threading.Event()

    class Releasing(Sink):
        def emit(self, event: events.Event) -> None:
            super().emit(event)
            if len(self.of(events.BranchFinished)) == 3:
                others_finished.set()

    sink = Releasing(trace_content=True)
    provider = Slow(release=others_finished)
    result = api.run(machine, {"items": ["a", "b", "c", "d"]}, provider=provider, concurrency=4, observer=sink)
    assert result.status == "done"
    seen = sink.events
    assert [event.seq for event in seen] == list(range(1, len(seen) + 1))
    assert len({event.run_id for event in seen}) == 1
    assert isinstance(seen[0], events.RunStarted) and isinstance(seen[-1], events.RunFinished)
    started = [event.index for event in sink.of(events.BranchStarted)]
    finished = [event.index for event in sink.of(events.BranchFinished)]
    assert sorted(started) == sorted(finished) == [0, 1, 2, 3]
    assert finished[-1] == 0  # the slow first branch ended last: the branches overlapped
    fan_state = events.PathLevel("fan", "each", 1)
    for event in sink.of(events.BranchStarted) + sink.of(events.BranchFinished):
        assert event.path == (fan_state,)
    for event in sink.of(events.ModelStarted):
        if event.path[0].state == "check":
            assert event.path == (events.PathLevel("fan", "check", 2),)
            continue
        index = int(event.prompt["user"].split(":")[0].removeprefix("item "))
        # The branch that made the call, then the called machine's state.
        assert event.path == (events.PathLevel("fan", "each", 1, index), events.PathLevel("item", "say", 1))
    for event in sink.of(events.CallStarted):
        assert event.machine == "item" and event.path[0].branch is not None
    entered = [(len(event.path), event.machine, event.state) for event in sink.of(events.StateEntered)]
    assert entered.count((2, "item", "say")) == 4
    assert [e for e in entered if e[0] == 1] == [(1, "fan", "each"), (1, "fan", "check")]


def test_the_calls_events_add_up_to_the_runs_usage(tmp_path):
    machine = write_machines(tmp_path, FAN, ITEM)
    sink = Sink()
    result = api.run(machine, {"items": ["a", "b", "c"]}, provider=Slow(), concurrency=3, observer=sink)
    finished = sink.of(events.ModelFinished)
    assert Counter(event.call for event in finished) == {"produce": 4, "judge": 1}
    assert {event.outcome for event in finished} == {"paid"}
    assert sum((event.usage for event in finished), Usage()) == result.usage
    assert sink.events[-1].usage == result.usage and sink.events[-1].calls == {"judge": 1, "produce": 4}
    branches = sum((event.usage for event in sink.of(events.BranchFinished)), Usage())
    assert branches == Usage(9, 6, 0.75)
    answers = [event.output_chars for event in finished if event.path[0].branch is not None]
    assert sorted(answers) == sorted(len(branch["output"]) for branch in result.trace[0]["branches"])
    assert all(event.output is None for event in finished)  # no content unless the sink asks for it
    assert all(event.prompt is None for event in sink.of(events.ModelStarted))


TWO = """
    machine two
    entry a
    budget 5
    state a {
      structure "s"
      prompt "first"
      output x
      otherwise -> b
    }
    state b {
      structure "s"
      prompt "second"
      output y
      otherwise -> END
    }
"""


class Answers:
    """A provider paying 10 + 1 tokens per answer, counting the answers it gave."""

    def __init__(self):
        self.given = 0
        self._lock = threading.Lock()

    def produce(self, system: str, user: str, tier: str, reason: bool) -> Produced:
        with self._lock:
            self.given += 1
        return Produced(f"answer to {user}", None, Usage(10, 1))

    def judge(self, *args: Any) -> Verdict:
        raise AssertionError("no gate is judged")


def test_a_run_resumed_after_a_crash_keeps_its_run_id_and_marks_the_replayed_calls(tmp_path):
    machine = write_machines(tmp_path, TWO)
    checkpoint = tmp_path / "cp.json"
    first, provider = Sink(), Answers()
    faults.arm("journal.call", 1, crash)  # the first answer is journaled, its step is not
    try:
        with pytest.raises(Crash):
            api.run(machine, provider=provider, checkpoint=checkpoint, observer=first)
    finally:
        faults.disarm()
    assert [event.kind for event in first.events] == ["run.started", "state.entered", "model.started"]
    second = Sink()
    result = api.resume(checkpoint, provider=provider, observer=second)
    assert result.status == "done" and provider.given == 2  # the first answer was not bought again
    assert {event.run_id for event in second.events} == {first.events[0].run_id}
    resumed = second.events[0]
    assert isinstance(resumed, events.RunResumed) and resumed.recovered and resumed.spent == Usage(10, 1)
    calls = [(event.path[-1].state, event.outcome, event.usage) for event in second.of(events.ModelFinished)]
    assert calls == [("a", "replayed", Usage(10, 1)), ("b", "paid", Usage(10, 1))]
    assert sum((event.usage for event in second.of(events.ModelFinished)), Usage()) == result.usage
    assert second.events[-1].calls == {"produce": 1}  # what this process paid for


def test_an_escalation_suspends_and_its_resume_continues_the_run_id(tmp_path):
    machine = api.load(HITL / "approval" / "approval.mk")
    script = HITL / "approval" / "scenarios.yaml"
    checkpoint = tmp_path / "cp.json"
    first, second = Sink(), Sink()
    parked = api.run(
        machine, script=script, scenario="ask-then-publish", checkpoint=checkpoint, hitl=True, observer=first
    )
    assert parked.status == "suspended"
    suspended = first.of(events.RunSuspended)
    assert [(s.reason, s.at, s.reply_to) for s in suspended] == [("escalated", "decide", "approval.answer")]
    assert suspended[0].ask == parked.ask
    assert [(e.policy, e.to, e.decided_by) for e in first.of(events.GateDecided)] == [
        ("escalate", "decide", "catch-all")
    ]
    done = api.resume(checkpoint, reply={"approval.answer": "yes"}, observer=second)
    assert done.status == "done"
    assert {event.run_id for event in second.events} == {first.events[0].run_id}
    assert not second.of(events.RunResumed)[0].recovered
    tools = second.of(events.ToolFinished)
    assert [(t.tool, t.read_only, t.outcome, t.output_chars) for t in tools] == [
        ("publish", False, "paid", len(done.result))
    ]
    decided = second.of(events.GateDecided)
    assert [(d.state, d.decided_by, d.decision_tainted) for d in decided] == [
        ("decide", "judge", True),  # it read the reviewer's answer: outside data
        ("publish", "catch-all", False),
    ]


def test_a_hook_gate_says_what_the_host_answered(tmp_path):
    machine = api.load(EXAMPLES / "triage" / "triage.mk")
    sink = Sink()
    api.run(
        machine,
        script=EXAMPLES / "triage" / "scenarios.yaml",
        scenario="small-refund-answered-directly",
        observer=sink,
    )
    hooks = sink.of(events.HookCalled)
    assert hooks and all(hook.hook == "amount_ok" and hook.error is None for hook in hooks)
    assert any(d.decided_by == "host" for d in sink.of(events.GateDecided))


def test_an_event_sink_that_raises_stops_the_run_as_a_crash_would(tmp_path):
    machine = write_machines(tmp_path, TWO)

    class Broken:
        def emit(self, event: events.Event) -> None:
            if isinstance(event, events.ModelFinished):
                raise Crash

    with pytest.raises(Crash):
        api.run(machine, provider=Answers(), observer=Broken())


# --- --events: JSON Lines against docs/events.schema.json ---------------------------------------


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def valid(documents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for document in documents:
        errors = sorted(VALIDATOR.iter_errors(document), key=str)
        assert not errors, (document, [error.message for error in errors[:3]])
    return documents


def test_the_events_of_real_runs_validate_against_the_published_schema(tmp_path):
    """A fan-out of calls, tools, an escalation that suspends and its resume, all in one file."""
    out = tmp_path / "events.jsonl"
    digest = EXAMPLES / "map-reduce"
    done = cli(
        "run", str(digest / "digest.mk"), "--script", str(digest / "scenarios.yaml"),
        "--scenario", "three-sections", "--events", str(out), "--trace-content", "-q", "--format", "json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    approval = HITL / "approval"
    checkpoint = tmp_path / "cp.json"
    parked = cli(
        "run", str(approval / "approval.mk"), "--script", str(approval / "scenarios.yaml"),
        "--scenario", "ask-then-publish", "--checkpoint", str(checkpoint), "--hitl", "--events", str(out),
        "--format", "json",
    )  # fmt: skip
    assert parked.returncode == 3, parked.stderr
    resumed = cli("resume", str(checkpoint), "--set", "approval.answer=yes", "--events", str(out), "--format", "json")
    assert resumed.returncode == 0, resumed.stderr
    documents = valid(lines(out))
    kinds = {document["event"] for document in documents}
    # a scenario script streams nothing: test_streamed_events validates `model.delta` lines
    assert kinds == set(events.KINDS) - {"hook.called", "run.halted", "model.delta"}, kinds
    runs = [document["run_id"] for document in documents if document["event"] in ("run.started", "run.resumed")]
    assert len(runs) == 3 and runs[1] == runs[2]  # the resume continues the suspended run
    traced = {document["run_id"] for document in documents if "output" in document or "prompt" in document}
    assert traced == {runs[0]}  # content only with --trace-content
    produced = [d for d in documents if d["event"] == "model.finished" and d["call"] == "produce"]
    assert all(len(d["output"]) == d["output_chars"] for d in produced if d["run_id"] == runs[0])


def test_hooks_halts_and_scenarios_of_mklang_test_validate_and_carry_the_scenario_name(tmp_path):
    out = tmp_path / "events.jsonl"
    triage = EXAMPLES / "triage"
    done = cli("test", str(triage / "triage.mk"), "--script", str(triage / "scenarios.yaml"), "--events", str(out))
    assert done.returncode == 0, done.stdout
    documents = valid(lines(out))
    assert {"hook.called", "run.halted", "run.suspended"} <= {document["event"] for document in documents}
    assert {document["run"] for document in documents} == {s.name for s in load_script(triage / "scenarios.yaml")}


def test_a_batchs_events_carry_each_runs_name(tmp_path):
    inputs = tmp_path / "in.jsonl"
    inputs.write_text('{"id": "one", "document": "x"}\n{"id": "two", "document": "y"}\n', encoding="utf-8")
    out = tmp_path / "events.jsonl"
    digest = EXAMPLES / "map-reduce"
    done = cli(
        "batch", str(digest / "digest.mk"), "--inputs", str(inputs), "--store", str(tmp_path / "store"),
        "--script", str(digest / "scenarios.yaml"), "--scenario", "three-sections", "--events", str(out),
        "--format", "json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    documents = valid(lines(out))
    by_run = {name: [d for d in documents if d["run"] == name] for name in ("one", "two")}
    assert {document["run"] for document in documents} == {"one", "two"}
    for name, own in by_run.items():
        assert [d["seq"] for d in own] == list(range(1, len(own) + 1)), name
        assert own[-1]["event"] == "run.finished" and own[-1]["status"] == "done"


def test_events_on_stderr_leave_the_json_result_on_stdout_alone(tmp_path):
    digest = EXAMPLES / "map-reduce"
    done = cli(
        "run", str(digest / "digest.mk"), "--script", str(digest / "scenarios.yaml"),
        "--scenario", "three-sections", "--events", "-", "-q", "--format", "json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["status"] == "done"
    documents = valid([json.loads(line) for line in done.stderr.splitlines()])
    assert documents[-1]["event"] == "run.finished" and documents[-1]["usage"] == json.loads(done.stdout)["usage"]


@pytest.mark.parametrize("where", ["missing-folder/events.jsonl", "."])
def test_an_events_path_that_cannot_be_written_is_a_one_line_usage_error(tmp_path, where):
    digest = EXAMPLES / "map-reduce"
    done = cli(
        "run", str(digest / "digest.mk"), "--script", str(digest / "scenarios.yaml"),
        "--scenario", "three-sections", "--events", str(tmp_path / where), "-q", "--format", "text",
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(f"mklang: error: --events {tmp_path / where}: ")
    assert done.stdout == ""


def test_trace_content_needs_events_or_spans():
    digest = EXAMPLES / "map-reduce"
    done = cli(
        "run", str(digest / "digest.mk"), "--script", str(digest / "scenarios.yaml"),
        "--scenario", "three-sections", "--trace-content", "-q",
    )  # fmt: skip
    assert refused(done) == (
        "mklang: error: --trace-content adds content to the events or spans: it needs --events PATH, "
        "or OpenTelemetry export (docs/observability.md)"
    )


# --- the schema and the event classes agree ---------------------------------------------------


def test_every_kind_has_a_schema_definition_with_the_classes_fields():
    envelope = {"schema", "event", "run_id", "run", "seq", "time", "path"}
    defined = {
        definition["properties"]["event"]["const"]: definition
        for name, definition in SCHEMA["$defs"].items()
        if "event" in definition.get("properties", {})
    }
    assert set(defined) == set(events.KINDS)
    assert len(SCHEMA["oneOf"]) == len(events.KINDS)
    for kind, cls in events.KINDS.items():
        fields = {field.name for field in dataclasses.fields(cls)} - {"run_id", "seq", "time", "path", "run"}
        assert set(defined[kind]["properties"]) == envelope | fields, kind
        assert set(defined[kind]["required"]) == (envelope - {"run"}) | (fields - events.CONTENT), kind


def test_the_documented_kinds_are_the_emitted_kinds_and_its_example_lines_are_valid():
    reference = (ROOT / "docs" / "events.md").read_text(encoding="utf-8")
    for kind in events.KINDS:
        assert f"`{kind}`" in reference, kind
    example = reference.split("```json\n")[1].split("```")[0]
    assert len(valid([json.loads(line) for line in example.splitlines()])) == 5


def test_the_live_view_shows_each_state_entered_outside_branches_against_the_budget_the_run_began_under():
    from mklang.cli.render import LiveView

    view = LiveView()
    began = {"machine": "brief", "max_tokens": 100, "max_cost": None, "concurrency": 4, "hitl": False}
    view.emit(events.RunResumed(**began, recovered=False, spent=Usage(30, 12)))
    levels = (events.PathLevel("brief", "add_section", 1), events.PathLevel("section", "write", 2))
    entered = events.StateEntered(
        path=levels, machine="section", state="write", step=2, steps=1, budget=5, spent=Usage(30, 12)
    )
    view.emit(entered)
    shown = str(view.live.renderable)
    assert shown == "▶ brief:add_section › section:write   steps 1/5   tokens 42/100"
    in_branch = (events.PathLevel("brief", "add_section", 1, 0), events.PathLevel("section", "write", 1))
    view.emit(dataclasses.replace(entered, path=in_branch, steps=0))
    view.emit(events.RunFinished(status="done", usage=Usage(50, 20)))
    assert str(view.live.renderable) == shown  # branches and other kinds leave it as it was


def test_a_routed_model_call_names_its_provider_and_model_and_no_event_holds_the_key(tmp_path, server, monkeypatch):
    from providers.test_providers_http import KEY, write_config
    from support.fakeserver import answer

    from mklang.providers.factory import make_provider

    monkeypatch.setenv("FAKE_KEY", KEY)
    server.add(answer("one", input_tokens=100, output_tokens=10))
    server.add(answer("two", input_tokens=100, output_tokens=10))
    machine = write_machines(tmp_path, TWO)
    sink = Sink(trace_content=True)
    provider = make_provider(config_path=write_config(tmp_path, server, "openai", tiers={"balanced": "p:m1"}))
    result = api.run(machine, provider=provider, observer=sink)
    assert result.status == "done"
    calls = [(e.provider, e.model, e.tier, e.usage) for e in sink.of(events.ModelFinished)]
    assert calls == [("p", "m1", "balanced", Usage(100, 10, (250 + 100) / 1_000_000))] * 2
    assert KEY not in json.dumps([event.to_json() for event in sink.events])


def test_a_tool_that_raises_is_a_failed_tool_event_with_its_error_and_no_output(tmp_path):
    lookup = """
        machine lookup
        entry find
        budget 3
        tool search "Look it up."
        state find {
          tool search { query: "q" }
          output found
          otherwise -> END
        }
    """

    def search(arguments: dict[str, Any], **call: Any) -> str:
        raise LookupError("the index is down")

    sink = Sink()
    result = run_mk(lookup, tools={"search": search}, observer=sink)
    assert (result.status, result.error) == ("halted", "state-error: tool search: the index is down")
    finished = sink.of(events.ToolFinished)
    assert [(t.tool, t.outcome, t.error, t.output_chars, t.output) for t in finished] == [
        ("search", "failed", "the index is down", None, None)
    ]
    assert 0 <= finished[0].duration_ms < 60_000  # the call's own time, not a clock reading


def test_with_trace_content_a_call_starts_with_its_prompts_or_the_conditions_it_judges():
    checked = """
        machine checked
        entry draft
        budget 3
        state draft {
          structure "One line."
          prompt "Write it."
          output text
          when "it is fine" -> END
          when "it is rude" -> END
          otherwise fail
        }
    """
    sink = Sink(trace_content=True)
    assert run_mk(checked, llm={"produce": ["hi"], "judge": [0]}, observer=sink).status == "done"
    produce, judge = sink.of(events.ModelStarted)
    assert (produce.call, produce.prompt["user"]) == ("produce", "Write it.")
    assert (judge.call, judge.prompt) == ("judge", {"conditions": ["it is fine", "it is rude"]})


ODD_VALUES = [
    None, True, False, 0, -5, 10**30, 1.5, 0.1, 1e300, -0.0, 5e-324, "", "x\u2028é\"\\\n\x00", [1, None, "a"],
    {"k": 1.5, 2: "x", None: [], True: {}}, (1, 2), object, Usage(1, 2, 0.5),
]  # fmt: skip


@pytest.mark.parametrize("kind", sorted(events.KINDS))
def test_an_events_line_is_the_json_of_its_event_whatever_its_fields_hold(kind):
    """`--events` puts a line's envelope together itself: it must say what `to_json` says, in the
    text `json.dumps` writes (names, paths and run ids quoted, a Usage outside a spend's field
    written as text, as json.dumps's `default=str` writes it), and refuse a NaN as json.dumps does."""
    cls = events.KINDS[kind]
    shape = events._shape(cls)
    paths = [(events.PathLevel('a"é', "s\u2028", 1), events.PathLevel("b", "t", 2, 3)), ()]
    for offset, _ in enumerate(ODD_VALUES):
        fields = {
            name: Usage(offset, place, offset / 7) if name in shape.spends else ODD_VALUES[(offset + place) % 18]
            for place, name in enumerate(shape.own)
        }
        event = cls(**fields)  # type: ignore[arg-type]
        event.run_id, event.seq, event.time = ['r"1', "é", ""][offset % 3], offset, 1764757000 + offset / 3
        event.path = paths[offset % 2]
        for run in (None, "batch/\u00e9"):
            event.run = run
            for content in (True, False):
                expected = json.dumps(event.to_json(content), ensure_ascii=False, default=str, allow_nan=False)
                assert event.to_line(content) == expected
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError):
            events.CallFinished(machine="m", status="done", usage=Usage(1, 2, bad)).to_line()


def test_lines_written_by_many_threads_each_keep_their_own_run_id_and_path(tmp_path):
    """A batch's runs share one `--events` sink, each in its thread: the run id and path a line
    begins with are its own event's, not those the line before kept, however the threads interleave."""
    import sys

    from mklang.cli.observe import JsonLines

    out = tmp_path / "events.jsonl"
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        with open(out, "w", encoding="utf-8") as stream:
            sink = JsonLines(stream, False)

            def emit_many(name: str) -> None:
                for step in range(1, 2001):
                    event = events.HookCalled(hook="h", result=True, duration_ms=0.5, error=None)
                    event.run_id, event.seq, event.path = name, step, (events.PathLevel(name, "s", step),)
                    sink.emit(event)

            threads = [threading.Thread(target=emit_many, args=(f"run-{n}",)) for n in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
    finally:
        sys.setswitchinterval(interval)
    documents = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert len(documents) == 4 * 2000
    for document in documents:
        assert document["path"] == [
            {"machine": document["run_id"], "state": "s", "step": document["seq"], "branch": None}
        ]
