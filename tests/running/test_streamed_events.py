"""`model.delta` (docs/events.md, Streamed answers): a run over a server that streams tells an observer
asking for deltas each piece of a produce call's answer, its text only with trace content; nothing
streams for an observer that does not ask; a crash mid-stream pays only that call again, and a
resume replays the answers journaled before it without streaming them."""

from __future__ import annotations

import json

import pytest
from conformance.harness import write_machines
from providers.test_providers_http import KEY, write_config
from running.test_events import VALIDATOR
from support.crashes import Crash
from support.fakeserver import answer

import mklang as api
from mklang.engine import events
from mklang.providers.factory import make_provider

TWO = """
    machine two
    entry a
    budget 5
    state a {
      structure "s"
      prompt "first"
      output x
      when "it is done" -> b
      otherwise fail
    }
    state b {
      structure "s"
      prompt "second"
      output y
      otherwise -> END
    }
"""
FIRST, SECOND = "one two three four", "five six seven eight nine"


class Watching:
    """Keeps every event; asks for deltas, and for content when told to."""

    stream_deltas = True

    def __init__(self, trace_content: bool = False, crash_at: int | None = None, crash_on_judge: bool = False):
        self.trace_content, self.crash_at, self.crash_on_judge = trace_content, crash_at, crash_on_judge
        self.events: list[events.Event] = []

    def emit(self, event: events.Event) -> None:
        self.events.append(event)
        if isinstance(event, events.ModelDelta) and len(self.of(events.ModelDelta)) == self.crash_at:
            raise Crash  # the process dies mid-stream
        if self.crash_on_judge and isinstance(event, events.ModelStarted) and event.call == "judge":
            raise Crash  # the process dies with the step's answer journaled, the step not

    def of(self, kind: type[events.Event]) -> list:
        return [event for event in self.events if isinstance(event, kind)]


@pytest.fixture
def provider(tmp_path, server, monkeypatch):
    monkeypatch.setenv("FAKE_KEY", KEY)
    return make_provider(config_path=write_config(tmp_path, server, "openai", tiers={"balanced": "p:m1"}))


def scripted(server) -> None:
    server.add(answer(FIRST, input_tokens=7, output_tokens=4), answer("1"), answer(SECOND, input_tokens=7))


@pytest.mark.parametrize("content", [False, True])
def test_a_produce_answer_streams_as_deltas_between_its_start_and_end(tmp_path, server, provider, content):
    scripted(server)
    sink = Watching(trace_content=content)
    result = api.run(write_machines(tmp_path, TWO), provider=provider, observer=sink)
    assert result.status == "done" and result.context["x"] == FIRST
    for state, text in (("a", FIRST), ("b", SECOND)):
        calls = [e for e in sink.events if isinstance(e, events._ModelCall) and e.path[-1].state == state]
        kinds = [e.kind for e in calls if e.call == "produce"]
        assert kinds == ["model.started", *["model.delta"] * len(text.split()), "model.finished"]
        deltas = [e for e in calls if isinstance(e, events.ModelDelta)]
        assert sum(e.chars for e in deltas) == len(text) == calls[-1].output_chars if state == "b" else True
        assert [e.offset for e in deltas] == [sum(d.chars for d in deltas[:i]) for i in range(len(deltas))]
        assert "".join(e.text for e in deltas) == text if content else {e.text for e in deltas} == {None}
    assert all(e.call == "produce" for e in sink.of(events.ModelDelta))  # the judge's answer arrives whole
    assert [request.body.get("stream") for request in server.requests] == [True, None, True]
    lines = [event.to_json() for event in sink.events]
    for line in lines:
        assert not list(VALIDATOR.iter_errors(line)), line
    assert all(("text" in line) == content for line in lines if line["event"] == "model.delta")


def test_nothing_streams_for_an_observer_that_does_not_ask(tmp_path, server, provider):
    scripted(server)
    sink = Watching()
    sink.stream_deltas = False
    assert api.run(write_machines(tmp_path, TWO), provider=provider, observer=sink).status == "done"
    assert sink.of(events.ModelDelta) == []
    assert [request.body.get("stream") for request in server.requests] == [None, None, None]


def test_a_crash_mid_stream_pays_that_call_again_and_the_resume_streams_only_it(tmp_path, server, provider):
    scripted(server)
    server.add(answer(SECOND, input_tokens=7, output_tokens=5))  # the second answer, bought again
    machine, checkpoint = write_machines(tmp_path, TWO), tmp_path / "cp.json"
    first = Watching(trace_content=True, crash_at=len(FIRST.split()) + 2)  # two pieces into the second answer
    with pytest.raises(Crash):
        api.run(machine, provider=provider, checkpoint=checkpoint, observer=first)
    assert server.count == 3
    second = Watching(trace_content=True)
    result = api.resume(checkpoint, provider=provider, observer=second)
    assert result.status == "done" and result.context == {**result.context, "x": FIRST, "y": SECOND}
    assert server.count == 4  # only the call cut by the crash was paid again
    finished = [(e.path[-1].state, e.call, e.outcome) for e in second.of(events.ModelFinished)]
    assert finished == [("b", "produce", "paid")]
    assert "".join(e.text for e in second.of(events.ModelDelta)) == SECOND  # told whole, from offset 0
    assert second.of(events.ModelDelta)[0].offset == 0
    assert json.loads(checkpoint.read_text())["status"] == "done"


def test_a_resume_replays_a_journaled_answer_without_streaming_it(tmp_path, server, provider):
    scripted(server)
    machine, checkpoint = write_machines(tmp_path, TWO), tmp_path / "cp.json"
    with pytest.raises(Crash):
        api.run(machine, provider=provider, checkpoint=checkpoint, observer=Watching(crash_on_judge=True))
    assert server.count == 1
    second = Watching(trace_content=True)
    result = api.resume(checkpoint, provider=provider, observer=second)
    assert result.status == "done" and server.count == 3
    finished = [(e.path[-1].state, e.call, e.outcome) for e in second.of(events.ModelFinished)]
    assert finished == [("a", "produce", "replayed"), ("a", "judge", "paid"), ("b", "produce", "paid")]
    assert {e.path[-1].state for e in second.of(events.ModelDelta)} == {"b"}  # the replayed answer streams nothing
