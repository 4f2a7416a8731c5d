"""The read path from pool nodes: chunks out of this node's mapped DRAM, or out of a peer's by one-sided READs.

Chunks in DRAM — this node's or a peer's — are first read with no call at all, at the offsets their placements give:
copied out of the mapped segment, or one batched READ per peer (with a short deadline; a peer a transfer failed with
is left out for a while: a dead holder is found at once by the pinned way's call, where the transport waits for it).
One that fails its checksum (it moved, was evicted or overwritten meanwhile) goes the pinned way: per holder, one call pins the chunks (``prepare_load``: promoting NVMe
hits to DRAM; a peer sends those left on NVMe along), one copy or one batched READ moves them, one call
(``complete_load``, not waited for) releases them.  Every chunk is verified against its checksum before it counts:
the caller never gets wrong bytes.  A chunk left on an encrypted NVMe tier is opened with ``keys`` (the client's
``PoolConfig.encryption``); one this process cannot open is a miss, not a corrupt replica.
"""

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvpool.core.types import Placement, Tier
from kvpool.errors import ChunkNotFound, NodeUnreachable, UndecodableChunk
from kvpool.pool.buffers import byte_view, scatter
from kvpool.pool.chunks import SEGMENT_NAMES, StoredChunk, checksum, checksum_of, copy_checked, short
from kvpool.pool.client.local import Binding, LocalNode
from kvpool.pool.client.peers import STAGING_BYTES, Peers, rounds
from kvpool.pool.protocol import NodeHandles
from kvpool.pool.tiers.codecs import decode
from kvpool.pool.tiers.crypto import Keyring, unseal
from kvpool.transport.base import Op


class Located(Protocol):
    """Where a chunk lies in a node's DRAM segment: a placement, or the pinned chunk its node handed out."""

    @property
    def offset(self) -> int: ...

    @property
    def stored(self) -> int: ...

    @property
    def checksum(self) -> int: ...


Outcome = bool | None  #: per chunk: True intact, False failed its checksum, None not read (moved, gone, unreachable)


def settle(idx: list[int], got: list[Outcome], done: list[bool], on_done: Callable[[int], None] | None = None) -> None:
    """Mark ``done[idx[j]]`` for each intact ``got[j]`` (and tell ``on_done``): a batch of reads' outcomes, in place."""
    for i, intact in zip(idx, got, strict=True):
        done[i] = intact is True
        if done[i] and on_done is not None:
            on_done(i)


def landed(one: memoryview, pieces: list[memoryview], i: int, on_done: Callable[[int], None] | None) -> None:
    """Chunk ``i``, read whole into ``one``: scattered into its ``pieces``, then ``on_done`` told."""
    scatter(one, pieces)
    if on_done is not None:
        on_done(i)


def at(fn: Callable[[int], None], index: list[int], j: int) -> None:
    """``fn(index[j])``: a read's callback by its position in a node's batch, told as the caller's index."""
    fn(index[j])


def fill(
    pieces: list[memoryview], data: Any, codec: str, expected: int, key: bytes = b"", keys: Keyring | None = None
) -> bool:
    """Put a chunk's stored bytes (encoded with ``codec``) into ``pieces`` (its bytes in order, piece after piece) if
    they match their checksum and decode to exactly their size; whether they did.  Sealed bytes (``codec`` ends in
    ``+aes256gcm``) are opened with ``keys`` for chunk ``key`` first: ``UndecryptableChunk`` (a ``ChunkNotFound``) if
    they cannot be."""
    if codec == "raw":
        raw = byte_view(data)
        return raw.nbytes == sum(p.nbytes for p in pieces) and copy_checked(raw, pieces) == expected
    if checksum(data) != expected:
        return False
    data, codec = unseal(data, codec, key, keys)
    try:
        flat = byte_view(decode(data)) if codec != "raw" else memoryview(data)
    except UndecodableChunk:
        return False
    if flat.nbytes != sum(p.nbytes for p in pieces):
        return False
    copy_checked(flat, pieces)
    return True


