"""mklang: LLM-driven agent state machines with budgeted, resumable runs.

The public API is `load`, `run`, `resume` and `batch`, and `read_only` to mark a
host tool that changes nothing; they import the heavy parts of
the package only when called, so `import mklang` stays cheap for the CLI.
"""

from __future__ import annotations

from mklang.version import __version__

__all__ = ["__version__", "batch", "load", "read_only", "resume", "run"]


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


def read_only(tool):
    """Mark a host tool as read-only (it observes the world, it changes nothing), so that a
    decision a judge made over outside data may reach it (SPEC section 4, "Control-flow taint")."""
    from mklang.effects import read_only as mark

    return mark(tool)


def resume(source, *, provider, tools=None, hooks=None, scripted=None, **options):
    """Continue a suspended or crashed run from a checkpoint path or an `Envelope`.

    Options are those of `mklang.session.resume`.
    """
    from mklang.session import Host
    from mklang.session import resume as resume_session

    return resume_session(source, Host(provider, tools or {}, hooks or {}, scripted=scripted), **options)


def batch(
    machine,
    inputs,
    *,
    store,
    provider,
    tools=None,
    hooks=None,
    concurrency=32,
    batch_max_tokens=None,
    batch_max_cost=None,
    out=None,
    hitl=False,
    **budgets,
):
    """Run `machine` once per input, each a durable run in `store`; returns their `Outcome`s.

    `inputs` is a JSON Lines path or a list of context maps (an `id` key names
    a run, else the hash of the input). `store` is a folder or a store URI.
    Calling it again with the same inputs resumes the batch. `budgets` are
    each run's (`max_tokens`, `max_cost`, `max_time`, and the `untrusted_flow`
    policy, report or halt); `batch_max_*` bound the
    whole batch. With `out`, one result line per input is written there.
    With `hitl`, an escalation parks its run for a human reply (`mklang resume
    STORE#RUN --set ...`); calling it again continues the answered runs.
    """
    from contextlib import nullcontext

    from mklang import batching
    from mklang.check import require_runnable
    from mklang.session import Host
    from mklang.stores import open_store

    machine = load(machine) if not hasattr(machine, "states") else require_runnable(machine)
    if isinstance(inputs, (str, bytes)) or hasattr(inputs, "__fspath__"):
        items = batching.read_inputs(inputs)
    else:
        items = batching.items_of((data, f"input {number}") for number, data in enumerate(inputs, 1))
    host = Host(provider, tools or {}, hooks or {})
    opened = open_store(store)
    try:
        runner = batching.Batch(
            machine,
            opened,
            str(store),
            lambda: nullcontext(host),
            ceilings=batching.Ceilings(batch_max_tokens, batch_max_cost),
            hitl=hitl,
            **budgets,
        )
        outcomes = runner.run(items, concurrency)
    finally:
        opened.close()
    if out is not None:
        batching.write_results(out, outcomes)
    return outcomes
