"""The words of the language, and the defaults every layer shares, defined once.

The grammar (grammar/mklang.lark) is the authority on what parses; this
module lists the same words for everything else that needs them: the
checker, the interpolator, the YAML front end, the syntax-error tables, the
highlighter and the language server. A test keeps the keyword list equal to
the grammar's keyword terminals.
"""

from __future__ import annotations

import re
from typing import Any, Final, Literal, get_args

Tier = Literal["fast", "balanced", "reasoning"]
TIERS: Final[tuple[Tier, ...]] = get_args(Tier)

ParseMode = Literal["list", "json"]
PARSE_MODES: Final[tuple[ParseMode, ...]] = get_args(ParseMode)
FlowPolicy = Literal["report", "halt"]  # what a run does when a tainted decision reaches an effect
FLOW_POLICIES: Final[tuple[FlowPolicy, ...]] = get_args(FlowPolicy)

# Keywords that open a line at the top level of a `.mk` file.
HEADER_KEYWORDS: Final = (
    "mklang", "machine", "entry", "budget", "tier", "result", "context", "tool", "hook", "moved", "state",
)  # fmt: skip
# Keywords that open a line inside a state (a gate line opens with `when` or `otherwise`).
STATE_KEYWORDS: Final = (
    "prompt", "structure", "execution", "reason", "parse", "call", "tool", "tier",
    "output", "accumulate", "sample", "over", "max_visits", "when", "otherwise",
)  # fmt: skip
# Words later on a gate line: the hook of a condition, the policies and an escalation's options.
POLICY_KEYWORDS: Final = ("repair", "escalate", "fail")
GATE_KEYWORDS: Final = ("hook", *POLICY_KEYWORDS, "ask", "show", "reply_to")
# Words that open a line inside the block of a human decision (`escalate ... { choice ... }`).
DECISION_KEYWORDS: Final = ("choice", "within")
# Words later on a `tool` declaration line.
DECLARATION_KEYWORDS: Final = ("read_only",)
KEYWORDS: Final = tuple(
    dict.fromkeys((*HEADER_KEYWORDS, *STATE_KEYWORDS, *GATE_KEYWORDS, *DECISION_KEYWORDS, *DECLARATION_KEYWORDS))
)
END: Final = "END"  # the target that finishes a run
STATE_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # a state's name (the grammar's NAME, undotted)
LITERALS: Final = ("true", "false", "null")

# The language version this release implements. Earlier versions are subsets
# of it (the YAML machines of mklang 1.x declare 0.2 and 0.3) and run
# unchanged; only a newer one is refused.
LANGUAGE_VERSION: Final = "0.5"
# What a `mklang` line may say: X or X.Y, and in YAML also X.Y.Z (1.x machines say
# "0.2.0"), read as X.Y: a language version has no patch level.
VERSION_NUMBER: Final = re.compile(r"([0-9]+)(?:\.([0-9]+))?(\.[0-9]+)?\Z")

MK_SUFFIX: Final = ".mk"
YAML_SUFFIXES: Final = (".mkl", ".yaml", ".yml")
SUFFIXES: Final = (MK_SUFFIX, *YAML_SUFFIXES)

# How much runs at once when nothing says otherwise (`--concurrency`).
DEFAULT_RUN_CONCURRENCY: Final = 8  # model, tool and hook calls in flight for one whole run
DEFAULT_BATCH_CONCURRENCY: Final = 32  # runs of a local batch at once: they wait on models, not on cores
DEFAULT_WORKER_CONCURRENCY: Final = 8  # runs one fleet worker runs at once (its threads)

# What a fan-out branch may read besides the context, and what each holds.
FAN_OUT_KEYS: Final = {
    "item": "the element of the `over` list this branch handles",
    "index": "the 0-based branch number",
}

# A context path as placeholders write it: a key, then `.key` or `.index` parts
# (keys may hold `-`, as in `ticket-id`; indices may be negative, as in `.-1`).
PATH: Final = r"[A-Za-z_][\w-]*(?:\.[\w-]+)*"
# `{{ path }}`: group 1 is the path.
PLACEHOLDER: Final = re.compile(r"\{\{\s*(" + PATH + r")\s*\}\}")
# A `{{` with no `}}` before the next brace: a placeholder never closed, sent as written.
UNCLOSED_PLACEHOLDER: Final = re.compile(r"\{\{(?![^{}]*\}\})")


def version_refusal(declared: str) -> str | None:
    """Why a machine declaring `mklang <declared>` cannot run here, or None when it can."""
    number = VERSION_NUMBER.match(declared)
    if number is None:
        return f"{declared} is not a language version (like {LANGUAGE_VERSION})"
    major, minor = LANGUAGE_VERSION.split(".")
    if (int(number[1]), int(number[2] or 0)) > (int(major), int(minor)):
        return f"it runs language version {LANGUAGE_VERSION} and earlier, not the newer {declared}"
    return None


def root_key(path: str) -> str:
    """The top-level context key a path starts with: taint, deposits and checks work per key."""
    return path.partition(".")[0]


def lookup(context: dict[str, Any], path: str) -> Any:
    """Read a dotted path (`a.b.0`, `a.-1`) from the context; None when absent."""
    value: Any = context
    for part in path.split("."):
        if isinstance(value, dict):
            value = value.get(part)
        elif isinstance(value, list) and part.lstrip("-").isdigit() and -len(value) <= int(part) < len(value):
            value = value[int(part)]
        else:
            return None
    return value


# A deadline of a human decision (`within 48h`): whole seconds, minutes, hours or days.
DURATION: Final = re.compile(r"([0-9]+)([smhd])\Z")
DURATION_UNITS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def duration_seconds(text: str) -> int | None:
    """The seconds a duration like `48h` stands for; None when it is not one."""
    match = DURATION.match(text)
    return None if match is None else int(match[1]) * DURATION_UNITS[match[2]]


# A placeholder still being typed at the end of a line, for completion.
OPEN_PLACEHOLDER: Final = re.compile(r"\{\{\s*[\w.-]*\Z")
