"""`trnrt compile` of an FP8 checkpoint: its graphs (float8 weight placeholders, a graph hash of
their own) go to <preset>/<backend>/fp8/ of the artifact cache, an engine over that FP8 model
runs them and gives the eager FP8 engine's greedy tokens, and the loader refuses default-weight
artifacts for the FP8 model and FP8 artifacts for the default model (reason "quantization").

One graph is compiled (the batch-1 greedy decode graph, the smallest; ~30-60 s on 2 cores), in
this process, apart from the session's shared compiles (conftest.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from typer.testing import CliRunner

from trnrt.cli import app
from trnrt.compile import CompiledArtifactError, expand, load_compiled
from trnrt.compile.artifact_cache import artifact_root, cached_artifacts
from trnrt.compile.manifest import Manifest, model_config_hash
from trnrt.config.presets import read_preset

sys.path.insert(0, str(Path(__file__).parents[1] / "engine_e2e"))  # e2e_helpers

GRAPH = "decode-b1-t1-base-greedy"  # what a batch of one greedy request decodes in


def _compile(*args: str) -> None:
    r = CliRunner().invoke(app, ["compile", "--preset", "default", "--only", GRAPH, *args], catch_exceptions=False)
    assert r.exit_code == 0, r.output


def test_fp8_checkpoint_compiles_and_serves_its_own_graphs(tmp_path, monkeypatch, tiny_dir):
    from e2e_helpers import greedy

    from trnrt.cli.serve_engine import cached_loader
    from trnrt.engine.core.engine import Engine
    from trnrt.models.glm5_next.loading import load_model
    from trnrt.models.tiny.fp8 import write_tiny_fp8_checkpoint

    monkeypatch.setenv("TRNRT_CACHE_DIR", str(tmp_path / "cache"))
    fp8_dir = write_tiny_fp8_checkpoint(tmp_path / "fp8", seed=0)  # tiny_dir's weights, quantized
    preset = read_preset("default")
    cfg = preset.engine_config
    spec = next(s for s in expand(cfg) if s.graph_id == GRAPH)

    _compile("--model", str(fp8_dir))  # into the artifact cache, where serve looks
    fp8_art = cached_artifacts(fp8_dir, "default", "cpu", "fp8")
    assert fp8_art is not None and fp8_art == artifact_root(fp8_dir) / "default" / "cpu" / "fp8"
    assert cached_artifacts(fp8_dir, "default", "cpu") is None  # not where the default graphs go
    man = Manifest.read(fp8_art)
    lock = json.loads(preset.lock_path.read_text())["dims"]["tiny"]["graphs"][GRAPH]["hash"]
    entry = man.entry(GRAPH)
    assert man.quantization == "fp8" and man.quantized_weights_sha256
    assert entry.status == "ok" and entry.graph_hash != lock  # never mistaken for the default graph
    assert cached_loader(str(fp8_dir), "default", "cpu") is not None  # the cache finds the FP8 graphs by itself

    # The default model of the same config: a dry-run manifest (export and hash only) of its graph.
    bf16_out = tmp_path / "bf16"
    _compile("--model", str(tiny_dir), "--out", str(bf16_out), "--dry-run")
    bf16_art = bf16_out / "default" / "cpu"
    bf16_man = Manifest.read(bf16_art)
    assert bf16_man.quantization is None and "quantization" not in bf16_man.to_json()
    assert bf16_man.entry(GRAPH).graph_hash == lock

    # FP8 weights and an FP8 KV cache (--kv-cache-dtype fp8_e4m3): graphs and a folder of their own.
    _compile("--model", str(fp8_dir), "--kv-cache-dtype", "fp8_e4m3", "--dry-run")
    kv_man = Manifest.read(cached_artifacts(fp8_dir, "default", "cpu", "fp8+kv_fp8"))
    assert kv_man.quantization == "fp8+kv_fp8" and kv_man.entry(GRAPH).graph_hash not in (lock, entry.graph_hash)

    from trnrt.models.glm5_next.fp8.kv_cache import to_fp8_kv_state, use_fp8_kv_cache

    dtype = getattr(torch, cfg.dtype)
    fp8_model, bf16_model = load_model(fp8_dir, dtype=dtype), load_model(tiny_dir, dtype=dtype)
    kv_model = load_model(fp8_dir, dtype=dtype)
    use_fp8_kv_cache(kv_model)
    assert model_config_hash(fp8_model) == model_config_hash(bf16_model)  # only the quantization tells them apart
    for art, model in ((bf16_art, fp8_model), (fp8_art, bf16_model), (fp8_art, kv_model)):
        state = model.allocate_state(cfg.num_blocks, cfg.block_size, cfg.num_slots)
        state = to_fp8_kv_state(state) if model is kv_model else state
        try:
            load_compiled(art, model, state, cfg, specs=[spec], check_graphs=False)
        except CompiledArtifactError as e:
            assert e.reason == "quantization" and "fp8 weights" in str(e), e
        else:
            raise AssertionError(f"{art} was loaded for a model of other weights")

    # Serving: the FP8 engine over the compiled FP8 graph (found from the cache root) vs eagerly.
    prompts = [[11, 22, 33, 44, 55], [7, 8, 9]]
    n_out = 8
    eager = Engine.from_model_dir(fp8_dir, preset="default")
    try:
        reference = [greedy(eager, p, n_out) for p in prompts]
    finally:
        eager.shutdown()
    calls = [0]  # calls of the AOTInductor callable itself (num_graph_calls counts eager runs too)

    def loader(m, s, e):
        fn = load_compiled(artifact_root(fp8_dir), m, s, e, specs=[spec], check_graphs=True)[spec]
        assert hasattr(fn, "runner"), "expected the AOTInductor callable, not an eager one"

        def counted(*inputs):
            calls[0] += 1
            return fn(*inputs)

        return {spec: counted}

    engine = Engine.from_model_dir(fp8_dir, preset="default", compiled_loader=loader)
    try:
        assert engine.model_info.compiled
        warm = calls[0]
        got = [greedy(engine, p, n_out) for p in prompts]  # one at a time: batch-1 greedy decodes
        decodes = engine.runner.num_graph_calls.get(GRAPH, 0)
    finally:
        engine.shutdown()
    assert got == reference
    assert decodes >= len(prompts) * (n_out - 1) and calls[0] - warm == decodes, (calls, warm, decodes)

    # `trnrt serve --compiled DIR` with the FP8 checkpoint is no longer refused: it goes to the
    # loader, which finds DIR/default/cpu/fp8 (and wants every graph of the preset, not one).
    from trnrt.cli.serve_engine import build_engine
    from trnrt.cli.server_args import ServerArgs

    try:
        build_engine(ServerArgs(model=str(fp8_dir), preset="default", compiled=str(artifact_root(fp8_dir))))
    except CompiledArtifactError as e:
        assert e.reason == "graph_missing" and str(fp8_art) in str(e), e
    else:
        raise AssertionError("a preset with one compiled graph of ten was accepted")
