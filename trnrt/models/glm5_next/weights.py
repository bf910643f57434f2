"""Load a glm5_next safetensors checkpoint (single file or sharded) into Glm5NextForServing.

Two namings are accepted and mapped onto the transformers module naming used by the model:
* transformers (a `model.state_dict()`): merged `mlp.experts.gate_up_proj` / `down_proj`,
  `self_attn.forget_gate.*`, concatenated `self_attn.conv1d.weight`, `attn_hc.*` / `ffn_hc.*`;
* release (and `save_pretrained` output): per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight`,
  separate `self_attn.{q,k,v}_conv1d.weight`, `hc_attn_*` / `hc_ffn_*`, `self_attn.{f_a_proj,
  f_b_proj,dt_bias,A_log}` (A_log 1-D [H] or any shape with H elements).
Prefixes `model.language_model.`, `language_model.model.`, `model.`, `language_model.` are accepted.
The vision tower is skipped (a debug line). The MTP layer is skipped with a log line, or, with
`load_mtp=True`, loaded into `model.mtp` (mtp.Glm5NextMTP) from either of its namings:
* vLLM / transformers / release: `layers.{num_hidden_layers}.*` (its `enorm`, `hnorm`, `eh_proj`,
  `shared_head.*`, optional `embed_tokens`, and the block's usual names, per-expert or merged);
* SGLang (`model.layers.{N}` renamed `model.decoder`): the block under `decoder.*`, and `enorm`,
  `hnorm`, `eh_proj`, `shared_head.*` directly under the prefix (or under `decoder.` too).
A missing, unexpected or mis-shaped tensor raises CheckpointError naming it.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch

from .config import ConfigError, Glm5NextConfig, Glm5NextMTPConfig
from .model import Glm5NextForServing

log = logging.getLogger("trnrt.models.glm5_next")

# Parameters transformers keeps in fp32 whatever the model dtype (`_keep_in_fp32_modules_strict`).
_FP32_PATTERNS = (
    "e_score_correction_bias", "conv1d.weight", "dt_bias", "A_log",
    "attn_hc.base", "attn_hc.scale", "ffn_hc.base", "ffn_hc.scale",
)
_PREFIXES = ("model.language_model.", "language_model.model.", "model.", "language_model.")
_VISION = re.compile(r"^(model\.)?(visual|vision_tower|vision_model|multi_modal_projector|mm_projector)\.")
_RENAMES = (
    (".hc_attn_fn", ".attn_hc.fn"), (".hc_attn_base", ".attn_hc.base"), (".hc_attn_scale", ".attn_hc.scale"),
    (".hc_ffn_fn", ".ffn_hc.fn"), (".hc_ffn_base", ".ffn_hc.base"), (".hc_ffn_scale", ".ffn_hc.scale"),
    (".self_attn.f_a_proj.", ".self_attn.forget_gate.f_a_proj."),
    (".self_attn.f_b_proj.", ".self_attn.forget_gate.f_b_proj."),
    (".self_attn.dt_bias", ".self_attn.forget_gate.dt_bias"),
    (".self_attn.A_log", ".self_attn.forget_gate.A_log"),
)
# SGLang's NextN module keeps these MTP tensors outside its `decoder` (spec §6).
_SGLANG_MTP_TOP = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")


class CheckpointError(ValueError):
    """A missing, unexpected or mis-shaped checkpoint tensor; `.tensor` names it."""

    def __init__(self, tensor: str, message: str):
        super().__init__(f"checkpoint tensor {tensor!r}: {message}")
        self.tensor = tensor


def is_fp32_param(name: str) -> bool:
    """Whether transformers keeps this parameter in fp32 in a bf16 model."""
    return any(p in name for p in _FP32_PATTERNS)


def read_safetensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint: model.safetensors.index.json shards, or *.safetensors files."""
    from safetensors.torch import load_file

    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.exists():
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in d.glob("*.safetensors"))
    if not files:
        raise CheckpointError(str(d), "no *.safetensors files in the checkpoint directory")
    out: dict[str, torch.Tensor] = {}
    for name in files:
        path = d / name
        if not path.exists():
            raise CheckpointError(name, "shard listed in model.safetensors.index.json is missing")
        out.update(load_file(str(path)))
    return out


