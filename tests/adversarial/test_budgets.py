"""Budgets bound fan-out (ADR 0012), tried the way a runaway machine would.

Each test fails on a tree that checks budgets only at loop-tops, lets nested
fan-outs open thread pools of their own, or caps HTTP requests at a fixed 8:
`over` a 300-item list must stop near `--max-tokens` / `--max-cost` / the
step budget (overshooting by at most the calls in flight, docs/language.md
"Budgets across fan-out"), a suspended fan-out resumes only the branches not
yet done, and `--concurrency` is the one limit of threads and requests.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from support.commands import cli
from support.fakeserver import FakeServer, Reply, Request, answer
from support.runs import outcome

from mklang import resume
from mklang.engine import Control, run
from mklang.providers.base import Produced, Usage, Verdict
from mklang.runs import start
from mklang.session import Host
from mklang.syntax import load_file

ITEMS = [f"item-{i}" for i in range(300)]
TOKENS_PER_CALL = 10  # 6 in + 4 out, both from the fake server and from Echo
WIDE = """\
mklang 0.4
machine wide
entry each
budget {budget}

state each {{
  over items
  structure "One line."
  prompt "Echo {{{{item}}}}"
  output echoes
  otherwise -> END
}}
"""


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text, encoding="utf-8")
    return path


def wide(folder: Path, budget: int = 400) -> Path:
    return write(folder, "wide.mk", WIDE.format(budget=budget))


def item_of(text: str) -> str:
    found = re.search(r"item-\d+", text)
    assert found, text
    return found.group(0)


class Echo:
    """An in-process model: echoes the item of its prompt for 10 tokens ($0.01), and
    measures what the engine does around it (calls, calls in flight, branch threads)."""

    def __init__(self, pause: float = 0.0):
        self.pause = pause
        self.calls = 0
        self.in_flight = 0
        self.peak_in_flight = 0
        self.peak_threads = 0
        self.lock = threading.Lock()

    def produce(self, system: str, user: str, tier: str, reason: bool) -> Produced:
        with self.lock:
            self.calls += 1
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            self.peak_threads = max(self.peak_threads, branch_threads())
        time.sleep(self.pause)
        with self.lock:
            self.in_flight -= 1
        return Produced(f"echo {item_of(user)}", None, Usage(6, 4, 0.01))

    def judge(self, conditions: list[str], output: Any, reasoning: Any, context: Any, tier: str) -> Verdict:
        return Verdict(0, Usage())


def echo_server(server: FakeServer) -> None:
    def reply(request: Request) -> Reply:
        return answer(f"echo {item_of(request.user)}", input_tokens=6, output_tokens=4)

    server.handler = reply


def config(folder: Path, server: FakeServer) -> Path:
    """One model at $1000 per million tokens both ways: a call of 10 tokens costs $0.01."""
    return write(
        folder,
        "mklang.toml",
        f'[tiers]\ndefault = "p:m"\n[providers.p]\nkind = "openai"\nbase_url = "{server.openai_url}"\n'
        f'[prices."p:m"]\ninput = 1000\noutput = 1000\n',
    )


@pytest.fixture
def server():
    with FakeServer() as running:
        echo_server(running)
        yield running


def cli_run(
    folder: Path, server: FakeServer, *options: str, budget: int = 400, count: int = 300
) -> tuple[int, dict[str, Any]]:
    items = write(folder, "items.json", json.dumps({"items": ITEMS[:count]}))
    done = cli(
        "run",
        str(wide(folder, budget)),
        "--input",
        str(items),
        "--config",
        str(config(folder, server)),
        "--format",
        "json",
        *options,
    )
    return done.returncode, json.loads(done.stdout)


# --- the ceilings hold across 300 branches ---------------------------------------------


def test_max_tokens_stops_300_branches_near_the_cap_through_the_cli(tmp_path, server):
    code, data = cli_run(tmp_path, server, "--max-tokens", "100", "--concurrency", "8")
    assert (code, data["status"], data["error"], data["at"]) == (1, "halted", "cost-exhausted", "each")
    tokens = data["usage"]["input_tokens"] + data["usage"]["output_tokens"]
    # The cap is reached by the 10th answer; at most the 7 other calls then in flight finish.
    assert 10 <= server.count <= 10 + 7
    assert tokens == server.count * TOKENS_PER_CALL and tokens <= 100 + 7 * TOKENS_PER_CALL
    assert data["calls"] == {"produce": server.count}


def test_max_cost_stops_300_branches_near_the_cap_through_the_cli(tmp_path, server):
    code, data = cli_run(tmp_path, server, "--max-cost", "0.1", "--concurrency", "8")
    assert (code, data["status"], data["error"]) == (1, "halted", "cost-exhausted")
    assert 10 <= server.count <= 10 + 7
    assert data["usage"]["cost_usd"] == pytest.approx(server.count * 0.01)
    assert data["usage"]["cost_usd"] <= 0.1 + 7 * 0.01 + 1e-9


def test_a_dollar_cap_is_met_by_a_float_sum_of_prices(tmp_path):
    """Ten calls of $0.01 add up to 0.0999...: the $0.10 cap must still stop the eleventh."""
    provider = Echo()
    result = run(load_file(wide(tmp_path)), {"items": ITEMS}, provider=provider, concurrency=1, max_cost=0.1)
    assert (result.status, result.error, provider.calls) == ("halted", "cost-exhausted", 10)


def test_the_step_budget_launches_no_branch_beyond_it(tmp_path):
    provider = Echo()
    result = run(load_file(wide(tmp_path, budget=25)), {"items": ITEMS}, provider=provider, concurrency=8)
    assert (result.status, result.error, result.at) == ("halted", "budget-exhausted", "each")
    assert provider.calls == 25 and result.usage.tokens == 25 * TOKENS_PER_CALL


def test_budgets_hold_for_a_fan_out_inside_a_sub_machine_and_inside_branches(tmp_path):
    """A call level's fan-out, and fan-outs nested in branches, read the run's one live total."""
    write(
        tmp_path,
        "inner.mk",
        'machine inner\nentry each\nbudget 50\nstate each {\n  over items\n  structure "s"\n'
        '  prompt "Echo {{item}}"\n  output echoes\n  otherwise -> END\n}\n',
    )
    outer = write(
        tmp_path,
        "outer.mk",
        'machine outer\nentry go\nbudget 50\nstate go {\n  over groups\n  call inner { items: "{{item}}" }\n'
        "  output results\n  otherwise -> END\n}\n",
    )
    groups = [ITEMS[i : i + 30] for i in range(0, 300, 30)]
    provider = Echo()
    result = run(load_file(outer), {"groups": groups}, provider=provider, concurrency=1, max_tokens=100)
    assert (result.status, result.error, result.at) == ("halted", "cost-exhausted", "go")
    assert provider.calls == 10  # one call at a time: nothing else was in flight
    assert result.usage.tokens == 100


# --- a cut fan-out suspends with its finished branches and resumes the rest ----------------


def test_a_token_cut_fan_out_resumes_only_the_branches_not_done_through_the_cli(tmp_path, server):
    first = tmp_path / "first"
    first.mkdir()
    checkpoint = first / "cp.json"
    # 60 items keep the journal's fsyncs few; the 300-item bounds are measured above.
    code, data = cli_run(
        first, server, "--max-tokens", "100", "--concurrency", "4", "--checkpoint", str(checkpoint), count=60
    )
    assert (code, data["status"], data["reason"], data["at"]) == (3, "suspended", "cost-exhausted", "each")
    paid = server.count
    assert 10 <= paid <= 10 + 3
    assert data["usage"]["input_tokens"] + data["usage"]["output_tokens"] == paid * TOKENS_PER_CALL

    done = cli(
        "resume", str(checkpoint), "--max-tokens", "100000", "--config", str(first / "mklang.toml"), "--format", "json"
    )
    resumed = json.loads(done.stdout)
    assert (done.returncode, resumed["status"]) == (0, "done"), done.stderr
    assert server.count == 60  # the kept branches were not asked again
    assert resumed["calls"] == {"produce": 60 - paid}

    again = tmp_path / "again"
    again.mkdir()
    code, whole = cli_run(again, server, count=60)
    assert code == 0
    for key in ("result", "context", "trace", "usage"):
        assert resumed[key] == whole[key], key


def test_a_step_cut_fan_out_resumes_only_the_branches_not_done(tmp_path):
    machine = load_file(wide(tmp_path, budget=25))
    checkpoint = tmp_path / "cp.json"
    provider = Echo()
    suspended = start(machine, {"items": ITEMS}, Host(provider), checkpoint=checkpoint, concurrency=8)
    assert (suspended.status, suspended.reason, suspended.at) == ("suspended", "budget-exhausted", "each")
    assert provider.calls == 25 and suspended.usage.tokens == 250
    again = resume(checkpoint, provider=provider)  # unchanged budgets: suspends again at once, no call
    assert (again.status, again.reason, provider.calls) == ("suspended", "budget-exhausted", 25)
    finished = resume(checkpoint, provider=provider, budget=400)
    assert finished.status == "done" and provider.calls == 300
    (tmp_path / "whole").mkdir()
    whole = run(load_file(wide(tmp_path / "whole", budget=400)), {"items": ITEMS}, provider=Echo())
    assert outcome(finished) == outcome(whole)


def test_a_fan_out_inside_a_sub_machine_suspends_and_resumes_through_its_parent(tmp_path):
    write(tmp_path, "child.mk", WIDE.format(budget=400).replace("machine wide", "machine child"))
    parent = write(
        tmp_path,
        "parent.mk",
        'machine parent\nentry go\nbudget 5\nstate go {\n  call child { items: "{{items}}" }\n'
        "  output echoes\n  otherwise -> END\n}\n",
    )
    checkpoint = tmp_path / "cp.json"
    provider = Echo()
    suspended = start(
        load_file(parent), {"items": ITEMS[:40]}, Host(provider), checkpoint=checkpoint, concurrency=1, max_tokens=100
    )
    assert (suspended.status, suspended.reason, [f.state for f in suspended.frames]) == (
        "suspended",
        "cost-exhausted",
        ["go", "each"],
    )
    assert provider.calls == 10 and suspended.usage.tokens == 100
    finished = resume(checkpoint, provider=provider, max_tokens=10_000)
    assert finished.status == "done" and provider.calls == 40
    assert finished.result == [f"echo item-{i}" for i in range(40)]
    assert finished.usage.tokens == 400


class Interrupting(Echo):
    """Echo that, on its 7th call, does what a SIGINT or a passing deadline does to the run."""

    def __init__(self, control: Control, what: str):
        super().__init__()
        self.control = control
        self.what = what

    def produce(self, system: str, user: str, tier: str, reason: bool) -> Produced:
        produced = super().produce(system, user, tier, reason)
        if self.calls == 7:
            if self.what == "interrupt":
                self.control.interrupted.set()
            else:
                self.control.deadline = time.monotonic() - 1
        return produced


@pytest.mark.parametrize(("what", "reason"), [("interrupt", "interrupted"), ("deadline", "time-exhausted")])
def test_an_interrupt_or_the_clock_stops_a_fan_out_which_resumes_the_rest(tmp_path, what, reason):
    checkpoint = tmp_path / "cp.json"
    control = Control()
    provider = Interrupting(control, what)
    machine = load_file(wide(tmp_path))
    suspended = start(
        machine, {"items": ITEMS[:30]}, Host(provider), checkpoint=checkpoint, concurrency=1, control=control
    )
    assert (suspended.status, suspended.reason, suspended.at, provider.calls) == ("suspended", reason, "each", 7)
    finished = resume(checkpoint, provider=provider)
    assert finished.status == "done" and provider.calls == 30
    control = Control()
    provider = Interrupting(control, what)
    halted = run(machine, {"items": ITEMS[:30]}, provider=provider, control=control, concurrency=1)
    assert (halted.status, halted.error, halted.at, provider.calls) == ("halted", reason, "each", 7)
    assert halted.usage.tokens == 7 * TOKENS_PER_CALL


def branch_threads() -> int:
    """The threads of the process's pool of branch threads alive now."""
    return sum(1 for thread in threading.enumerate() if thread.name.startswith("mklang-branch"))


