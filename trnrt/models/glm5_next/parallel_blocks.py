"""Rank-local glm5_next blocks: the existing block classes built from a per-rank config
(`sharding.local_config`), with the collective around them.

Each is a subclass of its block, so its state-dict names are the block's own (a rank's shard
from `sharding.shard_state_dict` loads with strict=True) and its maths is the block's code:

* ParallelKDA(KDAttention)     H / t heads (q/k/v/b/g_b/f_b, dt_bias, A_log, conv thirds, the
                               recurrent and conv state), f_a / g_a / o_norm whole; the o_proj
                               partial sums all-reduced.
* ParallelMLA(MLAttention)     H / t query heads (q_b, kv_b), the latent, q_a / kv_a and the
                               indexer replicated (every rank writes the same latents and picks the
                               same top-k); the o_proj partial sums all-reduced.
* ParallelDenseMLP(DenseMLP)   inter / t (gate_proj, up_proj rows; down_proj columns); all-reduced.
* ParallelMoE(MoE)             router replicated, shared expert I / t, routed experts I / t (TP
                               mode, ep_size 1: MoE.forward unchanged, the fused decode op too) or
                               E / ep experts (EP mode): routed + shared partials, ONE all-reduce.

EP mode, tokens replicated: every rank routes every token over all E experts (replicated
router), keeps the weights of the picks it owns and zeroes the others (an owned expert index is
`idx - expert_start`, a buffer: the rank is data, not a Python constant in the graph), so the
non-local experts add exactly 0 and the all-reduce sums the owners' terms. The fused decode op
`trnrt.moe_routed` assumes all E experts local (tensor_parallel.md §8.7): EP runs the plain
forms (gathered / grouped / dense) of `Experts`, chosen as MoE.forward chooses them. The
gathered form still computes k experts per token on every rank (the zeroed ones too): EP saves
expert memory there, not FLOPs.

At TP=1 each class builds exactly its base block (`local_config` returns the config itself) and
the collective is the identity: none of this changes a TP=1 graph (no existing line is touched).
"""

from __future__ import annotations

import torch

from trnrt.parallel.collectives import all_reduce
from trnrt.parallel.context import ParallelContext

from .batch import _Meta
from .config import Glm5NextConfig
from .kda import KDAttention
from .mla import MLAttention
from .moe import DenseMLP, Experts, MoE
from .sharding import expert_config, local_config
from .state import ModelState


class ParallelKDA(KDAttention):
    """KDAttention over this rank's heads; `state` is the rank's ModelState (local_config)."""

    def __init__(self, cfg: Glm5NextConfig, layer_idx: int, kda_idx: int, ctx: ParallelContext):
        super().__init__(local_config(cfg, ctx), layer_idx, kda_idx)
        self.ctx = ctx

    def forward(self, x: torch.Tensor, meta: _Meta, state: ModelState) -> torch.Tensor:
        return all_reduce(super().forward(x, meta, state), self.ctx)  # [B,S,D]


class ParallelMLA(MLAttention):
    """MLAttention over this rank's query heads; latents and the indexer replicated."""

    def __init__(self, cfg: Glm5NextConfig, layer_idx: int, mla_idx: int, full_idx: int | None,
                 ctx: ParallelContext):
        super().__init__(local_config(cfg, ctx), layer_idx, mla_idx, full_idx)
        self.ctx = ctx

    def forward(self, x, meta: _Meta, state: ModelState, prev_mask):
        o, mask = super().forward(x, meta, state, prev_mask)
        return all_reduce(o, self.ctx), mask  # [B,S,D], the (replicated) selection


class ParallelDenseMLP(DenseMLP):
    """DenseMLP of width inter / t (inter: the full width, as DenseMLP's argument)."""

    def __init__(self, cfg: Glm5NextConfig, inter: int, kind: str, ctx: ParallelContext):
        if inter % ctx.tp_size:
            raise ValueError(f"MLP width {inter} is not divisible by tp_size {ctx.tp_size}")
        super().__init__(cfg, inter // ctx.tp_size, kind)
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(super().forward(x), self.ctx)


class ParallelMoE(MoE):
    """MoE with this rank's experts (TP or EP mode, see the module doc)."""

    def __init__(self, cfg: Glm5NextConfig, ctx: ParallelContext):
        super().__init__(local_config(cfg, ctx))  # router over all E; shared expert and TP experts I / t
        self.ctx = ctx
        ecfg = expert_config(cfg, ctx)
        # experts on this rank, a Python int: reading it off the stack's shape would dequantize a
        # whole FP8 stack (Fp8Experts.gate_up_proj is a property) just for its length
        self.n_local_experts = ecfg.n_routed_experts
        if ctx.ep_size > 1:  # replace the TP experts (built like load_model, on meta: no memory)
            self.experts = Experts(ecfg)  # [E/ep, 2I/moe_tp, D], [E/ep, D, I/moe_tp]
            start = torch.tensor(ctx.ep_rank * ecfg.n_routed_experts, dtype=torch.int64)
            self.register_buffer("expert_start", start, persistent=False)

    def forward(self, x: torch.Tensor, short: bool = False) -> torch.Tensor:
        if self.ctx.ep_size == 1:
            return all_reduce(super().forward(x, short), self.ctx)
        return self.forward_ep(x, short)

    def forward_ep(self, x: torch.Tensor, short: bool = False, form: str | None = None) -> torch.Tensor:
        """EP mode, x [B,S,D] -> [B,S,D] all-reduced. form: 'gathered' | 'grouped' | 'dense',
        by default MoE.forward's choice for this shape and dtype (a test may force one)."""
        B, S, D = x.shape
        flat = x.reshape(-1, D)
        w, idx = self.gate(flat)  # [T,k] over all E, identical on every rank
        if form is None:
            bf16 = flat.dtype == torch.bfloat16
            form = "gathered" if S == 1 or (short and not bf16) else ("grouped" if bf16 else "dense")
        routed = self.local_routed(flat, w, idx, form)
        return all_reduce(routed.view(B, S, D) + self.shared_experts(x), self.ctx)

    def local_routed(self, flat: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, form: str) -> torch.Tensor:
        """The owned experts' share of the routed output: flat [T,D], w/idx [T,k] -> [T,D]."""
        T = flat.shape[0]
        n = self.n_local_experts
        own = torch.arange(n, device=flat.device)
        if form == "dense":
            # Experts.dense scatters (w, idx) into [T, E]; scatter is not duplicate-safe, so hand it
            # the owned columns of the full routing matrix with every local index exactly once.
            wd = torch.zeros(T, self.gate.weight.shape[0], dtype=torch.float32, device=flat.device)
            wd = wd.scatter(1, idx, w)  # [T, E]
            w_own = wd.index_select(1, self.expert_start + own)  # [T, n]
            return self.experts.dense(flat, w_own, own.expand(T, n))
        local = idx - self.expert_start  # [T,k]
        mine = (local >= 0) & (local < n)
        w_own = torch.where(mine, w, torch.zeros_like(w))  # other ranks' picks weigh 0
        idx_own = local.clamp(0, n - 1)  # any owned expert: its term is multiplied by 0
        if form == "gathered":
            return self.experts.gathered(flat, w_own, idx_own)
        if form == "grouped":
            return self.experts.grouped(flat, w_own, idx_own)
        raise ValueError(f"unknown experts form {form!r}")
