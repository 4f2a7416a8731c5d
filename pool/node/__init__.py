"""The node side: what runs inside each ``PoolNode`` Ray actor (its store, moves, journal, publishing, flushes)."""

from kvpool.pool.node.launch import start_pool, stop_pool

__all__ = ["start_pool", "stop_pool"]
