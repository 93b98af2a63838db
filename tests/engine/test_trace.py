"""A level's `Trace`: its length and appends need no segment; reading it reads each segment it needs once."""

from __future__ import annotations

import pytest

from mklang.engine.trace import Segment, Trace


def _steps(first: int, count: int) -> list[dict]:
    return [{"step": n, "state": "s"} for n in range(first, first + count)]


@pytest.fixture
def trace_and_reads():
    reads: list[str] = []
    stored = {"a" * 64: _steps(1, 3), "b" * 64: _steps(4, 2)}

    def read(segment: Segment) -> list[dict]:
        reads.append(segment.name)
        return stored[segment.name]

    segments = [Segment("a" * 64, 3), Segment("b" * 64, 2)]
    return Trace(_steps(6, 2), segments, read), reads


def test_length_appends_and_the_last_steps_of_the_tail_read_no_segment(trace_and_reads):
    trace, reads = trace_and_reads
    assert len(trace) == 7
    trace.append({"step": 8, "state": "s"})
    assert len(trace) == 8 and trace[-1]["step"] == 8 and trace.last(3) == _steps(6, 3)
    assert reads == []


def test_the_last_steps_read_only_the_segments_they_lie_in(trace_and_reads):
    trace, reads = trace_and_reads
    assert trace.last(4) == _steps(4, 4)
    assert reads == ["b" * 64]
    assert trace.last(100) == _steps(1, 7) and reads == ["b" * 64, "a" * 64]


def test_reading_it_whole_reads_each_segment_once_and_compares_as_a_list(trace_and_reads):
    trace, reads = trace_and_reads
    assert list(trace) == _steps(1, 7) and trace == _steps(1, 7) and _steps(1, 7) == trace
    assert trace[0] == {"step": 1, "state": "s"} and trace[2:4] == _steps(3, 2)
    assert trace != _steps(1, 6)
    assert sorted(reads) == ["a" * 64, "b" * 64]


def test_sealing_the_tail_keeps_its_steps_in_memory(trace_and_reads):
    trace, reads = trace_and_reads
    trace.seal(Segment("c" * 64, 2))
    assert trace.tail == [] and trace.segments[-1] == Segment("c" * 64, 2)
    assert trace.last(2) == _steps(6, 2) and reads == []
