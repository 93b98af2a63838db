"""Cassettes: what is recorded, how replay matches, and how a miss is reported."""

from __future__ import annotations

import threading

import pytest
import yaml

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


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, "cassette not found"),
        ("a: [", "not a valid YAML cassette"),
        ("exchanges: []\n", "not an mklang cassette"),
        ("mklang_cassette: 1\nexchanges: [{request: {}}]\n", "exchange 1 needs a request and a response"),
    ],
)
def test_unusable_cassettes_are_usage_errors(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(UsageError, match=message):
        make_provider(replay=path)


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
