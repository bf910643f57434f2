"""Read one rank's shard of a glm5_next checkpoint as slices, never a whole tensor it does not own.

`read_rank_state_dict(model_dir, cfg, ctx, load_mtp)` returns exactly what
`sharding.shard_state_dict(weights.to_serving_names(weights.read_safetensors(d)), cfg, ctx)`
returns (same names, shapes, dtypes as stored, bit-equal values), but every tensor is read
through `get_slice` (safetensors' reading API, `safetensors_pread.SafetensorsFile`: pread into
the rank's own buffers, not a memory map) for the blocks `sharding.rule_for` gives the rank:

* the checkpoint's names (either naming) are mapped one key at a time by
  `weights.classify_key`, the same mapping `to_serving_names` uses;
* a serving tensor that the checkpoint stores whole is read as the rank's slices of it;
* a merged serving tensor is read from its parts: `mlp.experts.gate_up_proj` [E, 2I, D] from the
  per-expert `gate_proj` / `up_proj` of the experts the rank owns (EP) or of their I-slice (TP),
  `mlp.experts.down_proj` [E, D, I] likewise, and `self_attn.conv1d.weight` [3*H*Dk, 1, K]
  from the rank's heads of each of `q_conv1d` / `k_conv1d` / `v_conv1d`;
* vision-tower (and unloaded MTP) tensors are skipped by name: never read.

Each file is opened once; only the requested bytes are read (a column slice in bounded chunks).
The pieces (SliceOpener, lazy_tensors, mtp_name / mtp_renamed, header_tensors) are public: the FP8 rank
reader (fp8/rank_read.py) adds its weights and scale grids to the same lazy tensors.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from pathlib import Path

import torch

from trnrt.parallel.context import ParallelContext

from .config import Glm5NextConfig
from .safetensors_pread import SafetensorsFile
from .sharding import iter_shards
from .weights import CheckpointError, classify_key

Index = tuple[slice, ...]
Getter = Callable[[Index], torch.Tensor]


def checkpoint_files(model_dir: str | Path) -> dict[str, Path]:
    """Every tensor name of the checkpoint -> the file that holds it (index.json or *.safetensors)."""
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.exists():
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        for name in sorted(set(weight_map.values())):
            if not (d / name).exists():
                raise CheckpointError(name, "shard listed in model.safetensors.index.json is missing")
        return {k: d / v for k, v in weight_map.items()}
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise CheckpointError(str(d), "no *.safetensors files in the checkpoint directory")
    out: dict[str, Path] = {}
    for p in files:
        with SafetensorsFile(p) as f:
            out.update({k: p for k in f.keys()})
    return out


class SliceOpener:
    """`with SliceOpener(where) as sl: sl(key)[idx]`: the safetensors slice of checkpoint tensor
    `key` (`where`: checkpoint_files), each file opened once and closed on exit."""

    def __init__(self, where: dict[str, Path]):
        self.where = where
        self._stack = ExitStack()
        self._handles: dict[Path, SafetensorsFile] = {}

    def __enter__(self) -> "SliceOpener":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def __call__(self, key: str):
        p = self.where[key]
        if p not in self._handles:
            self._handles[p] = self._stack.enter_context(SafetensorsFile(p))
        return self._handles[p].get_slice(key)


def header_tensors(where: dict[str, Path]) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor as a meta tensor of its stored shape and dtype (headers only: no
    data read), for checks and plans that run the loaders' own code before any weight is read."""
    out: dict[str, torch.Tensor] = {}
    for path in sorted(set(where.values())):
        with SafetensorsFile(path) as f:
            for key in f.keys():
                if where.get(key) == path:
                    s = f.get_slice(key)
                    out[key] = torch.empty(tuple(s.get_shape()), dtype=s.dtype, device="meta")
    return out


def lazy_tensors(keys: Iterable[str], sl: SliceOpener, cfg: Glm5NextConfig, load_mtp: bool
                 ) -> tuple[dict[str, tuple[int, ...]], dict[str, Getter]]:
    """Serving name -> (full shape, getter of an index) for the checkpoint tensors `keys`, mapped
    as the module docstring says; nothing is read yet. The MTP layer keeps its `layers.{N}.`
    names here (mtp_renamed moves them), so callers can add tensors under the same naming."""
    n = cfg.num_hidden_layers
    plain: dict[str, str] = {}            # serving name -> checkpoint key
    reshape_alog: set[str] = set()
    experts: dict[tuple[int, int, str], str] = {}
    convs: dict[tuple[int, str], str] = {}
    for key in keys:
        kind = classify_key(key, n, load_mtp)
        if kind[0] == "skip":
            continue
        if kind[0] == "expert":
            experts[(kind[1], kind[2], kind[3])] = key
        elif kind[0] == "conv":
            convs[(kind[1], kind[2])] = key
        else:
            plain[kind[1]] = key
            if kind[2]:
                reshape_alog.add(kind[1])
    shapes: dict[str, tuple[int, ...]] = {}
    getters: dict[str, Getter] = {}
    for name, key in plain.items():
        s = sl(key)
        shape = tuple(s.get_shape())
        if name in reshape_alog:  # release A_log may carry singleton dims: tiny, read whole
            full = s[:].reshape(-1)
            shapes[name], getters[name] = tuple(full.shape), full.__getitem__
        else:
            shapes[name], getters[name] = shape, (lambda idx, s=s: s[idx])
    _add_experts(experts, sl, cfg, shapes, getters)
    _add_convs(convs, sl, cfg, shapes, getters)
    return shapes, getters


def mtp_name(name: str, cfg: Glm5NextConfig) -> str:
    """The MTP layer's `layers.{N}.*` name as the serving `mtp.*`; other names unchanged."""
    pre = f"layers.{cfg.num_hidden_layers}."
    return "mtp." + name[len(pre):] if name.startswith(pre) else name


