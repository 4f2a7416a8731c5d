"""What every engine's connector to the pool does the same way, whatever the engine: one prefix lookup over the watch
cache (:class:`~kvpool.metadata.lookup.PrefixLookup`, which the pool client uses too: the hit, the miss cause, the
access log), one host staging buffer (:class:`~.staging.HostStaging`: grown and registered with the transport once),
one tenant scope
(:class:`~.tenancy.TenantScope`: which tenant a request is for, and the chain its keys are in) and one place that
counts what the engine moved (:class:`~.counts.EngineCounts`: ``kvpool_engine_*`` and ``kvpool_misses_total``); and
where an engine finds the pool (:class:`~.settings.PoolSettings`, from its engine's config) and its one client
(:class:`~.connection.PoolConnection`: made on first use, tried again while the pool is down); and the prefetches
requests wait for (:class:`~.prefetch.RequestPrefetches`: a held prefix brought into the engine's node's DRAM first);
and a load's reads (:func:`~.reads.read_each`: one batch, each object on its own if it failed, to learn which missed).

The reference engine's ``PoolConnector``, vLLM's ``KvPoolConnector`` and SGLang's ``KvPoolStorage`` sit on it.
Nothing here imports an engine (vLLM, SGLang, transformers); the pool client is reached through the small protocols
its methods satisfy, and imported only where one is made (``PoolConnection``, on first use).  Runs in the engine's
processes (scheduler and workers)."""
