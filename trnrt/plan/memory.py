"""Memory per rank of a TP / EP layout: weights, decode state, activations, and what is left.

Everything is computed from the real module and state shapes on the meta device (no weights
allocated) through the rules the loader and the state sharding use, so a plan cannot drift from
what a rank actually holds:

* weights: every name of the serving state dict of `Glm5NextForServing(cfg)` (and, with `mtp`,
  of `Glm5NextMTP`) BEFORE `prepare()` (the names `sharding.rule_for` knows), cut by
  `shard_shape(rule_for(name), shape, ParallelContext.for_rank(tp, 0, ep))`; bytes per element
  4 for the parameters transformers keeps in fp32 (`weights.is_fp32_param`), else the model dtype.
  Rank 0 holds as much as any rank (every split is even).
  FP8 (`quantization="fp8"`): the policy's weights at 1 byte plus a fp32 scale per 128 x 128 block.
* state: `ModelState.allocate(..., device="meta")` (its `mtp` stack with `mtp`), each field cut by
  `sharding.state_rule`: per block (MLA latents, pooled indexer keys; replicated) and per slot
  (KDA recurrent state fp32 and conv window by head; indexer tail replicated).
  `--kv-cache-dtype fp8_e4m3`: latents, pooled keys and tails at 1 byte.

Budget of one rank (`Plan`; the formula docs/DEPLOY.md documents):

    static     = mem_fraction_static * device_bytes          (weights + state pool, as SGLang)
    activation = step_tokens * act_bytes_per_token           (estimate, see activation_bytes)
    state pool = min(static, device_bytes - activation) - weights
    max_running_requests = floor(state pool / (slot_bytes + blocks(max_model_len) * block_bytes))
    max_total_tokens     = floor((state pool - max_running_requests * slot_bytes) / block_bytes) * block_size
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trnrt.config.engine_config import EngineConfig
from trnrt.models.glm5_next import sharding
from trnrt.models.glm5_next.config import ConfigError, Glm5NextConfig, Glm5NextMTPConfig
from trnrt.models.glm5_next.state import ModelState
from trnrt.models.glm5_next.weights import is_fp32_param
from trnrt.parallel.context import ParallelContext
from trnrt.parallel.shard import ShardingError, shard_shape

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_TORCH_DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of an engine dtype name ('float32' | 'bfloat16' | 'float16')."""
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPE_BYTES)}, got {dtype!r}")
    return _DTYPE_BYTES[dtype]


@functools.lru_cache(maxsize=8)
def serving_shapes(cfg: Glm5NextConfig, mtp: bool = False) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, full shape) of every serving state-dict tensor, built on the meta device (no memory).
    Names are the ones before `prepare()` (the loader's and the sharding rules'). mtp: with the MTP
    layer under `mtp.*` (sharing the target's embedding and head, as the released checkpoint)."""
    from trnrt.models.glm5_next.model import Glm5NextForServing
    from trnrt.models.glm5_next.mtp import Glm5NextMTP

    with torch.device("meta"):
        model = Glm5NextForServing(cfg)
        out = [(k, tuple(v.shape)) for k, v in model.state_dict().items()]
        if mtp:
            head = Glm5NextMTP(cfg, Glm5NextMTPConfig(num_nextn_predict_layers=1))
            out += [("mtp." + k, tuple(v.shape)) for k, v in head.state_dict().items()]
    return tuple(out)


@dataclass(frozen=True)
class WeightBytes:
    """Weight bytes of one rank: total, and how much of it every rank holds whole (replicated)."""

    total: int
    replicated: int
    mtp: int  # of total: the MTP layer's (0 without it)


FP8_BLOCK = 128  # rows and columns of one fp32 scale block of an FP8 weight


def is_fp8_weight(name: str) -> bool:
    """Whether `--quantization fp8` stores a serving weight in FP8 (fp8.policy; the stacked routed
    experts, whose serving names have no `.weight`, are FP8 as their projections)."""
    from trnrt.models.glm5_next.fp8.policy import quantizes

    return quantizes(name) or name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))


