"""The declared types of :class:`~kvpool.pool.client.PoolClient`'s arguments: what ``@checked`` holds each call's
arguments to, and what its ``ConfigError`` tells the caller to pass."""

from collections.abc import Sequence
from typing import Annotated, Any, Protocol, runtime_checkable

from msgspec import Meta

from kvpool.core.config import Finite
from kvpool.core.types import Tier


@runtime_checkable
class OnDone(Protocol):
    """What :meth:`PoolClient.get_into_batch` calls with a key's index as soon as its chunk is in its buffer."""

    def __call__(self, index: int, /) -> None: ...


ReplicaCount = Annotated[int, Meta(ge=1, description="an int >= 1: on how many nodes to store each chunk")]
NodeIds = Annotated[Sequence[str], Meta(description="a list of node ids (kvpool status lists them)")]
NodeId = Annotated[str, Meta(description="a node id (kvpool status lists them), or '' for this client's node")]
MaybeOnDone = Annotated[OnDone | None, Meta(description="a function of the key's index, or None")]
GraceS = Annotated[float, Meta(ge=0, description="a number of seconds >= 0")]
Counts = Annotated[dict[str, Finite], Meta(description="a dict of count names to numbers")]
#: each item is checked by ``tensor_bytes`` (not here: naming torch.Tensor would import torch with the client)
Tensors = Annotated[Sequence[Any], Meta(description="a list of torch tensors, one per key")]
NodeTier = Annotated[Tier, Meta(description="Tier.DRAM or Tier.NVME")]
