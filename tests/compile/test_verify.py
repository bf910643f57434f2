"""`trnrt verify graph-equiv` on the real step graph: clean tree passes, planted changes fail readably.

The planted changes monkeypatch a model function in this process; the CLI runs in-process
(typer's CliRunner), so it exports the patched model. Only one graph is checked per run
(--only) to keep each run to one export.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch.nn.functional as F
from typer.testing import CliRunner

from trnrt.cli import app

ROOT = Path(__file__).resolve().parents[2]
GID = "decode-b8-t1-base"
# The planted-change checks export the smallest graph a lock holds: the MTP draft (one layer with
# the same norms, attention and experts, ~870 nodes against ~3,200 for a decode step).
SMALL = ("mtp-always", "draft-b1-t4-base-greedy")


def verify(*args: str, graph: tuple[str, str] = ("batch8", GID)):
    preset, gid = graph
    return CliRunner().invoke(app, ["verify", "graph-equiv", "--preset", preset, "--only", gid, *args],
                              catch_exceptions=False)


def test_clean_tree_matches_lock():
    r = verify(graph=SMALL)
    assert r.exit_code == 0, r.output
    assert "same" in r.output and "DIFFERENT" not in r.output


def test_changed_constant_fails_with_first_node_and_line(monkeypatch):
    import trnrt.models.glm5_next.layers as M

    orig = M.rms_norm
    monkeypatch.setattr(M, "rms_norm", lambda x, w, eps: orig(x, w, eps * 10))
    r = verify(graph=SMALL)
    assert r.exit_code == 1, r.output
    out = r.output
    assert "DIFFERENT" in out and "first difference at node" in out
    # the first differing node is the add of eps inside rms_norm, shown with its source line
    assert "aten.add.Tensor" in out
    assert "models/glm5_next/layers.py:" in out and "rms_norm(" in out
    assert (1e-5 * 10).hex() in out  # the new literal, exactly


def test_changed_op_fails_with_op_delta(monkeypatch):
    import trnrt.models.glm5_next.moe as M

    def swiglu_gelu(gate, up, limit, kind):
        return F.gelu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)

    monkeypatch.setattr(M, "swiglu", swiglu_gelu)
    r = verify(graph=SMALL)
    assert r.exit_code == 1, r.output
    assert "op-count delta" in r.output and "aten.gelu.default +" in r.output and "aten.silu.default -" in r.output
    assert "first difference at node" in r.output and "models/glm5_next/moe.py:" in r.output


def test_known_flag_without_variant_is_a_usage_error(monkeypatch):
    from trnrt.engine.sample import logits_processors as lp

    monkeypatch.delitem(lp._PROCESSORS, "penalties")
    r = verify("--penalties")
    assert r.exit_code == 2
    assert "no variant graph is defined for --penalties" in r.output


def test_penalties_flag_keeps_base_hashes():
    """--penalties --structured-outputs --prompt-logprobs: the base graphs (a decode graph and the
    prefill graph the prompt-logprobs graphs are made from) hash as in the flag-off lock."""
    r = verify("--penalties", "--structured-outputs", "--prompt-logprobs", "--only", "prefill-b1-t32-base")
    assert r.exit_code == 0, r.output
    assert "prefill-b1-t32-base" in r.output and GID in r.output, r.output


def test_flag_on_keeps_base_hashes(monkeypatch):
    """With a (test-only) structured-outputs variant registered, the base graph still matches the
    flag-off lock, and the variant graph is a different graph."""
    import torch

    from trnrt.compile.catalogue import register_variant, unregister_variant
    from trnrt.engine.runner.step import StepFunction
    from trnrt.verify.graph_equiv import fingerprints_for, read_lock

    class MaskedStep(StepFunction):
        def forward(self, *args):
            *base, mask = args
            tok, lp, top_ids, top_lp = super().forward(*base)
            return tok * mask[:, 0], lp, top_ids, top_lp

    register_variant({"structured_outputs"}, ("decode",), lambda m, s, c: MaskedStep(m, s, c.max_top_logprobs),
                     lambda spec, cfg, vocab, device: (torch.ones(spec.batch, vocab, dtype=torch.int64, device=device),),
                     ("token_mask",))
    try:
        # what `verify graph-equiv --structured-outputs` hashes (the CLI over these fingerprints
        # is test_penalties_flag_keeps_base_hashes'): two exports, not four
        res = fingerprints_for("batch8", ["structured_outputs"], "tiny",
                               only=[GID, "decode-b8-t1-structured_outputs"])
    finally:
        unregister_variant({"structured_outputs"})
    lock = read_lock(ROOT / "presets" / "batch8.graphs.lock.json")
    assert res["graphs"][GID].hash == lock["dims"]["tiny"]["graphs"][GID]["hash"]
    assert res["graphs"]["decode-b8-t1-structured_outputs"].hash != res["graphs"][GID].hash


def _head_has_model() -> bool:
    r = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", "HEAD:trnrt/models/glm5_next/model.py"],
                       capture_output=True)
    return r.returncode == 0


@pytest.mark.skipif(not _head_has_model(), reason="HEAD has no committed glm5_next model yet")
def test_base_ref_shows_both_sides(monkeypatch):
    import trnrt.models.glm5_next.layers as M

    orig = M.rms_norm
    monkeypatch.setattr(M, "rms_norm", lambda x, w, eps: orig(x, w, eps * 10))
    r = verify("--base-ref", "HEAD", graph=SMALL)
    assert r.exit_code == 1, r.output
    assert "reference  aten.add.Tensor" in r.output and "current    aten.add.Tensor" in r.output


def test_lock_round_trip(tmp_path):
    import torch
    from torch import nn

    from trnrt.compile.graph_hash import fingerprint
    from trnrt.verify.graph_equiv import compare_to_lock, read_lock, write_lock

    class M(nn.Module):
        def forward(self, x):
            return torch.tanh(x) * 2.0

    fp = fingerprint(torch.export.export(M(), (torch.zeros(2, 3),)))
    res = {"preset_sha256": "p", "model_config_sha256": "m", "graphs": {"g": fp}}
    path = tmp_path / "x.graphs.lock.json"
    assert write_lock(path, "x", "tiny", res) == [f"g: (new) -> {fp.hash[:16]}"]
    assert write_lock(path, "x", "tiny", res, read_lock(path)) == []
    assert compare_to_lock(res, read_lock(path), "x", "tiny", str(path)).ok
    assert not compare_to_lock(res, read_lock(path), "x", "real", str(path)).ok  # no real section
