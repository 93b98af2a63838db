"""The scripted provider of SPEC section 5: canned answers for tests and demos.

Every scripted source (produce, judge, each hook, each tool) is an `Answers`:
a list consumed in call order whose last entry repeats, or a map whose first
key found in the request text wins. Which list entry a call gets depends on
the calls before it and on the call's idempotency key (`call_key`), never on
the engine: the sources of one scripted host keep all they remember in one
`ScriptState`, the host state a checkpoint saves
(`mklang.checkpoint.journal.HostState`), so a run resumed after a
suspension or a crash answers as the uninterrupted run would.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from mklang.errors import ProviderError, UsageError
from mklang.providers.base import NONE, UNPARSEABLE, Produced, Usage, Verdict, branch_of, call_key

# What the scripted model reasons when a `reason` state asks and the answer
# names no reasoning: the scripted model of mklang 1.x said this, and its
# scenario scripts expect it in the trace (ADR 0020).
SCRIPTED_REASONING = "thought"
GROUPS = ("llm", "tools", "hooks")  # how a saved state groups the sources: model, tools, hooks
Source = tuple[str, str]  # (group, name): ("llm", "produce"), ("tools", "lookup"), ...


class ScriptState:
    """Where each list source of one scripted host stands, and the fan-outs in flight.

    A call made outside every fan-out takes its source's next entry. Branches
    of a fan-out run concurrently, so they reach a list in no fixed order;
    they are answered by the branch their key names (`branch_of`): branch i
    of a fan-out of n branches that reaches a source at entry p takes p + i,
    and p + i + k*n for its k-th further call, what one-at-a-time branches
    with one call each take. Until a call outside every fan-out shows that
    none is in flight, the state keeps the entry each branch call took, by
    key: a call made again after a crash gets the entry it had, and a fan-out
    cut by a budget resumes with the entries that follow.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next: dict[Source, int] = {}  # the next list entry of each source
        self._starts: dict[Source, dict[str, int]] = {}  # fan-out (its step's key) -> its first entry
        self._taken: dict[Source, dict[str, int]] = {}  # call key -> entry, for the fan-outs in flight
        self._per_branch: dict[Source, Counter[tuple[str, int]]] = {}  # (fan-out, branch) -> keys taken

    def add(self, source: Source) -> None:
        self._next.setdefault(source, 0)

    def take(self, source: Source) -> int:
        """The list entry of the call in flight to `source`."""
        key = call_key()
        branch = branch_of(key) if key is not None else None
        with self._lock:
            if key is None or branch is None:
                self._starts.clear()
                self._taken.clear()
                self._per_branch.clear()
                index = self._next[source]
            else:
                taken = self._taken.setdefault(source, {})
                if key in taken:
                    return taken[key]
                fan_out, number, count = branch
                start = self._starts.setdefault(source, {}).setdefault(fan_out, self._next[source])
                per_branch = self._per_branch.setdefault(source, Counter())
                earlier = per_branch[fan_out, number]
                per_branch[fan_out, number] += 1
                index = taken[key] = start + number + earlier * count
            self._next[source] = max(self._next[source], index + 1)
            return index

    def save(self) -> dict[str, Any]:
        """As JSON: each group's next entries, and the fan-outs in flight when there are any."""
        with self._lock:
            saved: dict[str, Any] = {group: {} for group in GROUPS}
            for (group, name), position in self._next.items():
                saved[group][name] = position
            fan_outs: dict[str, dict[str, Any]] = {}
            for (group, name), starts in self._starts.items():
                taken = self._taken.get((group, name), {})
                fan_outs.setdefault(group, {})[name] = {"starts": dict(starts), "taken": dict(taken)}
            if fan_outs:
                saved["fan_outs"] = fan_outs
            return saved

    def restore(self, saved: dict[str, Any]) -> None:
        """Continue from a saved state (also the `position` of checkpoints before states)."""
        in_flight = saved.get("fan_outs", {})
        with self._lock:
            self._starts, self._taken, self._per_branch = {}, {}, {}
            for group, name in self._next:
                self._next[group, name] = int(saved.get(group, {}).get(name, 0))
                record = in_flight.get(group, {}).get(name)
                if record is not None:
                    self._starts[group, name] = {str(key): int(entry) for key, entry in record["starts"].items()}
                    self._taken[group, name] = {str(key): int(entry) for key, entry in record["taken"].items()}
                    self._per_branch[group, name] = _branch_counts(self._taken[group, name])


def _branch_counts(taken: dict[str, int]) -> Counter[tuple[str, int]]:
    """How many calls of each (fan-out, branch) a source has answered, from their keys."""
    branches = (branch_of(key) for key in taken)
    return Counter((branch[0], branch[1]) for branch in branches if branch is not None)


class Answers:
    """One scripted source: a list (in order, last repeats) or a substring map."""

    def __init__(self, what: str, spec: Any, state: ScriptState, source: Source):
        if isinstance(spec, (str, int, bool)) or spec is None:
            spec = [spec]
        if not isinstance(spec, (list, dict)):
            raise UsageError(f"scripted {what}: expected a list or a map")
        self.what = what
        self.spec = spec
        self.state = state
        self.source = source
        state.add(source)

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
        return self.spec[min(self.state.take(self.source), len(self.spec) - 1)]


def _as_text(answer: Any) -> str:
    """Scripts may give structured answers (for `parse json`/`list`); send them as JSON."""
    return answer if isinstance(answer, str) else json.dumps(answer)


class ScriptedProvider:
    """A Provider whose answers come from a scenario's `llm` section."""

    def __init__(self, llm: dict[str, Any] | None = None, state: ScriptState | None = None):
        llm = dict(llm or {})
        state = state if state is not None else ScriptState()
        self._lock = threading.Lock()
        self.produce_answers = Answers("produce", llm.pop("produce", [""]), state, ("llm", "produce"))
        self.judge_answers = Answers("judge", llm.pop("judge", [0]), state, ("llm", "judge"))
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


class ScriptedCallables:
    """Scripted hooks (`{name: [bool, ...]}`) or tools (`{name: [str, ...] | {substring: str}}`)."""

    def __init__(self, kind: str, spec: dict[str, Any] | None, state: ScriptState | None = None):
        if spec is not None and not isinstance(spec, dict):
            raise UsageError(f"scripted {kind}s: expected a map of name to answers")
        self.kind = kind
        state = state if state is not None else ScriptState()
        group = f"{kind}s"
        self.sources = {
            name: Answers(f"{kind} {name}", spec, state, (group, name)) for name, spec in (spec or {}).items()
        }

    def functions(self) -> dict[str, Callable[..., Any]]:
        """Host callables answering from the script: tools take the input map,
        hooks take (context, output); map keys are searched in their JSON."""
        return {name: self._function(name) for name in self.sources}

    def _function(self, name: str) -> Callable[..., Any]:
        source = self.sources[name]

        def answer(*args: Any) -> Any:
            request = json.dumps(args[-1] if self.kind == "hook" else args[0], ensure_ascii=False, default=str)
            return source.next(request)

        return answer