def check_fp8_blocks(name: str, shape: tuple[int, ...], rule, cfg: Glm5NextConfig, ctx: ParallelContext) -> None:
    """ShardingError naming `name` when `rule` at ctx's layout would give a rank part of an FP8
    weight's 128 x 128 scale block (the check the FP8 rank loader makes on a checkpoint's headers,
    fp8/shard.py, made here on the config's shapes, so that a plan never passes what serve refuses).
    The stacked experts' gate_up_proj is FP8 as separate gate and up stacks [E, I, D]."""
    from trnrt.models.glm5_next.fp8.shard import fp8_rule, scale_rule

    if name.endswith("mlp.experts.gate_up_proj"):
        name = name[: -len("gate_up_proj")] + "gate"
        shape, rule = (shape[0], shape[1] // 2, *shape[2:]), fp8_rule(name, cfg)
    scale_rule(name, shape, (FP8_BLOCK, FP8_BLOCK), rule, ctx)


def _fp8_bytes(shape: tuple[int, ...]) -> int:
    """1 byte an element plus one fp32 scale per FP8_BLOCK x FP8_BLOCK block of the last two dims."""
    *lead, rows, cols = shape
    n = rows * cols
    blocks = -(-rows // FP8_BLOCK) * -(-cols // FP8_BLOCK)
    for d in lead:
        n, blocks = n * d, blocks * d
    return n + 4 * blocks


def weight_bytes(cfg: Glm5NextConfig, tp: int, ep: int = 1, dtype: str = "bfloat16", mtp: bool = False,
                 rule=sharding.rule_for, quantization: str | None = None) -> WeightBytes:
    """Bytes of rank 0's weights at tp / ep (ConfigError / ShardingError if the layout cannot cut them).
    rule: the sharding rule lookup (tests pass a wrong one to see the check fail). quantization
    "fp8": the weights `is_fp8_weight` names at 1 byte plus their block scales (an estimate of
    `--quantization fp8` / an FP8 release; the rest as without)."""
    if quantization not in (None, "fp8"):
        raise ValueError(f"quantization must be fp8 or none, got {quantization!r}")
    ctx = ParallelContext.for_rank(tp, 0, ep)
    sharding.check_layout(cfg, ctx)
    b = dtype_bytes(dtype)
    total = repl = extra = 0
    for name, shape in serving_shapes(cfg, mtp):
        r = rule(name, cfg)
        local = shard_shape(r, shape, ctx, name)
        n = 1
        for d in local:
            n *= d
        if quantization and len(local) >= 2 and is_fp8_weight(name):
            check_fp8_blocks(name, shape, r, cfg, ctx)
            nbytes = _fp8_bytes(local)
        else:
            nbytes = n * (4 if is_fp32_param(name) else b)
        total += nbytes
        repl += nbytes if not r else 0
        extra += nbytes if name.startswith("mtp.") else 0
    return WeightBytes(total, repl, extra)


@dataclass(frozen=True)
class StateBytes:
    """Decode-state bytes of one rank: per block (block_size tokens) and per sequence slot."""

    block: int  # MLA latents + pooled indexer keys (+ the MTP layer's) of one block, all layers
    slot: int  # KDA recurrent + conv state + indexer tails of one sequence, all layers
    kda_slot: int  # of slot: KDA recurrent state + conv window
    block_size: int

    @property
    def token(self) -> float:
        """Paged bytes per token (latent + indexer keys)."""
        return self.block / self.block_size


FP8_KV_FIELDS = ("latent", "pooled", "tail")  # what --kv-cache-dtype fp8_e4m3 stores in 1 byte (fp8/kv_cache.py)


def state_bytes(cfg: Glm5NextConfig, tp: int, ep: int, block_size: int, dtype: str = "bfloat16",
                mtp: bool = False, kv_cache_dtype: str | None = None) -> StateBytes:
    """Rank 0's state bytes per block and per slot, from ModelState.allocate on the meta device
    (2 blocks, 2 slots) cut by `sharding.state_rule`. kv_cache_dtype "fp8_e4m3": FP8_KV_FIELDS
    at 1 byte an element."""
    fp8_kv = kv_cache_dtype == "fp8_e4m3"
    ctx = ParallelContext.for_rank(tp, 0, ep)
    st = ModelState.allocate(cfg, num_blocks=2, block_size=block_size, num_slots=2,
                             dtype=_TORCH_DTYPE[dtype], device="meta", mtp=mtp)
    per_block = per_slot = kda = 0
    stacks = [("", st)] + ([("mtp.", st.mtp)] if st.mtp is not None else [])
    for prefix, stack in stacks:
        for field in ("latent", "pooled", "kda", "conv", "tail"):
            t = getattr(stack, field, None)
            if t is None:
                continue
            shape = shard_shape(sharding.state_rule(field, cfg), tuple(t.shape), ctx, prefix + field)
            n = 1 if fp8_kv and field in FP8_KV_FIELDS else t.element_size()
            for d in shape:
                n *= d
            if field in ("latent", "pooled"):
                per_block += n // 2
            else:
                per_slot += n // 2
                kda += n // 2 if field in ("kda", "conv") else 0
    return StateBytes(per_block, per_slot, kda, block_size)


def activation_bytes(cfg: Glm5NextConfig, tp: int, step_tokens: int, dtype: str = "bfloat16") -> int:
    """Estimated peak activation bytes of one step of `step_tokens` tokens on a rank (an estimate,
    not a measurement): per token the fp32 mHC streams in and out plus two temporaries
    (4 x hc_mult x D x 4 B), the widest rank-local projection output live at once (the MLA heads'
    q|k|v over heads / tp, or the routed experts' gate|up for top-k experts, dtype bytes, twice)
    and the fp32 logits of the rank's vocabulary slice; times 2 for allocator fragmentation."""
    b = dtype_bytes(dtype)
    d = cfg.hidden_size
    streams = 4 * cfg.hc_mult * d * 4
    heads = cfg.num_attention_heads // tp * (2 * cfg.qk_nope_head_dim + cfg.v_head_dim)
    experts = cfg.num_experts_per_tok * 2 * cfg.moe_intermediate_size
    proj = 2 * max(heads, experts, 3 * cfg.linear_num_heads * cfg.linear_head_dim // tp) * b
    logits = cfg.vocab_size // tp * 4
    return 2 * step_tokens * (streams + proj + logits)


def step_tokens(engine: EngineConfig) -> int:
    """Tokens of the largest step graph: the largest prefill bucket or decode batch (x spec tokens)."""
    spec = engine.speculative_num_steps + 1
    return max(max(engine.prefill_token_buckets), max(engine.decode_batch_buckets) * spec)


@dataclass(frozen=True)
class Plan:
    """One rank's memory plan of a layout on a device (all in bytes)."""

    tp: int
    ep: int
    device_bytes: int
    mem_fraction_static: float
    weights: WeightBytes
    state: StateBytes
    activation: int
    max_model_len: int
    preset_state: int  # what the preset's num_blocks / num_slots allocate on the rank

    @property
    def state_pool(self) -> int:
        """Bytes left for the decode state (negative: the weights do not fit)."""
        static = int(self.mem_fraction_static * self.device_bytes)
        return min(static, self.device_bytes - self.activation) - self.weights.total

    @property
    def request_bytes(self) -> int:
        """State bytes of one request at max_model_len (its slot and its blocks)."""
        blocks = -(-self.max_model_len // self.state.block_size)
        return self.state.slot + blocks * self.state.block

    @property
    def max_running_requests(self) -> int:
        """Requests that can all reach max_model_len at once (slot 0 / block 0 scratch included)."""
        pool = self.state_pool - self.state.slot - self.state.block
        return max(pool // self.request_bytes, 0) if pool > 0 else 0

    @property
    def max_total_tokens(self) -> int:
        """Tokens of the paged pool next to max_running_requests slots (SGLang's max_total_tokens)."""
        n = self.max_running_requests
        pool = self.state_pool - (n + 1) * self.state.slot - self.state.block
        return max(pool // self.state.block, 0) * self.state.block_size if n else 0

    @property
    def fits(self) -> bool:
        """The weights, one request at max_model_len and the preset's allocation fit."""
        return self.max_running_requests >= 1 and self.preset_state <= self.state_pool


def plan(cfg: Glm5NextConfig, engine: EngineConfig, tp: int, ep: int, device_bytes: int,
         mem_fraction_static: float, dtype: str | None = None, mtp: bool | None = None,
         quantization: str | None = None, kv_cache_dtype: str | None = None) -> Plan:
    """The memory plan of rank 0 (dtype: the engine's unless given; mtp: on when the preset has
    speculative steps unless given)."""
    if not 0.0 < mem_fraction_static <= 1.0:
        raise ValueError(f"mem_fraction_static must be in (0, 1], got {mem_fraction_static}")
    sharding.check_layout(cfg, ParallelContext.for_rank(tp, 0, ep))  # names the dim first
    dtype = dtype or engine.dtype
    mtp = engine.speculative_num_steps > 0 if mtp is None else mtp
    st = state_bytes(cfg, tp, ep, engine.block_size, dtype, mtp, kv_cache_dtype)
    return Plan(tp=tp, ep=ep, device_bytes=device_bytes, mem_fraction_static=mem_fraction_static,
                weights=weight_bytes(cfg, tp, ep, dtype, mtp, quantization=quantization), state=st,
                activation=activation_bytes(cfg, tp, step_tokens(engine), dtype),
                max_model_len=engine.max_model_len,
                preset_state=engine.num_blocks * st.block + engine.num_slots * st.slot)


def layouts(cfg: Glm5NextConfig, max_tp: int, quantization: str | None = None) -> list[tuple[int, int]]:
    """(tp, ep) pairs up to max_tp that divide the dims (check_layout and every rule; with
    quantization "fp8" also the FP8 scale blocks), smallest tp first, then smallest ep."""
    out = []
    for tp in range(1, max_tp + 1):
        for ep in range(1, tp + 1):
            if tp % ep:
                continue
            try:
                sharding.check_layout(cfg, ParallelContext.for_rank(tp, 0, ep))
                weight_bytes(cfg, tp, ep, quantization=quantization)
            except (ConfigError, ShardingError):
                continue
            out.append((tp, ep))
    return out


def smallest_fitting_layout(cfg: Glm5NextConfig, engine: EngineConfig, device_bytes: int | Callable[[int], int],
                            mem_fraction_static: float | Callable[[int], float], max_tp: int,
                            dtype: str | None = None, mtp: bool | None = None,
                            quantization: str | None = None, kv_cache_dtype: str | None = None) -> Plan | None:
    """The plan of the smallest (tp, ep) up to max_tp that fits, or None. mem_fraction_static:
    a fraction, or a function of tp (SGLang's default depends on it); device_bytes: per rank, or a
    function of tp (ranks sharing one host's memory)."""
    for tp, ep in layouts(cfg, max_tp, quantization):
        frac = mem_fraction_static(tp) if callable(mem_fraction_static) else mem_fraction_static
        dev = device_bytes(tp) if callable(device_bytes) else device_bytes
        p = plan(cfg, engine, tp, ep, dev, frac, dtype, mtp, quantization, kv_cache_dtype)
        if p.fits:
            return p
    return None
