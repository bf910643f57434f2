"""`trnrt compile --tp-size N [--ep-size M]`: the graphs of one tensor-parallel layout (issue #31).

What is compiled: rank 0's step graphs, exported from its rank model (`rank_model.load_rank_model`,
or `rank_meta.meta_rank_model` for shapes only) on a FAKE world of N ranks in this one process.
That graph is every rank's graph: a rank's identity lives in its weights and in buffers
(vocab_start, expert_start), which the cpu backend binds from the live model at load, never in
the program; the collectives name the group ('0', the default group) and not the rank.
tests/parallel/test_tp_compile.py checks it: the fingerprints of 2 gloo ranks' exports are equal,
and equal to the fake-world export.

The layout is part of every key: `layout_hash(graph_hash, layout)` (the manifest's graph_hash at
TP>1) covers the exported program's fingerprint and the layout (tp, ep, moe_tp, the group), and the
artifacts go to <out>/<preset>/<backend>/tp{N}ep{M}/ with their own manifest (engine_config
"parallel" records the layout). TP=1 is untouched: same directory, same hash, no layout key.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from trnrt.parallel.context import ParallelContext

GROUP = "default"  # every collective runs on the default process group (ParallelContext.from_group(None))


def layout(ctx: ParallelContext) -> dict:
    """The parallel layout a TP graph depends on (empty at TP=1)."""
    if ctx.tp_size == 1:
        return {}
    return {"tp_size": ctx.tp_size, "ep_size": ctx.ep_size, "moe_tp_size": ctx.moe_tp_size, "group": GROUP}


def layout_key(ctx: ParallelContext) -> str:
    """The artifact subdirectory of a layout: 'tp2ep1'; '' at TP=1."""
    return "" if ctx.tp_size == 1 else f"tp{ctx.tp_size}ep{ctx.ep_size}"


def layout_hash(graph_hash: str, ctx: ParallelContext) -> str:
    """The key of a graph of this layout: graph_hash itself at TP=1 (the committed locks and TP=1
    manifests do not move), else sha256 over the fingerprint and the layout."""
    lay = layout(ctx)
    if not lay:
        return graph_hash
    return hashlib.sha256(json.dumps({"graph": graph_hash, "parallel": lay}, sort_keys=True).encode()).hexdigest()


def layout_dir(art_dir: Path, ctx: ParallelContext) -> Path:
    """<out>/<preset>/<backend> at TP=1, <out>/<preset>/<backend>/tp{N}ep{M} above it."""
    key = layout_key(ctx)
    return Path(art_dir) / key if key else Path(art_dir)


def rank_model_and_state(model_dir: str | Path | None, engine_config: Any, ctx: ParallelContext,
                         device: str = "cpu"):
    """The rank's serving model from `model_dir` (None: the embedded tiny checkpoint), and its state.
    (Speculative presets: the rank model's MTP layer is loaded when the preset drafts.)"""
    import torch

    from trnrt.models.glm5_next.rank_model import load_rank_model
    from trnrt.models.paths import resolve_model_dir

    spec = engine_config.speculative_num_steps > 0
    model = load_rank_model(resolve_model_dir(model_dir), getattr(torch, engine_config.dtype), ctx,
                            load_mtp=spec, device=device)
    state = model.allocate_state(engine_config.num_blocks, engine_config.block_size, engine_config.num_slots,
                                 mtp=spec)
    return model, state
