"""``ModelRunner``: prefill a prompt (reusing a cached prefix from the pool) and decode greedily.

The plain compute, with no Ray and no routing in it: a prefill either starts from ``reuse_chunks`` chunks
fetched through a :class:`PoolConnector` and computes only the rest of the prompt, or computes the whole
prompt.  A prefix whose chunks all hit still computes the last prompt token (its logits give the first
new token), so the cache is cropped to one token short of the prompt.  Any chunk that cannot be
fetched turns the request into a full recompute: a lost chunk costs time, never a wrong answer.
"""

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from kvpool.core.config import Positive, checked
from kvpool.core.keys import token_array
from kvpool.errors import ChunkNotFound, ConfigError
from kvpool.prefill_decode.reference.connector import LoadTimes, PoolConnector
from kvpool.prefill_decode.reference.model import LoadedModel, forward, kv_cache

log = logging.getLogger(__name__)


@dataclass
class Prefilled:
    """A prompt's state after prefill: the cache of every prompt token and the last position's logits."""

    tokens: list[int]
    logits: torch.Tensor  #: [vocab], float32, of the last prompt position
    cache: DynamicCache
    reused_tokens: int  #: prompt tokens whose KV came from the pool
    computed_tokens: int  #: prompt tokens run through the model
    fell_back: bool  #: a reuse was planned but a chunk could not be fetched: everything was recomputed
    seconds: float  #: prompt in → logits out
    load: LoadTimes | None = None

    @property
    def first_token(self) -> int:
        return int(self.logits.argmax())


def prompt_array(
    tokens: Any, *, vocab: int = 0, positions: int | None = None, more: int = 0, model: str = "the model"
) -> np.ndarray:
    """``tokens`` (:func:`~kvpool.core.keys.token_array`) as a prompt ``model`` can take: at least one id, each
    below ``vocab`` (0: not checked), and room for ``more`` tokens after them within ``positions`` (None: no limit)."""
    arr = token_array(tokens, "prompt")
    if not arr.size:
        raise ConfigError("the prompt is empty: give at least one token")
    if vocab and int(arr.max()) >= vocab:
        raise ConfigError(f"token id {int(arr.max())} is outside {model}'s vocabulary size {vocab}: give ids below it")
    if positions is not None and arr.size + more > positions:
        raise ConfigError(
            f"{arr.size} prompt tokens + {more} new ones exceed {model}'s {positions} positions: shorten the prompt"
        )
    return arr


class ModelRunner:
    def __init__(
        self, loaded: LoadedModel, connector: PoolConnector | None = None, *, pipeline_min_tokens: int = 64
    ) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.connector = connector
        #: a reload overlaps its per-layer fetch with compute when at least this many tokens are computed
        self.pipeline_min_tokens = pipeline_min_tokens

    def prompt(self, tokens: Any, more: int = 0) -> np.ndarray:
        """``tokens`` as :func:`prompt_array` this runner's model can take, with room for ``more`` new tokens."""
        cfg = self.model.config
        limit = getattr(cfg, "max_position_embeddings", None)
        return prompt_array(tokens, vocab=cfg.vocab_size, positions=limit, more=more, model=self.loaded.name)

    def _ids(self, tokens: Sequence[int]) -> torch.Tensor:
        return torch.as_tensor(token_array(tokens).astype("int64"), device=self.loaded.device).unsqueeze(0)

    @torch.no_grad()
    def prefill(self, tokens: Sequence[int], keys: Sequence[Sequence[bytes]] = (), reuse_chunks: int = 0) -> Prefilled:
        """Prefill ``tokens``, taking the KV of the first ``reuse_chunks`` chunks (named by ``keys``,
        from :meth:`PoolConnector.keys`) from the pool."""
        arr = self.prompt(tokens)
        prompt: list[int] = arr.tolist()
        ids = torch.from_numpy(arr.astype("int64")).to(self.loaded.device).unsqueeze(0)
        t0 = time.perf_counter()
        if reuse_chunks:
            connector = self._pool("reuse_chunks")
            try:
                return self._prefill_reusing(connector, prompt, ids, keys, reuse_chunks, t0)
            except ChunkNotFound as exc:
                log.warning("cached prefix lost mid-request (%s); recomputing all %d tokens", exc, len(prompt))
                connector.fell_back()
        out = forward(self.model, ids, logits_to_keep=1)
        return Prefilled(
            prompt,
            out.logits[0, -1].float(),
            kv_cache(out),
            0,
            len(prompt),
            bool(reuse_chunks),
            time.perf_counter() - t0,
        )

    def _pool(self, what: str) -> PoolConnector:
        if self.connector is None:
            raise ConfigError(f"{what} needs a runner with a PoolConnector: ModelRunner(loaded, connector)")
        return self.connector

    def _prefill_reusing(
        self,
        connector: PoolConnector,
        tokens: list[int],
        ids: torch.Tensor,
        keys: Sequence[Sequence[bytes]],
        chunks: int,
        t0: float,
    ) -> Prefilled:
        start = min(chunks * connector.layout.chunk_size, len(tokens) - 1)  # the last token's logits are needed
        # overlap pays only when there is compute to hide the fetch behind; for a short suffix a fetch on a
        # thread just competes with the model for the interpreter
        pipelined = len(tokens) - start >= self.pipeline_min_tokens
        loading = connector.load(keys, chunks, tokens=start, pipelined=pipelined)
        with loading.attached(self.model):
            out = forward(self.model, ids[:, start:], loading.cache, logits_to_keep=1)
        loading.finish()
        return Prefilled(
            tokens,
            out.logits[0, -1].float(),
            kv_cache(out),
            start,
            len(tokens) - start,
            False,
            time.perf_counter() - t0,
            loading.times,
        )

    def save(
        self, prefilled: Prefilled, keys: Sequence[Sequence[bytes]], skip_chunks: int = 0, tenant: str = ""
    ) -> int:
        """Put the prompt's full chunks from ``skip_chunks`` on (those before are in the pool) as ``tenant``'s; bytes
        put."""
        return self._pool("save").save(prefilled.cache, keys, skip_chunks, tenant=tenant)

    @checked
    @torch.no_grad()
    def decode(
        self, prefilled: Prefilled, max_new_tokens: Positive, *, first_token: int | None = None, eos: int | None = None
    ) -> list[int]:
        """Greedy tokens after the prompt (``first_token`` as given by the prefill worker, if any);
        stops after ``max_new_tokens`` or at ``eos``."""
        token = prefilled.first_token if first_token is None else int(first_token)
        out = [token]
        cache: Any = prefilled.cache
        while len(out) < max_new_tokens and token != eos:
            logits = forward(self.model, self._ids([token]), cache).logits[0, -1]
            token = int(logits.argmax())
            out.append(token)
        return out
