"""Fan-out: concurrency, order, step charge, branch errors (SPEC section 4, "Fan-out", "Steps")."""

from __future__ import annotations

import contextvars
import json
import threading
import time

import pytest
from conformance.harness import Recorder, run_mk, write_machines
from support.runs import TWO_STATES

from mklang.engine.runtime import BRANCH_THREADS, Control, ThreadPool
from mklang.errors import ProviderError
from mklang.providers.base import Produced, Usage


def over_items(xs: list[str], budget: int = 20, then: str = "END") -> str:
    """A machine fanning out over the author list `xs` (trusted: prompts stay unfenced)."""
    return f"""
        machine fan
        entry each
        budget {budget}
        context {{ xs: {json.dumps(xs)} }}
        state each {{
          over xs
          structure "s"
          prompt "{{{{item}}}}"
          output o
          otherwise -> {then}
        }}
    """


class SlowEcho(Recorder):
    """Echoes the prompt after `delays[prompt]` seconds."""

    def __init__(self, delays: dict[str, float]):
        super().__init__()
        self.delays = delays

    def produce(self, system, user, tier, reason):
        time.sleep(self.delays.get(user, 0))
        return Produced(user.upper(), None, Usage(1, 1))


class Wave(Recorder):
    """Holds calls until `width` are in flight at once, then lets every call through, recording the peak.

    No timing decides the outcome: a fan-out that runs fewer calls at once never
    fills the wave (its calls give up after 10 s and the peak falls short), and
    each call lingers until a call beyond `width` arrives (or 50 ms pass), so a
    fan-out that runs more shows a peak above `width`."""

    def __init__(self, width: int):
        super().__init__()
        self.width = width
        self.in_flight = 0
        self.peak = 0
        self.full = False
        self.changed = threading.Condition()

    def produce(self, system, user, tier, reason):
        with self.changed:
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
            self.full = self.full or self.in_flight >= self.width
            self.changed.notify_all()
            self.changed.wait_for(lambda: self.full, timeout=10)
            self.changed.wait_for(lambda: self.in_flight > self.width, timeout=0.05)
            self.in_flight -= 1
        return Produced(user.upper(), None, Usage(1, 1))


def test_outputs_keep_input_order_when_later_branches_finish_first():
    xs = ["a", "b", "c", "d"]
    provider = SlowEcho({"a": 0.08, "b": 0.06, "c": 0.04, "d": 0.0})
    result = run_mk(over_items(xs), provider=provider, concurrency=4)
    assert result.result == ["A", "B", "C", "D"]
    assert [b["output"] for b in result.trace[0]["branches"]] == ["A", "B", "C", "D"]


def test_branches_run_concurrently_up_to_the_concurrency_limit():
    xs = [f"item{i}" for i in range(8)]
    provider = Wave(8)
    result = run_mk(over_items(xs), provider=provider, concurrency=8)
    assert result.result == [x.upper() for x in xs]
    assert provider.peak == 8


def test_the_concurrency_limit_bounds_branches_in_flight():
    xs = [f"item{i}" for i in range(6)]
    provider = Wave(2)
    result = run_mk(over_items(xs), provider=provider, concurrency=2)
    assert result.status == "done"
    assert provider.peak == 2


def test_a_fan_out_step_records_its_branches_and_charges_one_step_each():
    xs = ["a", "b", "c"]
    result = run_mk(over_items(xs), provider=SlowEcho({}))
    (step,) = result.trace
    assert "output" not in step
    assert [b["output"] for b in step["branches"]] == ["A", "B", "C"]
    assert all(b["usage"]["input_tokens"] == 1 for b in step["branches"])
    assert step["usage"]["input_tokens"] == 3 and result.usage.tokens == 6


def test_fan_out_charges_max_1_n_steps_against_the_budget():
    provider = SlowEcho({})
    result = run_mk(over_items(["a", "b", "c"], budget=7, then="each"), provider=provider)
    # 3 + 3 steps leave 1: the third fan-out launches one branch, then halts at its state.
    assert (result.status, result.error, result.at, len(result.trace)) == ("halted", "budget-exhausted", "each", 2)
    assert result.usage.tokens == 7 * 2  # 3 + 3 + 1 branches: the cut fan-out's spend counts


