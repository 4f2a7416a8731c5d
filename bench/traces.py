"""The multi-tenant trace ``bench/routing.py`` replays, deterministic from a seed: requests over shared long
documents with Zipf popularity and per-user questions, and multi-turn conversations that each extend the previous
turn; and its reuse ceiling (the hit rate of one infinite cache)."""

from dataclasses import dataclass

import numpy as np

from kvpool.core.keys import CacheIdentity, chunk_keys


@dataclass(frozen=True)
class TraceSettings:
    requests: int = 160  #: in all, conversation turns included
    documents: int = 16
    doc_tokens: tuple[int, int] = (512, 2048)  #: a document's length is drawn uniformly in this range
    zipf: float = 1.1  #: document popularity: weight of the k-th document is 1 / k ** zipf
    users: int = 32  #: a document request's question is one of these users' (a user asks the same each time)
    question_tokens: tuple[int, int] = (16, 64)
    conversations: int = 8
    turns: int = 4
    answer_tokens: int = 32  #: the previous turn's answer, as the next turn's prompt carries it
    vocab: int = 4096
    seed: int = 0


@dataclass(frozen=True)
class Request:
    tokens: list[int]
    kind: str  #: "document" or "turn <n>"
    label: str  #: which document / conversation


def make_trace(s: TraceSettings) -> list[Request]:
    """The requests in arrival order; the same list for the same settings."""
    rng = np.random.default_rng(s.seed)

    def draw(bounds: tuple[int, int]) -> list[int]:
        return [int(t) for t in rng.integers(0, s.vocab, int(rng.integers(bounds[0], bounds[1] + 1)))]

    docs = [draw(s.doc_tokens) for _ in range(s.documents)]
    questions = [draw(s.question_tokens) for _ in range(s.users)]
    weights = 1.0 / np.arange(1, s.documents + 1) ** s.zipf
    weights /= weights.sum()
    chats = min(s.conversations * s.turns, s.requests)
    is_turn = np.zeros(s.requests, dtype=bool)
    is_turn[rng.choice(s.requests, chats, replace=False)] = True
    talks: list[tuple[int, list[int], int]] = []  #: (conversation, prompt so far, turns taken), not finished
    started, out = 0, []
    for turn_here in is_turn:
        if not turn_here:
            d = int(rng.choice(s.documents, p=weights))
            out.append(Request(docs[d] + questions[int(rng.integers(s.users))], "document", f"doc{d}"))
            continue
        if started < s.conversations and (not talks or rng.random() < 0.5):
            talks.append((started, docs[int(rng.choice(s.documents, p=weights))], 0))
            started += 1
        i = int(rng.integers(len(talks)))
        conv, prompt, taken = talks[i]
        prompt = prompt + draw(s.question_tokens)
        out.append(Request(prompt, f"turn {taken + 1}", f"chat{conv}"))
        prompt = prompt + [int(t) for t in rng.integers(0, s.vocab, s.answer_tokens)]
        if taken + 1 < s.turns:
            talks[i] = (conv, prompt, taken + 1)
        else:
            talks.pop(i)
    return out


def reuse_ceiling(trace: list[Request], chunk: int) -> float:
    """The prefill hit rate of one infinite cache: each request reloads the full chunks of the longest prefix
    an earlier request had (over the prompt tokens of the whole trace)."""
    ident = CacheIdentity(model="trace", kv_dtype="-", layout="-", chunk_size=chunk)
    seen: set[bytes] = set()
    hit = total = 0
    for r in trace:
        keys = chunk_keys(ident, r.tokens)
        n = 0
        while n < len(keys) and keys[n] in seen:
            n += 1
        hit += min(n * chunk, len(r.tokens) - 1)
        total += len(r.tokens)
        seen.update(keys)
    return hit / total
