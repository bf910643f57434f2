"""`trnrt compile` on the CPU backend (AOTInductor) and load_compiled, on the tiny model.

The session compiles once (conftest); these tests share it. Compiled and eager runs of the same
serving-like scenario must give the same tokens and (to float rounding) the same logprobs, and
leave the same state behind: the compiled graphs update the engine's state tensors in place.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import scenario
from trnrt.compile import CompiledArtifactError, expand, load_compiled
from trnrt.compile.export import eager_callable, state_tensors
from trnrt.compile.manifest import Manifest
from trnrt.config.presets import load_preset, read_preset
from trnrt.verify.graph_equiv import read_lock

from compile_groups import MODE, PRESETS, SUBSET, catalogue, compiled_ids, copied_ids, selected

LOGPROB_TOL = 1e-4  # fp32; Inductor fuses and reorders reductions, so bits may differ
# The presets whose compiled graphs the decode / prefill scenario checks; the MTP presets' plain
# graphs are copies of default's, their verify / draft graphs are checked in test_compile_spec.
PLAIN_PRESETS = tuple(p for p in PRESETS if not load_preset(p).speculative_num_steps)


def _state(model, cfg):
    return model.allocate_state(cfg.num_blocks, cfg.block_size, cfg.num_slots)


def _compiled_specs(art_dir, cfg):
    man = Manifest.read(art_dir)
    ok = {g.id for g in man.graphs if g.status == "ok"}
    return [s for s in expand(cfg) if s.graph_id in ok]


def _check_same(model, cfg, art_dir):
    """Runs the scenario over every graph of the preset: compiled graphs where the artifact has
    them, eager (on the same state) for the rest; the eager reference runs everything eagerly.
    Returns the ids of the compiled graphs checked."""
    specs = _compiled_specs(art_dir, cfg)
    assert specs
    all_specs = expand(cfg)
    st_c, st_e = _state(model, cfg), _state(model, cfg)
    fns = load_compiled(art_dir, model, st_c, cfg, specs=specs, check_graphs=False)
    assert all(hasattr(fns[s], "runner") for s in specs), "expected AOTInductor callables, not eager ones"
    fill = {s: eager_callable(model, st_c, cfg, s) for s in all_specs if s not in fns}
    eager = {s: eager_callable(model, st_e, cfg, s) for s in all_specs}
    used = set()

    def call_c(spec, inputs):
        used.add(spec)
        return (fns.get(spec) or fill[spec])(*inputs)

    out_c = scenario.run(call_c, cfg, all_specs)
    out_e = scenario.run(lambda spec, inputs: eager[spec](*inputs), cfg, all_specs)
    assert set(specs) <= used, "the scenario must exercise every compiled graph"
    assert len(out_c) == len(out_e)
    assert any(n < len(o[0]) for o, n in out_e), "the scenario must include padding rows"
    for i, ((c, n), (e, _)) in enumerate(zip(out_c, out_e)):
        c, e = [t[:n] for t in c], [t[:n] for t in e]  # live rows only
        assert torch.equal(c[0], e[0]), f"call {i}: tokens differ {c[0].tolist()} vs {e[0].tolist()}"
        torch.testing.assert_close(c[1], e[1], atol=LOGPROB_TOL, rtol=0)
        assert torch.equal(c[2], e[2]), f"call {i}: top ids differ"
        torch.testing.assert_close(c[3], e[3], atol=LOGPROB_TOL, rtol=0)
    # The state the compiled graphs wrote is the state eager wrote, in the engine's own tensors.
    # Index 0 of dim 1 (scratch block 0 / slot 0) is excluded: padding writes land there.
    for (name, a), (_, b) in zip(state_tensors(st_c), state_tensors(st_e)):
        assert a[:, 1:].abs().sum() > 0, f"compiled graphs never wrote state.{name}"
        torch.testing.assert_close(a[:, 1:], b[:, 1:], atol=1e-4, rtol=1e-4, msg=f"state.{name}")
    return {s.graph_id for s in specs}


@pytest.mark.parametrize("preset", PLAIN_PRESETS)
def test_compiled_equals_eager(tiny_model, compiled, preset):
    """Every compiled graph of the preset gives eager's tokens, logprobs and state."""
    if preset not in compiled:
        pytest.skip(f"TRNRT_TEST_COMPILE={MODE}: {preset}'s graphs are not compiled")
    checked = _check_same(tiny_model, load_preset(preset), compiled[preset])
    assert checked == set(compiled_ids()[preset])
    # a graph equal to an earlier preset's (equal lock hashes) is copied from there, not compiled again
    man = Manifest.read(compiled[preset])
    assert {g.id for g in man.graphs if g.reused} == copied_ids().get(preset, set())


