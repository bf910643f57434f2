"""Model implementations served by trnrt.

Kept light on purpose: importing `trnrt.models` must not import torch (`trnrt --help` and the
pure-Python engine parts depend on it). Model code lives in subpackages that are imported lazily:

* `trnrt.models.glm5_next` — GLM-5.3-Flash (`model_type` "glm5_next"): `config.Glm5NextConfig`,
  `weights.load_model`, `state.ModelState`, `model.Glm5NextForServing` / `ForwardBatch`.
* `trnrt.models.tiny` — the embedded tiny checkpoint.
"""

from __future__ import annotations

# model_type (config.json) -> module providing `load_model(model_dir, dtype, device)`
MODEL_TYPES: dict[str, str] = {"glm5_next": "trnrt.models.glm5_next.weights"}


def load_model(model_dir, dtype=None, device="cpu"):
    """Load the serving model for `model_dir` by its config.json `model_type` (imports torch)."""
    import importlib
    import json
    from pathlib import Path

    with open(Path(model_dir) / "config.json", encoding="utf-8") as f:
        model_type = json.load(f).get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"config field 'model_type': {model_type!r} is not supported (supported: {sorted(MODEL_TYPES)})")
    mod = importlib.import_module(MODEL_TYPES[model_type])
    if dtype is None:
        import torch

        dtype = torch.float32
    return mod.load_model(model_dir, dtype=dtype, device=device)
