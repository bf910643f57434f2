"""Which rank holds what of glm5_next: the sharding rule of every weight (and its MTP layer), the
per-rank config the rank-local blocks are built from, and the rules of the decode state.

The rules apply to the serving state dict (`weights.to_serving_names`: the names
Glm5NextForServing / Glm5NextMTP load), i.e. BEFORE `prepare()` fuses anything: the fused
KDA / MLA `in_proj` and the DenseMLP `gate_up` are then built per rank from already-cut pieces,
so a replicated piece (f_a, g_a, q_a, kv_a, the indexer's) stays whole inside a rank's fused
matrix. Two tensors of that state dict are merged layouts and are cut per part:
`self_attn.conv1d.weight` [3*H*Dk, 1, K] per q|k|v third, `mlp.experts.gate_up_proj`
[E, 2I, D] per gate|up half. The rule of every weight is looked up by exact name for its
layer's kind (KDA or MLA, full or shared indexer, dense or MoE): a name without a rule, or
one that its layer cannot have, raises ShardingError (a new weight must be given a rule).

Rules (t = tp_size; the MoE's axes in trnrt.parallel.context):
  replicated   norms, mHC (attn_hc/ffn_hc), KDA f_a/g_a/o_norm, MLA q_a/kv_a and their norms,
               the indexer, the router and its bias, MTP enorm/hnorm/eh_proj/shared_head.norm
  column       KDA q/k/v/b/g_b, f_b, dt_bias, A_log (by head); MLA q_b, kv_b (by head);
               dense and shared gate_proj/up_proj (by row)
  row          KDA and MLA o_proj, dense and shared down_proj (by input column)
  per third    KDA conv1d (each of q, k, v cut by head)
  vocab        embed_tokens, lm_head (and the MTP layer's own, if any): rows / t
  experts      gate_up_proj: E over 'ep', each half's I over 'moe_tp'; down_proj: E over 'ep',
               I over 'moe_tp' (EP mode: E / t experts whole; TP mode: I / t of every expert)
State: MLA latents, pooled keys and the indexer tail replicated; KDA recurrent state by head,
the conv window per third (its channels are the conv's).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch

from trnrt.parallel.context import ParallelContext
from trnrt.parallel.shard import REPLICATE, Rule, ShardingError, Split, read_shard

from .config import LINEAR, ConfigError, Glm5NextConfig

R = REPLICATE
VOCAB: Rule = (Split(0),)

_TOP: dict[str, Rule] = {"embed_tokens.weight": VOCAB, "lm_head.weight": VOCAB, "norm.weight": R}
_MTP_TOP: dict[str, Rule] = {
    "embed_tokens.weight": VOCAB, "shared_head.head.weight": VOCAB, "shared_head.norm.weight": R,
    "enorm.weight": R, "hnorm.weight": R, "eh_proj.weight": R,
    "input_layernorm.weight": R, "post_attention_layernorm.weight": R,
}
_LAYER_TOP: dict[str, Rule] = {
    "input_layernorm.weight": R, "post_attention_layernorm.weight": R,
    **{f"{hc}.{p}": R for hc in ("attn_hc", "ffn_hc") for p in ("fn", "base", "scale")},
}
_INDEXER: dict[str, Rule] = {
    f"self_attn.indexer.{n}": R for n in (
        "wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight",
        "index_kpool_compress_ape", "index_kpool_compress_gate",
    )
}


def _kda(cfg: Glm5NextConfig) -> dict[str, Rule]:
    dk = cfg.linear_head_dim
    head = (Split(0, unit=dk),)
    p = "self_attn."
    return {
        p + "q_proj.weight": head, p + "k_proj.weight": head, p + "v_proj.weight": head,
        p + "conv1d.weight": (Split(0, parts=3, unit=dk),),
        p + "forget_gate.f_a_proj.weight": R,
        p + "forget_gate.f_b_proj.weight": head,
        p + "forget_gate.dt_bias": head,
        p + "forget_gate.A_log": (Split(0),),
        p + "b_proj.weight": (Split(0),),
        p + "g_a_proj.weight": R,
        p + "g_b_proj.weight": head,
        p + "o_norm.weight": R,
        p + "o_proj.weight": (Split(1, unit=dk),),
    }


def _mla(cfg: Glm5NextConfig, full_indexer: bool) -> dict[str, Rule]:
    dn, dv = cfg.qk_nope_head_dim, cfg.v_head_dim
    p = "self_attn."
    rules = {
        p + "q_a_proj.weight": R, p + "q_a_layernorm.weight": R,
        p + "kv_a_proj_with_mqa.weight": R, p + "kv_a_layernorm.weight": R,
        p + "q_b_proj.weight": (Split(0, unit=dn),),
        p + "kv_b_proj.weight": (Split(0, unit=dn + dv),),  # per head [W_UK | W_UV] rows
        p + "o_proj.weight": (Split(1, unit=dv),),
    }
    return {**rules, **_INDEXER} if full_indexer else rules


def _dense(prefix: str) -> dict[str, Rule]:
    return {prefix + "gate_proj.weight": (Split(0),), prefix + "up_proj.weight": (Split(0),),
            prefix + "down_proj.weight": (Split(1),)}


_MOE: dict[str, Rule] = {
    "mlp.gate.weight": R, "mlp.gate.e_score_correction_bias": R,
    "mlp.experts.gate_up_proj": (Split(0, "ep"), Split(1, "moe_tp", parts=2)),  # [E, gate I | up I, D]
    "mlp.experts.down_proj": (Split(0, "ep"), Split(2, "moe_tp")),  # [E, D, I]
    **_dense("mlp.shared_experts."),
}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)$")


def rule_for(name: str, cfg: Glm5NextConfig) -> Rule:
    """The rule of a serving state-dict name (base model or `mtp.*`); ShardingError if it has none."""
    if name in _TOP:
        return _TOP[name]
    if name.startswith("mtp."):
        rest = name[len("mtp."):]
        table = {**_MTP_TOP, **_mla(cfg, True), **_MOE}
    else:
        m = _LAYER.match(name)
        if not m or int(m.group(1)) >= cfg.num_hidden_layers:
            raise ShardingError(name, "no sharding rule (not a weight of this glm5_next config)")
        i, rest = int(m.group(1)), m.group(2)
        attn = _kda(cfg) if cfg.layer_types[i] == LINEAR else _mla(cfg, cfg.indexer_types[i] == "full")
        mlp = _MOE if cfg.mlp_layer_types[i] == "sparse" else _dense("mlp.")
        table = {**_LAYER_TOP, **attn, **mlp}
    if rest not in table:
        raise ShardingError(name, "no sharding rule for this name in its layer (a new weight needs a rule "
                                  "in trnrt/models/glm5_next/sharding.py)")
    return table[rest]


RuleFor = Callable[[str, Glm5NextConfig], Rule]


def iter_shards(shapes: Mapping[str, Sequence[int]], get: Callable[[str, tuple[slice, ...]], torch.Tensor],
                cfg: Glm5NextConfig, ctx: ParallelContext, rule: RuleFor = rule_for
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, the rank's shard) for every name of `shapes` (full shapes), read lazily as
    `get(name, index)`: only the rank's blocks are requested. Checks the layout first."""
    check_layout(cfg, ctx)
    for name in shapes:
        yield name, read_shard(lambda idx, n=name: get(n, idx), shapes[name], rule(name, cfg), ctx, name)


