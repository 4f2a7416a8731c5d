"""The serving harness (``bench/serve.py``): a trace replayed by ``vllm bench serve`` through real vLLM OpenAI
servers behind ``kvpool route``, one KV-cache layer below them at a time (``layers``: none, kvpool; the peers
``lmcache`` and ``mooncake`` where they are installed)."""
