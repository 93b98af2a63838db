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


def run(machine, context=None, *, provider, tools=None, hooks=None, scripted=None, checkpoint=None, **options):
    """Run `machine` (a `Machine` or a path) and return a `RunResult`.

    With `checkpoint=PATH` the run persists there and suspends instead of
    halting on budgets. Other options are those of `mklang.session.start`.
    """
    from mklang.check import require_runnable
    from mklang.session import Host, start

    machine = load(machine) if not hasattr(machine, "states") else require_runnable(machine)
    host = Host(provider, tools or {}, hooks or {}, scripted=scripted)
    return start(machine, context, host, checkpoint=checkpoint, **options)


def resume(source, *, provider, tools=None, hooks=None, scripted=None, **options):
    """Continue a suspended or crashed run from a checkpoint path or an `Envelope`.

    Options are those of `mklang.session.resume`.
    """
    from mklang.session import Host
    from mklang.session import resume as resume_session

    return resume_session(source, Host(provider, tools or {}, hooks or {}, scripted=scripted), **options)
