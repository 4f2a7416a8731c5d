"""Engines on the pool, one room each: ``routing`` (cost model and routers), ``reference`` (prefill and decode
workers around a transformers model) and ``vllm`` (vLLM's KV connector, engine process and front).
``vllm_connector`` is the module path users' ``--kv-transfer-config`` names."""
