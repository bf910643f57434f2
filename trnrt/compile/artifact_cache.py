"""The compiled-artifact cache: where `trnrt compile` writes by default and `trnrt serve` looks.

Layout: <cache>/compiled/<model key>/<preset>/<backend>/manifest.json (an FP8 model's graphs:
<backend>/fp8/manifest.json, so `--quantization fp8` of a bf16 checkpoint has its own), with <cache> trnrt's cache
root ($TRNRT_CACHE_DIR, else $XDG_CACHE_HOME/trnrt, else ~/.cache/trnrt) and the model key a hash
of the checkpoint directory's resolved path. The key only finds a candidate: whether it may run is
decided by the loader's own checks (model config, preset settings, flags, torch, graph hashes),
exactly as for `--compiled DIR`, so a checkpoint replaced in place, an edited preset or changed
graph code is refused there and the server runs eagerly instead (the reason is logged).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from trnrt.compile.manifest import MANIFEST_NAME


def cache_root() -> Path:
    """<cache>/compiled."""
    from trnrt.models.cache_dir import cache_dir

    return cache_dir() / "compiled"


def model_key(model_dir: str | os.PathLike) -> str:
    """A short stable key of a checkpoint directory (its resolved path)."""
    return hashlib.sha256(str(Path(model_dir).resolve()).encode()).hexdigest()[:16]


def artifact_root(model_dir: str | os.PathLike) -> Path:
    """The --out that `trnrt compile` uses for `model_dir` by default (it writes PRESET/BACKEND/ below)."""
    return cache_root() / model_key(model_dir)


def cached_artifacts(model_dir: str | os.PathLike, preset: str, backend: str = "cpu",
                     quantization: str | None = None) -> Path | None:
    """The cached artifact directory of (model, preset name, backend, quantization:
    None or a manifest.quantization_name) if one was written, else None.

    Only the manifest's presence is checked here; the loader validates it."""
    from trnrt.compile.manifest import quantized_dir

    d = quantized_dir(artifact_root(model_dir) / preset / backend, quantization)
    return d if (d / MANIFEST_NAME).is_file() else None
