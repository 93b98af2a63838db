"""Cassettes: what is recorded, how replay matches, and how a miss is reported."""

from __future__ import annotations

import threading

import pytest
import yaml
from support.commands import cli, refused

from mklang.errors import ProviderError, UsageError
from mklang.providers.base import NONE, Produced, Usage, Verdict
from mklang.providers.cassette import RecordingProvider, ReplayProvider, fingerprint, produce_request
from mklang.providers.factory import make_provider


class Stub:
    """A provider that numbers its answers, so replay order is visible."""

    def __init__(self):
        self.calls = 0
        self.lock = threading.Lock()

    def produce(self, system, user, tier, reason):
        with self.lock:
            self.calls += 1
            number = self.calls
        return Produced(f"answer {number}\nsecond line", "thought" if reason else None, Usage(number, 2, 0.25))

    def judge(self, conditions, output, reasoning, context, tier):
        return Verdict(NONE, Usage(5, 1, 0.5), "strict")


def test_recording_writes_readable_yaml_after_each_exchange(tmp_path):
    path = tmp_path / "deep" / "c.yaml"
    recorder = RecordingProvider(Stub(), path)
    assert yaml.safe_load(path.read_text()) == {"mklang_cassette": 1, "exchanges": []}
    recorder.produce("sys", "line one\nline two", "fast", True)
    text = path.read_text()
    assert "user: |-\n      line one\n      line two\n" in text
    data = yaml.safe_load(text)["exchanges"]
    assert data[0]["request"] == {
        "kind": "produce",
        "tier": "fast",
        "system": "sys",
        "user": "line one\nline two",
        "reason": True,
    }
    assert data[0]["response"] == {
        "text": "answer 1\nsecond line",
        "reasoning": "thought",
        "usage": {"input_tokens": 1, "output_tokens": 2, "cost_usd": 0.25},
    }
    assert data[0]["fingerprint"] == fingerprint(data[0]["request"])
    recorder.judge(["a", "b"], {"x": [1, 2]}, None, {"k": ("t",)}, "balanced")
    judged = yaml.safe_load(path.read_text())["exchanges"][1]
    assert judged["request"] == {
        "kind": "judge",
        "tier": "balanced",
        "conditions": ["a", "b"],
        "output": {"x": [1, 2]},
        "reasoning": None,
        "context": {"k": ["t"]},
    }
    assert judged["response"] == {
        "choice": "none",
        "parsed_by": "strict",
        "usage": {"input_tokens": 5, "output_tokens": 1, "cost_usd": 0.5},
    }


def test_replay_answers_identical_requests_in_recorded_order_then_repeats_the_last(tmp_path):
    path = tmp_path / "c.yaml"
    recorder = RecordingProvider(Stub(), path)
    for _ in range(2):
        recorder.produce("s", "same", "fast", False)
    recorder.judge(["a"], "o", "r", {}, "fast")
    replay = make_provider(replay=path)
    texts = [replay.produce("s", "same", "fast", False).text for _ in range(3)]
    assert texts == ["answer 1\nsecond line", "answer 2\nsecond line", "answer 2\nsecond line"]
    assert replay.produce("s", "same", "fast", False).usage == Usage(2, 2, 0.25)
    assert replay.judge(["a"], "o", "r", {}, "fast") == Verdict(NONE, Usage(5, 1, 0.5), "strict")


def test_data_fence_nonces_do_not_break_matching(tmp_path):
    path = tmp_path / "c.yaml"
    RecordingProvider(Stub(), path).produce("s", "Use <data-0a1b2c>\nx\n</data-0a1b2c>", "fast", False)
    replay = ReplayProvider(path)
    assert replay.produce("s", "Use <data-ffee99>\nx\n</data-ffee99>", "fast", False).text.startswith("answer 1")
    assert "Use <data-NONCE>" in path.read_text()


def test_a_hand_edited_request_matches_what_it_now_says(tmp_path):
    path = tmp_path / "c.yaml"
    RecordingProvider(Stub(), path).produce("s", "old", "fast", False)
    path.write_text(path.read_text().replace("user: old", "user: new"))
    assert ReplayProvider(path).produce("s", "new", "fast", False).text.startswith("answer 1")


