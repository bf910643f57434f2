"""A per-machine memo of graph fingerprints shared by `trnrt compile` and `trnrt verify graph-equiv`.

Both export and hash the same step graphs (export + functionalisation is ~15 s a graph of the tiny
model, more at real dimensions). Whichever runs first stores each fingerprint here; the other reads
it instead of exporting again. The key holds everything a graph can depend on: the traced sources
(every file of `trnrt` that exporting a graph can import, inside functions too: the model, the
step functions, the sampler, compile/, config/; a change to one is a miss, while an edit to the
server, the scheduler or the docs keeps every entry), torch's version, the hasher's version, the
preset's graph settings, the model config, the flags and the graph id. A fresh checkout (CI) starts empty, so a hit there is a graph hashed earlier in the same
run from the same tree. `TRNRT_GRAPH_CACHE=0` or `trnrt verify graph-equiv --fresh` bypasses it.

Files: `<cache>/graph-fingerprints/<key>.json`, written atomically (temp file + rename), so
concurrent writers (pytest-xdist workers) never leave a torn file.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable

from .graph_hash import HASH_VERSION, GraphFingerprint, NodeInfo


def enabled() -> bool:
    return os.environ.get("TRNRT_GRAPH_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


def _dir() -> Path:
    from trnrt.models.cache_dir import cache_dir

    return cache_dir() / "graph-fingerprints"


# The modules graph export starts from; traced_sources() adds all they can import.
TRACED_ROOTS = (
    "trnrt.compile.export",      # export_spec, the ExportStep wrapper
    "trnrt.compile.pipeline",    # meta_model_and_state: the model a graph is exported from
    "trnrt.compile.catalogue",   # graph specs and variant steps
    "trnrt.compile.graph_hash",  # the hash itself
    "trnrt.config.presets",      # the preset's settings, as the step sees them
    "trnrt.verify.graph_equiv",  # model_config_for (tiny / real dims)
)


def traced_sources(pkg: Path) -> list[Path]:
    """The files of the trnrt package at `pkg` that a traced graph can depend on: the modules of
    TRACED_ROOTS and every trnrt module they import (trnrt.compile.import_graph.closure), plus the
    non-Python files beside them (the fused CPU kernels' C++ source, the tiny model's data)."""
    from .import_graph import closure

    mods = closure(pkg.parent, list(TRACED_ROOTS), package=pkg.name)
    files = set(mods.values())
    for d in {f.parent for f in mods.values()}:
        files.update(f for f in d.iterdir() if f.is_file() and f.suffix not in (".py", ".pyc"))
    return sorted(files)


def sources_digest(pkg: Path) -> str:
    """sha256 over the traced sources of the package at `pkg` (path and bytes), torch's version and
    the hasher's version."""
    import torch

    h = hashlib.sha256(f"torch {torch.__version__}\0hash {HASH_VERSION}\0".encode())
    for f in traced_sources(pkg):
        h.update(str(f.relative_to(pkg)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """sources_digest of the installed trnrt package (read once a process)."""
    import trnrt

    return sources_digest(Path(trnrt.__file__).resolve().parent)


def model_digest(model_or_config: Any) -> str:
    """sha256 of the model config without its special-token ids (pad/bos/eos), which no graph reads:
    the embedded checkpoint and the bare tiny config differ only in pad_token_id."""
    from .manifest import canonical_json, model_config_dict

    d = {k: v for k, v in model_config_dict(model_or_config).items() if not k.endswith(("token_id", "token_ids"))}
    return hashlib.sha256(canonical_json(d)).hexdigest()


def key(preset_sha256: str, model_or_config: Any, flags: Iterable[str], graph_id: str) -> str:
    parts = [source_digest(), preset_sha256, model_digest(model_or_config), ",".join(sorted(set(flags))), graph_id]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def to_json(fp: GraphFingerprint) -> dict:
    return dataclasses.asdict(fp)


def from_json(d: dict) -> GraphFingerprint:
    nodes = [NodeInfo(**{**n, "inputs": tuple(n["inputs"])}) for n in d["nodes"]]
    return GraphFingerprint(hash=d["hash"], nodes=nodes, op_counts=d["op_counts"], num_nodes=d["num_nodes"],
                            extra=d.get("extra", {}))


def get(k: str) -> GraphFingerprint | None:
    if not enabled():
        return None
    p = _dir() / f"{k}.json"
    try:
        return from_json(json.loads(p.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # missing or unreadable: recompute


def put(k: str, fp: GraphFingerprint) -> None:
    if not enabled():
        return
    d = _dir()
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(to_json(fp), f)
        os.replace(tmp, d / f"{k}.json")
    except OSError:
        pass  # a read-only cache only costs time
