"""The chaos bench's own OpenAI client (``vllm bench serve`` gives no tokens back): a trace's requests as token ids,
sent at their trace times from threads, each answer streamed (SSE) with its greedy tokens and their
log-probabilities, and an answer compared token by token with the same request's answer in a run without faults.

A request asks ``/v1/completions`` for ``max_tokens`` tokens at temperature 0, EOS ignored, with ``logprobs: 2``
and ``return_tokens_as_token_ids``: each streamed token comes back as ``token_id:N`` with its log-probability and the
runner-up's, which tells a wrong token (the reference's choice was clear) from a near-tie that float rounding of a
differently batched prefill may tip either way.  TTFT is the time to the first chunk that carries a token.
"""

import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

#: what :func:`compare` says of an answer against the reference's
SAME, WRONG_TOKEN, LOGPROB_OFF, TIE, FAILED = "same", "wrong token", "logprob off", "tie", "failed"


def prompt_tokens(row: dict[str, Any], hash_block: int, vocab: int) -> list[int]:
    """A trace row's prompt: ``hash_block`` token ids per hash id, drawn from the id alone (equal ids: equal tokens,
    so equal prefixes), cut to the row's ``input_length``."""
    blocks = [np.random.default_rng(h).integers(1, vocab, hash_block) for h in row["hash_ids"]]
    return [int(t) for t in np.concatenate(blocks)[: row["input_length"]]]


@dataclass
class Answer:
    """One request's answer, as streamed."""

    status: int = 0  #: HTTP status (0: none came)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    #: per token, the runner-up's log-probability (None: the answer named no other)
    runner_up: list[float | None] = field(default_factory=list)
    sent_at: float = 0.0  #: ``time.monotonic()`` when it was sent
    ttft_s: float = 0.0  #: to the first chunk carrying a token (0: none came)
    error: str = ""  #: why it failed ("" if it did not)

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error


def _token_id(text: str) -> int:
    return int(text.removeprefix("token_id:"))


def _take(answer: Answer, logprobs: dict[str, Any]) -> None:
    """A chunk's tokens, their log-probabilities and each one's runner-up into ``answer``."""
    tokens = [_token_id(t) for t in logprobs.get("tokens") or []]
    tops = logprobs.get("top_logprobs") or [None] * len(tokens)
    for token, lp, top in zip(tokens, logprobs.get("token_logprobs") or [], tops, strict=True):
        others = [v for k, v in (top or {}).items() if _token_id(k) != token]
        answer.tokens.append(token)
        answer.logprobs.append(float(lp))
        answer.runner_up.append(max(others) if others else None)


def complete(http: httpx.Client, url: str, body: dict[str, Any], answer: Answer) -> None:
    """POST ``body`` to ``url``'s ``/v1/completions``, streamed into ``answer`` (its error set where it fails)."""
    done = False
    try:
        with http.stream("POST", f"{url}/v1/completions", json=body) as r:
            answer.status = r.status_code
            if r.status_code != 200:
                answer.error = r.read().decode(errors="replace")[:300]
                return
            for line in r.iter_lines():
                data = line.removeprefix("data: ").strip() if line.startswith("data: ") else ""
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data) if data else {}
                if "error" in chunk:
                    answer.error = json.dumps(chunk["error"])[:300]
                    return
                for choice in chunk.get("choices", []):
                    if choice.get("logprobs") and not answer.tokens and choice["logprobs"].get("tokens"):
                        answer.ttft_s = time.monotonic() - answer.sent_at
                    _take(answer, choice.get("logprobs") or {})
    except httpx.HTTPError as exc:
        answer.error = f"{type(exc).__name__}: {exc}"[:300]
        return
    if not done:
        answer.error = "the stream ended without [DONE]"


def body(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """The request for ``prompt``: greedy, ``max_tokens`` tokens whatever they are, each with its log-probability."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 2,
        "stream": True,
        "ignore_eos": True,
        "return_tokens_as_token_ids": True,
    }


def replay(
    url: str, bodies: Sequence[dict[str, Any]], at_s: Sequence[float], before: Callable[[int], None] | None = None
) -> list[Answer]:
    """Each of ``bodies`` sent to ``url`` at its time (``at_s``, seconds from now) from a thread of its own;
    ``before(i)`` runs just before request ``i`` is sent (a late request goes as soon as it can).  Every answer, in
    order, once all are in."""
    answers = [Answer() for _ in bodies]
    timeout = httpx.Timeout(600.0, connect=30.0)
    with httpx.Client(timeout=timeout, limits=httpx.Limits(max_connections=len(bodies) + 1)) as http:
        start, threads = time.monotonic(), []
        for i, (request, t) in enumerate(zip(bodies, at_s, strict=True)):
            time.sleep(max(0.0, start + t - time.monotonic()))
            if before is not None:
                before(i)
            answers[i].sent_at = time.monotonic()
            threads.append(threading.Thread(target=complete, args=(http, url, request, answers[i]), daemon=True))
            threads[-1].start()
        for thread in threads:
            thread.join()
    return answers


def compare(got: Answer, want: Answer, tolerance: float) -> str:
    """What ``got`` is against the reference's ``want``: the same tokens with log-probabilities within
    ``tolerance`` (absolute), a wrong token, the same tokens with a log-probability off, a tie (the first token that
    differs is one the reference had within ``tolerance`` of its runner-up: either is right), or failed."""
    if not got.ok or len(got.tokens) != len(want.tokens):
        return FAILED
    for a, b, lp_a, lp_b, second in zip(
        got.tokens, want.tokens, got.logprobs, want.logprobs, want.runner_up, strict=True
    ):
        if a != b:
            return TIE if second is not None and lp_b - second <= tolerance else WRONG_TOKEN
        if abs(lp_a - lp_b) > tolerance:
            return LOGPROB_OFF
    return SAME
