"""Host budgets across a whole run (SPEC section 4 loop-top, section 5 "Usage")."""

from __future__ import annotations

from conformance.harness import Recorder, run_mk, steps, write_machines

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
      call spend_child
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

CHILD = """
    machine spend_child
    entry a
    budget 5
    state a {
      structure "s"
      prompt "a"
      output o
      otherwise -> b
    }
    state b {
      structure "s"
      prompt "b"
      output o
      otherwise -> END
    }
"""


def test_the_tokens_a_child_spent_count_against_the_parent(tmp_path):
    machine = write_machines(tmp_path, PARENT, CHILD)
    result = run_mk(machine, llm={"tokens": [4, 1]}, max_tokens=10)
    assert steps(result) == [("go", "ok", "after")]
    assert (result.status, result.error, result.at) == ("halted", "cost-exhausted", "after")


def test_without_host_budgets_only_steps_bound_a_run():
    result = run_mk(LOOP, llm={"tokens": [1000, 1000]})
    assert (result.error, len(result.trace), result.usage.tokens) == ("budget-exhausted", 50, 100_000)
