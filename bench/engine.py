"""Engine overhead, measured in process; prints its figures.

1. Per-step overhead of a 10,000-step loop with an instant scripted model,
   once with an `otherwise` gate and once with a judged prose gate.
2. Wall time of a 50-branch fan-out with `delay_ms: 100` at the default
   concurrency, against the ideal ceil(50 / concurrency) x 100 ms.
"""

from __future__ import annotations

import math
import time

from measure import print_load

from mklang.engine import run
from mklang.providers.scripted import ScriptedProvider
from mklang.syntax import parse

STEPS = 10_000
LOOP = """
machine loop
entry tick
budget {budget}
state tick {{
  structure "anything"
  prompt "{prompt}"
  output n
  {gate}
}}
"""
PLAIN = "tick"
FENCED = "tick {{{{n}}}}"  # interpolates the previous (untrusted) output: fenced every step
FAN_OUT = """
machine fan
entry vote
budget 60
state vote {
  sample 50
  structure "a vote"
  prompt "vote {{index}}"
  output votes
  otherwise -> END
}
"""


def per_step(gate: str, judge, prompt: str = PLAIN) -> float:
    machine = parse(LOOP.format(budget=STEPS, gate=gate, prompt=prompt), "loop.mk")
    timings = []
    for _ in range(5):
        provider = ScriptedProvider({"produce": ["ok"], "judge": judge})
        began = time.perf_counter()
        result = run(machine, provider=provider)
        timings.append(time.perf_counter() - began)
        assert result.error == "budget-exhausted" and len(result.trace) == STEPS, result.error
    # The minimum: other processes on the machine only ever add time.
    return min(timings) / STEPS * 1e6


def fan_out(concurrency: int = 8) -> tuple[float, float]:
    machine = parse(FAN_OUT, "fan.mk")
    provider = ScriptedProvider({"produce": ["yes"], "delay_ms": 100})
    began = time.perf_counter()
    result = run(machine, provider=provider, concurrency=concurrency)
    elapsed = time.perf_counter() - began
    assert result.status == "done" and len(result.result) == 50
    return elapsed, math.ceil(50 / concurrency) * 0.1


def main() -> None:
    print_load()
    otherwise = per_step("otherwise -> tick", [0])
    judged = per_step('when "keep going" -> tick', [0])
    fenced = per_step("otherwise -> tick", [0], FENCED)
    print(f"engine overhead per step, otherwise gate : {otherwise:6.1f} us  (target <= 16 us)")
    print(f"engine overhead per step, judged gate    : {judged:6.1f} us  (target <= 40 us)")
    print(f"  with an untrusted value fenced per step: {fenced:6.1f} us  (otherwise gate)")
    elapsed, ideal = fan_out()
    print(
        f"50-branch fan-out, delay 100 ms, concurrency 8: {elapsed * 1000:6.0f} ms "
        f"(ideal {ideal * 1000:.0f} ms, ratio {elapsed / ideal:.2f}x, target <= 1.5x)"
    )


if __name__ == "__main__":
    main()
