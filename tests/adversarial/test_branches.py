"""A fan-out cut mid-branch pays no call twice (docs/language.md "Budgets across fan-out").

Each branch of a 20-item `over` calls a 3-state sub-machine, so a run-wide
ceiling can stop a branch after some of its calls. On a tree that drops those
paid answers at the suspension, the resumed run asks the model again for the
first steps of every such branch: the per-prompt counts below then show a 2.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from support.commands import cli
from support.fakeserver import FakeServer, Reply, Request, answer
from support.runs import outcome

from mklang import resume
from mklang.engine import Control, run
from mklang.providers.base import Produced, Usage, Verdict
from mklang.runs import resume as resume_run
from mklang.runs import start
from mklang.scenarios import Scenario, ScriptedHost
from mklang.session import Host
from mklang.syntax import load_file

ITEMS = [f"item-{i}" for i in range(20)]
STEPS = """\
machine steps
entry draft
budget 10

state draft {
  structure "One line."
  prompt "Draft {{item}}"
  output draft
  otherwise -> check
}

state check {
  structure "One line."
  prompt "Check {{draft}}"
  output checked
  otherwise -> final
}

state final {
  structure "One line."
  prompt "Final {{checked}}"
  output final
  otherwise -> END
}
"""
EACH = """\
machine each
entry each
budget {budget}

state each {{
  over items
  call steps {{ item: "{{{{item}}}}" }}
  output finals
  otherwise -> END
}}
"""


def machines(folder: Path, budget: int = 100) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / "steps.mk").write_text(STEPS, encoding="utf-8")
    path = folder / "each.mk"
    path.write_text(EACH.format(budget=budget), encoding="utf-8")
    return path


def reply_to(prompt: str) -> str:
    """The step's verb and the item of a prompt: `Check ... item-3` -> `Check item-3`.

    It also names the request: prompts differ run to run only in their data fences' nonces."""
    item = re.search(r"item-\d+", prompt)
    assert item, prompt
    return f"{prompt.split()[0]} {item.group(0)}"


def expected_result() -> list[str]:
    return [f"Final {item}" for item in ITEMS]


# --- through the CLI, a real HTTP model server, --max-tokens ------------------------------


@pytest.fixture
def server():
    with FakeServer() as running:
        asked: Counter[str] = Counter()

        def reply(request: Request) -> Reply:
            asked[reply_to(request.user)] += 1
            return answer(reply_to(request.user), input_tokens=6, output_tokens=4)

        running.handler = reply
        running.asked = asked  # type: ignore[attr-defined]
        yield running


def run_items(folder: Path, server: FakeServer, *options: str) -> tuple[int, dict[str, Any]]:
    machine = machines(folder)
    (folder / "items.json").write_text(json.dumps({"items": ITEMS}), encoding="utf-8")
    (folder / "mklang.toml").write_text(
        f'[tiers]\ndefault = "p:m"\n[providers.p]\nkind = "openai"\nbase_url = "{server.openai_url}"\n',
        encoding="utf-8",
    )
    done = cli(
        "run",
        str(machine),
        "--input",
        str(folder / "items.json"),
        "--config",
        str(folder / "mklang.toml"),
        "--format",
        "json",
        *options,
    )
    return done.returncode, json.loads(done.stdout)


@pytest.mark.parametrize("concurrency", [1, 4])
def test_a_branch_cut_mid_sub_machine_pays_no_call_twice_through_the_cli(tmp_path, server, concurrency):
    first = tmp_path / "first"
    checkpoint = first / "cp.json"
    code, data = run_items(
        first, server, "--max-tokens", "110", "--concurrency", str(concurrency), "--checkpoint", str(checkpoint)
    )
    assert (code, data["status"], data["reason"], data["at"]) == (3, "suspended", "cost-exhausted", "each")
    paid = server.count
    if concurrency == 1:
        # Three whole branches (90 tokens), then the 4th stops after `draft` and `check`.
        assert paid == 11
    assert data["usage"]["input_tokens"] + data["usage"]["output_tokens"] == paid * 10  # spend so far, all of it

    done = cli(
        "resume", str(checkpoint), "--max-tokens", "100000", "--config", str(first / "mklang.toml"), "--format", "json"
    )
    resumed = json.loads(done.stdout)
    assert (done.returncode, resumed["status"]) == (0, "done"), done.stderr
    asked = server.asked  # type: ignore[attr-defined]
    assert len(asked) == 60 and set(asked.values()) == {1}, [p for p, n in asked.items() if n > 1]
    assert resumed["calls"] == {"produce": 60 - paid}
    assert resumed["result"] == expected_result()

    code, whole = run_items(tmp_path / "whole", server)
    assert code == 0
    for key in ("result", "context", "trace", "usage"):
        assert resumed[key] == whole[key], key


