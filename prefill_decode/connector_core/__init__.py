"""What every engine's connector to the pool does the same way, whatever the engine: one prefix lookup over the watch
cache (:class:`~kvpool.metadata.lookup.PrefixLookup`, which the pool client uses too: the hit, the miss cause, the
access log), one host staging buffer (:class:`~.staging.HostStaging`: grown and registered with the transport once),
one tenant scope
(:class:`~.tenancy.TenantScope`: which tenant a request is for, and the chain its keys are in) and one place that
counts what the engine moved (:class:`~.counts.EngineCounts`: ``kvpool_engine_*`` and ``kvpool_misses_total``).

The reference engine's ``PoolConnector`` and vLLM's ``KvPoolConnector`` sit on it, and so will SGLang's HiCache
backend.  Nothing here imports an engine (vLLM, SGLang, transformers) or the pool client: the client is reached
through the small protocols its methods satisfy.  Runs in the engine's processes (scheduler and workers)."""
