"""An FP8 checkpoint's tensors -> the serving model's FP8 modules (both namings of weights.py).

A weight is FP8 iff the checkpoint holds `<name>_scale_inv` beside it (`<module>.weight` ->
`<module>.weight_scale_inv`). Routed experts come in the release's per-expert naming
(`mlp.experts.{e}.{gate,up,down}_proj.weight[_scale_inv]`) and are stacked here; every other FP8
weight goes through weights.to_serving_names like a bf16 one, its scale beside it. Refused, with
a CheckpointError naming the tensor: an FP8 weight without its scale, a scale without its weight
(or over a non-FP8 weight), a scale grid that is not ceil(weight / weight_block_size), an FP8
weight in `modules_to_not_convert`.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import torch

from ..config import Glm5NextConfig
from ..weights import _PREFIXES, CheckpointError, to_serving_names
from .blocks import FP8_DTYPE, check_grid
from .qconfig import QuantConfig

SCALE = "_scale_inv"
_EXPERT = re.compile(r"^(?:layers\.(\d+)|(decoder))\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                    if hasattr(torch, n))


@dataclass
class Fp8Tensors:
    """The FP8 part of a checkpoint in serving names, and what is left for the bf16 path."""

    linears: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # module -> (q, s)
    experts: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)  # -> proj -> (q, s)
    rest: dict[str, torch.Tensor] = field(default_factory=dict)  # serving names (bf16 / fp32 tensors)


def _strip(key: str) -> str:
    for p in _PREFIXES:
        if key.startswith(p):
            return key[len(p):]
    return key


def check_pairs(raw: dict[str, torch.Tensor], qc: QuantConfig) -> dict[str, torch.Tensor]:
    """Pair every FP8 weight with its scale (checked); returns {weight name: scale}."""
    scales = {k[: -len(SCALE)]: v for k, v in raw.items() if k.endswith(SCALE)}
    for k, t in raw.items():
        if t.dtype in _FP8_DTYPES and k not in scales:
            raise CheckpointError(k + SCALE, f"missing: the FP8 weight {k!r} has no block scale tensor")
    for w, s in scales.items():
        if w not in raw:
            raise CheckpointError(w + SCALE, f"block scale without its weight {w!r}")
        q = raw[w]
        if q.dtype != FP8_DTYPE:
            raise CheckpointError(w, f"dtype {q.dtype} has a block scale; expected {FP8_DTYPE} "
                                  f"(trnrt loads e4m3 FP8 weights)")
        if q.dim() != 2:
            raise CheckpointError(w, f"FP8 weight of {q.dim()} dims; expected a 2-D [out, in] weight")
        try:
            check_grid(q.shape, s.shape, qc.block, w + SCALE)
        except ValueError as e:
            raise CheckpointError(w + SCALE, str(e)) from None
        if not s.is_floating_point():
            raise CheckpointError(w + SCALE, f"dtype {s.dtype}, expected fp32 scales")
        if qc.keeps_bf16(w):
            raise CheckpointError(w, "stored as FP8 but its module is in quantization_config's "
                                  "modules_to_not_convert / ignored_layers")
    return scales


def split(raw: dict[str, torch.Tensor], cfg: Glm5NextConfig, qc: QuantConfig, load_mtp: bool) -> Fp8Tensors:
    """Checkpoint tensors (either naming) -> Fp8Tensors in the serving model's names."""
    scales = check_pairs(raw, qc)
    n = cfg.num_hidden_layers
    out = Fp8Tensors()
    plain: dict[str, torch.Tensor] = {}
    per_expert: dict[tuple[str, str, int], tuple[torch.Tensor, torch.Tensor]] = {}
    for k, t in raw.items():
        if k.endswith(SCALE):
            continue
        if k not in scales:
            plain[k] = t
            continue
        m = _EXPERT.match(_strip(k))
        if m is None:
            plain[k] = t  # FP8 weight through the usual renaming; its scale follows below
            continue
        layer = n if m.group(2) else int(m.group(1))
        if layer >= n and not (load_mtp and layer == n):
            continue  # the MTP layer, not loaded (weights.to_serving_names logs the skip)
        path = "mtp.mlp.experts" if layer == n else f"layers.{layer}.mlp.experts"
        per_expert[(path, m.group(4), int(m.group(3)))] = (t, scales[k])
    out.rest = to_serving_names(plain, cfg, load_mtp=load_mtp)
    lin_scales = {w: s for w, s in scales.items() if _EXPERT.match(_strip(w)) is None}
    quiet = logging.getLogger("trnrt.models.glm5_next")
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # the scales' skip lines would repeat the weights'
    try:
        served_scales = to_serving_names(lin_scales, cfg, load_mtp=load_mtp)
    finally:
        quiet.setLevel(level)
    for name, s in served_scales.items():
        if not name.endswith(".weight") or name not in out.rest:
            raise CheckpointError(name + SCALE, "block scale of a tensor that is not a linear's weight")
        out.linears[name[: -len(".weight")]] = (out.rest.pop(name), s)
    _stack_experts(per_expert, cfg, out)
    return out


def _stack_experts(per_expert, cfg: Glm5NextConfig, out: Fp8Tensors) -> None:
    E, D, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    for path in sorted({k[0] for k in per_expert}):
        layer = path.rsplit(".mlp", 1)[0]
        stacks = {}
        for proj, shape in (("gate", (I, D)), ("up", (I, D)), ("down", (D, I))):
            qs, ss = [], []
            for e in range(E):
                name = f"{layer}.mlp.experts.{e}.{proj}_proj.weight"
                got = per_expert.get((path, proj, e))
                if got is None:
                    raise CheckpointError(name, "missing (the layer's other experts are FP8)")
                if tuple(got[0].shape) != shape:
                    raise CheckpointError(name, f"shape {tuple(got[0].shape)}, expected {shape}")
                qs.append(got[0])
                ss.append(got[1].to(torch.float32))
            stacks[proj] = (torch.stack(qs), torch.stack(ss))
        extra = {k[2] for k in per_expert if k[0] == path} - set(range(E))
        if extra:
            raise CheckpointError(f"{layer}.mlp.experts.{min(extra)}.gate_proj.weight", "unexpected expert index")
        out.experts[path] = stacks
