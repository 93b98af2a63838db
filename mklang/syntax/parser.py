"""The parser facade: text in, `Machine` out, or an `MkSyntaxError`. No Lark type leaks.

The LALR parser is Lark's standalone module generated from the grammar
(`_parser.py`), built once per process on first use (`grammar.standalone_parser`).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

from mklang.errors import Diagnostic, MkSyntaxError
from mklang.model import Machine


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Parsing allocates many objects that all stay alive until the machine is built; the
    cycle collector would scan them again and again as they pile up (cost growing with the
    file), and there is no cyclic garbage to find. Paused, parsing stays linear."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def parse(text: str, filename: str | None = None) -> Machine:
    """Parse `.mk` text; raise MkSyntaxError with diagnostics in words."""
    from mklang.syntax._parser import UnexpectedInput
    from mklang.syntax.build import build
    from mklang.syntax.comments import attach
    from mklang.syntax.grammar import standalone_parser
    from mklang.syntax.lexemes import comments
    from mklang.syntax.syntax_errors import diagnostic

    source = text.replace("\r\n", "\n")
    if not source.endswith("\n"):
        source += "\n"
    parser = standalone_parser()
    try:
        with _collector_paused():
            machine = build(parser.parse(source), filename)
            attach(machine, comments(source))
    except UnexpectedInput as error:
        raise MkSyntaxError([diagnostic(error, source, filename, parser.parse)]) from None
    except RecursionError:
        raise MkSyntaxError(
            [Diagnostic(filename, 1, 1, 1, 1, "error", "syntax", "values are nested too deeply")]
        ) from None
    return machine
