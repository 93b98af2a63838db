"""OpenTelemetry export (ADR 0034, docs/observability.md): the SDK's real OTLP/HTTP exporter sends
to a receiver on 127.0.0.1 that decodes the protobuf, and the spans, metrics and checkpoints are
checked as an operator's collector would see them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support import ROOT
from support.commands import cli_env, mklang, refused
from support.fakeserver import FakeServer, answer
from support.otlp import Receiver, Span, tree

import mklang as api
from mklang.checkpoint.envelope import load
from mklang.telemetry import otel

KEY = "sk-fake-otel-key-0123456789"  # a provider key: it must appear in no span or metric
SECRET_OUTPUT = "the-model-said-this"
SECRET_PROMPT = "confidential-topic"

MAIN = """\
mklang 0.4
machine main
entry fan
budget 10
result out

context {
  xs: ["alpha", "beta"]
}

tool lookup read_only "Look up a word. Input: {q}. Returns a note."

state fan {
  over xs
  structure "One word."
  prompt "Say {{item}} about {{topic}}"
  output drafts
  otherwise -> look
}

state look {
  tool lookup { q: "{{drafts}}" }
  output seen
  otherwise -> sub
}

state sub {
  call child { topic: "{{seen}}" }
  output out
  when "the text is good" -> END
  otherwise -> END
}
"""

CHILD = """\
mklang 0.4
machine child
entry write
budget 3
result text

context {
  topic: ""
}

state write {
  structure "One sentence."
  prompt "Write about {{topic}}"
  output text
  otherwise -> END
}
"""

APPROVAL = """\
mklang 0.4
machine approve
entry draft
budget 6
result verdict

context {
  approval: { answer: "" }
}

state draft {
  structure "One line."
  prompt "Draft a note about {{topic}}"
  output note
  otherwise escalate -> decide ask "Publish it?" reply_to approval.answer
}

state decide {
  structure "One word."
  prompt "The reviewer said {{approval.answer}}"
  output verdict
  otherwise -> END
}
"""


def reply(request):
    """A judge picks the first condition; every other call answers with the secret output."""
    if "none of the above" in request.user:
        return answer("1", input_tokens=7, output_tokens=1)
    return answer(SECRET_OUTPUT, input_tokens=11, output_tokens=4)


@pytest.fixture
def server():
    with FakeServer() as fake:
        fake.handler = reply
        yield fake


@pytest.fixture
def project(tmp_path: Path, server) -> Path:
    (tmp_path / "main.mk").write_text(MAIN)
    (tmp_path / "child.mk").write_text(CHILD)
    (tmp_path / "approve.mk").write_text(APPROVAL)
    (tmp_path / "mklang.toml").write_text(
        '[tiers]\nfast = "local:m"\nbalanced = "local:m"\nreasoning = "local:m"\n\n'
        f'[providers.local]\nkind = "openai"\nbase_url = "{server.openai_url}"\napi_key_env = "FAKE_OTEL_KEY"\n\n'
        '[prices."local:m"]\ninput = 1.0\noutput = 2.0\n'
    )
    return tmp_path


@pytest.fixture
def receiver(monkeypatch):
    """A receiver this process's runs export to, with a fresh exporter for it."""
    otel.shutdown()
    with Receiver() as receiving:
        for name, value in {**receiving.env(), "FAKE_OTEL_KEY": KEY}.items():
            monkeypatch.setenv(name, value)
        yield receiving
        otel.shutdown()  # flushes the metrics while the receiver still listens


def run_main(project: Path, **options):
    return api.run(
        project / "main.mk",
        {"topic": SECRET_PROMPT},
        config=project / "mklang.toml",
        tools={"lookup": lambda arguments, **_: "a note"},
        **options,
    )


def by_name(spans: list[Span]) -> dict[str, list[Span]]:
    named: dict[str, list[Span]] = {}
    for span in spans:
        named.setdefault(span.name, []).append(span)
    return named


def parent_of(span: Span, spans: list[Span]) -> Span:
    return next(other for other in spans if other.span_id == span.parent_id)


