"""Machine and host files as a checkpoint records them, so that it can move (ADR 0014).

A checkpoint names the root machine relative to its own folder, and every
machine file (in `machines`, frame `path`s and journal `enter` lines)
relative to the root machine's folder; standard-library machines as
`stdlib:<file>`, wherever mklang is installed. Moving or copying the project
folder with its checkpoint keeps every name valid; `--machine` says where
the root went when only the checkpoint stayed behind, and the rest follow.
The host files a run was started with (scenario script, config, cassettes,
plugin files) are named relative to the checkpoint's folder, as the root is.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from mklang.host.settings import files_renamed
from mklang.syntax.resolve import stdlib_dirs

if TYPE_CHECKING:
    from pydantic import BaseModel

# The envelope's `HostSettings`, named by what these functions need of it: this module is below the envelope's.
HostSettings = TypeVar("HostSettings", bound="BaseModel")

STDLIB = "stdlib:"


class MachinePaths:
    """Turns absolute machine files into the names a checkpoint records, and back."""

    def __init__(self, root: str | Path | None):
        self.root = Path(root).resolve() if root else None
        self._names: dict[str, str] = {}  # every snapshot names the same files again: named once each

    @property
    def folder(self) -> Path:
        return self.root.parent if self.root is not None else Path.cwd()

    def name(self, path: str | None) -> str | None:
        """The recorded name of a machine file (`None` for a machine without a file)."""
        if path is None or not os.path.isabs(path):
            return path
        named = self._names.get(path)
        if named is None:
            file = Path(path)
            if file.parent in _stdlib_folders():
                named = STDLIB + file.name
            else:
                named = Path(os.path.relpath(file, self.folder)).as_posix()
            self._names[path] = named
        return named

    def names(self, hashes: dict[str, str]) -> dict[str, str]:
        return {str(self.name(path)): digest for path, digest in hashes.items()}

    def file(self, name: str) -> Path:
        """Where a recorded machine file is now."""
        if name.startswith(STDLIB):
            base = name[len(STDLIB) :]
            found = [folder / base for folder in stdlib_dirs() if "/" not in base and (folder / base).is_file()]
            return found[0] if found else Path(base)
        return Path(os.path.normpath(self.folder / name))

    def root_from(self, folder: Path) -> str | None:
        """The root machine's file relative to `folder`, a checkpoint's (`checkpoint_folder`)."""
        if self.root is None:
            return None
        return Path(os.path.relpath(self.root, folder)).as_posix()


@functools.cache
def _stdlib_folders() -> frozenset[Path]:
    """The standard library's folders, resolved once: they do not move while mklang runs."""
    return frozenset(folder.resolve() for folder in stdlib_dirs())


def checkpoint_folder(checkpoint: str | Path) -> Path:
    """The folder of `checkpoint`, resolved: the root machine and the host's files are named relative to it."""
    return Path(checkpoint).resolve().parent


def root_file(recorded: str, checkpoint: str | Path) -> Path:
    """The root machine of a checkpoint: recorded relative to the checkpoint's folder."""
    return Path(os.path.normpath(checkpoint_folder(checkpoint) / recorded))


def _host_files(host: HostSettings, rename: Callable[[str], str]) -> HostSettings:
    return host.model_copy(update=files_renamed(dict(host), rename))


def portable_host(host: HostSettings, folder: Path) -> HostSettings:
    """The host's files (scenario script, config, cassettes, plugin files) named relative to
    `folder`, the checkpoint's (`checkpoint_folder`), as its root machine is, so a project folder
    moves with its checkpoint."""

    def relative(file: str) -> str:
        # A relative name is already relative to the checkpoint's folder: every snapshot passes
        # the envelope's host through here again, and it must come out unchanged.
        return Path(os.path.relpath(file, folder)).as_posix() if Path(file).is_absolute() else file

    return _host_files(host, relative)


def located_host(host: HostSettings, checkpoint: str | Path) -> HostSettings:
    """The host's files where they are now: recorded relative to the checkpoint's folder (or absolute)."""
    folder = checkpoint_folder(checkpoint)
    return _host_files(host, lambda name: os.path.normpath(folder / name))
