"""KVLayout and KVBuffer, pure: chunk views, the cache that views the buffer, keys per layout."""

import pytest
import torch

from kvpool.errors import ConfigError
from kvpool.prefill_decode.reference.layout import KVBuffer, KVLayout, auto_layout
from kvpool.prefill_decode.reference.model import LoadedModel, forward, kv_cache


@pytest.mark.parametrize("layout", ["per-layer", "all-layers", "groups-of-2"])
def test_objects_laid_end_to_end_are_the_cache(model: LoadedModel, layout: str) -> None:
    lay = KVLayout.of(model.model, chunk_size=16, layout=layout)
    with torch.no_grad():
        cache = kv_cache(forward(model.model, torch.arange(70).unsqueeze(0)))
    full = KVBuffer(lay, 4)
    full.fill_from(cache)
    part = KVBuffer(lay, 2)  # the first two chunks, object by object, as a load would fetch them
    objects = {(c, layer): v for c, layer, v in full.object_views()}
    for c, layer, view in part.object_views():
        assert view.is_contiguous() and view.numel() * view.element_size() == lay.object_bytes
        view.copy_(objects[(c, layer)])
    rebuilt = part.to_cache(30)
    for layer in range(lay.layers):
        assert torch.equal(rebuilt.layers[layer].keys, cache.layers[layer].keys[..., :30, :])
        assert torch.equal(rebuilt.layers[layer].values, cache.layers[layer].values[..., :30, :])


def test_the_cache_views_the_buffer_until_the_model_appends(model: LoadedModel) -> None:
    lay = KVLayout.of(model.model, chunk_size=32)
    buffer = KVBuffer(lay, 2)
    cache = buffer.to_cache(63)
    buffer.tensor.fill_(1.5)  # bytes arriving after the cache was made show through
    assert cache.get_seq_length() == 63 and bool((cache.layers[3].keys == 1.5).all())
    with torch.no_grad():
        forward(model.model, torch.tensor([[1, 2]]), cache)
    assert cache.get_seq_length() == 65
    buffer.tensor.fill_(0.0)  # the model's append copied: the buffer is free for the next load
    assert bool((cache.layers[3].keys[..., :63, :] == 1.5).all())


def test_keys_depend_on_the_layout(model: LoadedModel) -> None:
    tokens = list(range(100))
    per = KVLayout.of(model.model, chunk_size=32, layout="per-layer")
    whole = KVLayout.of(model.model, chunk_size=32, layout="all-layers")
    per_keys, whole_keys = per.keys(per.identity("m"), tokens), whole.keys(whole.identity("m"), tokens)
    assert len(per_keys) == len(whole_keys) == 3
    assert all(len(set(k)) == per.layers for k in per_keys) and all(len(k) == 1 for k in whole_keys)
    assert not {k for ks in per_keys for k in ks} & {k for ks in whole_keys for k in ks}
    assert per.object_bytes * per.layers == whole.object_bytes == 32 * per.token_bytes
    pairs = KVLayout.of(model.model, chunk_size=32, layout="groups-of-2")
    pair_keys = pairs.keys(pairs.identity("m"), tokens)
    assert all(len(set(k)) == pairs.layers // 2 == pairs.groups for k in pair_keys)
    assert pairs.object_bytes == 2 * per.object_bytes
    assert not {k for ks in pair_keys for k in ks} & {k for ks in per_keys for k in ks}  # another identity


def test_bad_layouts_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="layout"):
        KVLayout(2, 2, 32, torch.float32, layout="rows")
    for bad in ("groups-of-3", "groups-of-0", "groups-of-8", "groups-of-", None):
        with pytest.raises(ConfigError, match="layout"):
            KVLayout(4, 2, 32, torch.float32, layout=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="chunk_size"):
        KVLayout(2, 2, 32, torch.float32, chunk_size=0)


def test_auto_takes_the_most_layers_per_object_within_512_kib_and_two_groups() -> None:
    kib = 1 << 10
    assert auto_layout(8, 128 * kib) == "groups-of-4"  # the tiny Llama, 256 tokens per chunk
    assert auto_layout(30, 192 * kib) == "groups-of-2"  # SmolLM2-135M in bf16
    assert auto_layout(30, 384 * kib) == "per-layer"  # the same in fp32
    assert auto_layout(8, 16 * kib) == "groups-of-4"  # small layers: still two groups to pipeline
    assert auto_layout(7, 64 * kib) == auto_layout(1, 64 * kib) == "per-layer"
    lay = KVLayout(8, 2, 32, torch.float32, chunk_size=256)  # 128 KiB per layer and chunk
    assert lay.layout == "groups-of-4" and lay.group == 4
    assert lay.identity("m") == KVLayout(8, 2, 32, torch.float32, 256, "groups-of-4").identity("m")