def classify_key(key: str, num_hidden_layers: int, load_mtp: bool = False) -> tuple:
    """What one checkpoint tensor name is, in the serving naming (either checkpoint naming):
    ("skip", "vision" | "mtp"), ("expert", layer, expert, "gate_proj" | "up_proj" | "down_proj"),
    ("conv", layer, "q" | "k" | "v"), or ("plain", serving_name, flatten) where flatten marks a
    release A_log to reshape to [H]. The MTP layer keeps its `layers.{N}.` name here."""
    n = num_hidden_layers
    if key in ("lm_head.weight", "language_model.lm_head.weight"):
        return ("plain", "lm_head.weight", False)
    if _VISION.match(key):
        return ("skip", "vision")
    name = key
    for p in _PREFIXES:
        if name.startswith(p):
            name = name[len(p):]
            break
    if name.startswith("decoder."):  # SGLang naming of the MTP layer
        name = f"layers.{n}." + name[len("decoder."):]
    elif name.startswith(_SGLANG_MTP_TOP):
        name = f"layers.{n}." + name
    m = re.match(r"layers\.(\d+)\.(.*)$", name)
    if "shared_head." in name or (m and int(m.group(1)) >= n):
        if not (load_mtp and m and int(m.group(1)) == n):
            return ("skip", "mtp")
    if not m:
        return ("plain", name, False)
    i, rest = int(m.group(1)), m.group(2)
    e = re.match(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", rest)
    if e:
        return ("expert", i, int(e.group(1)), e.group(2))
    c = re.match(r"self_attn\.([qkv])_conv1d\.weight$", rest)
    if c:
        return ("conv", i, c.group(1))
    name = f"layers.{i}.{rest}"
    for a, b in _RENAMES:
        if a in "." + name and "forget_gate" not in name:
            name = ("." + name).replace(a, b)[1:]
    return ("plain", name, name.endswith("forget_gate.A_log"))


def to_serving_names(
    raw: dict[str, torch.Tensor], cfg: Glm5NextConfig, load_mtp: bool = False
) -> dict[str, torch.Tensor]:
    """Map checkpoint names (either naming) onto Glm5NextForServing's state-dict names; with
    load_mtp, the MTP layer's tensors become `mtp.*` (else they are skipped)."""
    n = cfg.num_hidden_layers
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, int, str], torch.Tensor] = {}
    convs: dict[tuple[int, str], torch.Tensor] = {}
    skipped_vision, skipped_mtp = 0, 0
    for key, t in raw.items():
        kind = classify_key(key, n, load_mtp)
        if kind[0] == "skip":
            if kind[1] == "vision":
                skipped_vision += 1
            else:
                skipped_mtp += 1
        elif kind[0] == "expert":
            experts[(kind[1], kind[2], kind[3])] = t
        elif kind[0] == "conv":
            convs[(kind[1], kind[2])] = t
        else:
            out[kind[1]] = t.reshape(-1) if kind[2] else t  # release A_log may carry singleton dims
    if skipped_vision:
        # Every GLM-5.x release carries its vision tower: routine, not news at every start.
        log.debug("glm5_next: skipped %d vision-tower tensors", skipped_vision)
    if skipped_mtp:
        log.info("glm5_next: skipped %d MTP-layer tensors (layers.%d.* / shared_head)", skipped_mtp, n)

    # per-expert weights -> merged [E, 2I, D] / [E, D, I]
    for i in sorted({k[0] for k in experts}):
        gu, dn = [], []
        for ex in range(cfg.n_routed_experts):
            parts = []
            for proj in ("gate_proj", "up_proj", "down_proj"):
                t = experts.get((i, ex, proj))
                if t is None:
                    raise CheckpointError(f"layers.{i}.mlp.experts.{ex}.{proj}.weight", "missing")
                parts.append(t)
            want = (cfg.moe_intermediate_size, cfg.hidden_size)
            for proj, t, shape in zip(("gate_proj", "up_proj", "down_proj"), parts, (want, want, want[::-1])):
                if tuple(t.shape) != shape:
                    raise CheckpointError(
                        f"layers.{i}.mlp.experts.{ex}.{proj}.weight", f"shape {tuple(t.shape)}, expected {shape}"
                    )
            gu.append(torch.cat(parts[:2], 0))
            dn.append(parts[2])
        extra = {k[1] for k in experts if k[0] == i} - set(range(cfg.n_routed_experts))
        if extra:
            raise CheckpointError(f"layers.{i}.mlp.experts.{min(extra)}.gate_proj.weight", "unexpected expert index")
        out[f"layers.{i}.mlp.experts.gate_up_proj"] = torch.stack(gu)
        out[f"layers.{i}.mlp.experts.down_proj"] = torch.stack(dn)
    # separate q/k/v convs -> concatenated depthwise weight [3*qkv, 1, K]
    for i in sorted({k[0] for k in convs}):
        parts = []
        for which in "qkv":
            t = convs.get((i, which))
            if t is None:
                raise CheckpointError(f"layers.{i}.self_attn.{which}_conv1d.weight", "missing")
            want = (cfg.linear_num_heads * cfg.linear_head_dim, 1, cfg.linear_conv_kernel_dim)
            if t.dim() == 2:
                t = t.unsqueeze(1)
            if tuple(t.shape) != want:
                raise CheckpointError(
                    f"layers.{i}.self_attn.{which}_conv1d.weight", f"shape {tuple(t.shape)}, expected {want}"
                )
            parts.append(t)
        out[f"layers.{i}.self_attn.conv1d.weight"] = torch.cat(parts, 0)
    if load_mtp:  # the MTP layer, processed like a decoder layer above, under its module's names
        pre = f"layers.{n}."
        out = {("mtp." + k[len(pre):] if k.startswith(pre) else k): t for k, t in out.items()}
    return out


