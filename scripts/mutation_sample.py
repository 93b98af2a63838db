"""Estimate a mutation score from a uniform sample of the mutants not run yet (docs/mutation.md).

A census of a wide scope takes longer than a working day on two cores, and the mutants mutmut
runs last are the costliest: those of the functions nearly every test reaches. This picks a
uniform random sample of the mutants `mutants/` holds as not run, for `mutmut run` to run by
name, then estimates each module's score: the mutants that ran before the sample are counted,
the sample's rate stands for the rest. Run it from the folder that holds `mutants/`:

    python scripts/mutation_sample.py pick 400 sample.json "mklang/stores/*" "mklang/runs/*"
    mutmut run $(python scripts/mutation_sample.py names sample.json)
    python scripts/mutation_sample.py estimate sample.json
"""

from __future__ import annotations

import json
import math
import random
import sys
from collections import Counter
from fnmatch import fnmatch
from pathlib import Path

from mutation_score import score
from mutmut.stats import status_by_exit_code


def statuses(patterns: list[str]) -> dict[str, dict[str, str]]:
    """Each module's mutants (matching `patterns`) and the state each ended in."""
    found = {}
    for meta in sorted(Path("mutants").rglob("*.py.meta")):
        module = meta.relative_to("mutants").as_posix().removesuffix(".meta")
        if any(fnmatch(module, pattern) for pattern in patterns):
            codes = json.loads(meta.read_text())["exit_code_by_key"]
            found[module] = {key: status_by_exit_code[code] for key, code in codes.items()}
    return found


def pick(size: int, target: str, patterns: list[str], seed: int = 20261201) -> None:
    """Write to `target` a uniform sample of `size` of the mutants not run yet."""
    modules = statuses(patterns).values()
    waiting = sorted(key for keys in modules for key, state in keys.items() if state == "not checked")
    sample = sorted(random.Random(seed).sample(waiting, min(size, len(waiting))))
    Path(target).write_text(json.dumps({"patterns": patterns, "seed": seed, "sample": sample}, indent=1))
    print(f"{len(sample)} of the {len(waiting)} mutants not run, in {target}")


def estimate(source: str) -> None:
    """Each module's score: counted where mutants ran outside the sample, estimated for the rest."""
    plan = json.loads(Path(source).read_text())
    sample = set(plan["sample"])
    counted_all, sampled_all, waiting_all = Counter[str](), Counter[str](), 0
    rows = []
    for module, keys in statuses(plan["patterns"]).items():
        counted = Counter(state for key, state in keys.items() if key not in sample)
        sampled = Counter(state for key, state in keys.items() if key in sample)
        waiting = counted.pop("not checked", 0)
        if not keys:
            continue  # a module with nothing to mutate
        rows.append((module, counted, sampled, waiting))
        counted_all, sampled_all, waiting_all = counted_all + counted, sampled_all + sampled, waiting_all + waiting
    detected, run = score(sampled_all)
    rate = detected / run
    print("| module | counted (detected / run) | sample (detected / run) | not run | estimated score |")
    print("| --- | --- | --- | --- | --- |")
    for module, counted, sampled, waiting in [*rows, ("total", counted_all, sampled_all, waiting_all)]:
        (cd, cr), (sd, sr) = score(counted), score(sampled)
        estimated = 100 * (cd + sd + rate * waiting) / (cr + sr + waiting)
        print(f"| `{module}` | {cd} / {cr} | {sd} / {sr} | {waiting} | {estimated:.1f} % |")
    margin = 1.96 * math.sqrt(rate * (1 - rate) / run) * waiting_all  # 95 %, normal approximation
    cd, cr = score(counted_all)
    whole = cr + run + waiting_all
    low, high = ((cd + detected + (rate * waiting_all + side)) / whole for side in (-margin, margin))
    print(f"sample: {detected} of {run} detected ({100 * rate:.1f} %)")
    print(f"total: {100 * low:.1f}-{100 * high:.1f} % (95 %)")


if __name__ == "__main__":
    command, *arguments = sys.argv[1:] or ["help"]
    if command == "pick":
        pick(int(arguments[0]), arguments[1], arguments[2:])
    elif command == "names":
        print("\n".join(json.loads(Path(arguments[0]).read_text())["sample"]))
    elif command == "estimate":
        estimate(arguments[0])
    else:
        print(__doc__)