def test_every_kind_is_compiled():
    """batch8 whole (the artifact-cache and serve tests load it) and a compiled graph of every
    (phase, variant) of both presets and every flag set, or of a larger variant of that phase; with TRNRT_TEST_COMPILE=buckets also
    every bucket of both presets and every kind (sampler, context table), with =every every graph."""
    if MODE in ("subset", "variants"):
        pytest.skip(f"TRNRT_TEST_COMPILE={MODE}")
    ids = compiled_ids()
    phases_variants = {g.kind[:2] for g in selected()}
    for phase, variant in {g.kind[:2] for g in catalogue()}:  # covered by itself or a larger variant
        assert any(p == phase and set(variant.split("+")) <= set(v.split("+")) for p, v in phases_variants), \
            (phase, variant)
    assert any(g.kind[:3] == ("decode", "base", "greedy") for g in selected())
    assert set(ids["batch8"]) == {s.graph_id for s in expand(load_preset("batch8"))}
    if MODE in ("buckets", "every"):
        assert {g.kind for g in selected()} == {g.kind for g in catalogue()}
        for preset in PRESETS:
            specs = expand(load_preset(preset))
            assert {(s.phase, s.batch, s.tokens, s.context) for s in specs if s.graph_id in ids[preset]} == \
                {(s.phase, s.batch, s.tokens, s.context) for s in specs}, preset


def test_manifest(compiled_batch8):
    man = Manifest.read(compiled_batch8)
    raw = json.loads((compiled_batch8 / "manifest.json").read_text())
    assert raw["preset"] == "batch8" and raw["backend"] == "cpu" and raw["flags"] == []
    assert len(raw["model_config_sha256"]) == 64 and len(raw["preset_sha256"]) == 64
    ok = [g for g in man.graphs if g.status == "ok"]
    assert ok
    lock = read_lock(read_preset("batch8").lock_path)
    for g in ok:
        assert (compiled_batch8 / g.artifact).stat().st_size == g.bytes > 0
        assert (g.compile_s > 0 or g.reused) and g.export_s > 0
        assert [i["name"] for i in g.inputs[:3]] == ["input_ids", "start_pos", "num_new"]
        assert g.inputs[0]["shape"] == [g.batch, g.tokens] and g.inputs[0]["dtype"] == "int64"
        assert [o["name"] for o in g.outputs] == ["token_ids", "token_logprobs", "top_ids", "top_logprobs"]
        assert g.outputs[0]["shape"] == [g.batch]
        # the compile hashes a checkpoint-loaded model; verify hashes the tiny config with no
        # weights: the same graph, the same hash
        assert g.graph_hash == lock["dims"]["tiny"]["graphs"][g.id]["hash"]