def test_a_miss_names_the_closest_request_and_shows_a_diff(tmp_path):
    path = tmp_path / "c.yaml"
    recorder = RecordingProvider(Stub(), path)
    recorder.produce("s", "Translate the text into French.", "fast", False)
    recorder.produce("s", "Count the words.", "fast", False)
    recorder.judge(["Translate the text into German."], "o", None, {}, "fast")
    with pytest.raises(ProviderError) as caught:
        ReplayProvider(path).produce("s", "Translate the text into German.", "fast", False)
    lines = str(caught.value).splitlines()
    assert (
        lines[0] == "replay: cassette c.yaml holds no produce request like this one (tier fast); closest is exchange 1:"
    )
    assert "-user: Translate the text into French." in lines
    assert "+user: Translate the text into German." in lines


def test_a_miss_in_an_empty_cassette(tmp_path):
    path = tmp_path / "c.yaml"
    RecordingProvider(Stub(), path)
    with pytest.raises(ProviderError, match="the cassette is empty"):
        ReplayProvider(path).judge(["a"], "o", None, {}, "fast")


MACHINE = """\
mklang 0.4
machine m
entry a
budget 2

state a {
  structure "One line."
  prompt "Say hi."
  output x
  otherwise -> END
}
"""
PRODUCED = "request: {kind: produce, tier: fast, system: s, user: u, reason: false}"
ONE_EXCHANGE = "mklang_cassette: 1\nexchanges:\n- "


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, "cassette not found: "),
        ("- 1\n- 2\n", "not an mklang cassette"),
        ("exchanges: []\n", "not an mklang cassette"),
        ("mklang_cassette: 1\nexchanges: {}\n", "not an mklang cassette"),
        (
            "mklang_cassette: 1\nexchanges:\n- request: {kind: produce, tier: fa",
            "c.yaml:3:36: the cassette is not valid YAML",
        ),
        ("mklang_cassette: 1\nexchanges: [7]\n", "exchange 1: expected a mapping with a request and a response"),
        ("mklang_cassette: 1\nexchanges: [{request: {}}]\n", "exchange 1: needs a request and a response"),
        (ONE_EXCHANGE + "request: {kind: 3}\n  response: {}\n", "exchange 1: request kind is 3, not produce or judge"),
        (ONE_EXCHANGE + "request: {kind: produce, tier: fast}\n  response: {text: a}\n", "request lacks its 'system'"),
        (ONE_EXCHANGE + "request: {kind: produce, 1: 2}\n  response: {text: a}\n", "request has an unknown field 1"),
        (ONE_EXCHANGE + PRODUCED + "\n  response: {text: 5}\n", "exchange 1: response text is 5, not a string"),
        (ONE_EXCHANGE + PRODUCED + "\n  response: {reasoning: x}\n", "response lacks its 'text'"),
        (ONE_EXCHANGE + PRODUCED + "\n  response: {text: a, usage: 5}\n", "response usage is 5, not a mapping"),
        (
            ONE_EXCHANGE + PRODUCED + "\n  response: {text: a, usage: {input_tokens: -1}}\n",
            "response usage input_tokens is -1",
        ),
        (
            ONE_EXCHANGE
            + "request: {kind: judge, tier: fast, conditions: [a], output: o, reasoning: null, context: {1: a, b: c}}\n"
            "  response: {choice: 0}\n",
            "request cannot be fingerprinted",
        ),
        (
            ONE_EXCHANGE
            + "request: {kind: judge, tier: fast, conditions: [a], output: o, reasoning: null, context: {}}\n"
            "  response: {choice: maybe}\n",
            "response choice is 'maybe', not a branch index from 0, none or unparseable",
        ),
    ],
)
def test_every_unusable_cassette_is_refused_in_one_line_before_the_run(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    if text is not None:
        path.write_text(text)
    machine = tmp_path / "m.mk"
    machine.write_text(MACHINE)
    refused(cli("run", str(machine), "--replay", str(path), "--checkpoint", str(tmp_path / "cp.json")), message)
    assert not (tmp_path / "cp.json").exists()


def test_record_and_replay_together_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="cannot be used together"):
        make_provider(record=tmp_path / "a.yaml", replay=tmp_path / "b.yaml")