def test_gates_judge_the_whole_list():
    provider = Recorder({"produce": ["x", "y"], "judge": [0]})
    source = """
        machine judged_fan
        entry s
        budget 5
        state s {
          sample 2
          structure "s"
          prompt "p"
          output o
          when "the answers agree" -> END
        }
    """
    result = run_mk(source, provider=provider)
    assert result.status == "done"
    assert len(provider.judged) == 1 and provider.judged[0].output == ["x", "y"]


def test_a_tool_exception_in_a_branch_becomes_a_marker():
    source = """
        machine tool_fan
        entry each
        budget 5
        context { xs: ["ok", "boom", "ok"] }
        state each {
          over xs
          tool risky { q: "{{item}}" }
          output o
          otherwise -> END
        }
    """

    def risky(args):
        if args["q"] == "boom":
            raise RuntimeError("exploded")
        return "fine"

    result = run_mk(source, tools={"risky": risky})
    assert result.status == "done"
    first, marker, last = result.result
    assert (first, last) == ("fine", "fine")
    assert marker.startswith("[branch-error: state-error: tool") and marker.endswith("]") and "exploded" in marker


def test_a_provider_error_in_a_branch_becomes_a_marker_even_when_suspendable():
    class Flaky(Recorder):
        def produce(self, system, user, tier, reason):
            if user == "b":
                raise ProviderError("rate limited")
            return super().produce(system, user, tier, reason)

    result = run_mk(over_items(["a", "b"]), provider=Flaky({"produce": "fine"}), suspendable=True)
    assert result.status == "done"
    assert result.result[0] == "fine"
    assert result.result[1].startswith("[branch-error: provider-error") and "rate limited" in result.result[1]


def test_branches_never_suspend(tmp_path):
    parent = """
        machine suspend_fan
        entry each
        budget 5
        context { xs: ["a", "b"] }
        state each {
          over xs
          call suspend_fan_child
          output o
          otherwise -> END
        }
    """
    child = """
        machine suspend_fan_child
        entry a
        budget 10
        state a {
          structure "s"
          prompt "p"
          output o
          otherwise -> a
        }
    """
    machine = write_machines(tmp_path, parent, child.replace("budget 10", "budget 2"))
    # A branch's own step budget is the branch's business: it fails into a marker.
    result = run_mk(machine, llm={"tokens": [5, 5]}, suspendable=True)
    assert result.status == "done"
    assert result.result == ["[branch-error: call-failed: budget-exhausted]"] * 2


def test_a_run_wide_ceiling_inside_branches_suspends_the_fan_out_instead_of_a_marker(tmp_path):
    parent = """
        machine cut_fan
        entry each
        budget 5
        context { xs: ["a", "b"] }
        state each {
          over xs
          call cut_fan_child
          output o
          otherwise -> END
        }
    """
    child = """
        machine cut_fan_child
        entry a
        budget 10
        state a {
          structure "s"
          prompt "p"
          output o
          otherwise -> a
        }
    """
    machine = write_machines(tmp_path, parent, child)
    result = run_mk(machine, llm={"tokens": [5, 5]}, max_tokens=25, suspendable=True)
    assert (result.status, result.reason, result.at) == ("suspended", "cost-exhausted", "each")
    # Both branches' spend counts: 20 after their first calls, then the calls in flight when 25 was
    # crossed (one per branch at most: which ones started first depends on the thread schedule).
    assert result.usage.tokens in (30, 40)
    halted = run_mk(machine, llm={"tokens": [5, 5]}, max_tokens=25)
    assert (halted.status, halted.error, halted.at) == ("halted", "cost-exhausted", "each")
    assert halted.usage.tokens in (30, 40)


def test_at_most_8_branches_run_at_once_by_default():
    xs = [f"item{i}" for i in range(12)]
    provider = Wave(8)
    result = run_mk(over_items(xs), provider=provider)
    assert len(result.result) == 12
    assert provider.peak == 8


