"""The client side: what runs in the user's or engine's process (``PoolClient`` and its read, write and
transport paths)."""

from kvpool.pool.client.client import PoolClient

__all__ = ["PoolClient"]
