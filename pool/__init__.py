"""The pool: chunk keys today; segments, the ``PoolNode`` actor and the client next (issue 3)."""
