"""`mklang.arun` and `mklang.aresume` in event loops: many runs of one loop against a real model
server that answers in 100 ms, the loop kept free, a cancelled run suspended with nothing lost."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import pytest
from support.commands import model_config
from support.fakeserver import FakeServer, Request, answer

import mklang

LATENCY = 0.1
THREE = """\
mklang 0.4
machine three
entry first
budget 10
""" + "".join(
    f"""
state {name} {{
  structure "One word."
  prompt "{name} {{{{topic}}}}"
  output {name}
  otherwise -> {following}
}}
"""
    for name, following in (("first", "second"), ("second", "third"), ("third", "END"))
)


@pytest.fixture
def slow() -> FakeServer:
    """The model server: every answer takes `LATENCY` seconds."""
    with FakeServer() as server:
        server.handler = lambda request: answer(f"ok {prompt(request)}", delay=LATENCY)
        yield server


def prompt(request: Request) -> str:
    """The state a call is made for, as its prompt begins (the topic is fenced as data, with a fresh tag)."""
    return request.body["messages"][-1]["content"].split()[0]


@pytest.fixture
def three(tmp_path: Path) -> Path:
    path = tmp_path / "three.mk"
    path.write_text(THREE, encoding="utf-8")
    return path


def test_a_cancelled_run_suspends_interrupted_and_aresume_finishes_it_as_if_never_cut(tmp_path, slow, three):
    whole = mklang.run(three, {"topic": "x"}, config=model_config(slow.openai_url, tmp_path / "mklang.toml"))
    assert whole.status == "done"
    slow.requests.clear()
    config = model_config(slow.openai_url, tmp_path / "mklang.toml")
    checkpoint = tmp_path / "run.json"

    async def cut() -> None:
        task = asyncio.create_task(mklang.arun(three, {"topic": "x"}, config=config, checkpoint=checkpoint))
        while slow.count < 2:  # the second state's call is in flight
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cut())
    stored = json.loads(checkpoint.read_text(encoding="utf-8"))
    assert (stored["status"], stored["reason"]) == ("suspended", "interrupted")
    # The call in flight when the task was cancelled was kept: its step is made.
    assert [step["state"] for step in stored["frames"][0]["trace"]] == ["first", "second"]

    resumed = asyncio.run(mklang.aresume(checkpoint, config=config))
    assert resumed.status == "done"
    assert resumed.result == whole.result and resumed.usage == whole.usage
    assert [(s["state"], s["output"], s["usage"]) for s in resumed.trace] == [
        (s["state"], s["output"], s["usage"]) for s in whole.trace
    ]
    assert Counter(prompt(request) for request in slow.requests) == {"first": 1, "second": 1, "third": 1}


def test_budgets_bound_every_run_of_many_awaited_at_once(tmp_path, slow, three):
    config = model_config(slow.openai_url, tmp_path / "mklang.toml")

    async def many() -> list[mklang.RunResult]:
        return await asyncio.gather(
            *(
                mklang.arun(three, {"topic": f"t{n}"}, config=config, checkpoint=tmp_path / f"{n}.json", max_tokens=20)
                for n in range(20)
            )
        )

    results = asyncio.run(many())
    # Each answer costs 15 tokens: the second reaches the cap, and the third state never asks.
    assert {(r.status, r.reason, r.usage.tokens) for r in results} == {("suspended", "cost-exhausted", 30)}
    assert slow.count == 40 and not any(prompt(request) == "third" for request in slow.requests)


def test_a_keyword_arun_does_not_take_is_a_type_error_and_nothing_runs(three, slow):
    with pytest.raises(TypeError, match="arun\\(\\) got an unexpected keyword argument 'max_tokenz'"):
        asyncio.run(mklang.arun(three, max_tokenz=5))  # type: ignore[call-arg]
    assert slow.count == 0
