"""One tensor-parallel rank's glm5_next serving model (issue #31): the rank-local blocks of
`parallel_blocks`, vocab-parallel embedding / lm_head, loaded strict from the rank's shard.

* `build_rank_model(cfg, rank_sd, ctx, mtp_cfg)`  the model (and its MTP layer when the shard
  has `mtp.*` tensors) from a rank's shard (`sharding.shard_state_dict` output), fused
  (`prepare`) as `weights.load_model` leaves it.
* `load_rank_model(model_dir, dtype, ctx, load_mtp)`  read the checkpoint (one swappable step,
  `read_rank_state_dict`), the dtype / fp32 rules of `weights.load_model`, then build.
* `state_config(model)`  the config a model's ModelState is allocated from (a rank's local one:
  KDA state and conv window per head, MLA latents / pooled keys / indexer tail whole).

What a rank owns (t = tp_size): H / t KDA heads and MLA query heads (their recurrent state, conv
thirds), the dense and shared MLPs' I / t, the routed experts' I / t (ep 1) or E / ep whole
experts, V / t rows of every vocabulary table; every norm, mHC, router, MLA latent projection and
indexer is replicated, so the tokens, hidden streams, routing and DSA top-k are the same on every
rank. Logits are all-gathered to the full vocabulary: every rank samples the same tokens from
the same [B, V] logits (same seeds), so every rank can run the same engine step.

TP=1: both builders return exactly the ordinary model (`Glm5NextForServing` / `Glm5NextMTP`, no
subclass, no collective), so no TP=1 graph changes. The TP>1 classes override only the two ends of
the forward (embedding, logits): the body below repeats `Glm5NextForServing.forward` /
`Glm5NextMTP.forward` with those two lines swapped (model.py / mtp.py are not touched).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from trnrt.parallel.context import ParallelContext
from trnrt.parallel.layers import (ParallelLMHead, VocabParallelEmbedding, vocab_parallel_embedding,
                                   vocab_parallel_logits)

from .batch import ForwardBatch, ModelOutput, _make_meta
from .config import ConfigError, Glm5NextConfig, Glm5NextMTPConfig
from .kda import KDAttention
from .model import Glm5NextForServing
from .moe import MoE
from .mtp import Glm5NextMTP, MTPOutput
from .parallel_blocks import ParallelDenseMLP, ParallelKDA, ParallelMLA, ParallelMoE
from .sharding import local_config
from .state import ModelState, MTPState
from .weights import CheckpointError, is_fp32_param


def _swap_blocks(layer, cfg: Glm5NextConfig, ctx: ParallelContext) -> None:
    """Replace a decoder (or MTP) layer's attention and MLP by their rank-local versions (same names)."""
    a = layer.self_attn
    if isinstance(a, KDAttention):
        layer.self_attn = ParallelKDA(cfg, a.layer_idx, a.kda_idx, ctx)
    else:
        full = a.indexer.full_idx if a.indexer is not None else None
        layer.self_attn = ParallelMLA(cfg, a.layer_idx, a.mla_idx, full, ctx)
    layer.mlp = (ParallelMoE(cfg, ctx) if isinstance(layer.mlp, MoE)
                 else ParallelDenseMLP(cfg, cfg.intermediate_size, "dense", ctx))