def load_model(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    load_mtp: bool = False,
) -> Glm5NextForServing:
    """Read config.json + safetensors from `model_dir` and return the serving model (eval mode).

    Parameters transformers keeps in fp32 (router bias, conv, dt_bias, A_log, mHC base/scale) stay
    fp32; all others are cast to `dtype`. Raises ConfigError / CheckpointError naming the culprit.
    load_mtp: also load the MTP layer into `model.mtp` (mtp.Glm5NextMTP; needs
    `num_nextn_predict_layers: 1`); off: it is skipped and the model is exactly the base model.
    """
    cfg = Glm5NextConfig.from_pretrained(model_dir)
    mtp_cfg = Glm5NextMTPConfig.from_pretrained(model_dir)
    if load_mtp and mtp_cfg.num_nextn_predict_layers != 1:
        raise ConfigError("num_nextn_predict_layers",
                          f"load_mtp needs exactly one MTP layer, the config has {mtp_cfg.num_nextn_predict_layers}")
    sd = to_serving_names(read_safetensors(model_dir), cfg, load_mtp=load_mtp)
    with torch.device("meta"):
        model = Glm5NextForServing(cfg)
        if load_mtp:
            from .mtp import Glm5NextMTP

            model.mtp = Glm5NextMTP(cfg, mtp_cfg, own_embed="mtp.embed_tokens.weight" in sd,
                                    own_head="mtp.shared_head.head.weight" in sd)
    expected = dict(model.state_dict())
    for name, ref in expected.items():
        if name not in sd:
            raise CheckpointError(name, "missing")
        t = sd[name]
        if tuple(t.shape) != tuple(ref.shape):
            raise CheckpointError(name, f"shape {tuple(t.shape)}, expected {tuple(ref.shape)}")
        if not t.is_floating_point():
            raise CheckpointError(name, f"dtype {t.dtype}, expected a floating-point tensor")
        sd[name] = t.to(device=device, dtype=torch.float32 if is_fp32_param(name) else dtype).contiguous()
    unexpected = sorted(set(sd) - set(expected))
    if unexpected:
        raise CheckpointError(unexpected[0], f"unexpected tensor ({len(unexpected)} in all)")
    model.load_state_dict(sd, strict=True, assign=True)
    model.requires_grad_(False)
    model.eval()
    model.prepare()
    return model