# --- through the Python API, every kind of cut -----------------------------------------------


class Model:
    """An in-process model answering like the server above (10 tokens, $0.01 a call), counting
    requests by name; on the call numbered `cut_at` it does what `what` says to the run's `control`."""

    def __init__(self, control: Control | None = None, what: str = "", cut_at: int = 0):
        self.asked: Counter[str] = Counter()
        self.control, self.what, self.cut_at = control, what, cut_at

    def produce(self, system: str, user: str, tier: str, reason: bool) -> Produced:
        self.asked[reply_to(user)] += 1
        if self.control is not None and sum(self.asked.values()) == self.cut_at:
            if self.what == "interrupt":
                self.control.interrupted.set()
            else:
                self.control.deadline = time.monotonic() - 1
        return Produced(reply_to(user), None, Usage(6, 4, 0.01))

    def judge(self, conditions: list[str], output: Any, reasoning: Any, context: Any, tier: str) -> Verdict:
        return Verdict(0, Usage())


CUTS = {  # how the first run is cut, and what its suspension says
    "tokens": ({"max_tokens": 110}, "cost-exhausted"),
    "dollars": ({"max_cost": 0.11}, "cost-exhausted"),
    "time": ({}, "time-exhausted"),
    "steps": ({}, "budget-exhausted"),
    "interrupt": ({}, "interrupted"),
}


@pytest.mark.parametrize("cut", sorted(CUTS))
def test_a_cut_fan_out_of_sub_machines_resumes_without_paying_twice(tmp_path, cut):
    options, reason = CUTS[cut]
    control = Control()
    model = Model(control, cut, cut_at=11) if cut in ("time", "interrupt") else Model()
    machine = load_file(machines(tmp_path / "cut", budget=4 if cut == "steps" else 100))
    checkpoint = tmp_path / "cp.json"
    suspended = start(
        machine, {"items": ITEMS}, Host(model), checkpoint=checkpoint, concurrency=1, control=control, **options
    )
    assert (suspended.status, suspended.reason, suspended.at) == ("suspended", reason, "each")
    paid = sum(model.asked.values())
    assert suspended.usage.tokens == 10 * paid  # the spend so far, the stopped branch's included
    if cut in ("tokens", "dollars", "steps"):  # the same ceilings: suspends again, pays nothing
        again = resume(checkpoint, provider=model, **options)
        assert (again.status, again.reason, sum(model.asked.values())) == ("suspended", reason, paid)
        # Nothing new spent, nothing counted twice.
        assert (again.usage.tokens, again.usage.cost_usd) == (10 * paid, pytest.approx(0.01 * paid))

    raised = {"max_tokens": 10_000, "max_cost": 10.0} if options else {"budget": 100} if cut == "steps" else {}
    finished = resume(checkpoint, provider=model, **raised)
    assert finished.status == "done", (finished.error, finished.reason)
    assert len(model.asked) == 60 and set(model.asked.values()) == {1}
    assert finished.calls == {"produce": 60 - paid}
    whole = run(load_file(machines(tmp_path / "whole")), {"items": ITEMS}, provider=Model())
    assert outcome(finished) == outcome(whole)
    assert finished.result == expected_result()


def test_a_scripted_run_cut_mid_branch_does_not_consume_the_replayed_answers_again(tmp_path):
    """The scripted host's state saved at the suspension counts the stopped branch's two answers
    already: replaying them must not take two more, or its last call gets a later answer. It
    keeps where the fan-out started too, so every branch takes what the uninterrupted run takes."""
    scenario = Scenario("cut", llm={"produce": [f"answer {n}" for n in range(60)], "tokens": [6, 4]})
    checkpoint = tmp_path / "cp.json"
    host = ScriptedHost(scenario)
    machine = load_file(machines(tmp_path / "cut"))
    suspended = start(
        machine,
        {"items": ITEMS},
        Host(host.provider, state=host.state),
        checkpoint=checkpoint,
        max_tokens=110,
        concurrency=1,
    )
    assert (suspended.status, host.provider.calls["produce"]) == ("suspended", 11)
    host = ScriptedHost(scenario)
    finished = resume_run(checkpoint, Host(host.provider, state=host.state), max_tokens=10_000)
    assert finished.status == "done" and host.provider.calls["produce"] == 60 - 11
    whole_machine = load_file(machines(tmp_path / "whole"))
    whole = run(whole_machine, {"items": ITEMS}, provider=ScriptedHost(scenario).provider)
    # Branch i takes answers i, 20 + i and 40 + i; the stopped branch 3 took 3 and 23.
    assert finished.result[3] == whole.result[3] == "answer 43"
    assert finished.result == whole.result and finished.trace == whole.trace