class RankForServing(Glm5NextForServing):
    """Glm5NextForServing of one rank at tp_size > 1 (see the module doc). `config` is the full
    model's config (vocab, widths the engine reads); `local_config` the one its blocks and its
    ModelState are built from; `ctx` the rank's ParallelContext."""

    def __init__(self, config: Glm5NextConfig, ctx: ParallelContext):
        super().__init__(config)
        self.ctx = ctx
        self.local_config = local_config(config, ctx)
        V, D = config.vocab_size, config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(V, D, ctx)  # [V/t, D] from vocab_start
        self.lm_head = None if config.tie_word_embeddings else ParallelLMHead(V, D, ctx)
        for layer in self.layers:
            _swap_blocks(layer, config, ctx)

    def allocate_state(self, num_blocks: int, block_size: int, num_slots: int, mtp: bool = False) -> ModelState:
        """The rank's ModelState: KDA state / conv window of its heads, latents whole (state_rule)."""
        if mtp and self.mtp is None:
            raise ValueError("allocate_state(mtp=True) needs a model with its MTP layer")
        w = self.embed_tokens.weight
        return ModelState.allocate(self.local_config, num_blocks, block_size, num_slots, w.dtype, w.device, mtp=mtp)

    def forward(self, batch: ForwardBatch, state: ModelState, all_logits: bool = False,
                all_hidden: bool = False, short_extend: bool = False) -> ModelOutput:
        """Glm5NextForServing.forward with the vocab-parallel embedding (one all-reduce) and the
        logits all-gathered to [.., V]; every other line is the base forward's."""
        meta = _make_meta(self.config, batch, state.block_size, short_extend)
        B, S = meta.B, meta.S
        e = self.embed_tokens(batch.input_ids)  # [B,S,D] (masked rows summed over the ranks)
        streams = e.unsqueeze(2).expand(B, S, self.config.hc_mult, e.shape[-1]).contiguous()  # [B,S,N,D]
        mask = None
        for layer in self.layers:
            streams, m = layer(streams, meta, state, mask)
            mask = m
        last = (meta.num_new - 1).clamp(min=0)  # [B]
        head = self.head_weight()  # [V/t, D]
        if all_logits or all_hidden:
            h = self.norm(streams.mean(2))  # [B,S,D]
            hidden = h.gather(1, last.view(B, 1, 1).expand(B, 1, h.shape[-1])).squeeze(1)  # [B,D]
            logits = vocab_parallel_logits(h if all_logits else hidden, head, self.ctx)  # [B,S,V] or [B,V]
            return ModelOutput(logits=logits, hidden=hidden, hidden_all=h)
        st = streams.gather(1, last.view(B, 1, 1, 1).expand(B, 1, *streams.shape[2:])).squeeze(1)  # [B,N,D]
        hidden = self.norm(st.mean(1))  # [B,D]
        return ModelOutput(logits=vocab_parallel_logits(hidden, head, self.ctx), hidden=hidden)  # [B,V]

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [.., D] -> fp32 logits [.., V]: the rank's [.., V/t] slice all-gathered, so every
        rank samples from the whole vocabulary (a local F.linear would sample a rank-local id)."""
        return vocab_parallel_logits(hidden, self.head_weight(), self.ctx)


class RankMTP(Glm5NextMTP):
    """Glm5NextMTP of one rank at tp_size > 1: rank-local MLA heads and MoE, its own embedding /
    head (if any) vocab-parallel; the target's tables it is handed are the rank's [V/t, D] rows."""

    def __init__(self, config: Glm5NextConfig, ctx: ParallelContext, mtp_config: Glm5NextMTPConfig | None = None,
                 own_embed: bool = False, own_head: bool = False):
        super().__init__(config, mtp_config, own_embed, own_head)
        self.ctx = ctx
        V, D = config.vocab_size, config.hidden_size
        if own_embed:
            self.embed_tokens = VocabParallelEmbedding(V, D, ctx)
        if own_head:
            self.shared_head.head = ParallelLMHead(V, D, ctx)
        _swap_blocks(self, config, ctx)
        n = V // ctx.tp_size  # every vocabulary table of a rank starts at the same row
        self.register_buffer("vocab_start", torch.tensor(ctx.tp_rank * n, dtype=torch.int64), persistent=False)

    def forward(self, batch: ForwardBatch, prev_hidden: torch.Tensor, state: MTPState,
                target_embed: torch.Tensor, target_head: torch.Tensor, all_positions: bool = False,
                short_extend: bool = False) -> MTPOutput:
        """Glm5NextMTP.forward with the vocab-parallel embedding and gathered logits
        (target_embed / target_head: the rank's [V/t, D] rows)."""
        meta = _make_meta(self.config, batch, state.block_size, short_extend)
        B = meta.B
        if prev_hidden.dim() == 2:  # [B, D] decode form
            prev_hidden = prev_hidden.unsqueeze(1)
        emb = target_embed if self.embed_tokens is None else self.embed_tokens.weight
        e = vocab_parallel_embedding(batch.input_ids, emb, self.vocab_start, self.ctx)  # [B,S,D]
        e = e.masked_fill((meta.pos == 0).unsqueeze(-1), 0.0)
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(prev_hidden)], -1))  # [B,S,D]
        a, _ = self.self_attn(self.input_layernorm(x), meta, state, None)  # [B,S,D]
        h = x + a
        out = h + self.mlp(self.post_attention_layernorm(h), meta.short)  # [B,S,D]
        head = target_head if self.shared_head.head is None else self.shared_head.head.weight
        if all_positions:
            h_next = self.shared_head.norm(out)  # [B,S,D]
        else:
            last = (meta.num_new - 1).clamp(min=0)  # [B]
            h_next = self.shared_head.norm(out.gather(1, last.view(B, 1, 1).expand(B, 1, out.shape[-1])).squeeze(1))
        return MTPOutput(logits=vocab_parallel_logits(h_next, head, self.ctx), hidden=h_next)


