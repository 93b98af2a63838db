"""The JSON Schema of scenario scripts, made from the tables `mklang.scenarios` validates with.

`docs/scenarios.schema.json` is `script_schema()` written out (a test keeps it
so), for editors and other tools: the keys allowed at each place, which are
lists or maps, the run settings' types and least values, the statuses. The
scripted answers themselves (`llm.produce`, `judge`, `tokens`, `hooks`,
`tools`) are checked by the scripted provider; the schema describes them.
"""

from __future__ import annotations

from typing import Any

from mklang.effects import FLOW_POLICIES
from mklang.exitcodes import STATUSES
from mklang.scenarios import FLAGS, KEYS, LISTS, MAPS, STATUS_1X, WHOLE_NUMBERS

ANSWERS = (
    "A list: answers in call order (the last one repeats). A map: the first key that is a substring of the "
    "{what} wins, and its value is ONE answer: a list there is one structured answer (sent as the JSON "
    "array), not answers in turn."
)
DESCRIPTIONS = {
    "": "One named run of the machine with a scripted model, tools and hooks, and what it must do.",
    "name": "The scenario's name, unique in the script (`mklang test --scenario NAME`).",
    "input": "The host context the run starts with (untrusted data, like --set).",
    "context": "mklang 1.x's name of `input` (`input` wins on a clash).",
    "llm.produce": "The model's answers. "
    + ANSWERS.format(what="rendered prompt")
    + " An answer is text, structured data, or {text, reasoning}.",
    "llm.judge": 'The judge\'s picks: 0-based indices into each batch of prose gates, "none" or "unparseable".',
    "llm.tokens": "[input, output] tokens charged per produce call.",
    "llm.delay_ms": "Simulated latency of every model call, in milliseconds.",
    "hooks": "Each declared hook's answers (true/false). " + ANSWERS.format(what="JSON of the hook's output"),
    "tools": "Each declared tool's answers. " + ANSWERS.format(what="JSON of the tool's input"),
    "run": "The run's settings; mklang 1.x's names are read as this release's.",
    "expect": "What the run must end with; only the keys given are compared, a missing key and null compare equal.",
    "resumes": "Continuations of a suspended run, each with the reply it injects and its own expectation.",
    "resumes[].set": "Values set on resume, like `mklang resume --set`.",
    "resumes[].answer": "The choice that answers the human decision the run waits on, like `mklang resume --answer`.",
    "resumes[].note": "A note that travels with the answer (untrusted data), like `mklang resume --note`.",
}


def script_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a scenario script."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "mklang scenario script",
        "description": "The scenarios `mklang test M --script FILE` runs (docs/scenarios.md).",
        "type": "object",
        "required": ["scenarios"],
        "additionalProperties": False,
        "properties": {"scenarios": {"type": "array", "minItems": 1, "items": _scenario()}},
    }


def _scenario() -> dict[str, Any]:
    schema = _at("", "")
    schema["type"] = "object"  # a scenario itself is never null
    schema["required"] = ["name"]
    return schema


def _at(place: str, key: str) -> dict[str, Any]:
    """The schema of the value at `place` (a path of `KEYS`), whose own key is `key`."""
    schema: dict[str, Any] = {}
    if place in DESCRIPTIONS:
        schema["description"] = DESCRIPTIONS[place]
    if place in LISTS:
        schema.update(type=["array", "null"], items=_at(f"{place}[]", ""))
    elif place in KEYS:
        keys = sorted(KEYS[place])
        properties = {name: _at(f"{place}.{name}" if place else name, name) for name in keys}
        schema.update(type=["object", "null"], additionalProperties=False, properties=properties)
    elif place in MAPS:
        schema["type"] = ["object", "null"]
    else:
        schema.update(_leaf(place, key))
    return schema


def _leaf(place: str, key: str) -> dict[str, Any]:
    """The rules `mklang.scenarios._check_setting` (and `_scenario`) apply to one value."""
    settings = place.split(".")[0] in ("run", "resumes[]") and place.count(".") == 1
    if place == "name":
        return {"type": "string", "minLength": 1}
    if key == "status" and place.endswith("expect.status"):
        return {"enum": [*STATUSES, *STATUS_1X, None]}
    if settings and key in WHOLE_NUMBERS:
        return {"type": ["integer", "null"], "minimum": WHOLE_NUMBERS[key]}
    if settings and key in FLAGS:
        return {"type": ["boolean", "null"]}
    if settings and key == "on_untrusted_flow":
        return {"enum": [*FLOW_POLICIES, None]}
    if settings and key in ("answer", "note"):
        return {"type": ["string", "null"]}
    return {}