def test_concurrent_recording_keeps_every_exchange(tmp_path):
    path = tmp_path / "c.yaml"
    recorder = RecordingProvider(Stub(), path)
    threads = [threading.Thread(target=recorder.produce, args=("s", f"q{i}", "fast", False)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    users = sorted(e["request"]["user"] for e in yaml.safe_load(path.read_text())["exchanges"])
    assert users == sorted(f"q{i}" for i in range(16))


def test_fingerprint_covers_every_request_field():
    base = produce_request("s", "u", "fast", False)
    variants = [
        produce_request("S", "u", "fast", False),
        produce_request("s", "U", "fast", False),
        produce_request("s", "u", "balanced", False),
        produce_request("s", "u", "fast", True),
    ]
    assert len({fingerprint(base), *map(fingerprint, variants)}) == 5


def test_a_cassette_is_owner_only_and_synced_to_disk(tmp_path, monkeypatch):
    import os

    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    path = tmp_path / "c.yaml"
    recorder = RecordingProvider(Stub(), path)
    recorder.produce("sys", "hello", "fast", False)
    assert (path.stat().st_mode & 0o777) == 0o600  # prompts and answers are the user's data
    assert len(synced) >= 4  # each write: the file, then its folder


class Echo:
    """A provider that says what it was asked, so a recorder that changes a request shows."""

    def __init__(self):
        self.judged: list[tuple] = []
        self.closed = False

    def produce(self, system, user, tier, reason):
        return Produced(f"{system}|{user}|{tier}|{reason}", None, Usage(1, 1, 0.0))

    def judge(self, conditions, output, reasoning, context, tier):
        self.judged.append((conditions, output, reasoning, context, tier))
        return Verdict(0, Usage(1, 1, 0.0), "strict")

    def close(self):
        self.closed = True


def test_recording_passes_each_request_on_unchanged_and_closing_closes_the_real_provider(tmp_path):
    import datetime

    inner = Echo()
    path = tmp_path / "a" / "b" / "c.yaml"  # missing folders are made
    recorder = RecordingProvider(inner, path)
    assert recorder.produce("sys", "usr", "fast", True).text == "sys|usr|fast|True"
    when = datetime.date(2026, 1, 2)
    recorder.judge(["c"], {"when": when}, "why", {"k": when}, "balanced")
    assert inner.judged == [(["c"], {"when": when}, "why", {"k": when}, "balanced")]
    judged = yaml.safe_load(path.read_text())["exchanges"][1]["request"]
    assert (judged["output"], judged["context"]) == ({"when": "2026-01-02"}, {"k": "2026-01-02"})  # as text
    path.unlink()
    recorder.close()
    assert inner.closed
    assert len(yaml.safe_load(path.read_text())["exchanges"]) == 2  # written again on close
    RecordingProvider(Stub(), tmp_path / "d.yaml").close()  # a provider without close is fine


def test_a_cassette_that_cannot_be_written_is_a_usage_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(UsageError) as caught:
        RecordingProvider(Stub(), tmp_path / "file" / "c.yaml")
    assert str(caught.value) == f"cannot write cassette {tmp_path / 'file' / 'c.yaml'}: File exists"


def test_a_cassette_keeps_keys_in_order_unicode_as_is_and_folds_at_100_columns(tmp_path):
    path = tmp_path / "c.yaml"
    long = "x " + " ".join(["word"] * 40)
    RecordingProvider(Stub(), path).produce("système", long, "fast", False)
    text = path.read_text(encoding="utf-8")
    request = text[text.index("  request:") :]
    assert request.splitlines()[:7] == [
        "  request:",
        "    kind: produce",
        "    tier: fast",
        "    system: système",
        "    user: x word word word word word word word word word word word word word word word word word word",
        "      word word word word word word word word word word word word word word word word word word word word",
        "      word word",
    ]


def test_the_fingerprint_is_the_sha256_of_the_canonical_json_of_the_request():
    import hashlib
    import json

    request = {"tier": "fast", "kind": "produce", "user": "été", "system": "s", "reason": False}
    canonical = '{"kind":"produce","reason":false,"system":"s","tier":"fast","user":"été"}'
    assert json.loads(canonical) == request
    assert fingerprint(request) == hashlib.sha256(canonical.encode()).hexdigest()


def test_replay_gives_recorded_answers_in_order_one_at_a_time(tmp_path):
    path = tmp_path / "c.yaml"
    recorder = RecordingProvider(Stub(), path)
    for _ in range(3):
        recorder.produce("s", "same", "fast", False)
    replay = ReplayProvider(path)
    assert [replay.produce("s", "same", "fast", False).text[:8] for _ in range(4)] == [
        "answer 1",
        "answer 2",
        "answer 3",
        "answer 3",
    ]


def test_a_miss_is_compared_with_requests_of_its_kind_first_then_with_any(tmp_path):
    path = tmp_path / "c.yaml"
    recorder = RecordingProvider(Stub(), path)
    recorder.produce("t", "zzz", "balanced", True)
    recorder.judge(["c"], "l1\nl2\nl3\nl4", None, {}, "fast")  # more lines in common, but a judge
    with pytest.raises(ProviderError) as caught:
        ReplayProvider(path).produce("s", "l1\nl2\nl3\nl4", "fast", False)
    assert str(caught.value).splitlines()[0].endswith("closest is exchange 1:")
    only_produce = tmp_path / "p.yaml"
    RecordingProvider(Stub(), only_produce).produce("s", "u", "fast", False)
    with pytest.raises(ProviderError) as caught:
        ReplayProvider(only_produce).judge(["a"], "o", None, {}, "fast")
    assert str(caught.value) == "\n".join(
        [
            "replay: cassette p.yaml holds no judge request like this one (tier fast); closest is exchange 1:",
            "@@ -1,5 +1,7 @@",
            "-kind: produce",
            "+kind: judge",
            " tier: fast",
            "-system: s",
            "-user: u",
            "-reason: false",
            "+conditions:",
            "+- a",
            "+output: o",
            "+reasoning: null",
            "+context: {}",
        ]
    )


CONDITIONS = [f"condition {i}" for i in range(14)]


@pytest.mark.parametrize(
    ("asked", "shown"),
    [
        (
            ["changed 0", "changed 1", "changed 2", "changed 3", "added", *CONDITIONS[4:]],
            [
                "@@ -3,6 +3,7 @@",
                " conditions:",
                *(f"-- condition {i}" for i in range(4)),
                *(f"+- changed {i}" for i in range(4)),
                "+- added",
                " - condition 4",
            ],
        ),
        (
            [*(f"changed {i}" for i in range(5)), *CONDITIONS[5:]],
            [
                "@@ -3,7 +3,7 @@",
                " conditions:",
                *(f"-- condition {i}" for i in range(5)),
                *(f"+- changed {i}" for i in range(5)),
                "  ...",
            ],
        ),
    ],
    ids=["twelve-lines", "more"],
)
def test_a_miss_shows_at_most_twelve_diff_lines_with_one_line_of_context(tmp_path, asked, shown):
    path = tmp_path / "c.yaml"
    recorder = RecordingProvider(Stub(), path)
    recorder.judge(["short"], "o", None, {}, "fast")
    recorder.judge(CONDITIONS, "o", None, {}, "fast")
    with pytest.raises(ProviderError) as caught:
        ReplayProvider(path).judge(asked, "o", None, {}, "fast")
    head = "replay: cassette c.yaml holds no judge request like this one (tier fast); closest is exchange 2:"
    assert str(caught.value).splitlines() == [head, *shown]


def test_a_cassette_that_is_not_text_is_named_as_a_cassette(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"mklang_cassette: 1\n\xff\xfe\n")
    with pytest.raises(UsageError) as caught:
        ReplayProvider(path)
    assert str(caught.value) == f"{path}: cannot read the cassette: not UTF-8 text"


def test_replay_gives_back_the_recorded_reasoning(tmp_path):
    path = tmp_path / "c.yaml"
    RecordingProvider(Stub(), path).produce("s", "u", "fast", True)
    assert ReplayProvider(path).produce("s", "u", "fast", True).reasoning == "thought"
