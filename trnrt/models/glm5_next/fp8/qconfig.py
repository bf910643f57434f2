"""config.json's `quantization_config`, read and checked once (standard library only).

Accepted (the fields of DeepSeek-V3 / GLM FP8 releases, transformers' FineGrainedFP8Config and
vLLM's Fp8Config):
    {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic",
     "fmt": "e4m3", "modules_to_not_convert": [...] | "ignored_layers": [...]}
Which weights are FP8 is decided by the tensors themselves (a weight with a `weight_scale_inv`);
the module lists, when given, must agree. Anything else is refused naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..config import ConfigError

QUANT_METHODS = ("fp8",)
_KNOWN = {"quant_method", "weight_block_size", "activation_scheme", "fmt", "modules_to_not_convert",
          "ignored_layers", "scale_fmt"}
_F = FIELD = "quantization_config"


@dataclass(frozen=True)
class QuantConfig:
    """FP8 block quantization: `block` = (rows, cols) of one scale block."""

    method: str = "fp8"
    block: tuple[int, int] = (128, 128)
    not_convert: tuple[str, ...] = field(default_factory=tuple)  # module name fragments kept bf16

    def to_json(self) -> dict:
        """The release's fields (what `make-tiny --fp8` writes)."""
        return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": self.method,
                "weight_block_size": list(self.block)}

    def keeps_bf16(self, name: str) -> bool:
        return any(m in name for m in self.not_convert)


def parse(d: dict | None) -> QuantConfig | None:
    """`quantization_config` (a dict or None) -> QuantConfig, or None when absent."""
    if d is None:
        return None
    if not isinstance(d, dict):
        raise ConfigError(_F, f"must be an object, got {type(d).__name__}")
    method = d.get("quant_method")
    if method not in QUANT_METHODS:
        raise ConfigError(f"{_F}.quant_method", f"unsupported quantization method {method!r} "
                          f"(trnrt loads {', '.join(QUANT_METHODS)})")
    unknown = sorted(set(d) - _KNOWN)
    if unknown:
        raise ConfigError(f"{_F}.{unknown[0]}", "unknown field for quant_method 'fp8'")
    bs = d.get("weight_block_size")
    if bs is None:
        raise ConfigError(f"{_F}.weight_block_size", "missing: trnrt loads block-quantized FP8 only "
                          "(per-tensor FP8 checkpoints are not supported)")
    if (not isinstance(bs, list) or len(bs) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in bs)):
        raise ConfigError(f"{_F}.weight_block_size", f"must be two positive integers, got {bs!r}")
    act = d.get("activation_scheme", "dynamic")
    if act != "dynamic":
        raise ConfigError(f"{_F}.activation_scheme", f"{act!r} is not supported (dynamic only: "
                          "static activation scales are not read)")
    fmt = d.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"{_F}.fmt", f"{fmt!r} is not supported (float8_e4m3fn weights only)")
    if d.get("scale_fmt") not in (None, "float32", "fp32"):
        raise ConfigError(f"{_F}.scale_fmt", f"{d['scale_fmt']!r} is not supported (fp32 scales only)")
    lists = []
    for key in ("modules_to_not_convert", "ignored_layers"):
        v = d.get(key)
        if v is None:
            continue
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise ConfigError(f"{_F}.{key}", f"must be a list of module names, got {v!r}")
        lists += v
    return QuantConfig(method=method, block=(bs[0], bs[1]), not_convert=tuple(lists))


def read(model_dir: str | Path) -> QuantConfig | None:
    """The checkpoint's QuantConfig (None: not quantized)."""
    with open(Path(model_dir) / "config.json", encoding="utf-8") as f:
        raw = json.load(f)
    # multimodal releases keep it at the top level; a text-only config.json has no text_config
    return parse(raw.get(_F, (raw.get("text_config") or {}).get(_F)))
