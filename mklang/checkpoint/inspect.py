"""What `mklang show` tells about a checkpoint, as plain data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mklang.checkpoint.envelope import load
from mklang.checkpoint.journal import read_journal
from mklang.checkpoint.lock import holder
from mklang.checkpoint.signing import SEAL_TEXT
from mklang.checkpoint.trust import recorded_host
from mklang.providers.base import Usage


def describe(path: str | Path, last: int = 5) -> dict[str, Any]:
    """Status, reason, frame chain, spend against budgets, last steps, pending ask.

    A `running` checkpoint belongs to a process that is still going or that
    died; its journal says how far it got.
    """
    envelope = load(path)
    frames = envelope.frames
    usage = Usage.from_json(envelope.usage)
    steps_after = 0
    if envelope.status == "running":
        # The process died (or still runs): replay its journal to say where it really is.
        from mklang.checkpoint import open_checkpoint

        steps_after = sum(1 for r in read_journal(path, envelope.generation) if r.get("k") == "step")
        chain = open_checkpoint(path, force=True, trust=True).chain
        frames = [frame.to_json() for frame in chain]
        usage = sum((frame.usage for frame in chain), Usage())
    root = frames[0] if frames else {}
    # The question the run waits on: its innermost frame's, even when it died before saying so.
    pending = (frames[-1].get("ask") if frames else None) or {"ask": envelope.ask, "reply_to": envelope.reply_to}
    tokens, cost = usage.tokens, usage.cost_usd
    budgets = envelope.budgets

    def remaining(limit: float | None, spent: float) -> float | None:
        return None if limit is None else max(0, limit - spent)

    summary = {
        "path": str(path),
        "status": envelope.status,
        "reason": envelope.reason,
        "detail": envelope.detail,
        "error": envelope.error,
        "at": envelope.at,
        "run_id": envelope.run_id,
        "machine": envelope.machine.model_dump(),
        "frames": [
            {
                "machine": f["machine"],
                "state": f["state"],
                "steps": f["steps"],
                "budget": f["budget"],
                "remaining": max(0, f["budget"] - f["steps"]),
            }
            for f in frames
        ],
        "tokens": {"spent": tokens, "budget": budgets.max_tokens, "remaining": remaining(budgets.max_tokens, tokens)},
        "cost_usd": {"spent": cost, "budget": budgets.max_cost, "remaining": remaining(budgets.max_cost, cost)},
        "max_time": budgets.max_time,
        "last_steps": (root.get("trace") or [])[-last:] if last else [],
        "ask": pending["ask"],
        "reply_to": pending["reply_to"],
        "resumable": envelope.status in ("running", "suspended"),
        "signature": {"seal": envelope.seal, "text": SEAL_TEXT[envelope.seal]},
        "host": recorded_host(envelope.host),
    }
    if envelope.status == "running":
        innermost = frames[-1]
        pid = holder(path)
        where = f"{innermost['machine']}:{innermost['state']}"
        if pid is not None:
            summary["running_pid"] = pid
            summary["interrupted"] = f"the run is still going in process {pid}, last durable at {where}"
        else:
            summary["interrupted"] = (
                f"the run was interrupted at {where} ({steps_after} journaled step(s) past the last "
                f"snapshot); `mklang resume {path}` continues from there"
            )
        summary["resumable"] = pid is None
    return summary
