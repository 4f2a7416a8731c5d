"""Prefill and decode workers around a real transformers model, on the pool (see issue 4)."""
