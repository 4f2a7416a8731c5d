"""The measuring side of ``bench/sglang.py``: one SGLang server's storage side (a host pool and SGLang's real
``HiCacheController`` over it, with one L3 backend) timed through the backend's own calls and through the controller's
threads; the pool client's pages-per-object figures.  It runs in the bench's process, in a Ray actor on the other node
(kvpool cross-node) and in the Mooncake child (its private network namespace)."""

import hashlib
import os
import statistics
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import ray

from kvpool.pool.chunks import checksum
from kvpool.prefill_decode.sglang.cpu_import import import_sglang, tp_group

WAIT_S = 300  #: the longest a controller's acknowledgement is waited for
EXISTS_CALLS = 50  #: batch_exists calls timed (the median is reported)
#: host memory SGLang leaves free when it sizes a host pool (it keeps 10 GiB for the rest of a server; the bench's
#: processes need far less, and the machine it runs on may not have 10 GiB to spare beside its pools)
RESERVE = 1 << 30


@dataclass(frozen=True)
class Shape:
    """The pages moved: ``page`` tokens of a ``layers``-layer model with ``heads`` KV heads of ``dim`` (bf16), in host
    layout ``layout``, ``batch`` pages a call (SGLang's controller moves up to 128 a batch)."""

    layers: int = 32
    heads: int = 8
    dim: int = 128
    page: int = 64
    batch: int = 128
    layout: str = "page_first_direct"

    @property
    def page_bytes(self) -> int:
        return 2 * self.layers * self.page * self.heads * self.dim * 2

    @property
    def batch_bytes(self) -> int:
        return self.batch * self.page_bytes


def tokens(shape: Shape, tag: str) -> list[int]:
    """``shape.batch`` pages of token ids that only ``tag`` gives (the same in every process)."""
    seed = int.from_bytes(hashlib.sha256(tag.encode()).digest()[:4], "little")
    return [(seed + i * 7919) % 150_000 for i in range(shape.batch * shape.page)]


class Memcpy:
    """memcpy of as many bytes as a batch, in this process, beside each timed pass (the machine's load changes
    during a run: each row is compared with the memcpy of its own moments): ``np.copyto`` between two 256 MiB
    buffers (past any cache), as many times as a batch needs."""

    BLOCK = 256 << 20

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.src = np.random.default_rng(2).integers(0, 256, min(nbytes, self.BLOCK), dtype=np.uint8)
        self.dst = np.ones_like(self.src)

    def seconds(self) -> float:
        t0 = time.perf_counter()
        for at in range(0, self.nbytes, self.src.nbytes):
            n = min(self.src.nbytes, self.nbytes - at)
            np.copyto(self.dst[:n], self.src[:n])
        return time.perf_counter() - t0


