"""Scenario scripts: named runs with a scripted model, tools and hooks, and expectations.

The format is the one `mklang test` reads (README, "Scenario scripts"). The
same scripted host serves `mklang run --script FILE --scenario NAME`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mklang.errors import UsageError
from mklang.limits import load_yaml, read_text
from mklang.providers.scripted import ScriptedCallables, ScriptedProvider

SCENARIO_KEYS = {"name", "input", "llm", "hooks", "tools", "run", "expect"}
RUN_KEYS = {"max_tokens", "max_cost", "checkpoint", "hitl", "concurrency", "budget"}
EXPECT_KEYS = {"status", "error", "error_prefix", "result", "at", "ask", "reply_to", "trace", "context", "usage"}


@dataclass
class Scenario:
    name: str
    input: dict[str, Any] = field(default_factory=dict)
    llm: dict[str, Any] = field(default_factory=dict)
    hooks: dict[str, Any] = field(default_factory=dict)
    tools: dict[str, Any] = field(default_factory=dict)
    run: dict[str, Any] = field(default_factory=dict)
    expect: dict[str, Any] = field(default_factory=dict)


class ScriptedHost:
    """The scripted provider, tools and hooks of one scenario, with a saveable position."""

    def __init__(self, scenario: Scenario):
        self.provider = ScriptedProvider(scenario.llm)
        self.tools = ScriptedCallables("tool", scenario.tools)
        self.hooks = ScriptedCallables("hook", scenario.hooks)

    def position(self) -> dict[str, Any]:
        return {"llm": self.provider.position(), "tools": self.tools.position(), "hooks": self.hooks.position()}

    def restore(self, position: dict[str, Any]) -> None:
        self.provider.restore(position.get("llm", {}))
        self.tools.restore(position.get("tools", {}))
        self.hooks.restore(position.get("hooks", {}))

    def skip(self, kind: str, name: str | None = None) -> None:
        """Consume the answer of a call that a crash journal replays instead."""
        if kind == "tool":
            if name in self.tools.sources:
                self.tools.skip(name)
        else:
            self.provider.skip(kind)


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise UsageError(f"{where}: expected a map, got {type(value).__name__}")
    return value


def load_script(path: str | Path) -> list[Scenario]:
    """Read and validate a scenario script; every problem is one UsageError line."""
    import yaml

    path = Path(path)
    text = read_text(path, "script")
    try:
        data = load_yaml(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise UsageError(f"{where}: the script is not valid YAML: {getattr(error, 'problem', error)}") from None
    if not isinstance(data, dict) or not isinstance(data.get("scenarios"), list) or not data["scenarios"]:
        raise UsageError(f"{path}: expected a top-level 'scenarios:' list")
    scenarios = []
    for number, raw in enumerate(data["scenarios"], 1):
        where = f"{path}: scenario {number}"
        raw = _mapping(raw, where)
        unknown = set(raw) - SCENARIO_KEYS
        if unknown:
            raise UsageError(f"{where}: unknown keys {sorted(unknown)}")
        if not isinstance(raw.get("name"), str):
            raise UsageError(f"{where}: every scenario needs a 'name'")
        scenario = Scenario(
            name=raw["name"],
            **{
                key: _mapping(raw.get(key), f"{where} ({raw['name']}): {key}")
                for key in ("input", "llm", "hooks", "tools", "run", "expect")
            },
        )
        for key, allowed in (("run", RUN_KEYS), ("expect", EXPECT_KEYS)):
            unknown = set(getattr(scenario, key)) - allowed
            if unknown:
                raise UsageError(f"{where} ({scenario.name}): unknown '{key}' keys {sorted(unknown)}")
        scenarios.append(scenario)
    names = [s.name for s in scenarios]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise UsageError(f"{path}: duplicate scenario names {duplicates}")
    return scenarios


def find_scenario(scenarios: list[Scenario], name: str | None, path: str) -> Scenario:
    if name is None:
        if len(scenarios) == 1:
            return scenarios[0]
        raise UsageError(
            f"{path} holds {len(scenarios)} scenarios: pick one with --scenario "
            f"({', '.join(s.name for s in scenarios)})"
        )
    for scenario in scenarios:
        if scenario.name == name:
            return scenario
    raise UsageError(f"{path}: no scenario named '{name}' ({', '.join(s.name for s in scenarios)})")


def run_scenario(machine, scenario: Scenario, **options):
    """Run one scenario in process; `options` override its `run:` settings."""
    from mklang.engine import run

    host = ScriptedHost(scenario)
    settings = scenario.run
    if settings.get("budget") is not None:
        machine = machine.replace(budget=int(settings["budget"]))
    kwargs = dict(
        provider=host.provider,
        tools=host.tools.functions(),
        hooks=host.hooks.functions(),
        max_tokens=settings.get("max_tokens"),
        max_cost=settings.get("max_cost"),
        # Scripted list answers are served in call order, so branches run one
        # at a time unless the scenario asks for concurrency.
        concurrency=settings.get("concurrency", 1),
        suspendable=bool(settings.get("checkpoint", False)),
        hitl=bool(settings.get("hitl", False)),
    )
    kwargs.update(options)
    return run(machine, dict(scenario.input), **kwargs)


_STATUS_ALIASES = {"halt": "halted", "halted": "halted", "done": "done", "suspended": "suspended"}


def compare(expect: dict[str, Any], result) -> list[str]:
    """Differences between a scenario's expectations and a result, one readable line each.

    A missing key and null compare equal; trace and context compare only the
    keys the expectation lists.
    """
    problems: list[str] = []
    actual = result.to_json()

    def differ(label: str, want: Any, got: Any) -> None:
        if want != got:
            problems.append(f"{label}: expected {_show(want)}, got {_show(got)}")

    if "status" in expect:
        differ("status", _STATUS_ALIASES.get(expect["status"], expect["status"]), result.status)
    for key in ("error", "at", "result", "ask", "reply_to"):
        if key in expect:
            differ(key, expect[key], actual.get(key))
    if "error_prefix" in expect and not str(result.error or "").startswith(expect["error_prefix"]):
        problems.append(f"error: expected to start with {_show(expect['error_prefix'])}, got {_show(result.error)}")
    if "usage" in expect:
        for key, want in expect["usage"].items():
            differ(f"usage.{key}", want, actual["usage"].get(key))
    if "context" in expect:
        for key, want in _mapping(expect["context"], "expect.context").items():
            differ(f"context.{key}", want, result.context.get(key))
    if "trace" in expect:
        want_trace = expect["trace"] or []
        if len(want_trace) != len(result.trace):
            problems.append(
                f"trace: expected {len(want_trace)} steps, got {len(result.trace)}: "
                + " -> ".join(f"{s['state']}({s['policy']})" for s in result.trace)
            )
        for number, (want, got) in enumerate(zip(want_trace, result.trace, strict=False), 1):
            for key, value in _mapping(want, f"expect.trace[{number}]").items():
                differ(f"trace[{number}].{key}", value, got.get(key))
    return problems


def _show(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 200 else text[:197] + "..."
