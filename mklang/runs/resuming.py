"""How a stored run is resumed, written once: open it, build its host, drive it.

The command line, the Python API, the console, batch claims, workers and the
scenario player all continue a run through `resume` (tests/test_architecture.py
holds them to it); what differs between them is only the `RunRequest` they
make and what they hand the run as it goes.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mklang.engine import Control, RunResult
from mklang.engine.events import EventSink
from mklang.errors import CheckpointError
from mklang.runs.driving import proceed
from mklang.runs.hosting import build_host
from mklang.runs.opening import Resumable, opened
from mklang.runs.request import RunRequest, Tell, on_stderr
from mklang.session import Host
from mklang.stores import Location, RunLock, locate

if TYPE_CHECKING:
    from mklang.checkpoint.envelope import Envelope


def resume(
    request: RunRequest | str | Path | Location | Envelope,
    host: Host | Callable[[Resumable], Host] | None = None,
    *,
    held: RunLock | None = None,
    control: Control | None = None,
    observer: EventSink | None = None,
    on_end: Callable[[Envelope], None] | None = None,
    tell: Tell = on_stderr,
    **asked: Any,
) -> RunResult:
    """Verify a checkpoint, then continue it: the run `request` describes, or, given a checkpoint,
    `RunRequest(source=it, **asked)`.

    The host is `host` when the caller has one, or makes one from the opened run (either stays the
    caller's), else built from the request (`hosting.build_host`, filled in from a trusted
    checkpoint) and closed after the run. `held` is
    the run's lock when the caller took it already (a claim); `control`, `observer` and `on_end`
    go to the run as `proceed` takes them; `tell` is told what the user should know. An `Envelope`
    source is first written to the request's `checkpoint` (required then), with the trace segments
    it names (`segments.placed`).
    """
    if not isinstance(request, RunRequest):
        request = RunRequest(source=request, **asked)
    elif asked:
        raise TypeError(f"resume() takes a RunRequest or keywords, not both: {sorted(asked)[0]}")
    source = _stored(request)
    with opened(source, held=held, tell=tell, **request.opening()) as resumable:
        if host is None:
            hosted: AbstractContextManager[Host] = build_host(request, resumable, tell)
        else:
            hosted = nullcontext(host(resumable) if callable(host) else host)
        with hosted as answering:
            return proceed(
                resumable,
                answering,
                reply=dict(request.reply),
                decision=request.decision,
                budget=request.budget,
                raised_by=request.raised_by,
                on_end=on_end,
                tell=tell,
                checkpoint=request.checkpoint,
                replace=request.replace,
                control=control,
                observer=observer,
                **request.bounds(),
            )


def _stored(request: RunRequest) -> str | Path | Location:
    """Where the checkpoint to continue is: an `Envelope` is saved at `checkpoint` first."""
    from mklang.checkpoint.envelope import Envelope, save
    from mklang.checkpoint.segments import placed

    source = request.source
    if source is None:
        raise CheckpointError("resuming needs the checkpoint of a run")
    if not isinstance(source, Envelope):
        return source
    if request.checkpoint is None:
        raise CheckpointError("resuming an Envelope needs checkpoint=PATH to persist the run to")
    target = locate(request.checkpoint)
    save(target, placed(source, target))
    return target
