"""Where a run of a store is, named as commands name it (`stores.target`: `STORE-URI#RUN`, or `FOLDER/RUN`)."""

from __future__ import annotations

from pathlib import Path

from mklang.stores import Location, RunStore, is_uri, target


def location(store: RunStore, uri: str, run: str) -> Location:
    """Where `run` is in the store opened from `uri`: named and anchored as `locate` does it, so a run
    a batch wrote records its machine as `mklang resume STORE#RUN` (or FOLDER/RUN) finds it."""
    text = target(uri, run)
    if is_uri(uri):
        return Location(store, run, text, text, getattr(store, "path", Path.cwd() / "checkpoint"))
    return Location(store, run, text, str(Path(text).resolve()), Path(text))
