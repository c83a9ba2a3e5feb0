"""``util.cuda.buffer_rounds``: how the staged restore and the snapshot's bounce route pack items into rounds
of a pinned buffer. Pure arithmetic, so checked here over generated item sizes (the copies it drives run on a
GPU: tests/gpu)."""

from __future__ import annotations

from flashckpt.util.cuda import buffer_rounds
from hypothesis import given, settings
from hypothesis import strategies as st


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(0, 5000), max_size=40), size=st.integers(1, 3000))
def test_every_byte_of_every_item_goes_once_in_order_into_full_rounds(sizes: list[int], size: int) -> None:
    rounds = list(buffer_rounds(sizes, size))
    pieces = [p for r in rounds for p in r]
    # each item's bytes, in order, exactly once (empty items take none)
    covered = {i: 0 for i in range(len(sizes))}
    for i, pos, n, _at in pieces:
        assert n > 0 and pos == covered[i]
        covered[i] += n
    assert covered == dict(enumerate(sizes))
    assert [i for i, *_ in pieces] == sorted(i for i, *_ in pieces)
    for k, r in enumerate(rounds):  # laid out back to back from the buffer's start, every round but the last full
        at = 0
        for _i, _pos, n, off in r:
            assert off == at
            at += n
        assert at <= size and (at == size or k == len(rounds) - 1)
    assert len(rounds) == -(-sum(sizes) // size)
