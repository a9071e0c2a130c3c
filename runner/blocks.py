"""pyarrow's JSON and CSV readers parse a file in blocks (1 MiB by default) and refuse a row longer
than a block ("straddling object"): read again in larger blocks, going on after the rows given."""
from __future__ import annotations

from typing import Callable, Iterable, Iterator

BLOCK_BYTES = 1 << 20  # pyarrow's default
MAX_BLOCK_BYTES = 1 << 30
STRADDLES = ("straddl", "Empty CSV file or block")  # pyarrow's words for a row longer than a block


class Resumable:
    """Batches of a file read by `read(block_bytes)`, each cut to at most batch_rows; `given` counts
    the rows yielded, which a later read (in larger blocks, or another reader) goes on after."""

    def __init__(self) -> None:
        self.given = 0

    def batches(self, read: Callable[[int], Iterable], batch_rows: int) -> Iterator:
        import pyarrow as pa

        block = BLOCK_BYTES
        while True:
            seen = 0
            try:
                for batch in read(block):
                    for start in range(0, batch.num_rows, batch_rows):
                        piece = batch.slice(start, batch_rows)
                        if seen + piece.num_rows > self.given:
                            yield piece.slice(max(self.given - seen, 0))
                            self.given = seen + piece.num_rows
                        seen += piece.num_rows
                return
            except pa.ArrowInvalid as exc:
                # CSV: a header longer than a block leaves the first block empty
                if not any(words in str(exc) for words in STRADDLES) or block >= MAX_BLOCK_BYTES:
                    raise
                block = min(block * 8, MAX_BLOCK_BYTES)  # pyarrow takes block sizes below 2 GiB
