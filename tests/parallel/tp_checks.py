"""The body of every rank of tests/parallel/test_tp_modules.py: each sharded block against its
unsharded original on the same input, on the embedded tiny model's config and weights.

Every rank builds the full tiny model (same seed: same weights on every rank), cuts its shard
with the real rules (`sharding.shard_state_dict`), builds the rank-local blocks
(`parallel_blocks`, `trnrt.parallel.layers`) from it and runs both on the same inputs: a prefill
chunk, a second chunk that reads the state the first left, and decode steps (plain PyTorch,
then with trnrt's fused CPU kernels where they load). A check's result is max |Δ| over its
output (and, where named, the state the forward left), and the collectives it issued.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

# Checks that must pass (max |Δ| <= TOL); the planted one must FAIL (a contiguous 3*qkv conv split).
CHECKS = (
    "embedding", "lm_head", "lm_head_all_positions",
    "kda_prefill", "kda_chunk", "kda_decode", "kda_recurrent_state", "kda_conv_state",
    "mla_prefill", "mla_chunk", "mla_decode", "mla_latent_state",
    "dense_mlp", "shared_expert",
    "moe_tp_prefill", "moe_tp_decode", "moe_tp_short",
    "moe_ep_prefill", "moe_ep_decode", "moe_ep_short", "moe_ep_grouped",
)
FUSED_CHECKS = ("kda_fused_decode", "kda_fused_state", "mla_fused_decode", "moe_tp_fused_decode",
                "moe_ep_decode_kernels_loaded")
PLANTED = "kda_contiguous_conv"
TOL = 1e-5

B, BLOCK, NUM_BLOCKS, NUM_SLOTS = 2, 8, 8, 4
TABLES = [[1, 2, 3], [4, 5, 6]]
SLOTS = [1, 2]
# (start_pos, num_new, S) of each forward: a prefill chunk, a chunk after it, decode steps
STEPS = (([0, 0], [10, 7], 10), ([10, 7], [6, 5], 6), ([16, 12], [1, 1], 1), ([17, 13], [1, 1], 1))


def _delta(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def _load(mod, sd: dict, prefix: str):
    """The rank's shard of the block under `prefix` into `mod` (strict names), fused as served."""
    mod.load_state_dict({k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}, strict=True)
    return _prepare(mod.requires_grad_(False))


def _prepare(mod):
    """What Glm5NextForServing.prepare does per block: fuse the input projections (in_proj, gate_up)."""
    for m in mod.modules():
        if hasattr(m, "prepare"):
            m.prepare()
    return mod


