"""mklang: LLM-driven agent state machines with budgeted, resumable runs.

The public API is what `__all__` names, documented in docs/api.md: `load`,
`check`, `run`, `resume`, their awaitable twins `arun` and `aresume`,
`batch` and `read_only`, their result types and the
errors they raise. Every submodule is internal and may change without notice.

Each name loads on first use (PEP 562), so `import mklang` runs nothing but
this file and `mklang.version`: the CLI's start-up pays for no more.
"""

from mklang.version import __version__

TYPE_CHECKING = False  # `typing` is not imported for this; type checkers read the block below
if TYPE_CHECKING:
    from mklang._api import aresume, arun, batch, check, load, read_only, resume, run
    from mklang.engine import RunResult
    from mklang.engine.decisions import Answer
    from mklang.engine.events import (
        BranchFinished,
        BranchStarted,
        CallFinished,
        CallStarted,
        Event,
        EventSink,
        GateDecided,
        HookCalled,
        ModelDelta,
        ModelFinished,
        ModelStarted,
        PathLevel,
        RunFinished,
        RunHalted,
        RunResumed,
        RunStarted,
        RunSuspended,
        StateEntered,
        ToolFinished,
        ToolStarted,
    )
    from mklang.engine.frame import Frame
    from mklang.errors import (
        CheckpointError,
        DecisionRefused,
        Diagnostic,
        LoadError,
        MklangError,
        MkSyntaxError,
        ProviderError,
        RunBusy,
        UsageError,
    )
    from mklang.model import Machine
    from mklang.providers.base import Produced, Provider, Usage, Verdict
    from mklang.runs import Outcome

# Where each public name lives; it is read from there when first used.
_HOMES = {
    "aresume": "mklang._api",
    "arun": "mklang._api",
    "batch": "mklang._api",
    "check": "mklang._api",
    "load": "mklang._api",
    "read_only": "mklang._api",
    "resume": "mklang._api",
    "run": "mklang._api",
    "Answer": "mklang.engine.decisions",
    "CheckpointError": "mklang.errors",
    "DecisionRefused": "mklang.errors",
    "Diagnostic": "mklang.errors",
    "LoadError": "mklang.errors",
    "MklangError": "mklang.errors",
    "MkSyntaxError": "mklang.errors",
    "ProviderError": "mklang.errors",
    "RunBusy": "mklang.errors",
    "UsageError": "mklang.errors",
    "Frame": "mklang.engine.frame",
    "Machine": "mklang.model",
    "BranchFinished": "mklang.engine.events",
    "BranchStarted": "mklang.engine.events",
    "CallFinished": "mklang.engine.events",
    "CallStarted": "mklang.engine.events",
    "Event": "mklang.engine.events",
    "EventSink": "mklang.engine.events",
    "GateDecided": "mklang.engine.events",
    "HookCalled": "mklang.engine.events",
    "ModelDelta": "mklang.engine.events",
    "ModelFinished": "mklang.engine.events",
    "ModelStarted": "mklang.engine.events",
    "RunFinished": "mklang.engine.events",
    "RunHalted": "mklang.engine.events",
    "RunResumed": "mklang.engine.events",
    "RunStarted": "mklang.engine.events",
    "RunSuspended": "mklang.engine.events",
    "PathLevel": "mklang.engine.events",
    "StateEntered": "mklang.engine.events",
    "ToolFinished": "mklang.engine.events",
    "ToolStarted": "mklang.engine.events",
    "Outcome": "mklang.runs",
    "Produced": "mklang.providers.base",
    "Provider": "mklang.providers.base",
    "RunResult": "mklang.engine",
    "Usage": "mklang.providers.base",
    "Verdict": "mklang.providers.base",
}

__all__ = [
    "Answer",
    "BranchFinished",
    "BranchStarted",
    "CallFinished",
    "CallStarted",
    "CheckpointError",
    "DecisionRefused",
    "Diagnostic",
    "Event",
    "EventSink",
    "Frame",
    "GateDecided",
    "HookCalled",
    "LoadError",
    "Machine",
    "MkSyntaxError",
    "MklangError",
    "ModelDelta",
    "ModelFinished",
    "ModelStarted",
    "Outcome",
    "PathLevel",
    "Produced",
    "Provider",
    "ProviderError",
    "RunBusy",
    "RunFinished",
    "RunHalted",
    "RunResult",
    "RunResumed",
    "RunStarted",
    "RunSuspended",
    "StateEntered",
    "ToolFinished",
    "ToolStarted",
    "Usage",
    "UsageError",
    "Verdict",
    "__version__",
    "aresume",
    "arun",
    "batch",
    "check",
    "load",
    "read_only",
    "resume",
    "run",
]


def __getattr__(name: str) -> object:
    """A public name, imported from its home. No submodule is named like a public name: importing
    it would set the package attribute over the function (hence `mklang.checker`)."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'mklang' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later look-ups find it without this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
