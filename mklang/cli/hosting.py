"""The host options of `run`, `resume`, `batch` and `worker`, declared once.

Typer reads a command's options from its signature, so options shared by
several commands would be spelled out in each. `hosted(...)` adds the named
host options (provider, scripted answers, cassettes, plugins) to a command's
signature in place of its `hosting` parameter, and hands the command one
`Hosting` value instead.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import typer

Command = TypeVar("Command", bound=Callable[..., None])

HOST_OPTIONS: dict[str, tuple[Any, Any]] = {  # name -> (type, typer declaration)
    "provider": (
        str | None,
        typer.Option(None, "--provider", help="openai, anthropic or ollama (else from the config)."),
    ),
    "model": (str | None, typer.Option(None, "--model", help="Model used for every tier.")),
    "config": (Path | None, typer.Option(None, "--config", help="Host config TOML (tiers, providers, prices).")),
    "script": (
        Path | None,
        typer.Option(None, "--script", help="Scenario script: answer from a scripted model, offline."),
    ),
    "scenario": (str | None, typer.Option(None, "--scenario", help="Scenario of --script to use.")),
    "replay": (Path | None, typer.Option(None, "--replay", help="Answer from a recorded cassette, offline.")),
    "record": (Path | None, typer.Option(None, "--record", help="Record every provider exchange into a cassette.")),
    "plugin": (
        list[str] | None,
        typer.Option(
            None,
            "--plugin",
            metavar="MODULE|FILE.py",
            help="Load host tools and hooks (its TOOLS and HOOKS maps). Repeatable.",
        ),
    ),
}


@dataclass(frozen=True)
class Hosting:
    """How the command line asks a run to be hosted (None: not given)."""

    provider: str | None = None
    model: str | None = None
    config: Path | None = None
    script: Path | None = None
    scenario: str | None = None
    replay: Path | None = None
    record: Path | None = None
    plugin: list[str] | None = None

    def settings(self) -> dict[str, Any]:
        """The keyword arguments of `Host.build` but `record` (paths as text, so they travel as JSON)."""
        return dict(
            script=str(self.script) if self.script else None,
            scenario=self.scenario,
            provider=self.provider,
            model=self.model,
            config=str(self.config) if self.config else None,
            replay=str(self.replay) if self.replay else None,
            plugins=self.plugin,
        )


def hosted(*names: str) -> Callable[[Command], Command]:
    """Give a command the host options `names`, passed to it as `hosting: Hosting`."""

    def decorate(command: Command) -> Command:
        hints = typing.get_type_hints(command)
        added = [
            inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=declared, annotation=kind)
            for name, (kind, declared) in ((name, HOST_OPTIONS[name]) for name in names)
        ]
        parameters: list[inspect.Parameter] = []
        for parameter in inspect.signature(command).parameters.values():
            if parameter.name == "hosting":
                parameters += added
            else:
                parameters.append(parameter.replace(annotation=hints[parameter.name]))

        @functools.wraps(command)
        def with_hosting(**values: Any) -> None:
            chosen = {name: values.pop(name) for name in names}
            command(**values, hosting=Hosting(**chosen))

        with_hosting.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        with_hosting.__annotations__ = {parameter.name: parameter.annotation for parameter in parameters}
        return typing.cast(Command, with_hosting)

    return decorate