def test_a_runs_spans_nest_as_it_ran_across_fan_out_threads_and_a_called_machine(project, receiver):
    result = run_main(project, max_tokens=10_000, max_cost=1.0, checkpoint=project / "cp.json")
    assert result.status == "done"
    spans = receiver.spans()
    assert tree(spans) == [
        "invoke_workflow main",
        "  state fan",
        "    branch 0",
        "      chat m",
        "    branch 1",
        "      chat m",
        "  state look",
        "    execute_tool lookup",
        "  state sub",
        "    call child",
        "      state write",
        "        chat m",
        "    chat m",
    ]
    assert len({span.trace_id for span in spans}) == 1
    named = by_name(spans)
    (root,) = named["invoke_workflow main"]
    assert root.parent_id == ""
    assert root.resource["service.name"] == "mklang-tests"
    assert root.attributes == {
        "gen_ai.operation.name": "invoke_workflow",
        "gen_ai.workflow.name": "main",
        "mklang.run.name": "cp.json",
        "mklang.run_id": json.loads((project / "cp.json").read_text())["run_id"],
        "mklang.run.resumed": False,
        "mklang.run.concurrency": 8,
        "mklang.run.hitl": False,
        "mklang.budget.max_tokens": 10_000,
        "mklang.budget.max_cost_usd": 1.0,
        "mklang.run.status": "done",
        "gen_ai.usage.input_tokens": 3 * 11 + 7,
        "gen_ai.usage.output_tokens": 3 * 4 + 1,
        "mklang.cost_usd": pytest.approx(result.usage.cost_usd),
        "mklang.run.paid_calls.produce": 3,
        "mklang.run.paid_calls.judge": 1,
        "mklang.run.paid_calls.tool": 1,
    }
    branches = named["branch 0"] + named["branch 1"]
    assert {parent_of(branch, spans).name for branch in branches} == {"state fan"}
    assert sorted(parent_of(chat, spans).name for chat in named["chat m"]) == [
        "branch 0",
        "branch 1",
        "state sub",
        "state write",
    ]
    (write,) = named["state write"]
    assert parent_of(write, spans).name == "call child"
    produce = next(chat for chat in named["chat m"] if chat.attributes["mklang.call"] == "produce")
    assert produce.kind == 3  # CLIENT
    assert produce.attributes == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "local",
        "gen_ai.request.model": "m",
        "gen_ai.usage.input_tokens": 11,
        "gen_ai.usage.output_tokens": 4,
        "mklang.cost_usd": pytest.approx((11 * 1.0 + 4 * 2.0) / 1e6),
        "mklang.call": "produce",
        "mklang.tier": "balanced",
    }
    (sub,) = named["state sub"]
    assert sub.attributes["mklang.gate.decided_by"] == "judge"
    assert sub.attributes["mklang.gate.label"] == "the text is good"
    assert sub.attributes["mklang.decision_tainted"] is True  # the judge read the tool's observation
    (tool,) = named["execute_tool lookup"]
    assert tool.attributes["gen_ai.tool.name"] == "lookup"
    assert tool.attributes["mklang.tool.read_only"] is True
    (called,) = named["call child"]
    assert called.attributes["mklang.call.status"] == "done"


def test_token_and_cost_metrics_follow_the_genai_conventions(project, receiver):
    result = run_main(project)  # its end sent the metrics
    tokens = receiver.metric_points("gen_ai.client.token.usage")
    summed: dict[str, float] = {}
    for attributes, point in tokens:
        assert attributes["gen_ai.provider.name"] == "local" and attributes["gen_ai.request.model"] == "m"
        summed[attributes["gen_ai.token.type"]] = summed.get(attributes["gen_ai.token.type"], 0) + point.sum
    assert summed == {"input": result.usage.input_tokens, "output": result.usage.output_tokens}
    cost = sum(point.as_double for _, point in receiver.metric_points("mklang.client.cost"))
    assert cost == pytest.approx(result.usage.cost_usd)
    assert sum(point.count for _, point in receiver.metric_points("gen_ai.client.operation.duration")) == 4


class AskForContent:
    """An observer that asks the run to trace content, as --trace-content does."""

    trace_content = True

    def emit(self, event):
        pass


