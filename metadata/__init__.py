"""Everything etcd, as the pool uses it: the client (retries, deadlines, errors translated), the node registry on
leases, placements, tombstones and identities, the watch-synced cache and the chunk events derived from it.  The etcd
servers kvpool starts live in ``kvpool.servers``."""
