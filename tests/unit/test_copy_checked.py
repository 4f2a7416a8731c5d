"""The one-pass copy of a same-node read (``copy_checked``: the copy and its crc32c block by block) and the
destinations of a batched read (a buffer, or a list of buffers one chunk is spread over)."""

import itertools

import numpy as np
import pytest

from kvpool.errors import ConfigError
from kvpool.pool.buffers import joined, pieces_of, scatter
from kvpool.pool.chunks import COPY_BLOCK, checksum, checksum_of, copy_checked, gather_checked
from kvpool.pool.tiers.codecs import TensorFormat


@pytest.mark.parametrize("sizes", [[3 * COPY_BLOCK + 17], [1000, COPY_BLOCK + 5, 1], [0, 64]])
def test_copy_checked_lands_the_bytes_in_order_and_returns_their_crc(sizes: list[int]) -> None:
    src = np.random.default_rng(0).integers(0, 256, sum(sizes), dtype=np.uint8)
    pieces = [np.zeros(n, dtype=np.uint8) for n in sizes]
    crc = copy_checked(memoryview(src.data), [memoryview(p.data) for p in pieces])
    assert np.array_equal(np.concatenate(pieces), src)
    assert crc == checksum(src.data)


def test_a_buffer_is_its_own_piece_and_a_spread_chunk_reads_whole_into_a_scratch_view_scattered_in_order() -> None:
    one, a, b = np.zeros(8, dtype=np.uint8), np.zeros(3, dtype=np.uint8), np.zeros(5, dtype=np.uint8)
    pieces = pieces_of([one, [a, b]])
    view = joined(pieces[0])
    assert len(pieces[0]) == 1 and view is pieces[0][0]
    scatter(view, pieces[0])  # its own piece: nothing to copy
    view = joined(pieces[1])
    view[:] = bytes(range(8))
    scatter(view, pieces[1])
    assert a.tolist() == [0, 1, 2] and b.tolist() == [3, 4, 5, 6, 7]
    with pytest.raises(ConfigError, match=r"buffers\[0\]"):
        pieces_of([[b"read-only"]])


def test_checksum_of_pieces_is_the_checksum_of_their_bytes_in_order() -> None:
    data = bytes(range(256)) * 3
    assert checksum_of([data[:5], data[5:5], data[5:300], data[300:]]) == checksum(data)


def test_gather_checked_lands_pieces_in_order_and_returns_their_crc() -> None:
    data = np.random.default_rng(1).integers(0, 256, 3 * COPY_BLOCK + 9, dtype=np.uint8).tobytes()
    cuts = [0, 7, COPY_BLOCK + 3, COPY_BLOCK + 3, len(data)]
    pieces = [memoryview(data[a:b]) for a, b in itertools.pairwise(cuts)]
    dest = bytearray(len(data))
    assert gather_checked(pieces, memoryview(dest)) == checksum(data) and bytes(dest) == data


def test_a_chunk_given_as_runs_of_blocks_has_the_format_of_their_concatenation() -> None:
    import torch

    runs = [torch.zeros(2, 4, 8, dtype=torch.bfloat16), torch.zeros(1, 4, 8, dtype=torch.bfloat16)]
    assert TensorFormat.of_pieces(runs) == TensorFormat("bfloat16", (3, 4, 8))
    assert TensorFormat.of_pieces(runs[0]) == TensorFormat.of(runs[0])
    assert TensorFormat.of_pieces([runs[0], torch.zeros(1, 4, 8)]) is None  # two dtypes
    assert TensorFormat.of_pieces([runs[0], torch.zeros(1, 8, 4, dtype=torch.bfloat16)]) is None
    assert TensorFormat.of_pieces([runs[0], b"bytes"]) is None and TensorFormat.of_pieces([]) is None
