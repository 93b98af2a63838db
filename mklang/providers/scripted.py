"""The scripted provider of SPEC section 5: canned answers for tests and demos.

Every scripted source (produce, judge, each hook, each tool) is an `Answers`:
a list consumed in call order whose last entry repeats, or a map whose first
key found in the request text wins. Its position can be saved and restored,
so a suspended scripted run resumes answering exactly as the uninterrupted
run would (`position()` / `restore()`), and `skip()` lets a crash-resume
consume an answer it replays from the journal.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from mklang.errors import ProviderError, UsageError
from mklang.providers.base import BRANCH, NONE, UNPARSEABLE, Produced, Usage, Verdict

# What the scripted model reasons when a `reason` state asks and the answer
# names no reasoning: the scripted model of mklang 1.x said this, and its
# scenario scripts expect it in the trace (ADR 0020).
SCRIPTED_REASONING = "thought"


class Answers:
    """One scripted source: a list (in order, last repeats) or a substring map.

    Branches of a fan-out run concurrently, so they reach a list in no fixed
    order; they are answered by branch index instead: branch i of a fan-out
    that starts at position p takes p + i (and p + i + k*count for its k-th
    further call), exactly what one-at-a-time branches with one call each take.
    The position moves past the answers taken only, so a fan-out cut by a
    budget and resumed gives its remaining branches the answers that follow.
    """

    def __init__(self, what: str, spec: Any):
        if isinstance(spec, (str, int, bool)) or spec is None:
            spec = [spec]
        if not isinstance(spec, (list, dict)):
            raise UsageError(f"scripted {what}: expected a list or a map")
        self.what = what
        self.spec = spec
        self.position = 0
        self._fan_out_starts: dict[int, int] = {}  # fan-out id -> its position when it started
        self._branch_calls: dict[tuple[int, int], int] = {}  # (fan-out id, branch) -> calls so far

    def next(self, request: str) -> Any:
        """The answer for this call; `request` is searched by map keys."""
        if isinstance(self.spec, dict):
            for key, answer in self.spec.items():
                if str(key) in request:
                    return answer
            # Fence nonces are random: keep them out of the message so runs stay reproducible.
            shown = re.sub(r"<(/?)data-[0-9a-f]+>", r"<\1data-NONCE>", request)[:80]
            raise ProviderError(f"scripted {self.what}: no scripted answer matches the request {shown!r}")
        if not self.spec:
            raise ProviderError(f"scripted {self.what}: the script lists no answers")
        return self.spec[min(self._take(), len(self.spec) - 1)]

    def skip(self) -> None:
        self._take()

    def _take(self) -> int:
        """The list position of this call; callers hold the source's lock."""
        branch = BRANCH.get()
        if branch is None:
            self.position += 1
            return self.position - 1
        start = self._fan_out_starts.setdefault(branch.fan_out, self.position)
        calls = self._branch_calls.get((branch.fan_out, branch.index), 0)
        self._branch_calls[(branch.fan_out, branch.index)] = calls + 1
        index = start + branch.index + calls * branch.count
        self.position = max(self.position, index + 1)
        return index


def _as_text(answer: Any) -> str:
    """Scripts may give structured answers (for `parse json`/`list`); send them as JSON."""
    return answer if isinstance(answer, str) else json.dumps(answer)


class ScriptedProvider:
    """A Provider whose answers come from a scenario's `llm` section."""

    def __init__(self, llm: dict[str, Any] | None = None):
        llm = dict(llm or {})
        self._lock = threading.Lock()
        self.produce_answers = Answers("produce", llm.pop("produce", [""]))
        self.judge_answers = Answers("judge", llm.pop("judge", [0]))
        tokens = llm.pop("tokens", [0, 0])
        if not (isinstance(tokens, list) and len(tokens) == 2 and all(isinstance(t, int) for t in tokens)):
            raise UsageError("scripted llm.tokens: expected [input, output] integers")
        self.tokens = Usage(tokens[0], tokens[1])
        self.delay = float(llm.pop("delay_ms", 0)) / 1000.0
        if llm:
            raise UsageError(f"scripted llm: unknown keys {sorted(llm)}")
        self.calls = {"produce": 0, "judge": 0}

    def produce(self, system: str, user: str, tier: str, reason: bool) -> Produced:
        with self._lock:
            answer = self.produce_answers.next(user)
            self.calls["produce"] += 1
        if self.delay:
            time.sleep(self.delay)
        reasoning = SCRIPTED_REASONING
        if isinstance(answer, dict) and "text" in answer:
            reasoning = answer.get("reasoning", SCRIPTED_REASONING)
            answer = answer["text"]
        return Produced(_as_text(answer), reasoning if reason else None, self.tokens)

    def judge(
        self, conditions: list[str], output: Any, reasoning: str | None, context: dict[str, Any], tier: str
    ) -> Verdict:
        with self._lock:
            answer = self.judge_answers.next("\n".join(conditions))
            self.calls["judge"] += 1
        if self.delay:
            time.sleep(self.delay)
        if answer in (NONE, UNPARSEABLE):
            return Verdict(answer, Usage())
        if isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer < len(conditions):
            return Verdict(answer, Usage())
        # Out of range answers are never clamped (SPEC section 4).
        return Verdict(UNPARSEABLE, Usage())

    def skip(self, kind: str) -> None:
        """Consume one answer without answering (its reply comes from a journal)."""
        with self._lock:
            (self.produce_answers if kind == "produce" else self.judge_answers).skip()

    def position(self) -> dict[str, int]:
        return {"produce": self.produce_answers.position, "judge": self.judge_answers.position}

    def restore(self, position: dict[str, int]) -> None:
        self.produce_answers.position = int(position.get("produce", 0))
        self.judge_answers.position = int(position.get("judge", 0))


class ScriptedCallables:
    """Scripted hooks (`{name: [bool, ...]}`) or tools (`{name: [str, ...] | {substring: str}}`)."""

    def __init__(self, kind: str, spec: dict[str, Any] | None):
        if spec is not None and not isinstance(spec, dict):
            raise UsageError(f"scripted {kind}s: expected a map of name to answers")
        self.kind = kind
        self._lock = threading.Lock()
        self.sources = {name: Answers(f"{kind} {name}", answers) for name, answers in (spec or {}).items()}

    def functions(self) -> dict[str, Callable[..., Any]]:
        """Host callables answering from the script: tools take the input map,
        hooks take (context, output); map keys are searched in their JSON."""
        return {name: self._function(name) for name in self.sources}

    def _function(self, name: str) -> Callable[..., Any]:
        source = self.sources[name]

        def answer(*args: Any) -> Any:
            request = json.dumps(args[-1] if self.kind == "hook" else args[0], ensure_ascii=False, default=str)
            with self._lock:
                return source.next(request)

        return answer

    def skip(self, name: str) -> None:
        with self._lock:
            self.sources[name].skip()

    def position(self) -> dict[str, int]:
        return {name: source.position for name, source in self.sources.items()}

    def restore(self, position: dict[str, int]) -> None:
        for name, value in position.items():
            if name in self.sources:
                self.sources[name].position = int(value)
