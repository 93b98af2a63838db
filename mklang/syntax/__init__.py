"""The `.mk` front end: parse, load, format (SPEC section 2).

`parse` and `format_machine` work on text; `load_file` reads `.mk` and the
YAML layout (`.mkl`, `.yaml`, `.yml`) into the same `Machine`.
"""

from __future__ import annotations

from pathlib import Path

from mklang.errors import Diagnostic, LoadError
from mklang.limits import UnreadableText, read_bounded
from mklang.model import Machine
from mklang.syntax.parser import parse
from mklang.vocabulary import YAML_SUFFIXES

__all__ = ["format_machine", "load_file", "parse"]


def load_file(path) -> Machine:
    """Load a machine file by its suffix; `machine.path` is its absolute path."""
    path = Path(path)
    name = str(path)
    try:
        text = read_bounded(path)
    except UnreadableText as error:
        raise LoadError(
            [Diagnostic(name, 1, 1, 1, 1, "error", "unreadable", f"cannot read the file: {error.reason}")]
        ) from None
    if path.suffix.lower() in YAML_SUFFIXES:
        from mklang.syntax.yaml_front import parse_yaml

        machine = parse_yaml(text, name)
    else:
        machine = parse(text, name)
    machine.path = str(path.resolve())
    return machine


def format_machine(machine: Machine) -> str:
    """The canonical `.mk` text of a machine."""
    from mklang.syntax.printer import format_machine as _format

    return _format(machine)