class NodeReads:
    """Reads by a client on Ray node ``node_id``; ``local``: the pool node there, as the client bound it (each read
    uses its binding of the moment: the node's actor and mapped segment, or none)."""

    def __init__(
        self, node_id: str, handles: NodeHandles, peers: Peers, local: LocalNode, keys: Keyring | None = None
    ) -> None:
        self.node_id, self.handles, self.peers, self.local = node_id, handles, peers, local
        self.keys = keys  #: opens chunks left on an encrypted NVMe tier

    def unpinned(
        self, nearest: list[Placement], pieces: list[list[memoryview]], on_done: Callable[[int], None] | None
    ) -> set[int]:
        """Read the chunks held in DRAM where their placements say, with no call to their node: this node's copied
        straight out of the mapped segment into their ``pieces`` (each checksummed as it lands:
        :func:`copy_checked`), a peer's by one batched READ per peer; the indexes that came out intact.  A chunk
        moved, evicted or overwritten meanwhile fails its checksum, and the caller reads it the pinned way.  The
        nodes are told of the hits afterwards (LRU order, counters), without waiting."""
        read: set[int] = set()

        def mark(i: int, intact: bool) -> None:
            if intact:
                read.add(i)
                if on_done is not None:
                    on_done(i)

        bound = self.local.current()
        by_peer: dict[str, list[tuple[int, Placement]]] = {}
        for i, p in enumerate(nearest):
            if p.tier is not Tier.DRAM or p.stored != sum(d.nbytes for d in pieces[i]):
                continue
            if p.node != self.node_id:
                if self.peers.trusted(p.node):
                    by_peer.setdefault(p.node, []).append((i, p))
            elif bound is not None and p.offset + p.stored <= bound.segment.capacity:
                with bound.segment.view(p.offset, p.stored) as src:
                    mark(i, copy_checked(src, pieces[i]) == p.checksum)
        for node_id, located in by_peer.items():
            self._read_dram(node_id, located, pieces, mark, pinned=False)
        hits: dict[str, list[bytes]] = {}
        for i in read:
            hits.setdefault(nearest[i].node, []).append(nearest[i].key)
        for node_id, keys in hits.items():
            with contextlib.suppress(NodeUnreachable):
                (bound.handle if node_id == self.node_id and bound is not None else self.handles[node_id]).touch(keys)
        return read

    def pinned(
        self,
        node_id: str,
        keys: list[bytes],
        pieces: list[list[memoryview]],
        on_done: Callable[[int], None] | None = None,
    ) -> list[Outcome]:
        """Pin ``keys`` on ``node_id``, move their bytes into ``pieces`` (per key, the buffers its bytes fill in
        order), release them; an :data:`Outcome` per key (``NodeUnreachable`` if the node is gone).  ``on_done(j)`` as
        soon as ``keys[j]`` is in place, intact."""
        bound = self.local.current() if node_id == self.node_id else None
        node = bound.handle if bound is not None else self.handles[node_id]
        loaded = node.prepare_load(keys, copy_nvme=bound is None)  # a peer's NVMe chunks come back with this one call
        chunks = loaded.chunks
        result: list[Outcome] = [None] * len(keys)

        def mark(j: int, intact: bool) -> None:
            result[j] = intact
            if intact and on_done is not None:
                on_done(j)

        try:
            usable = [
                (j, c) for j, c in enumerate(chunks) if c is not None and c.size == sum(p.nbytes for p in pieces[j])
            ]
            if bound is not None:
                for j, c in usable:
                    with contextlib.suppress(ChunkNotFound):
                        mark(j, self._copy_local(bound, c, pieces[j]))
            else:
                self._from_peer(node_id, usable, loaded.copies, pieces, mark)
            return result
        finally:
            node.complete_load(keys)

    def _copy_local(self, bound: Binding, chunk: StoredChunk, pieces: list[memoryview]) -> bool:
        """Copy a chunk pinned on this node (``bound``: as the client bound it) into ``pieces``; whether it came out
        intact.  One left on NVMe (not promoted: promote_on_hit off, or DRAM full) is read from the segment file, no
        byte through the node."""
        if chunk.tier is Tier.DRAM:
            with bound.segment.view(chunk.offset, chunk.stored) as src:
                return copy_checked(src, pieces) == chunk.checksum
        if (nvme := bound.nvme()) is None:
            raise ChunkNotFound(f"chunk {short(chunk.key)} is on an NVMe segment this client cannot open")
        if chunk.codec == "raw":
            at = chunk.offset
            for piece in pieces:
                at += nvme.read_into(at, piece)
            return checksum_of(pieces) == chunk.checksum
        return fill(pieces, nvme.read(chunk.offset, chunk.stored), chunk.codec, chunk.checksum, chunk.key, self.keys)

    def _from_peer(
        self,
        node_id: str,
        usable: list[tuple[int, StoredChunk]],
        copies: list[bytes | None],
        pieces: list[list[memoryview]],
        mark: Callable[[int, bool], None],
    ) -> None:
        """Chunks left on the peer's NVMe came back with ``prepare_load`` (``copies``: the transport reaches DRAM
        only); DRAM chunks by READs straight into the caller's registered buffers (a READ per piece), the rest
        through the staging buffer and one checked copy into their pieces."""
        for j, c in usable:
            if c.tier is not Tier.DRAM and (data := copies[j]) is not None:
                with contextlib.suppress(ChunkNotFound):  # sealed, and this process cannot open it: a miss
                    mark(j, fill(pieces[j], data, c.codec, c.checksum, c.key, self.keys))
        self._read_dram(node_id, [(j, c) for j, c in usable if c.tier is Tier.DRAM], pieces, mark)

    def _read_dram(
        self,
        node_id: str,
        located: Sequence[tuple[int, Located]],
        pieces: list[list[memoryview]],
        mark: Callable[[int, bool], None],
        pinned: bool = True,
    ) -> None:
        """READ chunks out of the DRAM segment of the peer ``node_id`` (``located``: each one's index and where it
        lies there; ``pinned`` there, or not) into their ``pieces``, each ``mark``-ed with whether it came out
        intact: one READ per piece, straight into it, where every piece lies in a registered buffer; the rest
        through the staging buffer and one checked copy into their pieces.  Nothing is marked if the transfer
        failed."""
        addresses = {j: a for j, _ in located if (a := self.peers.registered_addresses(pieces[j])) is not None}
        direct = [(j, c) for j, c in located if j in addresses]
        if direct:  # no staging, no copy
            ops = []
            for j, c in direct:
                at = c.offset
                for piece, address in zip(pieces[j], addresses[j], strict=True):
                    if piece.nbytes:
                        ops.append(Op(SEGMENT_NAMES[Tier.DRAM], at, address, piece.nbytes))
                    at += piece.nbytes
            if not self.peers.read(node_id, ops, pinned):
                return
            for j, c in direct:
                mark(j, checksum_of(pieces[j]) == c.checksum)
        staged = [(j, c) for j, c in located if j not in addresses]
        for r in rounds([c.stored for _, c in staged], STAGING_BYTES):
            staging = self.peers.staging(sum(c.stored for _, c in staged[r]))
            ops, at = [], 0
            for _, c in staged[r]:
                ops.append(Op(SEGMENT_NAMES[Tier.DRAM], c.offset, staging.ctypes.data + at, c.stored))
                at += c.stored
            if not self.peers.read(node_id, ops, pinned):
                return
            at = 0
            for j, c in staged[r]:
                mark(j, copy_checked(staging[at : at + c.stored].data, pieces[j]) == c.checksum)
                at += c.stored
