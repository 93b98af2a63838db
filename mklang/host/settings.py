"""The host settings a run is built from, and the run settings it goes by, each declared once (ADR 0039).

A run's host comes from a few settings: a scenario script, or a provider,
model and config; cassettes to replay or record; plugins. Each setting a
caller chooses is a keyword of `mklang.run` and of a `runs.RunRequest`, a command-line
option, and a field of the checkpoint's `HostSettings`, and on resume a
checkpoint signed with your key may fill it in (ADR 0014). `SETTINGS` says
all of that once; the typed declarations (the envelope's pydantic model, the
API's keyword dictionaries, ADR 0042) are written out for the type checker, and
tests/host/test_settings.py holds them to it. Plain Python, so the command
line reads it without importing pydantic.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, Literal, NamedTuple

# How a resume treats a setting the caller leaves out, from a checkpoint signed with your key:
# "answers": one of the ways a run is answered: given together, or all taken from the file;
# "with-answers": taken from the file along with them; "own": taken from the file on its own;
# "never": not taken (a resume never re-records).
Resumed = Literal["answers", "with-answers", "own", "never"]


# A named tuple, not a dataclass: the command line builds its options from these at start-up.
class Setting(NamedTuple):
    """One host setting: its name (the `HostSettings` field and the keyword) and how it is handled."""

    name: str
    help: str | None  # of its command-line option; None: no caller chooses it, the host records it
    resumed: Resumed = "never"
    names_file: bool = False  # recorded relative to the checkpoint's folder, so the project folder can move
    many: bool = False  # a list, its option repeatable; entries naming files end in `.py` (plugins)
    metavar: str | None = None

    @property
    def option(self) -> str:
        """Its command-line option: a list's is singular, as it is given once per entry."""
        return "--" + self.name.removesuffix("s" if self.many else "")


# In the order of the fields of the checkpoint's `HostSettings`: its JSON is signed as written.
SETTINGS: tuple[Setting, ...] = (
    Setting("script", "Scenario script: answer from a scripted model, offline.", "answers", names_file=True),
    Setting("scenario", "Scenario of --script to use.", "with-answers"),
    Setting("state", None),  # what the host remembers across calls (`journal.HostState`)
    Setting("provider", "openai, anthropic or ollama (else from the config).", "answers"),
    Setting("model", "Model used for every tier.", "answers"),
    Setting("config", "Host config TOML (tiers, providers, prices).", "answers", names_file=True),
    Setting("replay", "Answer from a recorded cassette, offline.", "answers", names_file=True),
    Setting("record", "Record every provider exchange into a cassette.", names_file=True),
    Setting("pool", "Draw every model call's worst case from this budget pool of the run's store.", "own"),
    Setting(
        "plugins",
        "Load host tools and hooks (its TOOLS and HOOKS maps). Repeatable.",
        "own",
        names_file=True,
        many=True,
        metavar="MODULE|FILE.py",
    ),
    Setting(
        "mcp",
        "Use the tools of an MCP server: NAME=COMMAND (stdio) or NAME=URL (HTTP). Repeatable.",
        "own",
        many=True,
        metavar="NAME=COMMAND",
    ),
)
CHOSEN = tuple(setting for setting in SETTINGS if setting.help is not None)  # what a caller may choose
BY_NAME = {setting.name: setting for setting in SETTINGS}
ANSWERS = tuple(setting.name for setting in SETTINGS if setting.resumed == "answers")


# From a checkpoint not signed with your key, a run setting the resume leaves out is:
# "file": the file's, which can only make the run stricter (a lower budget, `halt`);
# "on": on, whatever the file says (human gates); "capped": at most the default (calls in flight).
Untrusted = Literal["file", "on", "capped"]


class RunSetting(NamedTuple):
    """One run setting: how a run may go, whoever answers it. Each is a field of `runs.RunRequest`,
    of the CLI's `RunFlags` and the API's keywords, and of the envelope (a `budget` in its `budgets`),
    as tests/host/test_settings.py holds them to this declaration."""

    name: str
    untrusted: Untrusted
    budget: bool = False  # one of the run's budgets: a continued run's value is a new total


RUN_SETTINGS: tuple[RunSetting, ...] = (
    RunSetting("max_tokens", "file", budget=True),
    RunSetting("max_cost", "file", budget=True),
    RunSetting("max_time", "file", budget=True),
    RunSetting("hitl", "on"),
    RunSetting("concurrency", "capped"),
    RunSetting("untrusted_flow", "file"),
)
RUN_NAMES = tuple(setting.name for setting in RUN_SETTINGS)
BUDGETS = tuple(setting.name for setting in RUN_SETTINGS if setting.budget)


def given(**values: Any) -> dict[str, Any]:
    """Every setting a caller chooses, by name, as `values` give it (None: not given): paths as
    text and lists as lists, so the settings travel as JSON (to a worker, into a checkpoint)."""
    unknown = sorted(set(values) - {setting.name for setting in CHOSEN})
    if unknown:
        raise TypeError(f"not a host setting: {unknown[0]}")
    return {setting.name: _plain(setting, values.get(setting.name)) for setting in CHOSEN}


def _plain(setting: Setting, value: Any) -> Any:
    if value is None:
        return None
    if setting.many:
        return [os.fspath(entry) for entry in value]
    return os.fspath(value) if setting.names_file else value


def files_renamed(settings: Mapping[str, Any], rename: Callable[[str], str]) -> dict[str, Any]:
    """The settings of `settings` that name files, each file renamed by `rename` (a plugin is a
    module, or a file when it ends in `.py`); settings not given stay as they are."""
    renamed: dict[str, Any] = {}
    for setting in SETTINGS:
        if setting.names_file and setting.name in settings:
            value = settings[setting.name]
            if setting.many:
                renamed[setting.name] = [rename(entry) if entry.endswith(".py") else entry for entry in value or []]
            else:
                renamed[setting.name] = rename(value) if value else value
    return renamed