def _x(seed: int, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class _Recorder:
    def __init__(self, *ctxs):
        self.ctxs, self.out = ctxs, {}

    def calls(self) -> int:
        return sum(c.stats.total_calls() for c in self.ctxs)

    def run(self, name: str, fn):
        """fn() -> (reference, sharded[, extra dict]); the collectives issued inside are counted."""
        before = self.calls()
        ref, got, *extra = fn()
        self.out[name] = {"delta": _delta(ref, got), "calls": self.calls() - before, **(extra[0] if extra else {})}

    def value(self, name: str, ref: torch.Tensor, got: torch.Tensor, **extra):
        self.out[name] = {"delta": _delta(ref, got), "calls": 0, **extra}


def run_checks(ctx) -> dict:
    """Every check on this rank -> {"checks": {name: {"delta", "calls", ...}}, "router": [...], ...}."""
    from trnrt.models import kernels
    from trnrt.models.glm5_next.batch import ForwardBatch, _make_meta
    from trnrt.models.glm5_next.config import Glm5NextConfig
    from trnrt.models.glm5_next.model import Glm5NextForServing
    from trnrt.models.glm5_next.parallel_blocks import ParallelDenseMLP, ParallelKDA, ParallelMLA, ParallelMoE
    from trnrt.models.glm5_next.sharding import local_config, rule_for, shard_state_dict, state_rule
    from trnrt.models.glm5_next.state import ModelState
    from trnrt.models.tiny import randomize_, tiny_text_config
    from trnrt.parallel.context import ParallelContext
    from trnrt.parallel.layers import ParallelLMHead, VocabParallelEmbedding
    from trnrt.parallel.shard import Split, shard_tensor

    t0 = time.monotonic()
    cfg = Glm5NextConfig.from_dict(tiny_text_config())
    model = Glm5NextForServing(cfg)
    randomize_(model, seed=0)
    model.requires_grad_(False)
    full_sd = {k: v.clone() for k, v in model.state_dict().items()}
    ctx_ep = ParallelContext(tp_size=ctx.tp_size, tp_rank=ctx.tp_rank, ep_size=ctx.tp_size, group=ctx.group)
    sd_tp = shard_state_dict(full_sd, cfg, ctx)
    sd_ep = shard_state_dict(full_sd, cfg, ctx_ep)

    def contiguous_conv(name, c):  # the planted bug: 3*qkv cut as one block, not per third
        return (Split(0),) if name.endswith("self_attn.conv1d.weight") else rule_for(name, c)

    sd_wrong = shard_state_dict(full_sd, cfg, ctx, rule=contiguous_conv)
    rec = _Recorder(ctx, ctx_ep)
    D, V = cfg.hidden_size, cfg.vocab_size
    lcfg = local_config(cfg, ctx)

    def meta(step):
        start, new, S = step
        batch = ForwardBatch(torch.zeros(B, S, dtype=torch.long), torch.tensor(start), torch.tensor(new),
                             torch.tensor(TABLES), torch.tensor(SLOTS))
        return _make_meta(cfg, batch, BLOCK), S

    # ---- vocab-parallel embedding and lm_head
    emb = VocabParallelEmbedding(V, D, ctx)
    emb.weight.data.copy_(sd_tp["embed_tokens.weight"])
    emb.requires_grad_(False)
    ids = torch.cat([torch.randint(0, V, (B, 7), generator=torch.Generator().manual_seed(1)),
                     torch.tensor([[0, V // 2 - 1, V // 2], [V - 1, V // 2, 1]])], 1)  # shard edges too
    rec.run("embedding", lambda: (F.embedding(ids, full_sd["embed_tokens.weight"]), emb(ids)))
    head = ParallelLMHead(V, D, ctx)
    head.weight.data.copy_(sd_tp["lm_head.weight"])
    head.requires_grad_(False)
    w_head = full_sd["lm_head.weight"]
    h = _x(2, B, D)

    def lm_head():
        logits = head(h)
        return F.linear(h, w_head).float(), logits, {"shape": list(logits.shape)}

    rec.run("lm_head", lm_head)
    h3 = _x(3, B, 5, D)
    rec.run("lm_head_all_positions", lambda: (F.linear(h3, w_head).float(), head(h3)))

    # ---- KDA (layer 0), MLA with its full indexer (layer 1): the same steps through both
    kda_full = _prepare(model.layers[0].self_attn)
    kda = _load(ParallelKDA(cfg, 0, 0, ctx), sd_tp, "layers.0.self_attn.")
    kda_wrong = _load(ParallelKDA(cfg, 0, 0, ctx), sd_wrong, "layers.0.self_attn.")
    mla_full = _prepare(model.layers[1].self_attn)
    mla = _load(ParallelMLA(cfg, 1, 0, 0, ctx), sd_tp, "layers.1.self_attn.")
    st_full = ModelState.allocate(cfg, NUM_BLOCKS, BLOCK, NUM_SLOTS)
    st = ModelState.allocate(lcfg, NUM_BLOCKS, BLOCK, NUM_SLOTS)
    st_wrong = ModelState.allocate(lcfg, NUM_BLOCKS, BLOCK, NUM_SLOTS)

    def mla_step(name, m, S, x):
        def fn():
            o_ref, mask_ref = mla_full(x, m, st_full, None)
            o, mask = mla(x, m, st, None)
            same = (torch.equal(mask, mask_ref) if S > 1 else
                    all(torch.equal(getattr(mask, f), getattr(mask_ref, f)) for f in ("blk", "off", "visible")))
            return o_ref, o, {"selection_equal": same}
        rec.run(name, fn)

    for i, (step, kname, mname) in enumerate(zip(STEPS[:3], ("kda_prefill", "kda_chunk", "kda_decode"),
                                                 ("mla_prefill", "mla_chunk", "mla_decode"))):
        m, S = meta(step)
        x = _x(10 + i, B, S, D)
        y_ref = kda_full(x, m, st_full)
        rec.run(kname, lambda: (y_ref, kda(x, m, st)))
        if i == 0:
            rec.run(PLANTED, lambda: (y_ref, kda_wrong(x, m, st_wrong)))
        mla_step(mname, m, S, x)
    for field in ("kda", "conv"):  # the rank's heads / thirds of the state the full layer left
        ref = shard_tensor(getattr(st_full, field), state_rule(field, cfg), ctx, field)
        rec.value("kda_recurrent_state" if field == "kda" else "kda_conv_state", ref, getattr(st, field))
    rec.out["mla_latent_state"] = {"calls": 0, "delta": max(  # replicated: every rank holds all of it
        _delta(getattr(st_full, f), getattr(st, f)) for f in ("latent", "pooled", "tail"))}

    # ---- dense MLP (layer 0), shared expert and the MoE (layer 1) in TP and EP mode
    dense_full = _prepare(model.layers[0].mlp)
    dense = _load(ParallelDenseMLP(cfg, cfg.intermediate_size, "dense", ctx), sd_tp, "layers.0.mlp.")
    moe_full = _prepare(model.layers[1].mlp)
    inter = cfg.moe_intermediate_size * cfg.n_shared_experts
    shared = _load(ParallelDenseMLP(cfg, inter, "shared", ctx), sd_tp, "layers.1.mlp.shared_experts.")
    moe_tp = _load(ParallelMoE(cfg, ctx), sd_tp, "layers.1.mlp.")
    moe_ep = _load(ParallelMoE(cfg, ctx_ep), sd_ep, "layers.1.mlp.")
    x_pre, x_dec, x_short = _x(20, B, 10, D), _x(21, B, 1, D), _x(22, B, 3, D)
    rec.run("dense_mlp", lambda: (dense_full(x_pre), dense(x_pre)))
    rec.run("shared_expert", lambda: (moe_full.shared_experts(x_pre), shared(x_pre)))
    for mode, par in (("tp", moe_tp), ("ep", moe_ep)):
        rec.run(f"moe_{mode}_prefill", lambda: (moe_full(x_pre), par(x_pre)))
        rec.run(f"moe_{mode}_decode", lambda: (moe_full(x_dec), par(x_dec)))
        rec.run(f"moe_{mode}_short", lambda: (moe_full(x_short, True), par(x_short, True)))

    def grouped_ref():
        flat = x_pre.reshape(-1, D)
        w, idx = moe_full.gate(flat)
        return moe_full.experts.grouped(flat, w, idx).view_as(x_pre) + moe_full.shared_experts(x_pre)

    rec.run("moe_ep_grouped", lambda: (grouped_ref(), moe_ep.forward_ep(x_pre, form="grouped")))
    router = moe_ep.gate(x_pre.reshape(-1, D))[1].tolist()

    # ---- the same decode through trnrt's fused CPU kernels (local shapes), where they load
    fused = kernels.load()
    if fused:
        m, S = meta(STEPS[3])
        x = _x(13, B, S, D)
        rec.run("kda_fused_decode", lambda: (kda_full(x, m, st_full), kda(x, m, st)))
        ref = shard_tensor(st_full.kda, state_rule("kda", cfg), ctx, "kda")
        conv_ref = shard_tensor(st_full.conv, state_rule("conv", cfg), ctx, "conv")
        rec.out["kda_fused_state"] = {"delta": max(_delta(ref, st.kda), _delta(conv_ref, st.conv)), "calls": 0}
        mla_step("mla_fused_decode", m, S, x)
        rec.run("moe_tp_fused_decode", lambda: (moe_full(x_dec), moe_tp(x_dec)))
        rec.run("moe_ep_decode_kernels_loaded", lambda: (moe_full(x_dec), moe_ep(x_dec)))
    return {"checks": rec.out, "router": router, "fused": fused, "kernels_error": kernels.error(),
            "seconds": time.monotonic() - t0}
