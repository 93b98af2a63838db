"""Scenario scripts: named runs with a scripted model, tools and hooks, and expectations.

The format is the one `mklang test` reads (README, "Scenario scripts"). The
same scripted host serves `mklang run --script FILE --scenario NAME`. Every
key of a script is validated here, once, so a typo is a usage error that
names the file, the scenario and the key instead of a test that passes
without testing anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mklang.effects import FLOW_POLICIES
from mklang.errors import UsageError, did_you_mean
from mklang.exitcodes import STATUSES
from mklang.limits import read_text
from mklang.providers.scripted import ScriptedCallables, ScriptedProvider, ScriptState

if TYPE_CHECKING:
    from mklang.engine import RunResult
    from mklang.engine.decisions import Decision

TRACE_KEYS = {
    "step",
    "state",
    "policy",
    "to",
    "gate",
    "gate_via",
    "output",
    "branches",
    "reasoning",
    "sub_trace",
    "usage",
    "judge_fallback",
    "judge_none",
    "decision_tainted",
    "untrusted_control_flow",
}
EXPECT_KEYS = {
    "status",
    "reason",
    "error",
    "error_prefix",
    "result",
    "at",
    "ask",
    "reply_to",
    "trace",
    "context",
    "usage",
}
# What mklang 1.x scripts spell differently, read as this project's (SPEC section 5):
# statuses, `run:` settings, and `context:` for `input:` (which wins on a clash).
STATUS_1X = {"halt": "halted"}
RUN_1X = {"cost_budget": "max_tokens", "max_workers": "concurrency", "suspendable": "checkpoint",
          "escalate_suspend": "hitl"}  # fmt: skip
# The keys allowed at each place of a scenario; `[]` marks the items of a list.
# A place not listed here holds free data (input, expect.context, resumes[].set).
KEYS: dict[str, set[str]] = {
    "": {"name", "input", "context", "llm", "hooks", "tools", "run", "expect", "resumes"},
    "llm": {"produce", "judge", "tokens", "delay_ms"},
    "run": {"max_tokens", "checkpoint", "hitl", "concurrency", "budget", "on_untrusted_flow", *RUN_1X},
    "expect": EXPECT_KEYS,
    "expect.usage": {"input_tokens", "output_tokens", "cost_usd"},
    "expect.trace[]": TRACE_KEYS,
    "resumes[]": {"set", "answer", "note", "max_tokens", "budget", "hitl", "expect"},
    "resumes[].expect": EXPECT_KEYS,
    "resumes[].expect.usage": {"input_tokens", "output_tokens", "cost_usd"},
    "resumes[].expect.trace[]": TRACE_KEYS,
}
MAPS = {"input", "context", "llm", "hooks", "tools", "run", "expect", "expect.context", "expect.usage", "resumes[].set"}
MAPS |= {"resumes[]", "resumes[].expect", "resumes[].expect.context", "resumes[].expect.usage", "expect.trace[]"}
MAPS |= {"resumes[].expect.trace[]"}
LISTS = {"resumes", "expect.trace", "resumes[].expect.trace"}
# Settings of `run:` and of each resume, with what they must hold.
WHOLE_NUMBERS = {"max_tokens": 0, "budget": 0, "concurrency": 1, "cost_budget": 0, "max_workers": 1}  # least values
FLAGS = {"checkpoint", "hitl", "suspendable", "escalate_suspend"}
SCENARIO_KEYS = KEYS[""]


@dataclass
class Resume:
    """One `resumes:` entry: how to continue the suspended run, and what to expect of it."""

    set: dict[str, Any] = field(default_factory=dict)
    answer: str | None = None  # the choice that answers the human decision the run waits on
    note: str | None = None  # the note that travels with it
    max_tokens: int | None = None
    budget: int | None = None
    hitl: bool | None = None
    expect: dict[str, Any] = field(default_factory=dict)

    @property
    def decision(self) -> Decision | None:
        """What `answer` (and `note`) decide, as `mklang resume --answer` does."""
        if self.answer is None:
            return None
        return {"choice": self.answer, "note": self.note, "question": None, "by": "human"}

    def continuing(self) -> dict[str, Any]:
        """How `resume` continues the suspended run with this entry: its reply or answer, and raised budgets."""
        return {
            "reply": self.set,
            "decision": self.decision,
            "max_tokens": self.max_tokens,
            "budget": self.budget,
            "hitl": self.hitl,
        }


@dataclass
class Scenario:
    name: str
    input: dict[str, Any] = field(default_factory=dict)
    llm: dict[str, Any] = field(default_factory=dict)
    hooks: dict[str, Any] = field(default_factory=dict)
    tools: dict[str, Any] = field(default_factory=dict)
    run: dict[str, Any] = field(default_factory=dict)
    expect: dict[str, Any] = field(default_factory=dict)
    resumes: list[Resume] = field(default_factory=list)
    source: str = ""  # the script file, for messages
    traps: list[str] = field(default_factory=list)  # what may not mean what it looks like (`list_traps`)

    @property
    def durable(self) -> bool:
        """Runs with a real checkpoint (in a temporary folder): it asks for one, or resumes."""
        return bool(self.run.get("checkpoint")) or bool(self.resumes)


class ScriptedHost:
    """The scripted provider, tools and hooks of one scenario, and the one state they share
    (`state`: what a checkpoint saves, so a resumed run answers on from where it was)."""

    def __init__(self, scenario: Scenario):
        self.state = ScriptState()
        self.provider = ScriptedProvider(scenario.llm, self.state)
        self.tools = ScriptedCallables("tool", scenario.tools, self.state)
        self.hooks = ScriptedCallables("hook", scenario.hooks, self.state)


def _join(place: str, key: str) -> str:
    return f"{place}.{key}" if place else key


def _kind(value: Any) -> str:
    return {dict: "a map", list: "a list", str: "text", bool: "true/false"}.get(type(value), type(value).__name__)


def _validate(value: Any, place: str, shown: str) -> None:
    """Check the keys and values at `place` (a path of KEYS) of one scenario; `shown` is the
    same path with list positions, for the message. Raises UsageError without the file prefix."""
    if value is None:
        return
    if place in LISTS:
        if not isinstance(value, list):
            raise UsageError(f"'{shown}' must be a list, got {_kind(value)}")
        for number, item in enumerate(value, 1):
            _validate(item, f"{place}[]", f"{shown}[{number}]")
        return
    if place in MAPS or place in KEYS:
        if not isinstance(value, dict):
            raise UsageError(f"'{shown or 'the scenario'}' must be a map, got {_kind(value)}")
        allowed = KEYS.get(place)
        for key, item in value.items():
            if allowed is not None and key not in allowed:
                suggestion = did_you_mean(_join(shown, str(key)), [_join(shown, k) for k in allowed])
                raise UsageError(f"unknown key '{_join(shown, str(key))}'{suggestion}")
            if allowed is not None:
                _check_setting(place, str(key), item, _join(shown, str(key)))
                _validate(item, _join(place, str(key)), _join(shown, str(key)))


def _check_setting(place: str, key: str, value: Any, shown: str) -> None:
    """The values of `status` and of the run settings, in the user's words."""
    if value is None:
        return
    if key == "status" and place.endswith("expect") and value not in STATUSES and value not in STATUS_1X:
        hint = did_you_mean(str(value), STATUSES)
        raise UsageError(f"'{shown}' is {json.dumps(value)}, not one of {' | '.join(STATUSES)}{hint}")
    if place not in ("run", "resumes[]"):
        return
    if key in WHOLE_NUMBERS:
        least = WHOLE_NUMBERS[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise UsageError(f"'{shown}' expects a whole number of at least {least}, got {json.dumps(value)}")
    elif key in FLAGS and not isinstance(value, bool):
        raise UsageError(f"'{shown}' expects true or false, got {json.dumps(value)}")
    elif key in ("answer", "note") and not isinstance(value, str):
        raise UsageError(f"'{shown}' expects text, got {json.dumps(value)}")
    elif key == "on_untrusted_flow" and value not in FLOW_POLICIES:
        raise UsageError(f"'{shown}' is {json.dumps(value)}, not one of {' | '.join(FLOW_POLICIES)}")


def load_script(path: str | Path) -> list[Scenario]:
    """Read and validate a scenario script; every problem is one UsageError line
    naming the file, the scenario and the key."""
    import yaml

    from mklang.yaml_composer import error_line, load_yaml

    path = Path(path)
    text = read_text(path, "script")
    try:
        data = load_yaml(text)
    except yaml.YAMLError as error:
        raise UsageError(error_line(path, "the script", error)) from None
    if isinstance(data, dict) and set(data) - {"scenarios"}:
        unknown = sorted(set(data) - {"scenarios"}, key=str)[0]
        raise UsageError(f"{path}: unknown top-level key '{unknown}'{did_you_mean(str(unknown), ['scenarios'])}")
    if not isinstance(data, dict) or not isinstance(data.get("scenarios"), list) or not data["scenarios"]:
        raise UsageError(f"{path}: expected a top-level 'scenarios:' list")
    scenarios = [
        _scenario(raw, f"{path}: scenario {number}", str(path)) for number, raw in enumerate(data["scenarios"], 1)
    ]
    names = [s.name for s in scenarios]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise UsageError(f"{path}: duplicate scenario names {duplicates}")
    return scenarios


def named(scenarios: list[Scenario], names: list[str] | None, script: object) -> list[Scenario]:
    """The scenarios named (all when none is), refused when a name is not one of them."""
    if not names:
        return scenarios
    missing = sorted(set(names) - {scenario.name for scenario in scenarios})
    if missing:
        raise UsageError(f"{script}: no scenarios named {missing}")
    return [scenario for scenario in scenarios if scenario.name in names]


def _scenario(raw: Any, where: str, source: str) -> Scenario:
    if not isinstance(raw, dict):
        raise UsageError(f"{where}: expected a map, got {_kind(raw)}")
    if not isinstance(raw.get("name"), str) or not raw["name"]:
        raise UsageError(f"{where}: every scenario needs a 'name'")
    where = f"{source}: scenario '{raw['name']}'"
    try:
        _validate(raw, "", "")
        scenario = Scenario(
            name=raw["name"],
            input={**(raw.get("context") or {}), **(raw.get("input") or {})},
            run=_run_settings(raw.get("run") or {}),
            **{key: raw.get(key) or {} for key in ("llm", "hooks", "tools", "expect")},
            resumes=[
                Resume(**{k: v for k, v in (item or {}).items() if v is not None}) for item in raw.get("resumes") or []
            ],
            source=source,
            traps=list_traps(raw),
        )
        ScriptedHost(scenario)  # the scripted answers themselves (llm.tokens, answer lists)
    except UsageError as error:
        raise UsageError(f"{where}: {error}") from None
    return scenario


def list_traps(raw: dict[str, Any]) -> list[str]:
    """A list under a keyed answer (`produce: {"Classify": [a, b]}`, a hook's or tool's map) is one
    structured answer, sent as the JSON array, not answers in turn: each such place, in words,
    told with a scenario that fails (it may be meant: a `parse list` state's answer is a list)."""
    keyed = [("llm.produce", (raw.get("llm") or {}).get("produce"))]
    keyed += [
        (f"{kind}.{name}", answers) for kind in ("hooks", "tools") for name, answers in (raw.get(kind) or {}).items()
    ]
    return [
        f"'{place}.{json.dumps(key)}' is a list under a key: that is one structured answer (sent as the JSON "
        f"array), not answers in turn; for answers in turn give '{place}' a list, or a key of its own to each"
        for place, answers in keyed
        if isinstance(answers, dict)
        for key, answer in answers.items()
        if isinstance(answer, list)
    ]


def judged(scenario: Scenario, expect: dict[str, Any], result: RunResult) -> list[str]:
    """What differed from `expect` (`compare`), and, when anything did, the scenario's list traps."""
    problems = compare(expect, result)
    return [*problems, *(f"note: {trap}" for trap in scenario.traps)] if problems else problems


def _run_settings(run: dict[str, Any]) -> dict[str, Any]:
    """`run:` with the 1.x names read as this project's; 1.x parks on an escalation
    without asking for a checkpoint, which parking needs here."""
    settings = {key: value for key, value in run.items() if key not in RUN_1X}
    for old, new in RUN_1X.items():
        if old in run:
            if new in run:
                raise UsageError(f"'run.{old}' is the mklang 1.x name of 'run.{new}': give one of them")
            settings[new] = run[old]
    if run.get("escalate_suspend"):
        settings.setdefault("checkpoint", True)
    return settings


def check_names(scenario: Scenario, tools: set[str], hooks: set[str]) -> None:
    """Every scripted tool and hook is one the machine (or a machine it calls) declares."""
    for kind, scripted, declared in (("tools", scenario.tools, tools), ("hooks", scenario.hooks, hooks)):
        for name in scripted:
            if name not in declared:
                raise UsageError(
                    f"{scenario.source}: scenario '{scenario.name}': '{kind}.{name}': the machine declares no "
                    f"{kind[:-1]} named '{name}'{did_you_mean(str(name), declared)}"
                )


def find_scenario(scenarios: list[Scenario], name: str | None, path: str, option: str = "--scenario") -> Scenario:
    """The scenario `name` of a script (its only one when no name is given); `option` is how the
    caller picks one (`--scenario`, or the API's `scenario=`)."""
    if name is None:
        if len(scenarios) == 1:
            return scenarios[0]
        raise UsageError(
            f"{path} holds {len(scenarios)} scenarios: pick one with {option} ({', '.join(s.name for s in scenarios)})"
        )
    for scenario in scenarios:
        if scenario.name == name:
            return scenario
    raise UsageError(
        f"{path}: no scenario named '{name}'{did_you_mean(name, [s.name for s in scenarios])} "
        f"({', '.join(s.name for s in scenarios)})"
    )


def compare(expect: dict[str, Any], result: RunResult) -> list[str]:
    """Differences between a scenario's expectations and a result, one readable line each.

    A missing `status` means `done`: a scenario that says nothing of its
    outcome passes only when the run finishes. A missing key and null compare
    equal; trace and context compare only the keys the expectation lists.
    Scripts written for mklang 1.x compare as they did there: `halt` is
    `halted`, and the `error` of a suspended run is its `reason`.
    """
    problems: list[str] = []
    actual = result.to_json()

    def differ(label: str, want: Any, got: Any) -> None:
        if want != got:
            problems.append(f"{label}: expected {_show(want)}, got {_show(got)}")

    status = expect.get("status") or "done"
    differ("status", STATUS_1X.get(status, status), result.status)
    # A suspended run has no error: mklang 1.x scripts name its reason there.
    error = result.reason if result.status == "suspended" else result.error
    if "error" in expect:
        differ("error", expect["error"], error)
    for key in ("at", "result", "ask", "reply_to", "reason"):
        if key in expect:
            differ(key, expect[key], actual.get(key))
    if "error_prefix" in expect and not str(error or "").startswith(expect["error_prefix"]):
        problems.append(f"error: expected to start with {_show(expect['error_prefix'])}, got {_show(error)}")
    for key, want in (expect.get("usage") or {}).items():
        differ(f"usage.{key}", want, actual["usage"].get(key))
    for key, want in (expect.get("context") or {}).items():
        differ(f"context.{key}", want, result.context.get(key))
    if "trace" in expect:
        want_trace = expect["trace"] or []
        if len(want_trace) != len(result.trace):
            problems.append(
                f"trace: expected {len(want_trace)} steps, got {len(result.trace)}: "
                + " -> ".join(f"{s['state']}({s['policy']})" for s in result.trace)
            )
        for number, (want, got) in enumerate(zip(want_trace, result.trace, strict=False), 1):
            for key, value in (want or {}).items():
                differ(f"trace[{number}].{key}", value, got.get(key))
    return problems


def ending(result: RunResult) -> str:
    """Why a run ended, in one line: its status, error or reason, where, and any detail."""
    text = f"the run ended {result.status}"
    if result.error:
        text += f": {result.error}"
    if result.at:
        text += f" at {result.at}"
    if result.detail:
        text += f" ({result.detail})"
    return text


def _show(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 200 else text[:197] + "..."
