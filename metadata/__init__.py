"""Everything etcd: embedded server, client, node registry, placements, watch-synced cache."""
