"""bench/traces.py, the trace bench/routing.py replays: same seed, same requests, shaped as asked; its ceiling."""

import itertools
from dataclasses import replace

from kvpool.bench.traces import TraceSettings, make_trace, reuse_ceiling


def test_trace_is_deterministic_and_shaped() -> None:
    s = TraceSettings(requests=60, documents=5, conversations=3, turns=3, doc_tokens=(64, 128), seed=7)
    trace = make_trace(s)
    assert trace == make_trace(s) and trace != make_trace(replace(s, seed=8))
    assert len(trace) == 60
    turns = [r for r in trace if r.kind.startswith("turn")]
    assert len(turns) == 9 and {r.label for r in turns} == {"chat0", "chat1", "chat2"}
    for label in ("chat0", "chat1", "chat2"):  # each turn extends the one before: its prompt is a prefix
        mine = [r.tokens for r in turns if r.label == label]
        assert [r.kind for r in turns if r.label == label] == ["turn 1", "turn 2", "turn 3"]
        assert all(b[: len(a)] == a for a, b in itertools.pairwise(mine))
    assert all(max(r.tokens) < s.vocab for r in trace)


def test_reuse_ceiling() -> None:
    doc = list(range(100))
    from kvpool.bench.traces import Request

    trace = [
        Request([*doc, 1], "document", "d"),
        Request([*doc, 2], "document", "d"),
        Request([7] * 10, "document", "x"),
    ]
    # chunks of 10: the second request reuses the document's 10 full chunks, nothing else is seen twice
    assert reuse_ceiling(trace, 10) == 100 / (101 + 101 + 10)