def mtp_renamed(d: dict, cfg: Glm5NextConfig) -> dict:
    """`d` with its keys through mtp_name (order kept)."""
    return {mtp_name(k, cfg): v for k, v in d.items()}


def read_rank_state_dict(model_dir: str | Path, cfg: Glm5NextConfig, ctx: ParallelContext,
                         load_mtp: bool = False) -> dict[str, torch.Tensor]:
    """The rank's shard of the serving state dict, read as slices (see the module docstring)."""
    where = checkpoint_files(model_dir)
    with SliceOpener(where) as sl:
        shapes, getters = lazy_tensors(where, sl, cfg, load_mtp)
        if load_mtp:
            shapes, getters = mtp_renamed(shapes, cfg), mtp_renamed(getters, cfg)
        return {name: t for name, t in iter_shards(shapes, lambda nm, idx: getters[nm](idx), cfg, ctx)}


def _add_experts(experts, sl, cfg: Glm5NextConfig, shapes, getters) -> None:
    """Lazy merged [E, 2I, D] gate_up and [E, D, I] down of every MoE layer from per-expert tensors."""
    inter, dim, n_exp = cfg.moe_intermediate_size, cfg.hidden_size, cfg.n_routed_experts
    for i in sorted({k[0] for k in experts}):
        extra = {k[1] for k in experts if k[0] == i} - set(range(n_exp))
        if extra:
            raise CheckpointError(f"layers.{i}.mlp.experts.{min(extra)}.gate_proj.weight", "unexpected expert index")
        parts: dict[tuple[int, str], object] = {}
        for ex in range(n_exp):
            for proj, want in (("gate_proj", (inter, dim)), ("up_proj", (inter, dim)), ("down_proj", (dim, inter))):
                key = experts.get((i, ex, proj))
                if key is None:
                    raise CheckpointError(f"layers.{i}.mlp.experts.{ex}.{proj}.weight", "missing")
                s = sl(key)
                if tuple(s.get_shape()) != want:
                    raise CheckpointError(key, f"shape {tuple(s.get_shape())}, expected {want}")
                parts[(ex, proj)] = s

        def gate_up(idx: Index, parts=parts) -> torch.Tensor:  # idx over [E, 2I, D]
            e_sl, r_sl, d_sl = (tuple(idx) + (slice(None),) * 3)[:3]
            rows, exps = range(2 * inter)[r_sl], range(n_exp)[e_sl]
            out = None
            for j, ex in enumerate(exps):  # each expert's rows read into its place: no stacked copy
                at = 0
                for proj, lo in (("gate_proj", 0), ("up_proj", inter)):
                    a, b = max(rows.start, lo), min(rows.stop, lo + inter)
                    if a < b:
                        t = parts[(ex, proj)][a - lo:b - lo, d_sl]
                        if out is None:
                            out = torch.empty((len(exps), len(rows), t.shape[1]), dtype=t.dtype)
                        out[j, at:at + (b - a)] = t
                        at += b - a
            return out  # [e, r, d]

        def down(idx: Index, parts=parts) -> torch.Tensor:  # idx over [E, D, I]
            e_sl, d_sl, i_sl = (tuple(idx) + (slice(None),) * 3)[:3]
            out = None
            for j, ex in enumerate(exps := range(n_exp)[e_sl]):
                t = parts[(ex, "down_proj")][d_sl, i_sl]
                if out is None:
                    out = torch.empty((len(exps),) + tuple(t.shape), dtype=t.dtype)
                out[j] = t
            return out  # [e, d, i]

        shapes[f"layers.{i}.mlp.experts.gate_up_proj"] = (n_exp, 2 * inter, dim)
        getters[f"layers.{i}.mlp.experts.gate_up_proj"] = gate_up
        shapes[f"layers.{i}.mlp.experts.down_proj"] = (n_exp, dim, inter)
        getters[f"layers.{i}.mlp.experts.down_proj"] = down


def _add_convs(convs, sl, cfg: Glm5NextConfig, shapes, getters) -> None:
    """Lazy concatenated depthwise conv [3*C, 1, K] of every KDA layer from its q/k/v convs [C, (1,) K]."""
    c, k = cfg.linear_num_heads * cfg.linear_head_dim, cfg.linear_conv_kernel_dim
    for i in sorted({key[0] for key in convs}):
        parts = []
        for which in "qkv":
            key = convs.get((i, which))
            if key is None:
                raise CheckpointError(f"layers.{i}.self_attn.{which}_conv1d.weight", "missing")
            s = sl(key)
            shape = tuple(s.get_shape())
            if shape not in ((c, 1, k), (c, k)):
                raise CheckpointError(key, f"shape {shape}, expected {(c, 1, k)}")
            parts.append((s, len(shape) == 2))

        def conv(idx: Index, parts=parts) -> torch.Tensor:  # idx over [3C, 1, K]
            r_sl, one_sl, k_sl = (tuple(idx) + (slice(None),) * 3)[:3]
            rows = range(3 * c)[r_sl]
            pieces = []
            for p, (s, flat) in enumerate(parts):
                a, b = max(rows.start, p * c), min(rows.stop, (p + 1) * c)
                if a < b:
                    t = s[a - p * c:b - p * c, k_sl].unsqueeze(1) if flat else s[a - p * c:b - p * c, :, k_sl]
                    pieces.append(t[:, one_sl])
            return pieces[0] if len(pieces) == 1 else torch.cat(pieces, 0)

        shapes[f"layers.{i}.self_attn.conv1d.weight"] = (3 * c, 1, k)
        getters[f"layers.{i}.self_attn.conv1d.weight"] = conv