def test_recompile_reuses_up_to_date_artifacts(tiny_dir, compiled_batch8, tmp_path):
    from typer.testing import CliRunner

    from trnrt.cli import app

    out = tmp_path / "out"  # a copy: other tests read the shared artifacts meanwhile
    shutil.copytree(compiled_batch8.parents[1], out)
    art = out / "batch8" / "cpu"
    before = Manifest.read(art).entry("decode-b8-t1-base")
    r = CliRunner().invoke(app, ["compile", "--preset", "batch8", "--model", str(tiny_dir), "--out", str(out),
                                 "--only", "decode-b8-t1-base"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "up to date" in r.output
    after = Manifest.read(art).entry("decode-b8-t1-base")
    assert after.reused and after.artifact_sha256 == before.artifact_sha256


def test_refuses_other_model_config(tiny_model, compiled_batch8, tmp_path):
    d = tmp_path / "art"
    shutil.copytree(compiled_batch8, d)
    raw = json.loads((d / "manifest.json").read_text())
    raw["model_config_sha256"] = "0" * 64
    (d / "manifest.json").write_text(json.dumps(raw))
    cfg = load_preset("batch8")
    with pytest.raises(CompiledArtifactError, match="another model config") as e:
        load_compiled(d, tiny_model, _state(tiny_model, cfg), cfg)
    assert e.value.reason == "model_config"


def test_refuses_other_preset(tiny_model, compiled_batch8):
    cfg = load_preset("batch8").replace(max_top_logprobs=5)
    with pytest.raises(CompiledArtifactError, match="other preset settings") as e:
        load_compiled(compiled_batch8.parents[1], tiny_model, _state(tiny_model, cfg), cfg)
    assert e.value.reason == "preset"


def test_refuses_other_graph_hash(tiny_model, compiled_batch8, monkeypatch, tmp_path):
    """A model edit after the compile: the source digest differs, so each graph is re-exported
    and its hash compared. (The edit is planted by monkeypatching, which leaves the source as it
    was, so the manifest's digest is altered to stand for the edited file.)"""
    import trnrt.models.glm5_next.layers as M

    cfg = load_preset("batch8")
    spec = next(s for s in _compiled_specs(compiled_batch8, cfg) if s.phase == "decode")
    d = tmp_path / "art"
    shutil.copytree(compiled_batch8, d)
    raw = json.loads((d / "manifest.json").read_text())
    raw["code_digest"] = "edited"
    (d / "manifest.json").write_text(json.dumps(raw))
    assert load_compiled(d, tiny_model, _state(tiny_model, cfg), cfg, specs=[spec])  # same graph: accepted
    orig = M.rms_norm
    monkeypatch.setattr(M, "rms_norm", lambda x, w, eps: orig(x, w, eps * 10))
    with pytest.raises(CompiledArtifactError, match="compiled from other code") as e:
        load_compiled(d, tiny_model, _state(tiny_model, cfg), cfg, specs=[spec])
    assert e.value.reason == "graph_hash" and spec.graph_id in str(e.value)
    # with an unchanged source digest the recorded hashes are trusted (no re-export)
    load_compiled(compiled_batch8, tiny_model, _state(tiny_model, cfg), cfg, specs=[spec])


def test_refuses_missing_graph(tiny_model, compiled_batch8, tmp_path):
    cfg = load_preset("batch8")
    d = tmp_path / "art"
    shutil.copytree(compiled_batch8, d)
    raw = json.loads((d / "manifest.json").read_text())
    raw["graphs"] = raw["graphs"][:1]
    (d / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(CompiledArtifactError) as e:
        load_compiled(d, tiny_model, _state(tiny_model, cfg), cfg, check_graphs=False)
    assert e.value.reason in ("graph_missing", "graph_failed")


def _generated_code(pt2) -> tuple[str, str]:
    """(kernel C++, wrapper C++) of an AOTInductor package."""
    import zipfile

    with zipfile.ZipFile(pt2) as z:
        kernel = "".join(z.read(n).decode() for n in z.namelist() if n.endswith(".kernel.cpp"))
        wrapper = "".join(z.read(n).decode() for n in z.namelist() if n.endswith(".wrapper.cpp"))
    return kernel, wrapper


def test_compiled_decode_writes_state_in_place_and_fuses_the_sinkhorn(tiny_model, compiled_batch8):
    """The generated code never loops over a whole state pool (the cost that made decode-b8 8.5 ms:
    a mutated per-layer view of a state input made AOTInductor clone it and copy it back every
    step), the Sinkhorn is fused (no ~470 extern GEMM calls), and the greedy graph has no sort."""
    import re

    cfg = load_preset("batch8")
    st = _state(tiny_model, cfg)
    pools = {name: t[0].numel() for name, t in state_tensors(st)}  # one layer's pool
    pools.update({f"{name} (all layers)": t.numel() for name, t in state_tensors(st)})
    man = Manifest.read(compiled_batch8)
    decode = [g for g in man.graphs if g.status == "ok" and g.phase == "decode"]
    assert {g.sampling for g in decode} == {"full", "greedy"}
    for g in decode:
        kernel, wrapper = _generated_code(compiled_batch8 / g.artifact)
        bounds = {int(n) for n in re.findall(r"<static_cast<int64_t>\((\d+)L\)", kernel)}
        assert bounds, "no loops found: the generated code's format changed"
        copied = {name: n for name, n in pools.items() if n in bounds}
        assert not copied, f"{g.id}: loops over whole state pools {copied}"
        assert wrapper.count("aoti_torch_cpu_baddbmm_out(") < 50, f"{g.id}: Sinkhorn not fused"
        sorts = wrapper.count("aoti_torch_cpu_sort")
        assert sorts == (0 if g.sampling == "greedy" else 1), f"{g.id}: {sorts} sort calls"


def test_compiled_steps_call_the_boxed_runner(tiny_model, compiled_batch8):
    """Every step graph takes and returns flat tensors, so load() calls the package's boxed_run
    directly (no per-call treespec parsing); the fallback through the runner is silent, so pin it."""
    from torch._inductor import aoti_load_package

    from trnrt.compile.backends import _flat_boxed_run

    man = Manifest.read(compiled_batch8)
    for g in (g for g in man.graphs if g.status == "ok"):
        runner = aoti_load_package(str(compiled_batch8 / g.artifact))
        assert _flat_boxed_run(runner, len(g.inputs)) is not None, g.id
        assert _flat_boxed_run(runner, len(g.inputs) - 1) is None, g.id  # wrong input count: not taken
