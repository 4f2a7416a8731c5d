"""The transfer engine: a ``Transport`` interface with a NIXL/UCX implementation (see issue 8)."""
