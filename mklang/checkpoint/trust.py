"""What a checkpoint may decide about the host that resumes it (ADR 0014).

A checkpoint signed with the resuming user's key may fill in the host
settings the command line leaves out, as the run was hosted. From any other
checkpoint, code (plugins), endpoints, config files, cassettes and scenario
scripts come only from the resuming invocation; the recorded ones are
reported as ignored.
"""

from __future__ import annotations

from typing import Any

from mklang.checkpoint.envelope import HostSettings

# Answering a run: given together on the command line, or all taken from the file.
ANSWER_SETTINGS = ("script", "provider", "model", "config", "replay")


def recorded_host(settings: HostSettings) -> dict[str, Any]:
    """The host settings a checkpoint records (not the scripted position), as `show` prints them."""
    recorded = settings.model_dump(exclude={"position"})
    return {name: value for name, value in recorded.items() if value not in (None, [], {})}


def host_choice(recorded: HostSettings, given: dict[str, Any], trusted: bool) -> tuple[dict[str, Any], list[str]]:
    """The host settings a resume uses, and the names of the recorded ones it ignores.

    `given` holds the command line's script, scenario, provider, model,
    config, replay and plugins (None when not given). With no way of
    answering given, a trusted checkpoint answers as the run did (never
    re-recording), and its plugins load unless `--plugin` is given.
    """
    reused = dict(given)
    if not any(given[name] is not None for name in ANSWER_SETTINGS):
        reused.update({name: getattr(recorded, name) for name in ANSWER_SETTINGS})
        reused["scenario"] = given["scenario"] or recorded.scenario
    if given["plugins"] is None:
        reused["plugins"] = recorded.plugins
    if trusted:
        return reused, []
    ignored = [name for name, value in reused.items() if value not in (None, []) and value != given[name]]
    return dict(given), ignored
