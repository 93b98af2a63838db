"""Embed mklang in a Python program, offline: every model, tool and hook answer comes from
the scenario scripts beside the example machines, so no key or network is needed.

It checks a machine, runs one until its token budget suspends it and resumes it with a
larger one, parks another on a human question and answers it with a reply mapping, and
runs a small batch. Run it from anywhere: python examples/api/embed.py
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
    for finding in mklang.check(approval):
        print(f"check: {finding.line}:{finding.col} {finding.severity} [{finding.code}]")

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

        # An escalation parks the run on a question; the reply goes under its `reply_to` path.
        parked_at = Path(folder) / "approval.json"
        parked = mklang.run(
            mklang.load(approval),
            script=EXAMPLES / "approval" / "scenarios.yaml",
            scenario="ask-then-publish",
            checkpoint=parked_at,
            hitl=True,
        )
        say("run", parked)
        print(f"ask: {parked.ask} -> {parked.reply_to}")
        assert parked.reply_to is not None
        published = mklang.resume(parked_at, reply={parked.reply_to: "yes, ship it"})
        say("resume", published)
        print(f"published: {published.result}")

        # A batch runs the machine once per input, each a durable run in the store.
        outcomes = mklang.batch(
            approval,
            [{"id": "ops", "audience": "operators"}, {"id": "all", "audience": "all customers"}],
            store=Path(folder) / "runs",
            script=EXAMPLES / "approval" / "scenarios.yaml",
            scenario="approved-answer-given-up-front",
        )
        for outcome in outcomes:
            print(f"batch: {outcome.run} {outcome.status} {outcome.result}")


if __name__ == "__main__":
    main()