class Threads(Recorder):
    """Echoes the prompt, noting the thread of each call and the context it sees."""

    def __init__(self):
        super().__init__()
        self.noted = threading.Lock()
        self.calls = 0
        self.threads: set[threading.Thread] = set()
        self.seen: set[str | None] = set()

    def produce(self, system, user, tier, reason):
        with self.noted:
            self.calls += 1
            self.threads.add(threading.current_thread())
            self.seen.add(MARK.get())
        return Produced(user.upper(), None, Usage(1, 1))


MARK: contextvars.ContextVar[str | None] = contextvars.ContextVar("test_mark", default=None)


def test_branches_reuse_the_threads_of_a_pool_across_fan_outs_and_carry_the_context():
    provider = Threads()
    xs = [f"item{i}" for i in range(40)]
    pooled = sum(1 for thread in threading.enumerate() if thread.name == "mklang-branch")  # left by earlier runs
    mark = MARK.set("the run's")
    try:
        for _ in range(2):
            assert run_mk(over_items(xs, budget=50), provider=provider, concurrency=4).status == "done"
    finally:
        MARK.reset(mark)
    assert len(provider.threads) <= 1 + max(pooled, 3)  # the caller and the pool's threads, not one per branch
    assert provider.seen == {"the run's"}


def test_a_wide_fan_out_hands_a_thread_over_once_per_slot_not_once_per_branch(monkeypatch):
    handed = []
    hand_over = BRANCH_THREADS.run

    def counted(task, then):
        handed.append(task)
        hand_over(task, then)

    monkeypatch.setattr(BRANCH_THREADS, "run", counted)
    provider = Threads()
    xs = [f"item{i}" for i in range(60)]
    result = run_mk(over_items(xs, budget=60), provider=provider, concurrency=4)
    assert result.result == [x.upper() for x in xs]
    assert 1 <= len(handed) <= 3  # the slots beside the fanning thread's, each lent once


class StoreDown(Exception):
    """A batch ceiling's store that stopped answering."""


def test_a_launch_check_that_fails_on_a_lent_thread_fails_the_run_once_its_branches_end():
    checks = []

    def ceiling(spent: Usage) -> bool:  # as a batch's ledger in a store: asked at every launch
        checks.append(spent)
        if len(checks) == 30:
            raise StoreDown("the store did not answer")
        return False

    control = Control()
    control.ceiling = ceiling
    xs = [f"item{i}" for i in range(60)]
    with pytest.raises(StoreDown):
        run_mk(over_items(xs, budget=60), provider=Threads(), concurrency=4, control=control)
    # The pool's threads survived it: the next fan-out runs every branch.
    assert run_mk(over_items(xs, budget=60), provider=Threads(), concurrency=4).result == [x.upper() for x in xs]


def test_nested_fan_outs_finish_at_the_smallest_concurrency(tmp_path):
    outer = """
        machine outer
        entry each
        budget 20
        context { xs: ["a", "b", "c", "d"] }
        state each {
          over xs
          call inner { item: "{{item}}" }
          output o
          otherwise -> END
        }
    """
    inner = """
        machine inner
        entry each
        budget 20
        state each {
          sample 3
          structure "s"
          prompt "{{item}}"
          output o
          otherwise -> END
        }
    """
    machine = write_machines(tmp_path, outer, inner)
    provider = Threads()
    result = run_mk(machine, provider=provider, concurrency=2)
    assert result.status == "done", result.error
    assert provider.calls == 12


def test_a_pool_thread_idle_for_its_time_ends():
    pool = ThreadPool(idle_seconds=0.05)
    ran = []
    finished = threading.Semaphore(0)
    for i in range(3):
        pool.run(lambda i=i: ran.append((i, threading.current_thread())), finished.release)
    for _ in range(3):
        assert finished.acquire(timeout=10)
    threads = {thread for _, thread in ran}
    for thread in threads:
        thread.join(timeout=10)
    assert sorted(i for i, _ in ran) == [0, 1, 2]
    assert not any(thread.is_alive() for thread in threads)


def test_waiting_for_a_quiet_pool_returns_once_its_tasks_end_not_its_idle_threads():
    pool = ThreadPool(idle_seconds=60)  # its threads stay alive, idle, long after the test
    release = threading.Event()
    pool.run(release.wait, lambda: None)
    waited = threading.Thread(target=pool.wait_quiet)
    waited.start()
    waited.join(timeout=0.2)
    assert waited.is_alive()  # a task still runs
    release.set()
    waited.join(timeout=10)
    assert not waited.is_alive()
    started = time.monotonic()
    pool.wait_quiet()  # no task: at once, though a thread is idle for a minute
    assert time.monotonic() - started < 5


