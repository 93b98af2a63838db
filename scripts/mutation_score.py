"""Print the mutation score of each module from what `mutmut run` left in `mutants/`.

`mutmut results` lists survivors one by one; this sums them per module, the
table docs/mutation.md reports. Detected = killed + timed out; the score is
detected over every mutant that ran (a mutant no selected test reaches counts
as surviving). Run it from the folder that holds `mutants/`:

    python scripts/mutation_score.py [GLOB...]     # e.g. "mklang/checkpoint/*"
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from fnmatch import fnmatch
from pathlib import Path

from mutmut.stats import status_by_exit_code

COLUMNS = ("killed", "timeout", "survived", "no tests", "not checked")


def module_counts(meta: Path) -> Counter[str]:
    """How many mutants of one module ended in each state."""
    exit_codes = json.loads(meta.read_text())["exit_code_by_key"]
    return Counter(status_by_exit_code[code] for code in exit_codes.values())


def score(counts: Counter[str]) -> tuple[int, int]:
    """(detected, run): detected counts killed and timed-out mutants."""
    detected = counts["killed"] + counts["timeout"]
    return detected, sum(counts.values()) - counts["not checked"]


def row(name: str, counts: Counter[str]) -> str:
    detected, run = score(counts)
    percent = f"{100 * detected / run:.1f} %" if run else "-"
    return " | ".join([f"| `{name}`", str(run), *(str(counts[c]) for c in COLUMNS), f"{percent} |"])


def main(patterns: list[str]) -> None:
    total: Counter[str] = Counter()
    print("| module | run | " + " | ".join(COLUMNS) + " | score |")
    print("|" + " --- |" * (len(COLUMNS) + 3))
    for meta in sorted(Path("mutants").rglob("*.py.meta")):
        module = meta.relative_to("mutants").as_posix().removesuffix(".meta")
        if patterns and not any(fnmatch(module, p) for p in patterns):
            continue
        counts = module_counts(meta)
        total += counts
        print(row(module, counts))
    print(row("total", total))


if __name__ == "__main__":
    main(sys.argv[1:])
