"""Prefill → decode handoff between two Ray nodes: the consumer READs the producer's tensor directly."""

from typing import Any

import pytest
import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvpool.errors import TransferError
from kvpool.transport.handoff import Handoff, offer, take, wait_taken, withdraw
from kvpool.transport.nixl import NixlTransport


@ray.remote(num_cpus=0)
class Producer:
    def __init__(self) -> None:
        self.transport = NixlTransport(serve=True, scope="test")
        self.kv = torch.arange(3 << 20, dtype=torch.float32).reshape(3, 1 << 20)  # 12 MiB of "KV"
        self.handoff: Handoff | None = None

    def offer(self) -> Handoff:
        self.handoff = offer(self.transport, self.kv)
        return self.handoff

    def wait_taken(self, timeout_s: float) -> str:
        assert self.handoff is not None
        return wait_taken(self.transport, self.handoff, timeout_s)

    def withdraw(self) -> None:
        assert self.handoff is not None
        withdraw(self.transport, self.handoff)


@ray.remote(num_cpus=0)
class Consumer:
    def __init__(self, scope: str = "test") -> None:
        self.transport = NixlTransport(scope=scope)

    def take(self, handoff: Handoff) -> float:
        dest = torch.empty(3, 1 << 20, dtype=torch.float32)
        take(self.transport, handoff, dest)
        return float(dest.sum().item())


def on(node_id: str) -> Any:
    return NodeAffinitySchedulingStrategy(node_id, soft=False)


def test_consumer_reads_the_producers_tensor_and_the_producer_hears_of_it(ray_cluster: list[str]) -> None:
    producer = Producer.options(scheduling_strategy=on(ray_cluster[1])).remote()
    consumer = Consumer.options(scheduling_strategy=on(ray_cluster[2])).remote()
    handoff = ray.get(producer.offer.remote())
    taken = producer.wait_taken.remote(30.0)
    total = ray.get(consumer.take.remote(handoff))
    assert total == float(torch.arange(3 << 20, dtype=torch.float32).sum().item())
    assert ray.get(taken)  # the consumer's agent name: the producer may free its buffer


def test_unclaimed_handoff_times_out_and_another_cluster_is_refused(ray_cluster: list[str]) -> None:
    producer = Producer.options(scheduling_strategy=on(ray_cluster[1])).remote()
    handoff = ray.get(producer.offer.remote())
    with pytest.raises(TransferError, match="no notification"):
        ray.get(producer.wait_taken.remote(0.5))
    stranger = Consumer.options(scheduling_strategy=on(ray_cluster[2])).remote("other-cluster")
    with pytest.raises(TransferError, match="belongs to cluster"):
        ray.get(stranger.take.remote(handoff))
    ray.get(producer.withdraw.remote())