class Side:
    """A host pool with room for ``batches`` batches (the first filled with random bytes: the pages saved; the second
    for the loads) and SGLang's ``HiCacheController`` over it with ``backend`` (a factory name; ``extra``: its extra
    config)."""

    def __init__(
        self, shape: Shape, backend: str, extra: dict[str, Any], model: str = "bench-sglang", batches: int = 2
    ) -> None:
        import_sglang("sglang.srt.mem_cache.hicache_storage")
        import sglang.srt.mem_cache.pool_host.base as host_base
        import torch
        from sglang.srt.managers.cache_controller import HiCacheController
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

        self.shape = shape
        host_base.HICACHE_HOST_MEMORY_RESERVE_BYTES = RESERVE  # SGLang's 10 GiB: more than this machine spares
        dims = {"head_num": shape.heads, "head_dim": shape.dim, "layer_num": shape.layers}
        dev = MHATokenToKVPool(  # the device pool only sizes the host pool: a few pages
            size=4 * shape.page,
            page_size=shape.page,
            dtype=torch.bfloat16,
            device="cpu",
            enable_memory_saver=False,
            **dims,
        )
        self.host = MHATokenToKVPoolHost(
            dev.get_device_pool_infos()[0].buffer_info,
            2.0,
            0,
            shape.page,
            shape.layout,
            pin_memory=False,
            device="cpu",
            device_capacity_tokens=dev.size,
            start_layer=dev.start_layer,
            end_layer=dev.end_layer,
            host_token_capacity=(batches * shape.batch + 1) * shape.page,
        )
        allocator = PagedTokenToKVPoolAllocator(dev.size, shape.page, torch.bfloat16, "cpu", dev, need_sort=False)
        self.ctrl = HiCacheController(
            allocator,
            self.host,
            shape.page,
            tp_group(),
            load_cache_event=threading.Event(),
            write_policy="write_through",
            io_backend="direct",
            storage_backend=backend,
            model_name=model,
            storage_backend_extra_config=dict(extra),
        )
        self.backend = self.ctrl.storage_backend
        self.src: Any = self.host.alloc(shape.batch * shape.page) if batches > 1 else None
        for start in [] if self.src is None else self.src[:: shape.page].tolist():  # random bytes in each page saved
            self._page(int(start)).view(torch.int16).random_()
        self._op = SimpleNamespace(request_id="bench", is_terminated=lambda: False)
        self.memcpy = Memcpy(shape.batch_bytes)

    def _page(self, start: int) -> Any:
        """The page at host slot ``start`` as one strided view (K and V of every layer)."""
        from kvpool.prefill_decode.sglang.pages import PageLayout

        return PageLayout(self.host).view(start)

    def hashes(self, tag: str) -> list[str]:
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        return list(get_storage_hash_str(tokens(self.shape, tag), None, page_size=self.shape.page))

    def digests(self, slots: Any) -> list[int]:
        """The crc32c of each page at ``slots`` (page starts), in the pool object's order: compared across sides."""
        import torch

        return [checksum(self._page(int(s)).contiguous().view(-1).view(torch.uint8).numpy()) for s in slots]

    def source_digests(self) -> list[int]:
        return self.digests(self.src[:: self.shape.page].tolist())

    # -- the backend's own calls: the ones the controller makes for a batch ---------------------------------

    def save(self, tag: str) -> float:
        """Seconds to save the source pages as ``tag``'s (``batch_set_v1``, or the generic ``batch_set``)."""
        hashes = self.hashes(tag)
        t0 = time.perf_counter()
        ok = self.ctrl.page_set_func(hashes, self.src)
        seconds = time.perf_counter() - t0
        if not ok:
            raise RuntimeError(f"{type(self.backend).__name__} did not save the batch")
        return seconds

    def exists(self, tag: str) -> float:
        """Median seconds of ``batch_exists`` of ``tag``'s pages (all of them held: checked)."""
        hashes, times = self.hashes(tag), []
        for _ in range(EXISTS_CALLS):
            t0 = time.perf_counter()
            held = self.backend.batch_exists(hashes)
            times.append(time.perf_counter() - t0)
            if held != len(hashes):
                raise RuntimeError(f"{type(self.backend).__name__}.batch_exists: {held} of {len(hashes)} pages held")
        return statistics.median(times)

    def load(self, tag: str) -> tuple[float, list[int]]:
        """Seconds to load ``tag``'s pages into fresh host slots (``batch_get_v1``, or the generic ``batch_get``
        and the copy into the host pool) and the loaded pages' digests."""
        hashes, dst = self.hashes(tag), self.host.alloc(self.shape.batch * self.shape.page)
        try:
            t0 = time.perf_counter()
            got = self.ctrl.page_get_func(self._op, hashes, dst)
            seconds = time.perf_counter() - t0
            if got != len(hashes):
                raise RuntimeError(f"{type(self.backend).__name__} loaded {got} of {len(hashes)} pages")
            return seconds, self.digests(dst[:: self.shape.page].tolist())
        finally:
            self.host.free(dst)

    def drop(self, tag: str) -> None:
        """Remove ``tag``'s pages from the backend (so that the next save writes them again)."""
        hashes, backend = self.hashes(tag), getattr(self.backend, "_backend", self.backend)
        name = type(backend).__name__
        if name == "KvPoolStorage":
            backend.connection.connected.remove_batch(backend.keys(hashes))
        elif name == "HiCacheFile":
            for h in hashes:
                os.remove(os.path.join(backend.file_path, f"{backend._get_suffixed_key(h)}.bin"))
        elif name == "MooncakeStore":
            keys = [f"{k}_{backend.mha_suffix}_{kv}" for k in backend._tag_keys(hashes) for kv in "kv"]
            if any(backend.store.batch_remove(keys, True)):
                raise RuntimeError("Mooncake's batch_remove failed")
        else:
            raise RuntimeError(f"no way to drop pages from {name}")

    # -- through the controller's threads -------------------------------------------------------------------

    def backup(self, tag: str) -> float:
        """Seconds from ``write_storage`` of the source pages (as ``tag``'s tokens) to the backup thread's ack."""
        t0 = time.perf_counter()
        op_id = self.ctrl.write_storage(self.src, tokens(self.shape, tag), hash_value=self.hashes(tag))
        done = self.ctrl.ack_backup_queue.get(timeout=WAIT_S)
        seconds = time.perf_counter() - t0
        if done.id != op_id or done.completed_tokens != len(self.src):
            raise RuntimeError(f"the backup saved {done.completed_tokens} of {len(self.src)} tokens")
        return seconds

    def prefetch(self, tag: str) -> tuple[float, list[int]]:
        """Seconds from ``prefetch`` of ``tag``'s tokens to the prefetch's last ack (the hit query, host slots for
        the hit, the I/O thread's loads) and the loaded pages' digests."""
        ctrl = self.ctrl
        t0 = time.perf_counter()
        ctrl.prefetch(f"bench-{tag}-{t0}", tokens(self.shape, tag), None, None)
        hit = ctrl.prefetch_hit_queue.get(timeout=WAIT_S)
        if hit.storage_hit_count != self.shape.batch * self.shape.page:
            raise RuntimeError(
                f"the prefetch found {hit.storage_hit_count} of {self.shape.batch * self.shape.page} tokens"
            )
        hit.host_indices = self.host.alloc(hit.storage_hit_count)
        ctrl.prefetch_buffer.put(hit)
        completed = 0
        while True:
            ack = ctrl.ack_prefetch_queue.get(timeout=WAIT_S)
            if ack.completed_tokens is not None:
                completed = max(completed, ack.completed_tokens)
            if ack.completed_req:
                break
        seconds = time.perf_counter() - t0
        try:
            if completed != hit.storage_hit_count:
                raise RuntimeError(f"the prefetch loaded {completed} of {hit.storage_hit_count} tokens")
            return seconds, self.digests(hit.host_indices[:: self.shape.page].tolist())
        finally:
            self.host.free(hit.host_indices)

    def close(self) -> None:
        backend = self.backend
        self.ctrl.detach_storage_backend()
        backend = getattr(backend, "_backend", backend)
        if hasattr(backend, "close"):  # HiCacheFile has none
            backend.close()


