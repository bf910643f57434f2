"""`check_fits`: refuse a layout whose rank cannot hold its weights, one request at max_model_len
and the preset's state allocation, naming the smallest layout that would (before any weight loads)."""

from __future__ import annotations

from trnrt.config.engine_config import EngineConfig
from trnrt.models.glm5_next.config import Glm5NextConfig

from .devices import GB, device as get_device, sglang_mem_fraction_static
from .memory import Plan, plan, smallest_fitting_layout

MAX_SEARCH_TP = 128  # the layouts smallest_fitting_layout tries (more ranks than any one node)


class PlanError(ValueError):
    """A layout that does not fit its device; `.plan` is its Plan, `.smallest` the smallest that fits (or None)."""

    def __init__(self, message: str, plan: Plan, smallest: Plan | None):
        super().__init__(message)
        self.plan = plan
        self.smallest = smallest


def _gb(n: int) -> str:
    return f"{n / GB:.1f} GB"


def check_fits(cfg: Glm5NextConfig, engine: EngineConfig, tp: int = 1, ep: int = 1, device: str = "cpu",
               mem_fraction_static: float | None = None, dtype: str | None = None,
               mtp: bool | None = None, quantization: str | None = None,
               kv_cache_dtype: str | None = None) -> Plan:
    """The rank's Plan if it fits; else PlanError naming what does not fit and the smallest
    (tp, ep) that would (over the layouts that divide the dims, up to MAX_SEARCH_TP ranks),
    with how many devices of this kind it takes. mem_fraction_static None: SGLang's default for
    each tp; dtype None: the engine's; mtp None: on when the preset speculates; quantization
    "fp8": FP8 weights (memory.weight_bytes); kv_cache_dtype "fp8_e4m3": FP8 latents and keys."""
    dev = get_device(device)
    frac = mem_fraction_static if mem_fraction_static is not None else sglang_mem_fraction_static(tp)
    p = plan(cfg, engine, tp, ep, dev.rank_bytes(tp), frac, dtype, mtp, quantization, kv_cache_dtype)
    if p.fits:
        return p
    smallest = smallest_fitting_layout(cfg, engine, dev.rank_bytes,
                                       mem_fraction_static or sglang_mem_fraction_static, MAX_SEARCH_TP, dtype, mtp,
                                       quantization, kv_cache_dtype)
    why = (f"weights {_gb(p.weights.total)} per rank, activations {_gb(p.activation)}: "
           f"{_gb(p.state_pool)} left for state of the {_gb(int(frac * p.device_bytes))} static budget "
           f"(mem_fraction_static {frac:.2f} of {_gb(p.device_bytes)})")
    if p.state_pool > 0:
        why += (f"; one request at max_model_len {engine.max_model_len} needs {_gb(p.request_bytes)}, "
                f"the preset allocates {_gb(p.preset_state)}")
    if smallest is None:
        hint = f"no layout up to TP {MAX_SEARCH_TP} on {device} fits"
    else:
        nodes = -(-smallest.tp // dev.ranks_per_instance)
        hint = (f"the smallest layout that fits is TP {smallest.tp} EP {smallest.ep} "
                f"({smallest.tp} x {device}, {nodes} instance(s) of {dev.ranks_per_instance}): "
                f"weights {_gb(smallest.weights.total)} per rank, "
                f"{smallest.max_running_requests} requests at max_model_len")
    what = f"{dtype or engine.dtype}{', fp8 weights' if quantization else ''}"
    raise PlanError(f"TP {tp} EP {ep} on {device} ({what}) does not fit: {why}; {hint}",
                    p, smallest)


def real_config() -> Glm5NextConfig:
    """GLM-5.3-Flash's text config (trnrt/plan/real_config.json: the released config's dims)."""
    import json
    from pathlib import Path

    return Glm5NextConfig.from_dict(json.loads((Path(__file__).parent / "real_config.json").read_text()))


def model_config(model_dir) -> tuple[Glm5NextConfig, bool]:
    """A checkpoint's text config, and whether it is an FP8 checkpoint (its quantization_config,
    which Glm5NextConfig refuses, set aside: the plan needs only the dims)."""
    import json
    from pathlib import Path

    raw = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    fp8 = bool(raw.pop("quantization_config", None) or text.pop("quantization_config", None))
    return Glm5NextConfig.from_dict(raw), fp8


def check_serve_fits(model_dir: str, preset: str | None, tp: int = 1, ep: int = 1, device: str = "cpu",
                     mem_fraction_static: float | None = None, quantization: str | None = None,
                     kv_cache_dtype: str | None = None) -> Plan:
    """check_fits of a model directory's config under a preset (what `trnrt serve` runs before
    loading weights; an FP8 checkpoint or quantization "fp8" is planned with FP8 weights);
    PlanError if it does not fit."""
    from trnrt.config.presets import load_preset

    cfg, fp8 = model_config(model_dir)
    return check_fits(cfg, load_preset(preset or "default"), tp, ep, device, mem_fraction_static,
                      quantization=quantization or ("fp8" if fp8 else None), kv_cache_dtype=kv_cache_dtype)
