"""What every provider shares: the key of the call in flight, the usage and answers it returns and
how they are journaled, and the run's deadline."""

from __future__ import annotations

import time

import pytest

from mklang.providers.base import (
    NONE,
    Produced,
    Usage,
    Verdict,
    branch_of,
    branch_part,
    call_key,
    calling,
    deadline,
    decode_answer,
    earlier_key,
    encode_answer,
    seconds_left,
)

# --- call keys: the call a run makes, and the fan-out branch it is made in ----------


def test_a_call_key_names_the_branch_of_the_innermost_fan_out_it_is_made_in():
    assert branch_part(1, 4) == "2of4"
    assert branch_of("r:3.2of4.1") == ("r:3", 1, 4)
    assert branch_of("r:3.2of4/:5.1of12.1") == ("r:3.2of4/:5", 0, 12)
    assert branch_of("r:3.2of4/:5.g.1") == ("r:3", 1, 4)  # the judge of a sub-machine in a branch
    assert branch_of("r:3.0/:1.h.2") is None
    assert earlier_key("r:3.2of4/:5.10of12.1") == "r:3.2/:5.10.1"
    assert earlier_key("r:3.0.1") == "r:3.0.1"


def test_the_call_key_is_set_only_inside_a_call():
    assert call_key() is None
    with calling("r:1.0.1"):
        assert call_key() == "r:1.0.1"
    assert call_key() is None


# --- the values providers return -------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "usage"),
    [
        (None, Usage(0, 0, 0.0)),
        ({}, Usage(0, 0, 0.0)),
        ({"input_tokens": 3}, Usage(3, 0, 0.0)),
        ({"output_tokens": 4}, Usage(0, 4, 0.0)),
        ({"cost_usd": 0.5}, Usage(0, 0, 0.5)),
        ({"input_tokens": 7, "output_tokens": 8, "cost_usd": 1}, Usage(7, 8, 1.0)),
    ],
)
def test_a_usage_record_missing_keys_reads_them_as_zero(data, usage):
    read = Usage.from_json(data)
    assert read == usage
    assert type(read.input_tokens) is int and type(read.cost_usd) is float


@pytest.mark.parametrize(
    ("data", "named"),
    [
        ({"input_tokens": "7"}, "input_tokens"),
        ({"output_tokens": 8.0}, "output_tokens"),
        ({"input_tokens": True}, "input_tokens"),
        ({"cost_usd": "1"}, "cost_usd"),
        ({"cost_usd": float("nan")}, "cost_usd"),
        ({"output_tokens": -1}, "output_tokens"),
    ],
)
def test_a_usage_record_with_a_number_that_is_not_a_count_is_refused(data, named):
    with pytest.raises(ValueError, match=f"usage {named} is"):
        Usage.from_json(data)


def test_usages_add_field_by_field_and_count_tokens_both_ways():
    total = Usage(1, 2, 0.25) + Usage(10, 20, 0.5)
    assert total == Usage(11, 22, 0.75)
    assert total.tokens == 33
    assert total.to_json() == {"input_tokens": 11, "output_tokens": 22, "cost_usd": 0.75}


def test_answers_round_trip_through_the_journal_codec():
    produced = Produced("t", "r", Usage(1, 2, 0.5))
    verdict = Verdict(NONE, Usage(3, 4), "bare")
    assert encode_answer("produce", produced) == {
        "text": "t",
        "reasoning": "r",
        "usage": {"input_tokens": 1, "output_tokens": 2, "cost_usd": 0.5},
    }
    assert encode_answer("judge", verdict) == {
        "choice": "none",
        "parsed_by": "bare",
        "usage": {"input_tokens": 3, "output_tokens": 4, "cost_usd": 0.0},
    }
    assert decode_answer("produce", encode_answer("produce", produced)) == produced
    assert decode_answer("judge", encode_answer("judge", verdict)) == verdict
    assert encode_answer("tool", {"x": 1}) == {"x": 1} and decode_answer("tool", "text") == "text"
    assert decode_answer("produce", {"text": "t"}) == Produced("t", None, Usage())
    assert decode_answer("judge", {"choice": 1}) == Verdict(1, Usage(), None)


def test_the_time_left_counts_down_to_the_deadline_and_is_none_without_one():
    assert seconds_left() is None
    now = time.monotonic()
    with deadline(now + 100):
        assert 99 < seconds_left() <= 100
        with deadline(None):
            assert seconds_left() is None
        with deadline(now - 5):
            assert -6 < seconds_left() <= -5
        assert 99 < seconds_left() <= 100
    assert seconds_left() is None
