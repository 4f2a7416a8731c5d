"""What a layer below the engines could add on a window of the trace (``bench/serve.py --window``): pure logic."""

from kvpool.bench.serving.window import Shares, shares

TURNS = [[1, 2, 3], [1, 2, 3, 4]]  # a conversation's two turns: the second repeats the first's 3 blocks


def test_round_robin_sends_the_second_turn_elsewhere_and_only_a_global_layer_holds_its_prefix() -> None:
    assert shares(TURNS, engines=2, blocks=64, chunk_blocks=1, routing="round-robin") == Shares(0.0, 3 / 7)


def test_the_layer_serves_whole_chunks_only() -> None:
    assert shares(TURNS, engines=2, blocks=64, chunk_blocks=2, routing="round-robin") == Shares(0.0, 2 / 7)


def test_prefix_aware_routing_finds_the_engine_that_holds_the_prefix_and_the_layer_adds_nothing() -> None:
    assert shares(TURNS, engines=2, blocks=64, chunk_blocks=1, routing="prefix-aware") == Shares(3 / 7, 0.0)


def test_an_engine_cache_too_small_for_the_prefix_evicts_its_head_and_the_layer_serves_it() -> None:
    assert shares(TURNS, engines=1, blocks=2, chunk_blocks=1, routing="round-robin") == Shares(0.0, 3 / 7)


def test_an_empty_window_shares_nothing() -> None:
    assert shares([], engines=2, blocks=64, chunk_blocks=1, routing="round-robin") == Shares(0.0, 0.0)
