"""The body of every rank of tests/parallel/test_tp_compile.py, and of its one-process reference.

`export_layouts(ctx, layouts)`: per (tp, ep) layout, this rank's model from the embedded tiny
checkpoint (compile.tp.rank_model_and_state), the default preset's first decode graph exported
(compile.export.export_spec, what `trnrt compile` runs), and what identifies the program:
its fingerprint (compile.graph_hash), a digest of its code, the group names its collectives
carry and how many of each collective it has.
"""

from __future__ import annotations

import hashlib
from collections import Counter

GRAPH = "decode-b1-t1-base"


def export_one(ctx) -> dict:
    from trnrt.compile.catalogue import expand
    from trnrt.compile.export import export_spec
    from trnrt.compile.graph_hash import fingerprint
    from trnrt.compile.tp import rank_model_and_state
    from trnrt.config.presets import read_preset

    ec = read_preset("default").engine_config
    spec = next(s for s in expand(ec, []) if s.graph_id == GRAPH)
    model, state = rank_model_and_state(None, ec, ctx)
    eg = export_spec(model, state, ec, spec)
    nodes = [n for n in eg.program.graph.nodes if n.op == "call_function" and "_c10d_functional" in str(n.target)]
    groups = sorted({str(n.args[-1]) for n in nodes if "wait_tensor" not in str(n.target)})
    return {"hash": fingerprint(eg.program).hash, "code": hashlib.sha256(eg.program.graph_module.code.encode()).hexdigest(),
            "groups": groups, "ops": dict(Counter(str(n.target).split(".")[1] for n in nodes)),
            "export_s": round(eg.export_s, 2)}


def export_layouts(ctx, layouts: list[list[int]]) -> dict:
    """Rank body: export_one per layout on this rank's group (ctx's group, its ep_size replaced)."""
    import dataclasses

    from trnrt.models import kernels

    kernels.load()
    out = {}
    for tp, ep in layouts:
        assert tp == ctx.tp_size
        out[f"tp{tp}_ep{ep}"] = export_one(dataclasses.replace(ctx, ep_size=ep))
    return out