def shard_state_dict(sd: Mapping[str, torch.Tensor], cfg: Glm5NextConfig, ctx: ParallelContext,
                     rule: RuleFor = rule_for) -> dict[str, torch.Tensor]:
    """The rank's shard of a full serving state dict (replicated tensors are not copied)."""
    shapes = {k: tuple(v.shape) for k, v in sd.items()}
    return dict(iter_shards(shapes, lambda n, idx: sd[n][idx], cfg, ctx, rule))


# ---------------------------------------------------------------------- per-rank configs
def check_layout(cfg: Glm5NextConfig, ctx: ParallelContext) -> None:
    """ConfigError naming the first dimension the layout cannot split evenly."""
    t, e, mt = ctx.tp_size, ctx.ep_size, ctx.moe_tp_size
    for field, size, by, what in (
        ("vocab_size", cfg.vocab_size, t, "tp_size"),
        ("num_attention_heads", cfg.num_attention_heads, t, "tp_size"),
        ("linear_num_heads", cfg.linear_num_heads, t, "tp_size"),
        ("intermediate_size", cfg.intermediate_size, t, "tp_size"),
        ("moe_intermediate_size", cfg.moe_intermediate_size, t, "tp_size (the shared expert)"),
        ("moe_intermediate_size", cfg.moe_intermediate_size, mt, "tp_size / ep_size (the routed experts)"),
        ("n_routed_experts", cfg.n_routed_experts, e, "ep_size"),
    ):
        if size % by:
            raise ConfigError(field, f"{size} is not divisible by {what} = {by} (tp {t}, ep {e})")


def local_config(cfg: Glm5NextConfig, ctx: ParallelContext) -> Glm5NextConfig:
    """The config a rank builds its attention, dense MLP and MoE blocks from: heads / t, dense
    and shared-expert widths / t (MoE: moe_intermediate_size / t gives the shared expert, and
    the routed experts in TP mode). Router, vocabulary and every replicated width unchanged.
    At TP=1 it equals `cfg` (so the TP=1 blocks are the unsharded ones)."""
    check_layout(cfg, ctx)
    t = ctx.tp_size
    if t == 1:
        return cfg
    return dataclasses.replace(
        cfg, num_attention_heads=cfg.num_attention_heads // t, num_key_value_heads=cfg.num_key_value_heads // t,
        linear_num_heads=cfg.linear_num_heads // t, intermediate_size=cfg.intermediate_size // t,
        moe_intermediate_size=cfg.moe_intermediate_size // t,
    )


def expert_config(cfg: Glm5NextConfig, ctx: ParallelContext) -> Glm5NextConfig:
    """The config of a rank's routed experts: E / ep experts of I / moe_tp (Experts reads only these)."""
    check_layout(cfg, ctx)
    return dataclasses.replace(cfg, n_routed_experts=cfg.n_routed_experts // ctx.ep_size,
                               moe_intermediate_size=cfg.moe_intermediate_size // ctx.moe_tp_size)


# ---------------------------------------------------------------------- decode state
def state_rule(field: str, cfg: Glm5NextConfig) -> Rule:
    """The rule of a ModelState / MTPState tensor (layers stacked on dim 0, slots or blocks on dim 1)."""
    if field in ("latent", "pooled", "tail"):
        return R
    if field == "kda":  # [n_kda, NS, H, Dk, Dv]
        return (Split(2),)
    if field == "conv":  # [n_kda, NS, 3*H*Dk, K-1]: the conv's q|k|v channels
        return (Split(2, parts=3, unit=cfg.linear_head_dim),)
    raise ShardingError(field, "not a state tensor of glm5_next")

