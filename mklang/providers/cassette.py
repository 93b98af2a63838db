"""Record and replay provider exchanges as a readable YAML cassette.

A cassette is a list of exchanges. Each holds the request as readable
fields (kind, tier, and either system/user/reason or
conditions/output/reasoning/context), its fingerprint (sha256 of the
canonical JSON of those fields; the random nonces of data fences are
written as `NONCE`, so they do not break matching), and the response (text, reasoning, usage, or the verdict). Nothing
else is written: no URL, header or key.

Replay answers each request from the exchanges with the same fingerprint,
in recorded order (the last one repeats once they run out). Fingerprints
are recomputed from the readable fields on load, so a hand-edited request
matches what it now says. A request it
does not hold raises `ProviderError` naming the closest recorded request
and a short diff.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml

from mklang.errors import ProviderError, UsageError
from mklang.files import write_atomic
from mklang.limits import read_text
from mklang.providers.base import Produced, Provider, Usage, Verdict, decode_answer, encode_answer
from mklang.yaml_composer import error_line, load_yaml

FORMAT = 1
DIFF_LINES = 12


_NONCE = re.compile(r"(</?data-)[0-9a-f]+>")


def _without_nonces(text: str) -> str:
    """Data fences carry a fresh random nonce per call; a cassette stores them as `NONCE`."""
    return _NONCE.sub(r"\1NONCE>", text)


def produce_request(system: str, user: str, tier: str, reason: bool) -> dict[str, Any]:
    return {
        "kind": "produce",
        "tier": tier,
        "system": _without_nonces(system),
        "user": _without_nonces(user),
        "reason": reason,
    }


def judge_request(
    conditions: list[str], output: Any, reasoning: str | None, context: dict[str, Any], tier: str
) -> dict[str, Any]:
    return {
        "kind": "judge",
        "tier": tier,
        "conditions": list(conditions),
        "output": _plain(output),
        "reasoning": reasoning,
        "context": _plain(context),
    }


def fingerprint(request: dict[str, Any]) -> str:
    return hashlib.sha256(_canonical(request).encode("utf-8")).hexdigest()


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)


def _plain(value: Any) -> Any:
    """The JSON-shaped copy of a value, so YAML can store it and fingerprints stay stable."""
    return json.loads(_canonical(value))


class RecordingProvider:
    """Wraps a real provider and writes each completed exchange to the cassette at once."""

    def __init__(self, inner: Provider, path: str | os.PathLike[str]):
        self._inner = inner
        self._path = Path(path)
        self._exchanges: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self.flush()

    def produce(self, system: str, user: str, tier: str, reason: bool) -> Produced:
        produced = self._inner.produce(system, user, tier, reason)
        self._add(produce_request(system, user, tier, reason), encode_answer("produce", produced))
        return produced

    def judge(
        self, conditions: list[str], output: Any, reasoning: str | None, context: dict[str, Any], tier: str
    ) -> Verdict:
        verdict = self._inner.judge(conditions, output, reasoning, context, tier)
        self._add(judge_request(conditions, output, reasoning, context, tier), encode_answer("judge", verdict))
        return verdict

    def close(self) -> None:
        self.flush()
        close = getattr(self._inner, "close", None)
        if close:
            close()

    def _add(self, request: dict[str, Any], response: dict[str, Any]) -> None:
        with self._lock:
            self._exchanges.append({"fingerprint": fingerprint(request), "request": request, "response": response})
            self._write()

    def flush(self) -> None:
        with self._lock:
            self._write()

    def _write(self) -> None:
        """Replace the file atomically, so a crash leaves the previous complete cassette."""
        text = dump({"mklang_cassette": FORMAT, "exchanges": self._exchanges})
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self._path, text.encode("utf-8"))
        except OSError as error:
            raise UsageError(f"cannot write cassette {self._path}: {error.strerror}") from None


class ReplayProvider:
    """Answers from a cassette with no network; thread-safe."""

    def __init__(self, path: str | os.PathLike[str]):
        self._path = Path(path)
        self._exchanges = load(self._path)
        self._queues: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for exchange in self._exchanges:
            self._queues[fingerprint(exchange["request"])].append(exchange["response"])
        self._used: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    def produce(self, system: str, user: str, tier: str, reason: bool) -> Produced:
        return decode_answer("produce", self._answer(produce_request(system, user, tier, reason)))

    def judge(
        self, conditions: list[str], output: Any, reasoning: str | None, context: dict[str, Any], tier: str
    ) -> Verdict:
        return decode_answer("judge", self._answer(judge_request(conditions, output, reasoning, context, tier)))

    def close(self) -> None:
        """Nothing to release; present so hosts can close any provider alike."""

    def _answer(self, request: dict[str, Any]) -> dict[str, Any]:
        key = fingerprint(request)
        with self._lock:
            queue = self._queues.get(key)
            if not queue:
                raise ProviderError(self._miss(request))
            index = min(self._used[key], len(queue) - 1)
            self._used[key] += 1
            return queue[index]

    def _miss(self, request: dict[str, Any]) -> str:
        head = (
            f"replay: cassette {self._path.name} holds no {request['kind']} request like this one "
            f"(tier {request['tier']})"
        )
        wanted = _lines(request)
        candidates = [e for e in self._exchanges if e["request"].get("kind") == request["kind"]] or self._exchanges
        if not candidates:
            return f"{head}; the cassette is empty"
        scored = [
            (difflib.SequenceMatcher(None, _lines(e["request"]), wanted).ratio(), i, e)
            for i, e in enumerate(candidates)
        ]
        _, _, closest = max(scored, key=lambda item: (item[0], -item[1]))
        number = self._exchanges.index(closest) + 1
        diff = [
            line.rstrip("\n")
            for line in difflib.unified_diff(
                _lines(closest["request"]), wanted, "recorded", "requested", n=1, lineterm=""
            )
        ]
        shown = diff[2:][:DIFF_LINES]
        more = ["  ..."] if len(diff) - 2 > DIFF_LINES else []
        return "\n".join([f"{head}; closest is exchange {number}:", *shown, *more])


def _lines(request: dict[str, Any]) -> list[str]:
    """The request as short readable lines, for matching and diffs."""
    return dump(request).splitlines()


def load(path: Path) -> list[dict[str, Any]]:
    """The exchanges of a cassette file, each checked as replay reads it; `UsageError` when it cannot be used."""
    if not path.is_file():
        raise UsageError(f"cassette not found: {path}")
    try:
        data = load_yaml(read_text(path, "cassette"))
    except yaml.YAMLError as error:
        raise UsageError(error_line(path, "the cassette", error)) from None
    if (
        not isinstance(data, dict)
        or data.get("mklang_cassette") != FORMAT
        or not isinstance(data.get("exchanges"), list)
    ):
        raise UsageError(f"{path}: not an mklang cassette (expected 'mklang_cassette: {FORMAT}' and 'exchanges')")
    for number, exchange in enumerate(data["exchanges"], 1):
        problem = _exchange_problem(exchange)
        if problem is not None:
            raise UsageError(f"{path}: exchange {number}: {problem}")
    exchanges: list[dict[str, Any]] = data["exchanges"]
    return exchanges


def _text(value: Any) -> bool:
    return isinstance(value, str)


def _maybe_text(value: Any) -> bool:
    return value is None or isinstance(value, str)


def _texts(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def _choice(value: Any) -> bool:
    return value in ("none", "unparseable") or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)


def _any(value: Any) -> bool:
    return True


# What each kind of request holds, and what its response holds, as `produce_request`, `judge_request`
# and `encode_answer` write them: field -> (check, what it must be). `usage` is checked by `Usage.from_json`.
REQUESTS: dict[str, dict[str, tuple[Any, str]]] = {
    "produce": {
        "tier": (_text, "a string"),
        "system": (_text, "a string"),
        "user": (_text, "a string"),
        "reason": (lambda value: isinstance(value, bool), "true or false"),
    },
    "judge": {
        "tier": (_text, "a string"),
        "conditions": (_texts, "a list of strings"),
        "output": (_any, "any value"),
        "reasoning": (_maybe_text, "a string or null"),
        "context": (lambda value: isinstance(value, dict), "a mapping"),
    },
}
RESPONSES: dict[str, dict[str, tuple[Any, str]]] = {
    "produce": {"text": (_text, "a string"), "reasoning": (_maybe_text, "a string or null")},
    "judge": {
        "choice": (_choice, "a branch index from 0, none or unparseable"),
        "parsed_by": (_maybe_text, "a string or null"),
    },
}
OPTIONAL = {"reasoning", "parsed_by", "usage"}  # a response field left out reads as null (no usage: none spent)


def _exchange_problem(exchange: Any) -> str | None:
    """What makes a cassette exchange unusable for replay, or None: it needs the fields of its
    kind, of their types, and a request whose fingerprint can be computed."""
    if not isinstance(exchange, dict):
        return "expected a mapping with a request and a response"
    request, response = exchange.get("request"), exchange.get("response")
    if not isinstance(request, dict) or not isinstance(response, dict):
        return "needs a request and a response, each a mapping"
    kind = request.get("kind")
    if kind not in REQUESTS:
        return f"request kind is {kind!r}, not produce or judge"
    problem = _fields_problem("request", {k: v for k, v in request.items() if k != "kind"}, REQUESTS[kind], set())
    problem = problem or _fields_problem("response", response, {**RESPONSES[kind], "usage": (_any, "")}, OPTIONAL)
    if problem is not None:
        return problem
    usage = response.get("usage")
    if usage is not None and not isinstance(usage, dict):
        return f"response usage is {usage!r:.40}, not a mapping"
    try:
        Usage.from_json(usage)
    except ValueError as error:
        return f"response {error}"
    try:
        fingerprint(request)
    except (TypeError, ValueError) as error:  # keys JSON cannot order, say
        return f"request cannot be fingerprinted: {error}"
    return None


def _fields_problem(
    what: str, fields: dict[Any, Any], declared: dict[str, tuple[Any, str]], optional: set[str]
) -> str | None:
    """The first field of `fields` that is unknown, missing or of the wrong type, as `declared` says."""
    for name in fields:
        if name not in declared:
            return f"{what} has an unknown field {name!r} (expected {', '.join(declared)})"
    for name, (check, shape) in declared.items():
        if name not in fields:
            if name not in optional:
                return f"{what} lacks its {name!r}"
        elif not check(fields[name]):
            return f"{what} {name} is {fields[name]!r:.40}, not {shape}"
    return None


class _Dumper(yaml.SafeDumper):  # type: ignore[misc]  # PyYAML ships no types
    """Multi-line strings as `|` blocks, so prompts read as they were sent."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump(data: dict[str, Any]) -> str:
    text: str = yaml.dump(data, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=100)
    return text
