"""Host budgets across a whole run (SPEC section 4 loop-top, section 5 "Usage")."""

from __future__ import annotations

from typing import Any

import pytest
from conformance.harness import Recorder, run_mk, steps, write_machines
from support.runs import CHILD, TWO_STATES

from mklang.errors import ProviderError
from mklang.providers.base import Produced, Usage


class Priced(Recorder):
    """Every produce costs one cent and no tokens."""

    def produce(self, system, user, tier, reason):
        super().produce(system, user, tier, reason)
        return Produced("x", None, Usage(0, 0, 0.01))


LOOP = """
    machine loop
    entry a
    budget 50
    state a {
      structure "s"
      prompt "p"
      output o
      otherwise -> a
    }
"""


def test_a_dollar_budget_halts_cost_exhausted():
    provider = Priced()
    result = run_mk(LOOP, provider=provider, max_cost=0.025)
    assert (result.status, result.error, result.at) == ("halted", "cost-exhausted", "a")
    assert len(provider.produced) == 3
    assert round(result.usage.cost_usd, 6) == 0.03


PARENT = """
    machine spend_parent
    entry go
    budget 10
    state go {
      call child
      output r
      otherwise -> after
    }
    state after {
      structure "s"
      prompt "after"
      output o
      otherwise -> END
    }
"""


def test_the_tokens_a_child_spent_count_against_the_parent(tmp_path):
    machine = write_machines(tmp_path, PARENT, CHILD.format(budget=5))
    result = run_mk(machine, llm={"tokens": [4, 1]}, max_tokens=10)
    assert steps(result) == [("go", "ok", "after")]
    assert (result.status, result.error, result.at) == ("halted", "cost-exhausted", "after")


def test_without_host_budgets_only_steps_bound_a_run():
    result = run_mk(LOOP, llm={"tokens": [1000, 1000]})
    assert (result.error, len(result.trace), result.usage.tokens) == ("budget-exhausted", 50, 100_000)


def test_the_clock_and_a_batch_ceiling_stop_a_run_at_a_loop_top_by_name():
    from mklang.engine.runtime import Control

    late = run_mk(TWO_STATES, max_time=0, suspendable=True)
    assert (late.status, late.reason, late.at) == ("suspended", "time-exhausted", "a")
    seen = []

    def ceiling(spent: Usage) -> bool:
        seen.append(spent)
        return spent.tokens >= 3

    control = Control()
    control.ceiling = ceiling
    capped = run_mk(TWO_STATES, llm={"tokens": [2, 1]}, control=control, suspendable=True)
    assert (capped.status, capped.reason, capped.at) == ("suspended", "batch-ceiling", "b")
    assert seen[-1] == Usage(2, 1)


# --- steps, visits and the clock at their edges ----------------------------------


def test_max_visits_1_lets_a_state_run_once():
    result = run_mk("""
        machine m
        entry a
        budget 5
        state a {
          structure "s"
          prompt "p"
          output o
          max_visits 1
          otherwise -> a
        }
    """)
    assert (result.error, result.at, len(result.trace)) == ("loop-ceiling", "a", 1)


def test_a_fan_out_over_one_item_costs_one_step():
    result = run_mk(
        """
        machine m
        entry each
        budget 2
        context { xs: ["a"] }
        state each {
          over xs
          structure "s"
          prompt "{{item}}"
          output o
          otherwise -> b
        }
        state b {
          structure "s"
          prompt "p"
          output p
          otherwise -> END
        }
        """,
        suspendable=True,
    )
    assert (result.status, [step["state"] for step in result.trace]) == ("done", ["each", "b"])


def test_a_call_that_fails_after_the_deadline_is_the_time_budget_not_a_provider_error():
    import time as clock

    class Slow(Recorder):
        def produce(self, system, user, tier, reason):
            clock.sleep(0.2)
            raise ProviderError("timeout: no answer")

    machine = 'machine m\nentry a\nbudget 5\nstate a {\n structure "s"\n prompt "p"\n output x\n otherwise -> END\n}\n'
    halted = run_mk(machine, provider=Slow(), max_time=0.05)
    assert (halted.status, halted.error, halted.at) == ("halted", "time-exhausted", "a")
    parked = run_mk(machine, provider=Slow(), max_time=0.05, suspendable=True)
    assert (parked.status, parked.reason) == ("suspended", "time-exhausted")


FAN = """
    machine m
    entry each
    budget {budget}
    tool probe "looks"
    context {{ xs: ["a", "b", "c"] }}
    state each {{
      over xs
      {face}
      output o
      otherwise -> END
    }}
"""


def test_a_branch_reads_the_context_and_fences_what_the_host_gave():
    provider = Recorder()
    result = run_mk(
        FAN.format(budget=5, face='structure "s"\n      prompt "{{item}} for {{topic}}"'),
        {"topic": "tides"},
        provider=provider,
    )
    assert result.status == "done", result.error
    users = sorted(request.user for request in provider.produced)
    assert len(users) == 3 and all("tides" in user and "<data-" in user for user in users)


def test_a_fan_out_cut_by_the_step_budget_suspends_with_its_finished_branches():
    result = run_mk(
        FAN.format(budget=2, face='structure "s"\n      prompt "{{item}}"'),
        provider=Recorder({"produce": ["A", "B", "C"]}),
        suspendable=True,
        concurrency=1,
    )
    assert (result.status, result.reason, result.at) == ("suspended", "budget-exhausted", "each")
    assert sorted(result.frames[-1].branches) == [0, 1]


def test_an_exception_that_is_not_a_halt_leaves_the_fan_out():
    class Crash(BaseException):
        pass

    finished = []

    def probe(arguments: dict[str, Any]) -> str:
        if arguments["q"] == "b":
            raise Crash
        finished.append(arguments["q"])
        return "ok"

    with pytest.raises(Crash):
        run_mk(FAN.format(budget=5, face='tool probe { q: "{{item}}" }'), tools={"probe": probe})
    assert "a" in finished  # branches launched before it still finish