def test_no_prompt_output_or_key_is_exported_unless_content_is_asked_for(project, receiver):
    run_main(project)
    assert SECRET_OUTPUT.encode() not in receiver.raw()
    assert SECRET_PROMPT.encode() not in receiver.raw()
    assert KEY.encode() not in receiver.raw()
    before = len(receiver.spans())
    run_main(project, observer=AskForContent())
    spans = receiver.spans()[before:]
    chats = [span for span in spans if span.name == "chat m" and span.attributes["mklang.call"] == "produce"]
    messages = json.loads(chats[0].attributes["gen_ai.input.messages"])
    assert SECRET_PROMPT in messages[0]["parts"][0]["content"]
    output = json.loads(chats[0].attributes["gen_ai.output.messages"])
    assert output[0]["parts"][0]["content"] == SECRET_OUTPUT
    (tool,) = [span for span in spans if span.name == "execute_tool lookup"]
    assert tool.attributes["gen_ai.tool.call.result"] == "a note"
    assert KEY.encode() not in receiver.raw()


def test_a_resumed_run_continues_the_trace_its_checkpoint_names_and_an_edited_one_only_moves_it(project, receiver):
    checkpoint = project / "cp.json"
    options = {"config": project / "mklang.toml", "checkpoint": checkpoint, "hitl": True}
    assert api.run(project / "approve.mk", {"topic": "x"}, **options).status == "suspended"
    (first,) = by_name(receiver.spans())["invoke_workflow approve"]
    stored = json.loads(checkpoint.read_text())["trace"]
    assert stored["traceparent"] == f"00-{first.trace_id}-{first.span_id}-{stored['traceparent'][-2:]}"
    edited = json.loads(checkpoint.read_text())
    other_trace = "ab" * 16
    edited["trace"] = {"traceparent": f"00-{other_trace}-{'cd' * 8}-01"}
    checkpoint.write_text(json.dumps(edited))  # no longer as signed, but the signature does not cover it
    assert load(checkpoint).seal == "signed"
    result = api.resume(checkpoint, config=project / "mklang.toml", reply={"approval.answer": "yes"})
    assert result.status == "done"
    resumed = [span for span in receiver.spans() if span.name == "invoke_workflow approve"][-1]
    assert resumed.trace_id == other_trace and resumed.parent_id == "cd" * 8
    assert resumed.attributes["mklang.run.resumed"] is True


def test_one_trace_across_a_suspension_and_mklang_resume_in_processes_of_their_own_content_when_asked(
    project, receiver
):
    env = cli_env(**receiver.env(), FAKE_OTEL_KEY=KEY)
    common = ["--config", str(project / "mklang.toml")]
    suspended = mklang("run", "approve.mk", "--checkpoint", "cp.json", "--hitl", *common, cwd=project, env=env)
    assert suspended.returncode == 3, suspended.stderr
    resume = ["resume", "cp.json", "--set", "approval.answer=yes", "--trace-content"]
    done = mklang(*resume, *common, cwd=project, env=env)
    assert done.returncode == 0, done.stderr
    spans = receiver.spans()  # both processes flushed before they exited
    assert len({span.trace_id for span in spans}) == 1
    first, second = sorted(by_name(spans)["invoke_workflow approve"], key=lambda span: span.start)
    assert second.parent_id == first.span_id
    assert first.attributes["mklang.run.status"] == "suspended"
    assert first.attributes["mklang.run.suspend_reason"] == "escalated"
    assert second.attributes["mklang.run.status"] == "done"
    assert tree(spans) == [
        "invoke_workflow approve",
        "  state draft",
        "    chat m",
        "  invoke_workflow approve",
        "    state decide",
        "      chat m",
    ]
    drafted, decided = sorted(by_name(spans)["chat m"], key=lambda span: span.start)
    assert "gen_ai.output.messages" not in drafted.attributes  # the run did not ask for content
    assert SECRET_OUTPUT in decided.attributes["gen_ai.output.messages"]  # its resume did
    assert KEY.encode() not in receiver.raw()


SCRIPTED_RUN = """
import sys, mklang
if sys.argv[3] == "without-the-extra":
    sys.modules["opentelemetry"] = None  # as if the otel extra were not installed
result = mklang.run(sys.argv[1], script=sys.argv[2], scenario="answer-follows")
loaded = [name for name, module in sys.modules.items() if module and name.split(".")[0] == "opentelemetry"]
print(result.status, sorted(loaded))
"""


