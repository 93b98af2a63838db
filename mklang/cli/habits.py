"""What mklang 1.x users type, met with the way it is done here.

1.x (published as `mklang` 1.4.0) had commands and flags this release names
differently or does without. `lint` runs `check` (saying so on stderr,
`mklang.cli.syntax_cmds`); the others are unknown, and their error says what to do instead, where a "did
you mean" would guess a name that merely looks alike (`--max-steps` is
`--budget` on `resume`, not `--max-tokens`; `run` has no step flag, its
budget is the machine's). A machine is also run by its name in the
standard library, as 1.x did (`mklang run chain_of_thought`).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from pathlib import Path

# The 1.x commands this release does not have, with what to do instead.
COMMANDS_1X = {
    "machines": "the standard library's machines are the .mk files of {library}; run one by its name "
    "(mklang run chain_of_thought --set question=...)",
    "console": "the console is a web console of a store's runs: mklang serve --store URI "
    "(pip install 'mklang[console]>=2', docs/console.md)",
}
# The 1.x flags this release names differently: the name here, and what to do on a command without it.
RENAMED_1X = {
    "--max-steps": (
        "--budget",
        "a run's step budget is its machine's `budget` line (mklang resume --budget gives a suspended run a new one)",
    ),
}
# The 1.x flags this release does without, with what to do instead.
FLAGS_1X = {
    "--strict": "it is the default: a machine whose version is unsupported is always refused, "
    "and mklang check exits 2 on any error",
    "--workspace": "there are no built-in file tools: tools come from --plugin and work in the current folder",
    "--allow-write": "there are no built-in file tools: tools come from --plugin and decide what they write",
    "--on-truncate": "a truncated answer is a provider error: it halts, or suspends with --checkpoint",
    "--color": "colours appear only on a terminal, and never with NO_COLOR set",
    "--log-level": "a run prints its progress on stderr; --events - prints each of its events as JSON",
    "--llm": "checking gates with a live judge is gone: scenario scripts test them (mklang test)",
    "--llm-samples": "checking gates with a live judge is gone: scenario scripts test them (mklang test)",
    "--llm-repeats": "checking gates with a live judge is gone: scenario scripts test them (mklang test)",
    "--agent": "the console is a web console of a store's runs: mklang serve --store URI",
    "--continue": "the console is a web console of a store's runs: mklang serve --store URI",
    "--session": "the console is a web console of a store's runs: mklang serve --store URI",
    "--user": "the user's config is $XDG_CONFIG_HOME/mklang/config.toml (mklang config shows where it looks)",
    "--dir": "name the folder as the argument: mklang init DIR",
}
# How alike a typo is to the 1.x flag it is taken for (difflib's ratio): `--max-step` and `--colour`
# are, at 0.95 and 0.93; `--config` is no `--continue` (0.67), `--version` no `--session` (0.78).
TYPO = 0.85
# The 1.x standard library's machines and their nearest here; their inputs differ.
LIBRARY_1X = {
    "std_cot": "chain_of_thought",
    "std_debate": "debate",
    "std_map_reduce": "map_reduce",
    "std_plan_execute": "plan_execute",
    "std_refine": "self_refine",
    "std_self_consistency": "self_consistency",
    "std_cascade": None,
    "std_compress": None,
    "std_research": None,
    "std_tot": None,
}


def command_1x(name: str) -> str | None:
    """`; in mklang 2 ...` for a 1.x command this release does not have, else None."""
    if name not in COMMANDS_1X:
        return None
    from mklang.syntax.resolve import stdlib_dirs

    library = next(iter(stdlib_dirs()), Path("machines"))
    return f"; mklang {name} is a mklang 1.x command: " + COMMANDS_1X[name].format(library=library)


def flag_1x(option: str, options: Iterable[str]) -> str | None:
    """`; ... is a mklang 1.x option: ...` for a 1.x flag this release names differently or does without,
    or for a typo closer to one than to any of the command's `options`; else None. A renamed flag is
    named only where the command has it."""
    options = list(options)
    if option not in RENAMED_1X and option not in FLAGS_1X:
        close = difflib.get_close_matches(option, [*options, *RENAMED_1X, *FLAGS_1X], n=1, cutoff=TYPO)
        if not close or close[0] in options:
            return None
        option = close[0]
    if option in RENAMED_1X:
        name, elsewhere = RENAMED_1X[option]
        instead = f'it is "{name}"' if name in options else elsewhere
    else:
        instead = FLAGS_1X[option]
    return f"; {option} is a mklang 1.x option: {instead}"


def machine_file(given: Path) -> Path:
    """The file of a machine argument: a path as given, else a machine of the standard library
    (or of a plugin) by its name, `chain_of_thought`; a 1.x library name says what is here instead."""
    if given.exists() or given.suffix or len(given.parts) != 1:
        return given
    from mklang.errors import UsageError, did_you_mean
    from mklang.syntax.resolve import find_machine, stdlib_dirs

    found = find_machine(given.name, ".")
    if found is not None:
        return found
    library = sorted(path.stem for folder in stdlib_dirs() for path in Path(folder).glob("*.mk"))
    if given.name in LIBRARY_1X:
        nearest = LIBRARY_1X[given.name]
        instead = f"its nearest here is {nearest} (read its inputs: they differ)" if nearest else "it has none here"
        raise UsageError(f"{given.name} is a machine of mklang 1.x's standard library; {instead}")
    hint = did_you_mean(given.name, library)
    raise UsageError(f"no file {given} and no machine of that name{hint} (the standard library: {', '.join(library)})")