# --- fan-out edges: what `over` is, a branch's reasoning and its failed call -----


@pytest.mark.parametrize(
    ("xs", "what"), [(None, "missing"), ('"text"', "a str, not a list"), ("{ a: 1 }", "a dict, not a list")]
)
def test_over_a_value_that_is_not_a_list_halts_at_the_state_saying_what_it_is(xs, what):
    context = f"context {{ xs: {xs} }}" if xs is not None else ""
    result = run_mk(f"""
        machine fan
        entry start
        budget 5
        {context}
        state start {{
          structure "s"
          prompt "p"
          output first
          otherwise -> each
        }}
        state each {{
          over xs
          structure "s"
          prompt "{{{{item}}}}"
          output o
          otherwise -> END
        }}
    """)
    assert (result.status, result.error, result.at) == ("halted", f"state-error: over: 'xs' is {what}", "each")


def test_a_branch_keeps_its_reasoning_only_when_it_has_some():
    result = run_mk(
        """
        machine fan
        entry each
        budget 5
        context { xs: ["a", "b"] }
        state each {
          over xs
          reason
          structure "s"
          prompt "{{item}}"
          output o
          otherwise -> END
        }
        """,
        llm={"produce": {"a": {"text": "A", "reasoning": "because"}, "b": {"text": "B", "reasoning": None}}},
    )
    assert result.status == "done", result.error
    first, second = result.trace[0]["branches"]
    assert (first["output"], first["reasoning"]) == ("A", "because")
    assert (second["output"], "reasoning" in second) == ("B", False)


def test_an_escalation_suspends_with_its_question_and_a_provider_error_with_its_detail():
    result = run_mk(
        """
        machine ask
        entry a
        budget 5
        state a {
          structure "s"
          prompt "p"
          output x
          otherwise escalate -> b ask "Publish?" reply_to answer
        }
        state b {
          structure "s"
          prompt "p"
          output y
          otherwise -> END
        }
        """,
        suspendable=True,
        hitl=True,
    )
    assert (result.status, result.reason, result.ask, result.reply_to) == (
        "suspended",
        "escalated",
        "Publish?",
        "answer",
    )

    class Down(Recorder):
        def produce(self, system, user, tier, reason):
            raise ProviderError("HTTP 503 from the model server")

    parked = run_mk(
        'machine m\nentry a\nbudget 5\nstate a {\n structure "s"\n prompt "p"\n output x\n otherwise -> END\n}\n',
        provider=Down(),
        suspendable=True,
    )
    assert (parked.status, parked.reason, parked.detail) == (
        "suspended",
        "provider-error",
        "HTTP 503 from the model server",
    )
    assert parked.to_json()["detail"] == "HTTP 503 from the model server"


def test_an_interrupt_ends_a_run_that_cannot_suspend_at_its_state_with_its_spend():
    from mklang.engine.runtime import Control

    control = Control()

    class InterruptAfterOne(Recorder):
        def produce(self, system, user, tier, reason):
            control.interrupted.set()
            return Produced("x", None, Usage(3, 4, 0.5))

    result = run_mk(
        TWO_STATES,
        provider=InterruptAfterOne(),
        control=control,
    )
    assert (result.status, result.error, result.at) == ("halted", "interrupted", "b")
    assert result.usage == Usage(3, 4, 0.5)


def test_branch_locals_are_read_by_path_and_shadow_context_keys():
    machine = """
        machine m
        entry a
        budget 5
        context { item: "shadowed", people: [{ name: "Ada", langs: ["en", "fr"] }, { name: "Bo" }] }
        state a {
          over people
          structure "s"
          prompt "{{item.name}}|{{item.langs.-1}}|{{item.missing}}|{{index}}"
          output o
          otherwise -> END
        }
    """
    provider = Recorder({"produce": ["x"]})
    run_mk(machine, provider=provider, concurrency=1)
    assert sorted(request.user for request in provider.produced) == ["Ada|fr||0", "Bo|||1"]
