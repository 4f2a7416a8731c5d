"""Where a request goes and whether its cached prefix is reloaded: the cost model (``cost``), reload-or-recompute
(``decide``) and the lane router of the reference engine's HTTP front (``router``), routing over vLLM engines from
their KV events (``engine_router``).  Pure decisions over placements and cost figures, no engine import: runs in the
HTTP front's process and in the reference prefill workers (through ``reference/reload.py``)."""
