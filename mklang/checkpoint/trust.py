"""What a checkpoint may decide about the host that resumes it (ADR 0014).

A checkpoint signed with the resuming user's key may fill in the host
settings the command line leaves out, as the run was hosted. From any other
checkpoint, code (plugins), endpoints, config files, cassettes and scenario
scripts come only from the resuming invocation, and so do the run settings
(budgets, hitl, concurrency): where the command line says nothing, the
stricter of the file's value and the default holds. What the file recorded
and the resume does not use is reported as ignored.
"""

from __future__ import annotations

from typing import Any

from mklang.checkpoint.envelope import HostSettings
from mklang.host.settings import ANSWERS, BY_NAME, RUN_NAMES, RUN_SETTINGS
from mklang.vocabulary import DEFAULT_RUN_CONCURRENCY


def recorded_host(settings: HostSettings) -> dict[str, Any]:
    """The host settings a checkpoint records (not the host's state), as `show` prints them."""
    recorded = settings.model_dump(exclude={"state"})
    return {name: value for name, value in recorded.items() if value not in (None, [], {})}


def host_choice(recorded: HostSettings, given: dict[str, Any], trusted: bool) -> tuple[dict[str, Any], list[str]]:
    """The host settings a resume uses, and the names of the recorded ones it ignores.

    `given` holds the settings the caller chooses (`host.settings.given`,
    None when not given). With no way of answering given, a trusted
    checkpoint answers as the run did (never re-recording), and its plugins
    load unless `--plugin` is given: each setting's `resumed` says which.
    """
    answered = any(given.get(name) is not None for name in ANSWERS)
    reused = dict(given)
    for name, value in given.items():
        resumed = BY_NAME[name].resumed
        if value is None and (resumed == "own" or (resumed in ("answers", "with-answers") and not answered)):
            reused[name] = getattr(recorded, name)
    if trusted:
        return reused, []
    ignored = [name for name, value in reused.items() if value not in (None, []) and value != given[name]]
    return dict(given), ignored


def run_settings(recorded: dict[str, Any], given: dict[str, Any], trusted: bool) -> tuple[dict[str, Any], list[str]]:
    """The budgets, hitl and concurrency of a resume, and what of the file's it ignores.

    `recorded` and `given` hold `max_tokens`, `max_cost`, `max_time`, `hitl`,
    `concurrency` and `untrusted_flow` (None: not given). A trusted file fills in
    what is not given. From an untrusted one, a budget is the lower of the
    file's and none (so the file's: it can only lower it), as is the flow policy
    (`halt` is stricter than the default `report`); human gates stay on unless
    `--no-hitl`, and concurrency is at most the default.
    """
    chosen = {name: given[name] if given[name] is not None else recorded[name] for name in RUN_NAMES}
    if trusted:
        return chosen, []
    ignored = []
    for setting in RUN_SETTINGS:  # what the resume leaves out, the file decides only as `untrusted` says
        name, file = setting.name, recorded[setting.name]
        if given[name] is not None or setting.untrusted == "file":
            continue
        if setting.untrusted == "on":
            chosen[name] = True
            if not file:
                ignored.append(f"{name} false (human gates stay on; --no-{name} turns them off)")
        elif file > DEFAULT_RUN_CONCURRENCY:
            chosen[name] = DEFAULT_RUN_CONCURRENCY
            ignored.append(f"{name} {file} (at most {DEFAULT_RUN_CONCURRENCY}; --{name} N)")
    return chosen, ignored
