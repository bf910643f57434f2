"""The embedded tiny GLM-5.3-Flash checkpoint (`trnrt make-tiny`).

A config that exercises every path of the architecture (KDA and indexed layers, a full and a
shared indexer layer, dense and sparse MLPs, grouped top-k routing, hc_mult 4, sparse selection
within 32 tokens, a SwiGLU clamp that bites) with weights scaled so activations are O(1).
Same seed, byte-identical files. See ../shared/reference/glm5_next.md §4 for why each value.
"""

from __future__ import annotations

import copy
from pathlib import Path

TINY_VOCAB_SIZE = 4096

# Text config of the tiny model. Layer 2 is a "shared" indexer layer directly after the full
# indexer layer 1 (the only arrangement transformers accepts).
TINY_TEXT_CONFIG: dict = dict(
    vocab_size=TINY_VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=6,
    layer_types=[
        "linear_attention", "indexed_attention", "indexed_attention",
        "linear_attention", "indexed_attention", "linear_attention",
    ],
    indexer_types=["full", "full", "shared", "full", "full", "full"],
    mlp_layer_types=["dense", "sparse", "sparse", "dense", "sparse", "sparse"],
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=0,
    v_head_dim=16,
    index_n_heads=16,
    index_head_dim=16,
    index_topk=8,
    index_kpool=4,
    index_kpool_always_select_tail=True,
    linear_num_heads=4,
    linear_head_dim=16,
    linear_conv_kernel_dim=4,
    linear_lower_bound=-5.0,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    swiglu_limit=1.5,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    rms_norm_eps=1e-5,
    max_position_embeddings=4096,
    pad_token_id=0,
    eos_token_id=None,
    tie_word_embeddings=False,
)

# transformers always builds the vision tower; keep it as small as it allows.
TINY_VISION_CONFIG: dict = dict(
    depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
    projection_intermediate_size=64, patch_size=14, image_size=28,
)


def tiny_text_config(**overrides) -> dict:
    """A copy of the tiny text config with `overrides` applied."""
    cfg = copy.deepcopy(TINY_TEXT_CONFIG)
    cfg.update(overrides)
    return cfg


# Residual-branch output projections are N(0,1)/sqrt(fan_in) times this (see randomize_).
RESIDUAL_OUT_SCALE = 0.2
# Std of the router's e_score_correction_bias (a load-balancing offset, see randomize_).
ROUTER_BIAS_STD = 0.1


def randomize_(model, seed: int) -> None:
    """Give every floating parameter and buffer O(1)-activation values, deterministically.

    Matrices N(0,1)/sqrt(fan_in); 1-D tensors N(0, 0.25); norm weights 1 + 0.2 N(0,1).
    transformers' default init (0.02 std, zero A_log) gives near-zero activations that test nothing.

    Three exceptions make the checkpoint look like a trained model where it matters for bf16:
    * the text embedding is N(0,1) (torch's nn.Embedding init), not N(0,1)/sqrt(hidden);
    * every residual-branch output projection (KDA/MLA `o_proj`, dense/shared/routed `down_proj`)
      is scaled by RESIDUAL_OUT_SCALE, so each block adds a small update (rms ~0.1-0.2) to a
      stream that already carries the token (rms ~1), as in trained models (the GPT-2/Megatron
      1/sqrt(2 * layers) init rule would give 0.29 here; 0.2 leaves more bf16 margin);
    * the router's e_score_correction_bias (a load-balancing offset) is N(0, ROUTER_BIAS_STD^2),
      smaller than the spread of the sigmoid scores, instead of N(0, 0.25) which decided routing
      by itself (every token picked the same expert group in layer 4).
    With the plain rule the embedding (rms 0.125) was swamped by layer 0's output (rms ~0.5), so
    the whole stream carried bf16 rounding error (1.6 % relative after layer 0, 46 % after layer
    5), which flipped indexer pool picks (2 of <= 28 pools) and expert choices from layer 1 on:
    transformers' own bf16 model matched its fp32 argmax on only 42 % of teacher-forced positions.
    Now it matches on ~97.5 % (1000 positions; trnrt's bf16 decode ~96.5 % vs its fp32), the
    rest being near-tied top-2 logits (logit std ~1 over 4096 tokens; bf16 rounding of the fp32
    logits alone flips 1 %). The blocks still matter (they move the final hidden state by ~40 %;
    the embedding-only "bigram" argmax matches on only ~41 % of positions), and the SwiGLU clamp
    (7 % of gates, 14 % of ups), indexer sparsity and group masking (both groups win in every
    MoE layer) act on RMS-normalised block inputs, unchanged.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    with torch.no_grad():
        for name, t in sorted(tensors, key=lambda kv: kv[0]):
            if not t.is_floating_point():
                continue
            noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
            leaf = name.rsplit(".", 1)[-1]
            text = "language_model." in name
            is_norm = "norm" in name and leaf == "weight" and t.dim() == 1
            if is_norm:
                val = 1.0 + 0.2 * noise
            elif text and name.endswith("embed_tokens.weight"):
                val = noise
            elif t.dim() >= 2:
                fan_in = t.shape[-1] if t.dim() == 2 else int(torch.tensor(t.shape[1:]).prod())
                if t.dim() == 3 and "conv" not in name:
                    fan_in = t.shape[-1]  # experts [E, out, in]
                val = noise / (fan_in ** 0.5)
                if text and name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                    val = val * RESIDUAL_OUT_SCALE
            elif leaf == "e_score_correction_bias":
                val = ROUTER_BIAS_STD * noise
            else:
                val = 0.5 * noise
            t.copy_(val.to(t.dtype))


def build_hf_model(seed: int = 0, text_overrides: dict | None = None, dtype: str = "float32"):
    """A randomised transformers Glm5NextForConditionalGeneration with the tiny config."""
    import torch
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    text = tiny_text_config(**(text_overrides or {}))
    cfg = Glm5NextConfig(text_config=text, vision_config=dict(TINY_VISION_CONFIG))
    torch.manual_seed(seed)
    model = Glm5NextForConditionalGeneration(cfg)
    randomize_(model, seed)
    model.to(getattr(torch, dtype))
    model.eval()
    return model


# Imported last: checkpoint.py reads the names above (it imports torch only inside functions).
from trnrt.models.tiny.checkpoint import (  # noqa: E402
    TINY_CHECKPOINT_VERSION,
    cache_dir,
    default_model_dir,
    write_tiny_checkpoint,
)
