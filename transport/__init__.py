"""The transfer engine: the ``Transport`` interface, ``NixlTransport`` (UCX via NIXL), handoff."""
