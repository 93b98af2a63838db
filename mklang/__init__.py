"""mklang: LLM-driven agent state machines with budgeted, resumable runs.

The public API is `load`, `run` and `resume`; they import the heavy parts of
the package only when called, so `import mklang` stays cheap for the CLI.
"""

from __future__ import annotations

__version__ = "0.4.0"

__all__ = ["__version__", "load", "resume", "run"]


def load(path):
    """Load a `.mk` (or YAML `.mkl`/`.yaml`) machine file into a `Machine`.

    Raises `mklang.errors.LoadError` for syntax errors and for check errors.
    """
    from mklang.check import require_runnable
    from mklang.syntax import load_file

    return require_runnable(load_file(path))


def run(machine, context=None, **options):
    """Run `machine` (a `Machine` or a path) and return a `RunResult`."""
    from mklang.check import require_runnable
    from mklang.engine import run as engine_run

    machine = load(machine) if not hasattr(machine, "states") else require_runnable(machine)
    return engine_run(machine, context, **options)


def resume(source, **options):
    """Continue a suspended or crashed run from a checkpoint path or an `Envelope`."""
    from mklang.checkpoint import resume as checkpoint_resume

    return checkpoint_resume(source, **options)
