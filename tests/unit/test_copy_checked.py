"""The one-pass copy of a same-node read (``copy_checked``: the copy and its crc32c block by block) and the
destinations of a batched read (a buffer, or a list of buffers one chunk is spread over)."""

import numpy as np
import pytest

from kvpool.errors import ConfigError
from kvpool.pool.buffers import destinations, scatter
from kvpool.pool.chunks import COPY_BLOCK, checksum, copy_checked


@pytest.mark.parametrize("sizes", [[3 * COPY_BLOCK + 17], [1000, COPY_BLOCK + 5, 1], [0, 64]])
def test_copy_checked_lands_the_bytes_in_order_and_returns_their_crc(sizes: list[int]) -> None:
    src = np.random.default_rng(0).integers(0, 256, sum(sizes), dtype=np.uint8)
    pieces = [np.zeros(n, dtype=np.uint8) for n in sizes]
    crc = copy_checked(memoryview(src.data), [memoryview(p.data) for p in pieces])
    assert np.array_equal(np.concatenate(pieces), src)
    assert crc == checksum(src.data)


def test_destinations_give_a_buffer_itself_and_a_spread_chunk_a_scratch_view_scattered_in_order() -> None:
    one, a, b = np.zeros(8, dtype=np.uint8), np.zeros(3, dtype=np.uint8), np.zeros(5, dtype=np.uint8)
    views, pieces = destinations([one, [a, b]])
    assert len(pieces[0]) == 1 and pieces[0][0] is views[0]
    scatter(views[0], pieces[0])  # its own piece: nothing to copy
    views[1][:] = bytes(range(8))
    scatter(views[1], pieces[1])
    assert a.tolist() == [0, 1, 2] and b.tolist() == [3, 4, 5, 6, 7]
    with pytest.raises(ConfigError, match=r"buffers\[0\]"):
        destinations([[b"read-only"]])
