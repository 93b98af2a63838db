"""The texts of a run's machines, kept in its store by sha256 (ADR 0024).

A run records the sha256 of every machine file it loaded (`machines`) and of
every machine its root may call (`texts`), each named relative to the root's
folder (`paths.py`); both are covered by the envelope's signature. The texts
themselves are notes of the store (`machine:<sha256>`), so any process that
reaches the store can run the machines without the files: a text is used
only when its sha256 is the signed one. A resume or a worker uses its local
files when they match; when they are missing (or, on a worker, differ) it
writes the kept texts into a private folder laid out by their names and
runs them from there.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from mklang.checkpoint.paths import STDLIB, MachinePaths
from mklang.errors import CheckpointError
from mklang.files import write_atomic
from mklang.model import Machine
from mklang.stores import NoteStore, RunStore
from mklang.syntax.machines import file_sha256


def text_key(digest: str) -> str:
    return f"machine:{digest}"


def keep_texts(store: RunStore, root: Machine, where: object) -> dict[str, str]:
    """Add the texts of `root` and of every machine it may call to `store`: their names -> sha256
    (none when the store keeps no notes: the run resumes only where its files are).

    `where` (the run, or the batch) names what failed in an error."""
    from mklang.syntax.machines import machine_tree

    if not isinstance(store, NoteStore):
        return {}
    paths = MachinePaths(root.path)
    names: dict[str, str] = {}
    for machine in machine_tree(root):
        if machine.path is None:
            continue
        try:
            text = Path(machine.path).read_bytes()
            digest = hashlib.sha256(text).hexdigest()
            store.add_note(text_key(digest), text)
        except (OSError, CheckpointError) as error:
            reason = error.strerror if isinstance(error, OSError) else error
            raise CheckpointError(f"{where}: cannot keep the text of {machine.path} in the store: {reason}") from None
        names[str(paths.name(machine.path))] = digest
    return names


def machine_root(store: RunStore, root: Path, names: dict[str, str], *, changed: bool) -> tuple[Path, str | None]:
    """Where to load a run's root machine from, and what to tell the user about it.

    `root` itself when every file of `names` beside it has its sha256.
    Otherwise the root written from the texts the store keeps, with a line
    saying so, when the files are missing, or also when one was edited if
    `changed` (a worker: the user who edited it is not there to choose). Else
    `root`: the caller reports the missing or edited file (SPEC: a resume
    refuses an edited machine unless `--force`).
    """
    paths = MachinePaths(root)
    differing = [name for name, digest in sorted(names.items()) if not _matches(paths.file(name), digest)]
    edited = [name for name in differing if paths.file(name).exists()]
    if not differing or (edited and not changed):
        return root, None
    kept = _kept_root(store, root.name, names)
    if kept is None:
        return root, None
    first = paths.file(differing[0])
    why = "differs from the run's" if first.exists() else "is missing"
    return kept, f"{first} {why}; running the machine texts the store keeps (sha256-checked) from {kept.parent}"


def _matches(file: Path, digest: str) -> bool:
    try:
        return file_sha256(file) == digest
    except OSError:
        return False


def _kept_root(store: RunStore, root_name: str, names: dict[str, str]) -> Path | None:
    """The root in a private folder holding every kept text at its name; None when one is not kept."""
    if not isinstance(store, NoteStore):
        return None
    texts: dict[str, bytes] = {}
    for name, digest in names.items():
        if name.startswith(STDLIB):
            continue  # the standard library is where mklang is installed
        text = store.read_note(text_key(digest))
        if text is None or hashlib.sha256(text).hexdigest() != digest:
            return None
        texts[name] = text
    # Names may climb out of the root's folder (`../lib/x.mk`): the root goes as deep as they climb.
    depth = max((Path(os.path.normpath(name)).parts.count("..") for name in texts), default=0)
    digest = hashlib.sha256("\n".join(f"{name} {names[name]}" for name in sorted(texts)).encode()).hexdigest()
    base = _cache_folder() / digest[:32]
    folder = base.joinpath(*(["_"] * depth))
    for name, text in texts.items():
        target = Path(os.path.normpath(folder / name))
        if base not in target.parents:
            raise CheckpointError(f"machine name {name!r} leaves the run's folder")
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_atomic(target, text)
    return folder / root_name


def _cache_folder() -> Path:
    """$XDG_CACHE_HOME/mklang/machines (else ~/.cache/...): private to this user."""
    home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    folder = Path(home) / "mklang" / "machines"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    return folder
