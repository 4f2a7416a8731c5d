"""``PoolClient.get_into_device``: chunks on this node's NVMe go straight from the segment file into the
caller's tensor (GPUDirect Storage where there is a GPU, O_DIRECT here), verified, without promotion."""

import pytest
import ray
import torch

from kvpool.core.keys import CacheIdentity, chunk_keys
from kvpool.core.types import Tier
from kvpool.errors import ConfigError, CorruptChunk
from kvpool.pool.client import PoolClient
from kvpool.pool.gds import nvme_io_path
from kvpool.pool.protocol import NodeInfo, actor_name

SHAPE = (64, 2, 4, 64)  # 128 KiB of float32


def kv(i: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(i))


def keys_of(n: int) -> list[bytes]:
    return chunk_keys(CacheIdentity(model="device-reads", kv_dtype="float32", layout="t", chunk_size=1), range(n))


def tier_of(client: PoolClient, key: bytes) -> Tier:
    return next(p.tier for p in client.cache.replicas(key) if p.node == client.node_id)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


@pytest.mark.parametrize("device", DEVICES)
def test_nvme_chunks_land_in_device_tensors_directly(client: PoolClient, device: str) -> None:
    keys, tensors = keys_of(5), [kv(i) for i in range(5)]
    client.put_batch(list(zip(keys, tensors, strict=True)))
    client.move(keys[:4], Tier.NVME)  # the fifth stays in DRAM: read through the host
    out = [torch.empty(SHAPE, device=device) for _ in keys]
    assert client.get_into_device(keys, out) == [t.nbytes for t in tensors]
    assert all(torch.equal(o.cpu(), t) for o, t in zip(out, tensors, strict=True))
    assert client.device_reads == {
        "direct": 4,
        "direct_bytes": 4 * tensors[0].nbytes,
        "via_host": 1,
        "via_host_bytes": tensors[0].nbytes,
    }
    assert [tier_of(client, k) for k in keys] == [Tier.NVME] * 4 + [Tier.DRAM]  # read in place, not promoted
    node = ray.get_actor(actor_name(client.node_id), namespace=client.config.namespace)
    assert ray.get(node.stats.remote())["nvme_io"] == nvme_io_path().name


def test_a_corrupt_nvme_chunk_is_not_served_to_the_device(client: PoolClient) -> None:
    keys, tensors = keys_of(2), [kv(10), kv(11)]
    client.put_batch(list(zip(keys, tensors, strict=True)))
    client.move(keys, Tier.NVME)
    node = ray.get_actor(actor_name(client.node_id), namespace=client.config.namespace)
    info: NodeInfo = ray.get(node.info.remote())
    [p] = [p for p in client.cache.replicas(keys[0]) if p.tier is Tier.NVME]
    with open(info.nvme_path, "r+b") as f:  # one byte flipped behind the node's back (buffered: the file's pages)
        f.seek(p.offset + 123)
        byte = f.read(1)
        f.seek(p.offset + 123)
        f.write(bytes([byte[0] ^ 0xFF]))
    out = [torch.empty(SHAPE), torch.empty(SHAPE)]
    with pytest.raises(CorruptChunk):
        client.get_into_device(keys, out)
    assert torch.equal(out[1], tensors[1])
    assert not client.exists(keys[0])  # the corrupt replica was dropped by the host path's check


def test_device_reads_need_contiguous_tensors(client: PoolClient) -> None:
    keys = keys_of(1)
    client.put(keys[0], kv(0))
    with pytest.raises(ConfigError, match="must be a dense, contiguous tensor"):
        client.get_into_device(keys, [torch.empty(SHAPE[::-1]).permute(3, 2, 1, 0)])
    with pytest.raises(ConfigError, match=r"must be a torch\.Tensor"):
        client.get_into_device(keys, [bytearray(kv(0).nbytes)])  # type: ignore[list-item]
