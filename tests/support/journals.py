"""A run's crash journal opened by hand, and the records it reads back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conformance.harness import write_machines

from mklang.checkpoint.envelope import MachineRef, load
from mklang.checkpoint.journal import StoreJournal, read_journal
from mklang.checkpoint.paths import MachinePaths
from mklang.engine.frame import Frame
from mklang.engine.records import StepRecord
from mklang.providers.base import NO_SPEND, Usage
from mklang.stores import locate
from support.checkpoints import blank_envelope
from support.runs import TWO_STATES


class KeepsNothing:
    """A journal (`engine.runtime.Journal`) that keeps nothing, as a run without one: every call
    is live. Tests watch what a run reports by overriding what they look at."""

    def loop_top(self, chain: list[Frame]) -> None:
        pass

    def enter(self, depth: int, frame: Frame) -> None:
        pass

    def step(self, depth: int, record: StepRecord) -> None:
        pass

    def replay(self, key: str, kind: str) -> Any:
        return None

    def record(self, key: str, kind: str, value: Any) -> None:
        pass

    def fold(self, prefix: str) -> None:
        pass

    def unreplayed(self) -> Usage:
        return NO_SPEND

    def halt(self, depth: int, error: str, usage: Usage) -> None:
        pass


def run_journal(folder: Path, **options: Any) -> tuple[StoreJournal, Frame]:
    """A journal of a run of `folder/proj/m.mk` (TWO_STATES, hashed "abc") checkpointed to
    `folder/cp.json`, and its first frame; `options` go to `StoreJournal`."""
    (folder / "proj").mkdir(exist_ok=True)
    machine = write_machines(folder / "proj", TWO_STATES)
    envelope = blank_envelope(machine=MachineRef(name="m", path=None, sha256="abc"))
    options.setdefault("hashes", {str(machine.path): "abc"})
    options.setdefault("paths", MachinePaths(machine.path))
    return StoreJournal(locate(folder / "cp.json"), envelope, **options), Frame.start(machine)


def journal_records(folder: Path) -> list[dict[str, Any]]:
    """The records after the header of the journal of `folder/cp.json`, each line's chained MAC
    checked against the envelope."""
    envelope = load(folder / "cp.json")
    assert envelope.signature is not None
    return read_journal(locate(folder / "cp.json"), envelope.generation, chain_from=envelope.signature.hmac)


def step_record(state: str, to: str | None, output: Any, tokens: int = 0) -> Any:
    """A journaled step from `state` to `to` that output `output` and read `tokens` input tokens."""
    usage = {"input_tokens": tokens, "output_tokens": 0, "cost_usd": 0.0}
    return {"step": {"state": state, "to": to, "output": output, "usage": usage}, "charge": 1}
