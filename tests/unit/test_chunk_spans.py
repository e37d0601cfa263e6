"""How a pipelined reduce cuts a flat buffer (contiguous, covering, few and large) and in which order the
caller's per-chunk stages run around the chunks' collectives."""

from __future__ import annotations

import itertools

import pytest
import torch

from flodl.averaging.reducer import MIN_CHUNK_BYTES, PIPELINE_CHUNKS, Reducer, chunk_spans
from tests.helpers.stage_log import Recorder, logged_wire


def covered(spans: list[slice]) -> list[int]:
    return [i for span in spans for i in range(span.start, span.stop)]


@pytest.mark.parametrize("numel", [1, 7, 1000, 10_485_760, 119_939_072])
def test_spans_cover_every_element_once_in_order(numel):
    spans = chunk_spans(numel, 4, chunks=4, min_bytes=64)
    assert spans[0].start == 0 and spans[-1].stop == numel
    assert all(a.stop == b.start for a, b in itertools.pairwise(spans))
    assert all(s.stop > s.start for s in spans)
    if numel <= 1000:
        assert covered(spans) == list(range(numel))


def test_small_buffers_are_one_chunk_and_large_ones_at_most_the_limit():
    assert chunk_spans(1000, 4) == [slice(0, 1000)]  # 4 kB: chunking would only add launches
    assert chunk_spans(10_485_760, 4) == [slice(0, 10_485_760)]  # 40 MiB: one piece
    big = chunk_spans(120_000_000, 4)
    assert len(big) == PIPELINE_CHUNKS
    assert all((s.stop - s.start) * 4 >= MIN_CHUNK_BYTES for s in big)


def test_element_size_counts():
    # The same element count in bf16 is half the bytes: fewer chunks.
    assert len(chunk_spans(48 << 20, 4)) == 3  # 192 MiB
    assert len(chunk_spans(48 << 20, 2)) == 1  # 96 MiB


def test_a_chunk_is_kept_before_its_reduce_and_settled_one_chunk_later(solo_group):
    # Three chunks of 4 elements: chunk k+1 is kept and goes on the wire before chunk k is settled.
    reducer = Reducer(gamma=1.0)
    reducer.min_chunk_bytes = 16
    reducer.chunks = 3
    flat = torch.arange(12, dtype=torch.float32)
    stages = Recorder()
    logged_wire(reducer, stages)
    result = reducer.reduce([flat], None, None, steps=2, stages=stages)
    assert stages.calls == [
        ("before", 0),
        ("wire", 0, 4),
        ("before", 4),
        ("wire", 4, 4),
        ("after", 0),
        ("before", 8),
        ("wire", 8, 4),
        ("after", 4),
        ("after", 8),
    ]
    assert torch.equal(flat, torch.arange(12, dtype=torch.float32))  # one rank: its own weight is 1
    assert (result.skipped, result.total_steps, result.payload_bytes) == (False, 2, 48)
