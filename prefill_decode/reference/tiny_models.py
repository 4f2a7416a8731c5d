"""Tiny random-weight models of the families beyond one full-attention group, as vLLM's CPU backends run them:
MLA (DeepSeek-V2), a sliding-window hybrid (Gemma3) and a Mamba-2 hybrid (Falcon-H1).  The engine tests and
bench/vllm.py build them; ``tiny_llama`` (model.py) is the dense one."""

from pathlib import Path
from typing import Any

#: the tiny configs' common kwargs (transformers 5.19; hidden 256, vocab 4096, float32)
COMMON: dict[str, Any] = dict(
    vocab_size=4096, hidden_size=256, intermediate_size=512, max_position_embeddings=4096, bos_token_id=1
)

#: name -> (transformers config class, model class, config kwargs)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "deepseek-v2-mla": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        # CPU_MLA compiles head size 576 only: kv_lora_rank 512 + qk_rope_head_dim 64
        dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            kv_lora_rank=512,
            q_lora_rank=128,
            qk_rope_head_dim=64,
            qk_nope_head_dim=32,
            v_head_dim=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=128,
            first_k_dense_replace=1,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            rope_scaling=None,
        ),
    ),
    "gemma3-sliding": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        # 3 sliding-window layers (window 128: 4 of a 256-token chunk's 8 blocks) and 1 full: 4 KV-cache groups
        dict(
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            sliding_window=128,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
        ),
    ),
    "falcon-h1-mamba": (
        "FalconH1Config",
        "FalconH1ForCausalLM",
        # Mamba-2 and attention in every layer: a FullAttention group and a Mamba group
        dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            mamba_n_heads=8,
            mamba_d_head=64,
            mamba_n_groups=1,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=64,
            mamba_d_ssm=512,
        ),
    ),
}


def save_tiny(name: str, root: Path) -> Path:
    """Model ``name`` of :data:`FAMILIES` with random weights (seed 0), saved under ``root`` for vLLM to load
    offline; its directory."""
    import torch
    import transformers

    config_cls, model_cls, kw = FAMILIES[name]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = getattr(transformers, config_cls)(**COMMON, **kw)
        model = getattr(transformers, model_cls)(config)
    path = root / name
    model.to(torch.float32).save_pretrained(path)
    return path