def scripted_run(tmp_path: Path, how: str, **env: str) -> subprocess.CompletedProcess[str]:
    """A scripted run of a machine of the library in a fresh interpreter, with the OTEL_* variables `env`."""
    machine = ROOT / "machines" / "chain_of_thought.mk"
    script = ROOT / "machines" / "chain_of_thought.scenarios.yaml"
    variables = {k: v for k, v in cli_env().items() if not k.startswith("OTEL_")}
    return subprocess.run(
        [sys.executable, "-c", SCRIPTED_RUN, str(machine), str(script), how],
        env={**variables, **env},
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )


def test_without_the_variables_nothing_of_opentelemetry_is_imported(tmp_path: Path):
    done = scripted_run(tmp_path, "as installed")
    assert done.stdout.strip() == "done []", done.stderr
    assert done.stderr == ""


def test_without_the_extra_the_variables_are_told_to_be_of_no_use_and_the_run_goes_on(tmp_path: Path):
    done = scripted_run(tmp_path, "without-the-extra", OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9")
    assert done.stdout.strip() == "done []", done.stderr
    assert done.stderr.strip() == (
        "mklang: OTEL_EXPORTER_OTLP_ENDPOINT asks for OpenTelemetry, but the otel extra is not installed "
        "(pip install 'mklang[otel]>=2'): no spans are exported"
    )


def test_each_run_of_a_batch_is_a_trace_of_its_own_named_by_its_run(project, receiver):
    inputs = [{"id": "first", "topic": "a"}, {"id": "second", "topic": "b"}]
    outcomes = api.batch(project / "approve.mk", inputs, store=project / "runs", config=project / "mklang.toml")
    assert [outcome.status for outcome in outcomes] == ["done", "done"]
    roots = by_name(receiver.spans())["invoke_workflow approve"]
    assert sorted(root.attributes["mklang.run.name"] for root in roots) == ["first", "second"]
    assert len({root.trace_id for root in roots}) == 2


HALTING = """\
mklang 0.4
machine gate
entry one
budget 3

state one {
  structure "One word."
  prompt "Say it"
  output word
  when "the word is fine" hook approve -> END
  otherwise fail
}
"""


def test_a_halted_run_is_an_error_span_and_its_hooks_say_what_they_answered(project, receiver):
    (project / "gate.mk").write_text(HALTING)
    result = api.run(
        project / "gate.mk", config=project / "mklang.toml", hooks={"approve": lambda context, output: False}
    )
    assert result.status == "halted"
    named = by_name(receiver.spans())
    (root,) = named["invoke_workflow gate"]
    assert root.status == 2  # ERROR
    assert (root.attributes["mklang.run.status"], root.attributes["error.type"]) == ("halted", "mklang.halted")
    (hook,) = named["hook approve"]
    assert hook.attributes == {"mklang.hook.name": "approve", "mklang.hook.result": False}
    assert parent_of(hook, named["hook approve"] + named["state one"]).name == "state one"


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
        ("OTEL_TRACES_EXPORTER", "zipkin"),
        ("OTEL_METRICS_EXPORTER", "prometheus"),
    ],
)
def test_an_exporter_or_protocol_mklang_lacks_refuses_the_run_before_it_starts(tmp_path: Path, variable, value):
    from support.commands import cli

    env = {k: v for k, v in cli_env().items() if not k.startswith("OTEL_")}
    env |= {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", variable: value}
    done = cli(
        "run",
        str(ROOT / "machines" / "chain_of_thought.mk"),
        "--script",
        str(ROOT / "machines" / "chain_of_thought.scenarios.yaml"),
        "--scenario",
        "answer-follows",
        "--checkpoint",
        str(tmp_path / "cp.json"),
        env=env,
    )
    assert refused(done) == f"mklang: error: {variable}={value} is not supported: mklang exports with " + (
        "http/protobuf" if "PROTOCOL" in variable else "otlp or console or none"
    )
    assert not (tmp_path / "cp.json").exists()  # refused before the run began