class RemoteSide:
    """A :class:`Side` in a Ray actor (kvpool on another node): its calls, and the pool client's pages-per-object
    reads."""

    def __init__(self, shape: Shape, extra: dict[str, Any]) -> None:
        self.side = Side(shape, "dynamic", extra, batches=1)  # loads only

    def node(self) -> str:
        return str(ray.get_runtime_context().get_node_id())

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.side, method)(*args)

    def memcpy(self) -> float:
        return self.side.memcpy.seconds()

    def far_gets(self, tag: str, g: int, repeat: int) -> list[float]:
        """:func:`far_gets` by this actor's pool client: what the bench's process stored, read from here."""
        return far_gets(self.side.backend.connection.connected, tag, self.side.shape, g, repeat)

    def close(self) -> None:
        self.side.close()


RemoteActor: Any = ray.remote(num_cpus=0)(RemoteSide)


# -- pages per pool object, through the pool client ------------------------------------------------------------


def group_keys(tag: str, pages: int, group: int) -> list[bytes]:
    """The keys of ``pages`` pages stored ``group`` pages an object."""
    return [hashlib.sha256(f"{tag}-{group}-{i}".encode()).digest() for i in range(pages // group)]


def _get_once(client: Any, keys: list[bytes], size: int) -> float:
    dst = np.empty(len(keys) * size, dtype=np.uint8)
    dst[::4096] = 0  # faulted in before the clock starts
    t0 = time.perf_counter()
    client.get_into_batch(keys, [dst[i * size : (i + 1) * size] for i in range(len(keys))])
    return time.perf_counter() - t0


def grouped(
    client: Any, tag: str, shape: Shape, groups: list[int], repeat: int, far: Any = None
) -> dict[int, dict[str, Any]]:
    """For each ``g`` of ``groups``: seconds of ``repeat`` ``put_batch`` passes of one batch of pages as ``batch / g``
    objects of ``g`` pages (removed between passes), of ``repeat`` ``get_into_batch`` passes of them, and of
    ``far(tag, g)``'s (another node's reads of them, or why there are none); then they are removed."""
    src = np.random.default_rng(0).integers(0, 256, shape.batch_bytes, dtype=np.uint8)
    out: dict[int, dict[str, Any]] = {}
    for g in groups:
        keys, size = group_keys(tag, shape.batch, g), g * shape.page_bytes
        items = [(k, src[i * size : (i + 1) * size]) for i, k in enumerate(keys)]
        puts = []
        for rep in range(repeat):
            t0 = time.perf_counter()
            client.put_batch(items)
            puts.append(time.perf_counter() - t0)
            if rep < repeat - 1:
                client.remove_batch(keys)
        gets = [_get_once(client, keys, size) for _ in range(repeat)]
        out[g] = {"put_s": puts, "get_s": gets, "cross_get_s": far(tag, g) if far is not None else None}
        client.remove_batch(keys)
    return out


def far_gets(client: Any, tag: str, shape: Shape, g: int, repeat: int) -> list[float]:
    """Seconds of ``repeat`` ``get_into_batch`` passes of one batch stored ``g`` pages an object (by :func:`grouped`)."""
    return [_get_once(client, group_keys(tag, shape.batch, g), g * shape.page_bytes) for _ in range(repeat)]


# -- where a same-node load's time goes: its steps alone, on one batch ----------------------------------------


def load_steps(shape: Shape, repeat: int) -> dict[str, float]:
    """GB/s of each step a same-node load can take, alone, over one batch: memcpy, crc32c, a copy and its checksum in
    one pass (``copy_checked``: what a page read straight into its host slots costs), and the staging path's copy
    into the host pool's strided pages (``copy_`` into the page views)."""
    import torch

    from kvpool.pool.chunks import copy_checked

    src = np.random.default_rng(1).integers(0, 256, shape.batch_bytes, dtype=np.uint8)
    dst = np.ones(shape.batch_bytes, dtype=np.uint8)
    host = torch.ones(2 * shape.layers * shape.batch * shape.page * shape.heads * shape.dim, dtype=torch.bfloat16)
    pages = host.view(2, shape.batch, shape.layers, shape.page, shape.heads, shape.dim)  # page_first_direct's order
    staged = torch.from_numpy(src).view(torch.bfloat16).view(shape.batch, 2, shape.layers, shape.page, shape.heads, -1)
    size = shape.page_bytes
    steps = {
        "memcpy": lambda: np.copyto(dst, src),
        "crc32c": lambda: checksum(src.data),
        "copy_checked": lambda: [
            copy_checked(src.data[i * size : (i + 1) * size], [dst.data[i * size : (i + 1) * size]])
            for i in range(shape.batch)
        ],
        "copy into page views": lambda: [pages[:, i].copy_(staged[i]) for i in range(shape.batch)],
    }
    out = {}
    for name, step in steps.items():
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        out[name] = shape.batch_bytes / statistics.median(times) / 1e9
    return out
