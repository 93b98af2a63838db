"""Loading the machines a run calls, once each, remembering what was loaded.

The sha256 of every machine file a run loads is kept so that a checkpoint can
refuse to resume when any of them changed.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from mklang.errors import LoadError, UsageError
from mklang.model import Machine, called_machines


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


class MachineLoader:
    """Resolves `call` targets by name (SPEC section 3 order) and caches them by path."""

    def __init__(self) -> None:
        self._by_path: dict[str, Machine] = {}
        self.hashes: dict[str, str] = {}

    def add(self, machine: Machine) -> Machine:
        """Remember a machine loaded by the host (the root)."""
        if machine.path:
            self._by_path[machine.path] = machine
            self.hashes[machine.path] = file_sha256(machine.path)
        return machine

    def load_path(self, path: str | Path) -> Machine:
        from mklang.syntax import load_file

        key = str(Path(path).resolve())
        machine = self._by_path.get(key)
        if machine is None:
            machine = self.add(load_file(key))
        return machine

    def __call__(self, name: str, near: str | None) -> Machine:
        from mklang.syntax.resolve import find_machine

        near_dir = Path(near).parent if near else Path.cwd()
        path = find_machine(name, near_dir)
        if path is None:
            raise UsageError(
                f"machine '{name}' not found (looked beside {near_dir}, in ./machines/ and the standard library)"
            )
        try:
            return self.load_path(path)
        except LoadError as error:
            raise UsageError(f"machine '{name}' does not load: {error}") from None


def machine_tree(root: Machine, loader: MachineLoader | None = None) -> list[Machine]:
    """The root and every machine it calls, directly or not, each once: what a run may
    need, so that it can be checked before the first model call."""
    load = loader or MachineLoader()

    def load_or_skip(name: str, path: str | None) -> Machine | None:
        try:
            return load(name, path)
        except UsageError:
            return None  # `mklang check` reports a call it cannot resolve

    return list(called_machines(root, load_or_skip))
