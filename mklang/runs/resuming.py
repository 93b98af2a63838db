"""Resuming a stored run: open it (`opening`), then drive it with a host (`driving`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from mklang.engine import RunResult
from mklang.errors import CheckpointError
from mklang.runs.driving import proceed
from mklang.runs.opening import opened
from mklang.session import Host
from mklang.stores import Location, locate

if TYPE_CHECKING:
    from mklang.checkpoint.envelope import Envelope


def resume(
    source: str | Path | Location | Envelope,
    host: Host,
    *,
    force: bool = False,
    machine_path: str | None = None,
    trust: bool = False,
    allow_rollback: bool = False,
    checkpoint: str | Path | Location | None = None,
    **options: Any,
) -> RunResult:
    """Verify a checkpoint, then continue it with `host`.

    `source` is a checkpoint file or an `Envelope`; an envelope is first
    written to `checkpoint` (required then), with the trace segments it
    names (`segments.placed`). A re-suspension goes to
    `checkpoint`, by default the same file. Other options are those of `proceed`.
    """
    from mklang.checkpoint.envelope import Envelope, save
    from mklang.checkpoint.segments import placed

    if isinstance(source, Envelope):
        if checkpoint is None:
            raise CheckpointError("resuming an Envelope needs checkpoint=PATH to persist the run to")
        target = locate(checkpoint)
        save(target, placed(source, target))
        source = target
    with opened(
        source, force=force, machine_path=machine_path, trust=trust, allow_rollback=allow_rollback
    ) as resumable:
        return proceed(resumable, host, checkpoint=checkpoint, **options)
