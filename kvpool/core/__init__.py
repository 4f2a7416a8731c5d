"""The bottom layer: the vocabulary every other layer shares.

:mod:`kvpool.core.keys` holds chunk keys and cache identities; :mod:`kvpool.core.types` holds tiers, placements, node
records and tombstones; :mod:`kvpool.core.config` holds the base of every config struct and the one function that
checks a config or a mapping against its declared types.  ``kvpool.metadata`` stores these values, and ``kvpool.pool``, ``kvpool.prefill_decode`` and
the CLI speak them.  This package imports nothing of kvpool but ``kvpool.errors`` and ``kvpool.clock`` (the clock
imports only the errors, which import nothing), so that every layer may import it and it imports no layer.
"""
