"""The artifact manifest: <out>/<preset>/<backend>/manifest.json.

One entry per graph spec (id, shapes and dtypes of inputs and outputs, graph hash, compile
seconds, bytes, status, artifact file) plus what every entry depends on: the model config hash,
the preset hash, the flags, the backend, the versions it was built with and, for a quantized
model, its quantization ("fp8") and the layout of its quantized weights (`quantization_of`,
`quantized_weights_hash`; None for the default bf16 / fp32 weights, so their manifests are
unchanged). FP8 artifacts live under <out>/<preset>/<backend>/fp8/. `trnrt compile`
reuses an entry whose inputs all match; `load_compiled` refuses one that does not.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = 1
MANIFEST_NAME = "manifest.json"


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()


def model_config_dict(model_or_config: Any) -> dict:
    """The model's config as a plain dict (a dataclass, a transformers config or a dict)."""
    cfg = getattr(model_or_config, "config", model_or_config)
    if dataclasses.is_dataclass(cfg):
        d = dataclasses.asdict(cfg)
    elif hasattr(cfg, "to_dict"):
        d = cfg.to_dict()
    elif isinstance(cfg, dict):
        d = dict(cfg)
    else:
        d = dict(vars(cfg))
    # Bookkeeping fields that do not change the computation.
    for k in ("_name_or_path", "transformers_version", "architectures", "_commit_hash"):
        d.pop(k, None)
    return d


def model_config_hash(model_or_config: Any) -> str:
    """sha256 of the model config as canonical JSON."""
    return hashlib.sha256(canonical_json(model_config_dict(model_or_config))).hexdigest()


FP8_DTYPE_NAMES = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")


def _weight_tensors(model: Any):
    import torch

    if not isinstance(model, torch.nn.Module):
        return []
    return [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]


def _is_fp8(t: Any) -> bool:
    return str(getattr(t, "dtype", "")).removeprefix("torch.") in FP8_DTYPE_NAMES


def quantization_name(fp8_weights: bool, fp8_kv_cache: bool) -> str | None:
    """"fp8" (FP8 weights), "kv_fp8" (`--kv-cache-dtype fp8_e4m3`), "fp8+kv_fp8" (both) or None."""
    return "+".join(n for n, on in (("fp8", fp8_weights), ("kv_fp8", fp8_kv_cache)) if on) or None


def quantization_of(model: Any, state: Any = None) -> str | None:
    """quantization_name of a model (FP8 weights: Fp8Linear / Fp8Experts swapped in by
    glm5_next.loading) and its state (an FP8 latent / key cache: fp8/kv_cache.py); None for the
    default model and state (their graphs and manifests)."""
    weights = any(_is_fp8(t) for _, t in _weight_tensors(model))
    kv = state is not None and dataclasses.is_dataclass(state) and \
        any(_is_fp8(getattr(state, f.name, None)) for f in dataclasses.fields(state))
    return quantization_name(weights, kv)


def quantized_weights_hash(model: Any) -> str | None:
    """sha256 of the (name, dtype, shape) of every weight of a quantized model (the MTP layer's
    left out: a target graph never reads it, and a server may load it or not), so artifacts of
    one FP8 layout are not bound to another (which linears are FP8, the block grid). None for an
    unquantized model."""
    if not any(_is_fp8(t) for _, t in _weight_tensors(model)):
        return None
    rows = sorted((n, str(t.dtype), list(t.shape)) for n, t in _weight_tensors(model) if not n.startswith("mtp."))
    return hashlib.sha256(canonical_json(rows)).hexdigest()


def quantized_dir(art_dir: Path, quantization: str | None) -> Path:
    """Where the artifacts of a `quantization` model go under <out>/<preset>/<backend>: a folder
    of their own (`fp8/`, `kv_fp8/`, `fp8+kv_fp8/`), so they never overwrite or stand in for the
    default graphs."""
    return Path(art_dir) / quantization if quantization else Path(art_dir)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class GraphEntry:
    id: str
    phase: str
    batch: int
    tokens: int
    variant: str
    inputs: list[dict]
    outputs: list[dict]
    graph_hash: str
    status: str  # "ok" | "failed" | "pending" | "exported" (dry run) | "load-time" (cuda capture, eager)
    export_s: float = 0.0
    compile_s: float = 0.0
    bytes: int = 0
    artifact: str | None = None  # path relative to the manifest's directory
    artifact_sha256: str | None = None
    files: list[str] = field(default_factory=list)  # every file of the entry, relative
    reused: bool = False
    error: str | None = None
    sampling: str = "full"  # "full" | "greedy" (GraphSpec.sampling)


@dataclass
class Manifest:
    preset: str
    preset_sha256: str
    model_config_sha256: str
    backend: str
    flags: list[str]
    engine_config: dict
    versions: dict
    graphs: list[GraphEntry] = field(default_factory=list)
    schema: int = SCHEMA
    compiler: dict = field(default_factory=dict)
    code_digest: str = ""
    quantization: str | None = None  # "fp8": built from an FP8 model (quantization_of); None: default weights
    quantized_weights_sha256: str | None = None  # quantized_weights_hash of that model

    def entry(self, graph_id: str) -> GraphEntry | None:
        for g in self.graphs:
            if g.id == graph_id:
                return g
        return None

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        for k in ("quantization", "quantized_weights_sha256"):  # a default model's manifest keeps its fields
            if d[k] is None:
                del d[k]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Manifest":
        d = dict(d)
        graphs = [GraphEntry(**g) for g in d.pop("graphs", [])]
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(graphs=graphs, **{k: v for k, v in d.items() if k in known})

    def write(self, directory: Path) -> Path:
        """Atomically write manifest.json into `directory`."""
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / MANIFEST_NAME
        tmp = path.with_name(f".{MANIFEST_NAME}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1, sort_keys=False) + "\n", encoding="utf-8")
        os.replace(tmp, path)
        return path

    @classmethod
    def read(cls, directory: Path) -> "Manifest":
        with open(Path(directory) / MANIFEST_NAME, encoding="utf-8") as f:
            return cls.from_json(json.load(f))


# Source files that define the step graphs. If none changed (and torch did not), the graphs did
# not change, so load_compiled can trust the recorded graph hashes without re-exporting.
_GRAPH_SOURCES = ("models/glm5_next", "engine/runner/step.py", "engine/sample/sampler.py", "compile/export.py",
                  "compile/catalogue.py", "compile/graph_hash.py")


def code_digest() -> str:
    """sha256 over the source of the modules that define the step graphs."""
    import trnrt

    root = Path(trnrt.__file__).resolve().parent
    h = hashlib.sha256()
    for rel in _GRAPH_SOURCES:
        p = root / rel
        files = sorted(p.rglob("*.py")) if p.is_dir() else [p]
        for f in files:
            if f.is_file():
                h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def versions() -> dict:
    """Versions the artifacts depend on (a compiled .so is tied to torch and the host ISA)."""
    import torch

    import trnrt

    return {
        "trnrt": getattr(trnrt, "__version__", "?"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
