"""The pool, by the process each file runs in: ``node/`` (inside each ``PoolNode`` Ray actor), ``client/`` (in the
user's or engine's process), ``protocol.py`` (the typed calls between them), and here what both sides share
(config, chunk records, segments, tenants, what clients count) plus offline analysis (advisor, reuse)."""
