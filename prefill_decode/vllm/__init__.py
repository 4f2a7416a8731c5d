"""vLLM on the pool: ``KvPoolConnector`` (``connector``: a dispatch shell over its ``scheduler`` and ``worker`` sides),
its validated ``kv_connector_extra_config`` (``config``: no vLLM import, for ``kvpool vllm-config``), a request's
hint in its ``kv_transfer_params`` (``hint``), an engine in a process of its own (``engine``) and the HTTP front over
several engines (``front``).

Nothing here imports vLLM at package import: ``kvpool.prefill_decode.vllm.config`` works where vLLM is not
installed."""
