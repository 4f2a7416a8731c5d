"""The transfer engine: the ``Transport`` interface and ``NixlTransport`` (UCX via NIXL)."""
