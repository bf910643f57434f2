"""Helpers for the glm5_next model tests: a tiny block/slot allocator that drives
Glm5NextForServing like the engine will (padded buckets, block tables, slots), references from
transformers, and checkpoint conversion to the release naming."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import torch

from trnrt.models.glm5_next.batch import ForwardBatch

BLOCK = 8  # block size: 2 pools of kpool 4 per block


class Driver:
    """Owns a ModelState; gives each sequence a slot and blocks (never slot 0 / block 0)."""

    def __init__(self, model, num_blocks=96, num_slots=12, max_blocks=10, block_size=BLOCK):
        self.model, self.bs, self.mb = model, block_size, max_blocks
        self.state = model.allocate_state(num_blocks, block_size, num_slots)
        self.next_block, self.next_slot = 1, 1
        self.seqs: dict[str, dict] = {}

    def new_seq(self, name: str, slot: int | None = None) -> None:
        blocks = list(range(self.next_block, self.next_block + self.mb))
        self.next_block += self.mb
        if slot is None:
            slot, self.next_slot = self.next_slot, self.next_slot + 1
        self.seqs[name] = dict(blocks=blocks, slot=slot, pos=0)

    def step(self, items: list[tuple[str, list[int]]], bucket: int | None = None, pad_rows: int = 0,
             all_logits: bool = False, short_extend: bool = False):
        """One forward over `items` (name, new tokens); rows padded to `bucket` tokens, plus
        `pad_rows` padding rows (num_new 0, slot 0, block table of zeros)."""
        S = bucket or max(len(t) for _, t in items)
        B = len(items) + pad_rows
        ids = torch.zeros(B, S, dtype=torch.long)
        start = torch.zeros(B, dtype=torch.long)
        num = torch.zeros(B, dtype=torch.long)
        bt = torch.zeros(B, self.mb, dtype=torch.int32)
        slots = torch.zeros(B, dtype=torch.long)
        for r, (name, toks) in enumerate(items):
            s = self.seqs[name]
            ids[r, : len(toks)] = torch.tensor(toks)
            ids[r, len(toks):] = 7  # arbitrary pad token: must not matter
            start[r], num[r], slots[r] = s["pos"], len(toks), s["slot"]
            bt[r] = torch.tensor(s["blocks"], dtype=torch.int32)
        for r in range(len(items), B):
            ids[r] = 11
            start[r] = 5  # garbage start on padding rows: must not matter either
        out = self.model(ForwardBatch(ids, start, num, bt, slots), self.state, all_logits=all_logits,
                         short_extend=short_extend)
        for name, toks in items:
            self.seqs[name]["pos"] += len(toks)
        return out


def hf_oneshot(hf, ids: torch.Tensor) -> torch.Tensor:
    """transformers logits [L, V] of one sequence, no cache."""
    with torch.no_grad():
        return hf(input_ids=ids[None], use_cache=False).logits[0].float()


def hf_chunked(hf, ids: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """transformers logits [L, V] computed chunk by chunk through its DynamicCache."""
    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config.text_config)
    outs, p = [], 0
    with torch.no_grad():
        for c in chunks:
            o = hf(input_ids=ids[None, p: p + c], past_key_values=cache, use_cache=True)
            cache = o.past_key_values
            outs.append(o.logits[0].float())
            p += c
    return torch.cat(outs, 0)


def tokens(seed: int, n: int, vocab: int = 4096) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def to_release_naming(sd: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """transformers-named state dict (model.state_dict()) -> release naming: per-expert weights,
    separate q/k/v convs, hc_attn_*/hc_ffn_*, flat self_attn.{f_a_proj,f_b_proj,dt_bias,A_log}."""
    out: dict[str, torch.Tensor] = {}
    qkv = cfg.linear_num_heads * cfg.linear_head_dim
    inter = cfg.moe_intermediate_size
    for k, t in sd.items():
        t = t.detach().clone().contiguous()
        if k.endswith("mlp.experts.gate_up_proj"):
            base = k[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :inter].clone()
                out[f"{base}{e}.up_proj.weight"] = t[e, inter:].clone()
            continue
        if k.endswith("mlp.experts.down_proj"):
            base = k[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].clone()
            continue
        if k.endswith("self_attn.conv1d.weight"):
            base = k[: -len("conv1d.weight")]
            for j, w in enumerate("qkv"):
                out[f"{base}{w}_conv1d.weight"] = t[j * qkv: (j + 1) * qkv].clone()
            continue
        k = k.replace(".attn_hc.", ".hc_attn_").replace(".ffn_hc.", ".hc_ffn_")
        k = k.replace(".self_attn.forget_gate.", ".self_attn.")
        out[k] = t
    return out


def save_sharded(sd: dict[str, torch.Tensor], out_dir: Path, config_src: Path, shards: int = 3) -> None:
    """Write `sd` as `shards` safetensors files + model.safetensors.index.json, with config.json."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(config_src / "config.json", out_dir / "config.json")
    keys = sorted(sd)
    per = math.ceil(len(keys) / shards)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: sd[k] for k in keys[i * per: (i + 1) * per]}
        save_file(part, str(out_dir / name))
        weight_map.update({k: name for k in part})
    with open(out_dir / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def save_single(sd: dict[str, torch.Tensor], out_dir: Path, config_src: Path) -> None:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(config_src / "config.json", out_dir / "config.json")
    save_file({k: v.detach().contiguous() for k, v in sd.items()}, str(out_dir / "model.safetensors"))


# sha256 over (name, dtype, shape, bytes) of every tensor of the seed-0 tiny checkpoint as it was
# before it had an MTP layer (278 tensors): the MTP addition must leave each one byte-identical.
BASE_TENSORS_SHA256 = "d2e01f9ed21682f3f87706ec14d9750da05c20d7b2f99cd4b663bc0438e56810"


def base_tensors_digest(sd: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(sd):
        t = sd[k].contiguous()
        h.update(k.encode() + b"\0" + str(t.dtype).encode() + b"\0" + str(tuple(t.shape)).encode() + b"\0")
        h.update(t.numpy().tobytes())
    return h.hexdigest()
