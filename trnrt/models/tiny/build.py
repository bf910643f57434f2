"""The tiny model itself: its configuration (text, vision and MTP) and a randomised transformers
model of it. A leaf of `trnrt.models.tiny`: checkpoint.py and tokenizer.py read these names.

See the package docstring for why each value; torch and transformers are imported inside functions.
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
            t.copy_(_scaled(name, noise, text="language_model." in name).to(t.dtype))


def _scaled(name: str, noise, text: bool):
    """The value randomize_ gives tensor `name` from its N(0,1) `noise` (text: a text-model tensor)."""
    import torch

    leaf = name.rsplit(".", 1)[-1]
    is_norm = "norm" in name and leaf == "weight" and noise.dim() == 1
    if is_norm:
        return 1.0 + 0.2 * noise
    if text and name.endswith("embed_tokens.weight"):
        return noise
    if noise.dim() >= 2:
        fan_in = noise.shape[-1] if noise.dim() == 2 else int(torch.tensor(noise.shape[1:]).prod())
        if noise.dim() == 3 and "conv" not in name:
            fan_in = noise.shape[-1]  # experts [E, out, in]
        val = noise / (fan_in ** 0.5)
        if text and name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
            val = val * RESIDUAL_OUT_SCALE
        return val
    if leaf == "e_score_correction_bias":
        return ROUTER_BIAS_STD * noise
    return 0.5 * noise


# The tiny checkpoint's MTP ("nextn") layer (spec §6): config.json fields and the seed offset of
# its own generator (its weights never draw from randomize_'s stream, so the base weights are the
# same with or without it).
TINY_MTP_CONFIG: dict = dict(num_nextn_predict_layers=1, index_share_for_mtp_iteration=True)
TINY_MTP_SEED_OFFSET = 0x4D5450  # "MTP"


def mtp_tensors(seed: int, text_overrides: dict | None = None) -> dict:
    """The tiny MTP layer's tensors, release-named (`model.language_model.layers.{N}.*`, per-expert
    weights), drawn by randomize_'s rules from a generator of its own (seed + TINY_MTP_SEED_OFFSET),
    in sorted parameter-name order. No `embed_tokens` / `shared_head.head`: the target's are shared."""
    import torch

    from trnrt.models.glm5_next.config import Glm5NextConfig
    from trnrt.models.glm5_next.mtp import Glm5NextMTP

    cfg = Glm5NextConfig.from_dict(tiny_text_config(**(text_overrides or {})))
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Glm5NextMTP(cfg).state_dict().items()}
    gen = torch.Generator().manual_seed(seed + TINY_MTP_SEED_OFFSET)
    pre = f"model.language_model.layers.{cfg.num_hidden_layers}."
    inter = cfg.moe_intermediate_size
    out = {}
    for name in sorted(shapes):
        val = _scaled(name, torch.randn(shapes[name], generator=gen, dtype=torch.float32), text=True)
        if name == "mlp.experts.gate_up_proj":  # [E, 2I, D]: gate rows, then up rows
            for e in range(val.shape[0]):
                out[f"{pre}mlp.experts.{e}.gate_proj.weight"] = val[e, :inter].clone()
                out[f"{pre}mlp.experts.{e}.up_proj.weight"] = val[e, inter:].clone()
        elif name == "mlp.experts.down_proj":  # [E, D, I]
            for e in range(val.shape[0]):
                out[f"{pre}mlp.experts.{e}.down_proj.weight"] = val[e].clone()
        else:
            out[pre + name] = val
    return out


def add_mtp_layer(model_dir, seed: int = 0) -> None:
    """Add the tiny MTP layer to a tiny checkpoint written by save_pretrained: its tensors
    (mtp_tensors) into model.safetensors (the base tensors keep their bytes) and TINY_MTP_CONFIG
    into config.json's text_config. Deterministic: same seed, same bytes."""
    import json

    from safetensors.torch import load_file, save_file

    d = Path(model_dir)
    cfg_path = d / "config.json"
    raw = json.loads(cfg_path.read_text(encoding="utf-8"))
    sd = load_file(str(d / "model.safetensors"))
    extra = mtp_tensors(seed)
    clash = sorted(set(sd) & set(extra))
    if clash:
        raise ValueError(f"{d} already has MTP tensors ({clash[0]}, ...)")
    sd.update(extra)
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    raw["text_config"].update(TINY_MTP_CONFIG)
    # transformers' own config.json layout (to_json_string): sorted keys, 2-space indent, newline.
    cfg_path.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n", encoding="utf-8")


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
