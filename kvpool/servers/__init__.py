"""The real servers kvpool starts itself for the embedded default and the tests: etcd, a SeaweedFS S3 server, a
local multi-node Ray cluster."""
