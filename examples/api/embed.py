"""Embed mklang in a Python program, offline: every model, tool and hook answer comes from
the scenario scripts beside the example machines, so no key or network is needed.

It checks a machine, runs one until its token budget suspends it and resumes it with a
larger one, parks another on a human decision and answers it with one of its choices, and
runs a small batch whose runs all park on that decision. Run it from anywhere: python examples/api/embed.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import mklang

EXAMPLES = Path(__file__).resolve().parent.parent


def say(label: str, result: mklang.RunResult) -> None:
    """One line per run: how it ended, where, what it spent, and the calls this process paid for."""
    where = f" at {result.at}" if result.at else ""
    why = f" ({result.reason})" if result.reason else ""
    paid = ", ".join(f"{kind} {count}" for kind, count in sorted(result.calls.items()))
    print(f"{label}: {result.status}{why}{where}, {result.usage.tokens} tokens, calls: {paid or 'none'}")


def main() -> None:
    approval = EXAMPLES / "approval" / "approval.mk"
    findings = mklang.check(approval)
    print(f"check: {len(findings)} findings")

    with tempfile.TemporaryDirectory() as folder:
        # A token budget suspends a durable run instead of halting it; a larger one continues it.
        research = EXAMPLES / "plan-execute"
        checkpoint = Path(folder) / "research.json"
        cut = mklang.run(
            research / "research.mk",
            script=research / "scenarios.yaml",
            scenario="plan-search-answer",
            checkpoint=checkpoint,
            max_tokens=150,
        )
        say("run", cut)
        finished = mklang.resume(checkpoint, max_tokens=10_000)
        say("resume", finished)
        print(f"answer: {finished.result}")

        # A human decision parks the run on its question; an answer is one of its choices.
        parked_at = Path(folder) / "approval.json"
        parked = mklang.run(
            mklang.load(approval),
            script=EXAMPLES / "approval" / "scenarios.yaml",
            scenario="ask-then-publish",
            checkpoint=parked_at,
        )
        say("run", parked)
        question = parked.to_json()["question"]
        print(f"ask: {parked.ask} {question['choices']} -> {parked.reply_to}")
        try:
            mklang.resume(parked_at, reply=mklang.Answer("maybe"))
        except mklang.DecisionRefused as refused:
            print(f"refused: {str(refused).partition(': ')[2]}")
        published = mklang.resume(parked_at, reply=mklang.Answer("approve", note="Ship it."))
        say("resume", published)
        print(f"published: {published.result}")

        # A batch runs the machine once per input, each a durable run in the store.
        outcomes = mklang.batch(
            approval,
            [{"id": "ops", "audience": "operators"}, {"id": "all", "audience": "all customers"}],
            store=Path(folder) / "runs",
            script=EXAMPLES / "approval" / "scenarios.yaml",
            scenario="ask-then-publish",
        )
        for outcome in outcomes:
            print(f"batch: {outcome.run} {outcome.status} ({outcome.reason})")


if __name__ == "__main__":
    main()
