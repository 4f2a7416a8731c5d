"""The reference engine: prefill and decode Ray workers around a real transformers model, on the pool — the model
(``model``), its KV cut into pool chunks (``layout``), the connector that saves and reloads them (``connector``), the
device tier (``device_tier``), the runner, the workers, the HTTP service and the ``kvpool up`` demo."""
