"""Find the machine a `call` names (SPEC section 3).

Order: the calling machine's directory, `./machines/`, the standard library
shipped in the package, then the `mklang.machines` entry-point group.
"""

from __future__ import annotations

from pathlib import Path

from mklang.vocabulary import SUFFIXES

_PACKAGE = Path(__file__).resolve().parent.parent


def stdlib_dirs() -> list[Path]:
    """The standard library: inside an installed wheel, else the checkout's `machines/`."""
    return [path for path in (_PACKAGE / "machines", _PACKAGE.parent / "machines") if path.is_dir()]


def _in(directory: Path, name: str) -> Path | None:
    for suffix in SUFFIXES:
        candidate = directory / f"{name}{suffix}"
        if candidate.is_file():
            return candidate
    return None


def _plugin(name: str) -> Path | None:
    """A machine registered by a package: the entry point names a path or a module beside the file."""
    from importlib.metadata import entry_points

    for entry in entry_points(group="mklang.machines"):
        if entry.name != name:
            continue
        target = entry.load()
        if isinstance(target, (str, Path)):
            return Path(target)
        module_file = getattr(target, "__file__", None)
        if module_file:
            return _in(Path(module_file).parent, name)
    return None


def find_machine(name: str, near_dir) -> Path | None:
    """The file of machine `name`, or None."""
    for directory in (Path(near_dir), Path.cwd() / "machines", *stdlib_dirs()):
        found = _in(directory, name)
        if found is not None:
            return found.resolve()
    try:
        return _plugin(name)
    except Exception:
        return None