# --- one concurrency limit for the whole run --------------------------------------------


def test_nested_fan_outs_share_one_limit_of_threads_and_calls(tmp_path):
    write(
        tmp_path,
        "leaf.mk",
        'machine leaf\nentry vote\nbudget 5\nstate vote {\n  sample 3\n  structure "s"\n'
        '  prompt "Vote on {{about}}"\n  output votes\n  otherwise -> END\n}\n',
    )
    write(
        tmp_path,
        "middle.mk",
        'machine middle\nentry each\nbudget 10\nstate each {\n  over parts\n  call leaf { about: "{{item}}" }\n'
        "  output leaves\n  otherwise -> END\n}\n",
    )
    top = write(
        tmp_path,
        "top.mk",
        'machine top\nentry each\nbudget 10\nstate each {\n  over groups\n  call middle { parts: "{{item}}" }\n'
        "  output middles\n  otherwise -> END\n}\n",
    )
    groups = [[f"item-{g}{p}" for p in range(4)] for g in range(4)]
    provider = Echo(pause=0.005)
    pooled = branch_threads()  # idle in the process's pool, left by earlier runs
    result = run(load_file(top), {"groups": groups}, provider=provider, concurrency=3)
    assert result.status == "done" and provider.calls == 4 * 4 * 3
    assert result.result[3][2] == ["echo item-32"] * 3
    assert provider.peak_threads <= max(pooled, 2)  # the caller plus 2: three threads work for the run
    assert provider.peak_in_flight <= 3


def test_concurrency_50_reaches_50_requests_in_flight_over_http(tmp_path, server):
    """The HTTP provider's own cap no longer stops the run's --concurrency at 8."""
    wave = threading.Condition()
    active = peak = 0
    released = False

    def hold_until_50(request: Request) -> Reply:
        nonlocal active, peak, released
        with wave:
            active += 1
            peak = max(peak, active)
            if active >= 50:
                released = True
                wave.notify_all()
            # The first requests wait for the wave to fill (or, when it cannot, for 10 s).
            wave.wait_for(lambda: released, timeout=10)
            released = True
            active -= 1
        return answer(f"echo {item_of(request.user)}", input_tokens=6, output_tokens=4)

    server.handler = hold_until_50
    items = write(tmp_path, "items.json", json.dumps({"items": ITEMS[:50]}))
    done = cli(
        "run",
        str(wide(tmp_path)),
        "--input",
        str(items),
        "--config",
        str(config(tmp_path, server)),
        "--concurrency",
        "50",
        "--format",
        "json",
    )
    assert done.returncode == 0, done.stderr
    assert server.count == 50
    assert peak == 50
