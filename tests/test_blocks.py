"""Resumable: pyarrow refuses a row longer than its block; the read goes on in larger blocks."""
from __future__ import annotations

import pyarrow as pa
import pytest

from runner.blocks import BLOCK_BYTES, MAX_BLOCK_BYTES, Resumable


def test_blocks_grow_to_the_cap_and_no_further():
    """A 1.1 GiB line went 512 MiB -> 4 GiB, past what pyarrow takes (an OverflowError traceback)."""
    asked = []

    def read(block):
        asked.append(block)
        raise pa.ArrowInvalid("straddling object straddles two block boundaries")
        yield

    with pytest.raises(pa.ArrowInvalid):
        list(Resumable().batches(read, 10))
    assert asked[0] == BLOCK_BYTES and asked[-1] == MAX_BLOCK_BYTES < 1 << 31
    assert asked == sorted(set(asked)) and len(asked) == 5


def test_a_read_again_goes_on_after_the_rows_given_in_batches_of_at_most_batch_rows():
    table = pa.table({"id": list(range(25))})

    def read(block):
        yield from table.slice(0, 12).to_batches()
        if block == BLOCK_BYTES:  # the long row is met after 12 rows
            raise pa.ArrowInvalid("straddling object straddles two block boundaries")
        yield from table.slice(12).to_batches()

    rows = Resumable()
    got = list(rows.batches(read, 5))
    assert [x for b in got for x in b.column(0).to_pylist()] == list(range(25))
    assert max(b.num_rows for b in got) <= 5 and rows.given == 25
