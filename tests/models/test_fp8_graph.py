"""FP8 graphs are graphs of their own: the FP8 weights (float8_e4m3fn placeholders) and their
in-graph dequantization change the fingerprint, while the default model loaded through the same
entry point (glm5_next.loading) still exports the committed lock's graph, hash for hash."""

from __future__ import annotations

import json

import torch

from trnrt.compile.catalogue import base_specs
from trnrt.compile.export import export_spec
from trnrt.compile.graph_hash import fingerprint
from trnrt.config.presets import read_preset
from trnrt.models.glm5_next.loading import load_model


def test_fp8_decode_graph_has_its_own_fingerprint(tmp_path):
    from trnrt.models.tiny import write_tiny_checkpoint
    from trnrt.models.tiny.fp8 import write_tiny_fp8_checkpoint

    preset = read_preset("default")
    ecfg = preset.engine_config
    spec = next(s for s in base_specs(ecfg) if s.phase == "decode")
    lock = json.loads(preset.lock_path.read_text())["dims"]["tiny"]["graphs"][spec.graph_id]
    got = {}
    for name, d in (("bf16", write_tiny_checkpoint(tmp_path / "bf16")),
                    ("fp8", write_tiny_fp8_checkpoint(tmp_path / "fp8"))):
        m = load_model(d, dtype=getattr(torch, ecfg.dtype))
        state = m.allocate_state(ecfg.num_blocks, ecfg.block_size, ecfg.num_slots)
        ep = export_spec(m, state, ecfg, spec).program
        dtypes = {n.meta["val"].dtype for n in ep.graph.nodes
                  if n.op == "placeholder" and hasattr(n.meta.get("val"), "dtype")}
        got[name] = (fingerprint(ep).hash, dtypes)
    assert got["bf16"][0] == lock["hash"]  # the default graph is byte-identical to the lock
    assert torch.float8_e4m3fn not in got["bf16"][1]
    assert torch.float8_e4m3fn in got["fp8"][1] and got["fp8"][0] != got["bf16"][0]
