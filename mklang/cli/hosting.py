"""The host options of `run`, `resume`, `batch`, `worker` and `serve`, made from `host.settings`.

`hosted(...)` adds the host options (provider, scripted answers, cassettes,
plugins), one per setting a caller chooses, to a command's signature in
place of its `hosting` parameter (`groups.grouped`), and hands the command
one `Hosting` value instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import typer

from mklang.cli.groups import Command, grouped, option
from mklang.host.settings import CHOSEN, given


@dataclass(frozen=True)
class Hosting:
    """How the command line asks a run to be hosted: `host.settings.given` of its host options."""

    settings: dict[str, Any] = field(default_factory=given)


# One option per setting a caller chooses, made once: every hosted command shares them.
OPTIONS = {
    setting.name: option(
        setting.name,
        (list[str] if setting.many else Path if setting.names_file else str) | None,
        typer.Option(None, setting.option, metavar=setting.metavar, help=setting.help),
    )
    for setting in CHOSEN
}


def hosted(*left_out: str) -> Callable[[Command], Command]:
    """Give a command the host options but those of the settings `left_out`, passed to it as `hosting: Hosting`."""
    options = [declared for name, declared in OPTIONS.items() if name not in left_out]
    return grouped("hosting", options, lambda **chosen: Hosting(given(**chosen)))
