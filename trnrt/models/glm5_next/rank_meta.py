"""A rank's serving model with no weights: the real dimensions on the meta device (issue #31).

`meta_rank_model(cfg, ctx, dtype)` builds the rank model of `rank_model` from a state dict of
empty tensors whose shapes are `sharding`'s shard shapes of the full model's (so a rank model
whose blocks disagree with the sharding rules fails here, by name), with the dtypes load_model
gives, fused (`prepare`). device "meta": no memory at all (GLM-5.3-Flash at TP 64 in seconds);
"cpu": uninitialised weights (small configs; the graph `trnrt compile --tp-size` exports from a
checkpoint). Used by `trnrt compile --tp-size` (export and hash only) and the real-dims tests.
"""

from __future__ import annotations

import torch

from trnrt.parallel.context import ParallelContext
from trnrt.parallel.shard import shard_shape

from .config import Glm5NextConfig, Glm5NextMTPConfig
from .model import Glm5NextForServing
from .mtp import Glm5NextMTP
from .sharding import check_layout, rule_for
from .weights import is_fp32_param


def full_shapes(cfg: Glm5NextConfig, mtp: bool = False) -> dict[str, tuple[int, ...]]:
    """Every serving state-dict name of the unsharded model (and its MTP layer) -> its shape."""
    with torch.device("meta"):
        model = Glm5NextForServing(cfg)
        if mtp:
            model.mtp = Glm5NextMTP(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def rank_shapes(cfg: Glm5NextConfig, ctx: ParallelContext, mtp: bool = False) -> dict[str, tuple[int, ...]]:
    """name -> the shape of rank ctx.tp_rank's shard (sharding.rule_for + parallel.shard_shape);
    ConfigError naming the first dimension the layout cannot split."""
    check_layout(cfg, ctx)
    return {k: shard_shape(rule_for(k, cfg), s, ctx, k) for k, s in full_shapes(cfg, mtp).items()}


def meta_rank_model(cfg: Glm5NextConfig, ctx: ParallelContext, dtype: torch.dtype, device: str = "meta",
                    mtp_cfg: Glm5NextMTPConfig | None = None, mtp: bool = False) -> Glm5NextForServing:
    """The rank's model (see the module doc): build_rank_model on empty shards of `device`."""
    from .rank_model import build_rank_model

    sd = {k: torch.empty(s, device=device, dtype=torch.float32 if is_fp32_param(k) else dtype)
          for k, s in rank_shapes(cfg, ctx, mtp).items()}
    if device == "meta":  # build_rank_model refuses buffers left on meta; here that is the point
        from . import rank_model

        return _meta_build(rank_model, cfg, sd, ctx, mtp_cfg)
    return build_rank_model(cfg, sd, ctx, mtp_cfg)


def _meta_build(rank_model, cfg, sd, ctx, mtp_cfg) -> Glm5NextForServing:
    """build_rank_model's steps on meta: skeleton, strict shape check, assign, prepare."""
    model = rank_model._skeleton(cfg, ctx, mtp_cfg, set(sd))
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for name, shape in expected.items():
        if name not in sd or tuple(sd[name].shape) != shape:
            got = tuple(sd[name].shape) if name in sd else "missing"
            raise rank_model.CheckpointError(name, f"rank {ctx.tp_rank}: shard {got}, model expects {shape}")
    extra = sorted(set(sd) - set(expected))
    if extra:
        raise rank_model.CheckpointError(extra[0], f"unexpected tensor ({len(extra)} in all)")
    model.load_state_dict(sd, strict=True, assign=True)
    model.requires_grad_(False)
    model.eval()
    model.prepare()
    return model