# ---------------------------------------------------------------------- building and loading
def state_config(model: torch.nn.Module) -> Glm5NextConfig:
    """The config to allocate `model`'s ModelState from: a rank model's local config, else
    `model.config` (the engine should call this, or `model.allocate_state`, not read .config)."""
    return getattr(model, "local_config", None) or model.config


def _skeleton(cfg: Glm5NextConfig, ctx: ParallelContext, mtp_cfg: Glm5NextMTPConfig | None,
              names: set[str]) -> Glm5NextForServing:
    """The model on meta: the ordinary classes at TP=1, the rank classes above it; an MTP layer
    when `names` has `mtp.*` (its own embedding / head when they are among them)."""
    own = dict(own_embed="mtp.embed_tokens.weight" in names, own_head="mtp.shared_head.head.weight" in names)
    with torch.device("meta"):
        if ctx.tp_size == 1:
            model = Glm5NextForServing(cfg)
            if any(n.startswith("mtp.") for n in names):
                model.mtp = Glm5NextMTP(cfg, mtp_cfg, **own)
        else:
            model = RankForServing(cfg, ctx)
            if any(n.startswith("mtp.") for n in names):
                model.mtp = RankMTP(cfg, ctx, mtp_cfg, **own)
    return model


def build_rank_model(cfg: Glm5NextConfig, rank_sd: Mapping[str, torch.Tensor], ctx: ParallelContext,
                     mtp_cfg: Glm5NextMTPConfig | None = None, dtype: torch.dtype | None = None,
                     device: str | torch.device | None = None) -> Glm5NextForServing:
    """The rank's serving model from its shard of the serving state dict (`mtp.*` names: with its
    MTP layer), loaded strict, frozen, eval, fused (`prepare`). dtype: cast as weights.load_model
    does (the fp32 parameters stay fp32); None keeps the tensors' dtypes. device: None keeps theirs.
    Raises CheckpointError naming a missing, unexpected or mis-shaped tensor."""
    sd = dict(rank_sd)
    model = _skeleton(cfg, ctx, mtp_cfg, set(sd))
    expected = dict(model.state_dict())
    for name, ref in expected.items():
        if name not in sd:
            raise CheckpointError(name, f"missing from rank {ctx.tp_rank}'s shard")
        t = sd[name]
        if tuple(t.shape) != tuple(ref.shape):
            raise CheckpointError(name, f"rank {ctx.tp_rank}'s shard has shape {tuple(t.shape)}, "
                                        f"expected {tuple(ref.shape)} (tp {ctx.tp_size}, ep {ctx.ep_size})")
        if not t.is_floating_point():
            raise CheckpointError(name, f"dtype {t.dtype}, expected a floating-point tensor")
        want = t.dtype if dtype is None else (torch.float32 if is_fp32_param(name) else dtype)
        sd[name] = t.to(device=t.device if device is None else device, dtype=want).contiguous()
    unexpected = sorted(set(sd) - set(expected))
    if unexpected:
        raise CheckpointError(unexpected[0], f"unexpected tensor ({len(unexpected)} in all)")
    model.load_state_dict(sd, strict=True, assign=True)
    _rank_buffers(model, next(iter(sd.values())).device)
    model.requires_grad_(False)
    model.eval()
    model.prepare()
    return model


