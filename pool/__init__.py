"""The pool: chunk keys, DRAM/NVMe segments, allocation and eviction, the ``PoolNode`` actor, the client."""
