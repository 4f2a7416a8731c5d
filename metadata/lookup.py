"""One prefix lookup over the watch cache, for the pool client and every engine's connector: how many leading chunks
the pool holds, why the next one is missing, and the access log ``kvpool advise`` reads."""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvpool.metadata.cache import MetadataCache
from kvpool.metadata.misses import MissCause, miss_cause


@dataclass(frozen=True)
class Hit:
    """A prefix lookup's answer, in chunks."""

    asked: int  #: chunks looked up
    held: int  #: leading chunks every object of which the pool holds
    cause: MissCause | None = None  #: why chunk ``held`` is missing (None: every chunk asked for is held)


class AccessRecorder(Protocol):
    """What a lookup needs of an access log (:class:`~kvpool.pool.advisor.AccessLog`)."""

    def record(self, keys: Sequence[bytes], size_of: Callable[[bytes], int]) -> None: ...

    def close(self) -> None: ...


class PrefixLookup:
    """Prefix lookups in a watch-synced copy of etcd (no round trip), each added to the process's access log.

    An engine process has one access log (``KVPOOL_ACCESS_LOG``: one file per process): a process with a
    ``PoolClient`` hands in the client's (``client.access_log``), one without (vLLM's scheduler) its own."""

    def __init__(self, access_log: AccessRecorder | None) -> None:
        self.access_log = access_log

    def __call__(self, cache: MetadataCache, objects: Sequence[Sequence[bytes]]) -> Hit:
        """Look up a prefix given as the pool objects of each of its chunks, in chain order (every chunk the same
        number of objects: its layers, groups of layers or TP ranks' layers, as the engine stores them)."""
        held = len(objects)
        for column in range(max(map(len, objects), default=0)):  # one pass per object of a chunk, not per key
            held = cache.lookup_prefix([chunk[column] for chunk in objects[:held]])
            if held == 0:
                break
        cause = miss_cause(cache, objects[held])[0] if held < len(objects) else None
        if self.access_log is not None:  # every object the request needs, for kvpool advise
            self.access_log.record([key for chunk in objects for key in chunk], cache.size_of)
        return Hit(len(objects), held, cause)

    def close(self) -> None:
        if self.access_log is not None:
            self.access_log.close()
