"""A per-machine memo of graph fingerprints shared by `trnrt compile` and `trnrt verify graph-equiv`.

Both export and hash the same step graphs (export + functionalisation is ~15 s a graph of the tiny
model, more at real dimensions). Whichever runs first stores each fingerprint here; the other reads
it instead of exporting again. The key holds everything a graph can depend on: the source of the
whole `trnrt` package (every .py file, not only the model: a change anywhere is a miss), torch's
version, the hasher's version, the preset's graph settings, the model config, the flags and the
graph id. A fresh checkout (CI) starts empty, so a hit there is a graph hashed earlier in the same
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


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 over every .py file of the installed trnrt package (path and bytes), and torch's version."""
    import torch

    import trnrt

    root = Path(trnrt.__file__).resolve().parent
    h = hashlib.sha256(f"torch {torch.__version__}\0hash {HASH_VERSION}\0".encode())
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


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
