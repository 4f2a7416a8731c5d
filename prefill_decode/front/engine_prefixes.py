"""What each upstream engine holds of a prompt, from the engine's own KV events: ``kvpool route --kv-events``.

Without it, ``kvpool route``'s prefix-aware policy guesses: an upstream holds what it was *sent* (blocks of the prompt's
characters), which is wrong once the engine's prefix cache evicted them, and blind to what reached an engine some other
way (another router, a restart).  vLLM publishes what its prefix cache stores and evicts (``--kv-events-config``);
given an endpoint, each engine *connects* its PUB socket to it, so the router binds one SUB socket
(:class:`~kvpool.prefill_decode.routing.engine_router.EngineEvents`) and tells the engines apart by topic:
``engine0``, ``engine1``, ... in ``--upstream`` order (:func:`events_flag` writes each engine's flag).  The events
carry token ids, so the router tokenizes a prompt as vLLM does (``--tokenizer``: the engines' model directory or
name), then walks each engine's index of blocks.
"""

import itertools
import json
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.errors import ConfigError
from kvpool.prefill_decode.routing.engine_router import EngineEvents

Tokenize = Callable[[dict[str, Any]], list[int] | None]  #: a request body's prompt tokens (None: it has none we read)


def topic(i: int) -> str:
    """The KV-event topic upstream ``i`` publishes under."""
    return f"engine{i}"


def events_config(endpoint: str, i: int) -> dict[str, Any]:
    """vLLM's KV-events config for upstream ``i``, publishing to ``endpoint`` (the router's)."""
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": topic(i)}


def events_flag(endpoint: str, i: int) -> str:
    """:func:`events_config` as vLLM's ``--kv-events-config`` flag, for a shell."""
    return f"--kv-events-config '{json.dumps(events_config(endpoint, i))}'"


@dataclass(frozen=True)
class Asked:
    """A request's prompt as the engines' blocks are compared with it: its tokens, its ``cache_salt``, and its whole
    blocks as a chain of hashes (each covering every block before it; none before the engines' block size is known)."""

    tokens: Sequence[int]
    salt: str
    chain: tuple[int, ...]


class EnginePrefixes:
    """The engines' prefix caches as their KV events describe them, and prompts tokenized as the engines do.

    ``tokenize(body)`` gives a request body's prompt tokens, or None where it cannot (then nothing matches and the
    policy balances load): :func:`tokenizer` makes one from a model directory.  A prompt sent to an engine and not
    answered yet counts as held there too (:meth:`sent`, :meth:`answered`): its blocks are stored once computed, and
    a request that shares them and comes meanwhile (a conversation's next turn, at a high rate) belongs there."""

    def __init__(self, endpoint: str, upstreams: int, tokenize: Tokenize) -> None:
        self.events = EngineEvents(endpoint, [topic(i) for i in range(upstreams)])
        self.tokenize = tokenize
        self._in_flight: list[Counter[int]] = [Counter() for _ in range(upstreams)]
        self._lock = threading.Lock()

    def asked(self, body: dict[str, Any]) -> Asked | None:
        """``body``'s prompt (None where :attr:`tokenize` cannot read one)."""
        tokens = self.tokenize(body)
        if tokens is None:
            return None
        salt = body["cache_salt"] if isinstance(body.get("cache_salt"), str) else ""
        size, chain, h = self._block_size(), [], hash(salt)
        for start in range(0, len(tokens) - size + 1, size) if size else ():
            h = hash((h, tuple(tokens[start : start + size])))
            chain.append(h)
        return Asked(tokens, salt, tuple(chain))

    def held(self, asked: Asked) -> tuple[list[int], int]:
        """Per upstream, the leading blocks of ``asked`` its engine holds or was sent and has not answered, and the
        prompt's whole blocks (of the engines' block size; 0 before any engine stored one)."""
        size = self._block_size()
        if not size:
            return [0] * len(self._in_flight), 0
        held = []
        with self._lock:
            for t, in_flight in zip(self.events.indexes, self._in_flight, strict=True):
                sent = sum(1 for _ in itertools.takewhile(in_flight.__contains__, asked.chain))
                held.append(max(self.events.cached_tokens(t, asked.tokens, asked.salt) // size, sent))
        return held, len(asked.tokens) // size

    def sent(self, i: int, asked: Asked) -> None:
        with self._lock:
            self._in_flight[i].update(asked.chain)

    def answered(self, i: int, asked: Asked) -> None:
        with self._lock:
            self._in_flight[i].subtract(asked.chain)
            self._in_flight[i] = +self._in_flight[i]  # drops what is no longer in flight

    def _block_size(self) -> int:
        return next((index.block_size for index in self.events.indexes.values() if index.block_size), 0)

    def close(self) -> None:
        self.events.close()


def tokenizer(name: str) -> Tokenize:
    """A ``tokenize(body)`` for request bodies of the model ``name`` (a directory, or a name already downloaded): a
    completion's ``prompt`` (text, token ids, or the first of a list of either) as vLLM's completions endpoint tokenizes
    it, a chat's ``messages`` through the model's chat template; ``ConfigError`` if there is no tokenizer there."""
    try:
        from transformers import AutoTokenizer

        loaded = AutoTokenizer.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as exc:
        why = " ".join(str(exc).split())[:240] or type(exc).__name__  # transformers' reasons run to many lines
        raise ConfigError(
            f"--tokenizer {name}: no tokenizer there ({why}); give the engines' model directory"
        ) from None

    from jinja2 import TemplateError  # transformers' chat templates are Jinja

    refused = (TypeError, ValueError, KeyError, AttributeError, IndexError, TemplateError)

    def tokenize(body: dict[str, Any]) -> list[int] | None:
        try:
            if "messages" in body:
                add = bool(body.get("add_generation_prompt", True))
                return list(loaded.apply_chat_template(body["messages"], add_generation_prompt=add, tokenize=True))
            prompt = body.get("prompt", "")
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                prompt = prompt[0]  # a batch: routed by its first prompt
            if isinstance(prompt, str):
                return list(loaded(prompt, add_special_tokens=bool(body.get("add_special_tokens", True))).input_ids)
            return [int(t) for t in prompt] if isinstance(prompt, list) else None
        except refused:  # a body vLLM would refuse too: it says why
            return None

    return tokenize
