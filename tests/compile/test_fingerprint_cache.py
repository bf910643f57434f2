"""The graph fingerprint cache shared by `trnrt compile` and `trnrt verify graph-equiv`."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from trnrt.cli import app
from trnrt.compile import fingerprint_cache

# The smallest graph a lock file holds (the MTP draft: one layer, ~870 nodes against ~3,200 for a
# decode step): every check here exports it, up to three times a test.
PRESET, GID = "mtp-always", "draft-b1-t4-base-greedy"


@pytest.fixture
def cache_on(monkeypatch, tmp_path):
    monkeypatch.setenv("TRNRT_GRAPH_CACHE", "1")
    monkeypatch.setenv("TRNRT_CACHE_DIR", str(tmp_path))
    return tmp_path / "graph-fingerprints"


def verify(*args: str):
    return CliRunner().invoke(app, ["verify", "graph-equiv", "--preset", PRESET, "--only", GID, *args],
                              catch_exceptions=False)


def test_verify_stores_then_reuses_fresh_recomputes_and_new_source_misses(cache_on, monkeypatch):
    r = verify()
    assert r.exit_code == 0, r.output
    assert "exported and hashed" in r.output
    assert len(list(cache_on.glob("*.json"))) == 1
    r = verify()
    assert r.exit_code == 0 and "fingerprint cache" in r.output, r.output
    # The key is the source on disk: an in-process patch is invisible to a cached check (why
    # tests/conftest.py turns the cache off), and --fresh exports again and sees it.
    import trnrt.models.glm5_next.layers as M

    orig = M.rms_norm
    monkeypatch.setattr(M, "rms_norm", lambda x, w, eps: orig(x, w, eps * 10))
    assert verify().exit_code == 0
    r = verify("--fresh")
    assert r.exit_code == 1 and "exported and hashed" in r.output, r.output
    assert len(list(cache_on.glob("*.json"))) == 1  # --fresh neither reads nor stores
    # another source tree (any .py file of trnrt changed) is another key: exported again
    monkeypatch.setattr(fingerprint_cache, "source_digest", lambda: "another tree")
    r = verify()
    assert r.exit_code == 1 and "exported and hashed" in r.output, r.output
    assert len(list(cache_on.glob("*.json"))) == 2


def test_cache_off_by_env(monkeypatch, tmp_path):
    from trnrt.compile.graph_hash import GraphFingerprint

    monkeypatch.setenv("TRNRT_CACHE_DIR", str(tmp_path))
    fp = GraphFingerprint(hash="h", nodes=[], op_counts={}, num_nodes=0)
    monkeypatch.setenv("TRNRT_GRAPH_CACHE", "0")
    fingerprint_cache.put("k", fp)
    assert fingerprint_cache.get("k") is None and not (tmp_path / "graph-fingerprints").exists()
    monkeypatch.setenv("TRNRT_GRAPH_CACHE", "1")
    fingerprint_cache.put("k", fp)
    assert fingerprint_cache.get("k") == fp


def test_compile_stores_what_verify_reads(cache_on, tiny_dir, tmp_path):
    """`trnrt compile` hashes a checkpoint-loaded model (pad id from its tokenizer), verify the bare
    tiny config: the same graphs, so the same key, and verify reads what compile stored."""
    r = CliRunner().invoke(app, ["compile", "--preset", PRESET, "--model", str(tiny_dir), "--out",
                                 str(tmp_path / "art"), "--dry-run", "--only", GID], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert len(list(cache_on.glob("*.json"))) == 1
    r = verify()
    assert r.exit_code == 0 and "fingerprint cache" in r.output, r.output


def test_key_covers_preset_model_flags_and_graph():
    from trnrt.verify.graph_equiv import model_config_for

    tiny, real = model_config_for("tiny"), model_config_for("real")
    k = fingerprint_cache.key("p", tiny, [], GID)
    assert k == fingerprint_cache.key("p", tiny, [], GID)
    assert len({k, fingerprint_cache.key("q", tiny, [], GID), fingerprint_cache.key("p", real, [], GID),
                fingerprint_cache.key("p", tiny, ["penalties"], GID), fingerprint_cache.key("p", tiny, [], "x")}) == 5


def test_key_follows_the_traced_sources_only(tmp_path):
    """The source part of the key digests the files a graph can import (the model, the step
    functions, the sampler, compile/, the fused kernels' C++): an edit to one changes it, an edit
    to the server or the scheduler does not."""
    import shutil
    from pathlib import Path

    import trnrt

    pkg = tmp_path / "trnrt"
    shutil.copytree(Path(trnrt.__file__).resolve().parent, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    traced = {str(f.relative_to(pkg)) for f in fingerprint_cache.traced_sources(pkg)}
    for rel in ("models/glm5_next/model.py", "models/glm5_next/moe.py", "engine/runner/step.py",
                "engine/sample/sampler.py", "compile/export.py", "models/kernels/cpu_ops.cpp", "__init__.py"):
        assert rel in traced, rel
    for rel in ("serve/app.py", "engine/sched/scheduler.py", "engine/core/engine.py", "cli/serve.py",
                "stats/collector.py"):
        assert rel not in traced, rel
    base = fingerprint_cache.sources_digest(pkg)

    def edited(rel: str) -> str:
        f = pkg / rel
        old = f.read_bytes()
        f.write_bytes(old + b"\n# edited\n")
        try:
            return fingerprint_cache.sources_digest(pkg)
        finally:
            f.write_bytes(old)

    assert edited("serve/app.py") == base
    assert edited("engine/sched/scheduler.py") == base
    assert edited("models/glm5_next/kda.py") != base
    assert edited("models/kernels/cpu_ops.cpp") != base
    assert edited("engine/sample/sampler.py") != base
    assert fingerprint_cache.sources_digest(pkg) == base
