"""A request's word to kvpool's connector: ``kv_transfer_params={"kvpool": {"prefetch": true}}``.

vLLM hands each request's ``kv_transfer_params`` (the OpenAI server: the request body's; ``LLM``: the sampling
params' ``extra_args["kv_transfer_params"]``) to the connector as ``request.kv_transfer_params``.  kvpool reads only
its own key, ``"kvpool"``, and leaves the others to whoever set them.  No vLLM import here."""

from typing import Any

import msgspec

from kvpool.core.config import validated

KEY = "kvpool"  #: kvpool's key in a request's ``kv_transfer_params``


class PoolHint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``kv_transfer_params["kvpool"]``, checked: unknown keys and wrong types are refused."""

    #: bring the part of the prompt's held prefix that is not in this engine's pool node's DRAM (its NVMe, the S3
    #: tier, another node) there before loading it; the request waits for it up to the connector's ``prefetch_wait_s``
    prefetch: bool = False


NO_HINT = PoolHint()


def pool_hint(params: Any) -> PoolHint:
    """The hint in a request's ``kv_transfer_params`` (:data:`NO_HINT` where it has none); ``ConfigError`` saying what
    to write where kvpool's key holds something else than a :class:`PoolHint`."""
    if not isinstance(params, dict) or KEY not in params:
        return NO_HINT
    hint: PoolHint = validated(PoolHint, params[KEY], f"kv_transfer_params[{KEY!r}]")
    return hint