def _rank_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """The rank offsets (non-persistent buffers: vocab_start, expert_start) were made on meta
    with the skeleton and load_state_dict does not fill them: make them again, then check that
    no buffer is left on meta."""
    for mod in model.modules():
        ctx = getattr(mod, "ctx", None)
        if isinstance(mod, VocabParallelEmbedding):
            mod.vocab_start = torch.tensor(ctx.tp_rank * mod.weight.shape[0], dtype=torch.int64, device=device)
        elif isinstance(mod, RankMTP):
            n = mod.config.vocab_size // ctx.tp_size
            mod.vocab_start = torch.tensor(ctx.tp_rank * n, dtype=torch.int64, device=device)
        elif isinstance(mod, ParallelMoE) and "expert_start" in mod._buffers:
            mod.expert_start = torch.tensor(ctx.ep_rank * mod.n_local_experts, dtype=torch.int64, device=device)
        for name, b in mod.named_buffers(recurse=False):
            if b is not None and b.device.type == "meta":
                raise RuntimeError(f"buffer {name!r} of {type(mod).__name__} is still on meta after loading")


ReadFn = Callable[[str | Path, Glm5NextConfig, ParallelContext, bool], dict[str, torch.Tensor]]


def read_full_then_shard(model_dir: str | Path, cfg: Glm5NextConfig, ctx: ParallelContext,
                         load_mtp: bool = False) -> dict[str, torch.Tensor]:
    """The rank's shard of the serving state dict, by reading the WHOLE checkpoint and cutting
    it (every rank reads every byte: fine for the tiny model and tests, not for a 288-expert one)."""
    from .sharding import shard_state_dict
    from .weights import read_safetensors, to_serving_names

    return shard_state_dict(to_serving_names(read_safetensors(model_dir), cfg, load_mtp=load_mtp), cfg, ctx)


def read_rank_state_dict(model_dir: str | Path, cfg: Glm5NextConfig, ctx: ParallelContext,
                         load_mtp: bool = False) -> dict[str, torch.Tensor]:
    """The read step of load_rank_model: the sliced per-rank reader of `sharded_load` where it
    exists (reads only the rank's slices), else `read_full_then_shard`."""
    import importlib

    try:  # by name: the module may not exist yet (then import-linter would resolve it to `trnrt`)
        sliced = importlib.import_module(f"{__package__}.sharded_load").read_rank_state_dict
    except ModuleNotFoundError as e:
        if e.name != f"{__package__}.sharded_load":
            raise  # the module exists but one of its imports does not
        return read_full_then_shard(model_dir, cfg, ctx, load_mtp)
    return sliced(model_dir, cfg, ctx, load_mtp)


def load_rank_model(model_dir: str | Path, dtype: torch.dtype, ctx: ParallelContext, load_mtp: bool = False,
                    device: str | torch.device = "cpu", read: ReadFn | None = None) -> Glm5NextForServing:
    """`weights.load_model` for one rank: config.json, the rank's shard (`read`, by default
    read_rank_state_dict), dtype with the fp32 rules, build_rank_model. At ctx.tp_size == 1 the
    result is the model load_model returns. FP8 (a checkpoint's quantization_config, or
    quantization "fp8"): fp8.rank_load.load_fp8_rank_model, which builds on this module."""
    cfg = Glm5NextConfig.from_pretrained(model_dir)
    mtp_cfg = Glm5NextMTPConfig.from_pretrained(model_dir)
    if load_mtp and mtp_cfg.num_nextn_predict_layers != 1:
        raise ConfigError("num_nextn_predict_layers",
                          f"load_mtp needs exactly one MTP layer, the config has {mtp_cfg.num_nextn_predict_layers}")
    sd = (read or read_rank_state_dict)(model_dir, cfg, ctx, load_mtp)
    return build_rank_model(cfg, sd, ctx, mtp_cfg if load_mtp else None, dtype=dtype, device=device)
