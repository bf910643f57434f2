"""The compiled-artifact cache: `trnrt compile` without --out writes there, and `trnrt serve`
without --compiled runs what it finds there when the loader accepts it (eagerly otherwise)."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from trnrt.compile.artifact_cache import artifact_root, cached_artifacts
from trnrt.compile.manifest import Manifest

from compile_groups import SUBSET


@pytest.fixture
def cache(tmp_path, monkeypatch, tiny_dir, compiled_batch8):
    """A fresh cache root holding the session's batch8 artifacts where `trnrt compile` would put them."""
    monkeypatch.setenv("TRNRT_CACHE_DIR", str(tmp_path / "cache"))
    dst = artifact_root(tiny_dir) / "batch8" / "cpu"
    shutil.copytree(compiled_batch8, dst)
    return dst


def test_compile_writes_into_the_cache_by_default(tiny_dir, cache):
    from typer.testing import CliRunner

    from trnrt.cli import app

    before = Manifest.read(cache).entry("decode-b8-t1-base")
    r = CliRunner().invoke(app, ["compile", "--preset", "batch8", "--model", str(tiny_dir),
                                 "--only", "decode-b8-t1-base"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "up to date" in r.output  # it looked in the cache (and found the graph there)
    assert cached_artifacts(tiny_dir, "batch8") == cache
    assert Manifest.read(cache).entry("decode-b8-t1-base").artifact_sha256 == before.artifact_sha256


def _engine(tiny_dir, **kw):
    from trnrt.cli.server_args import ServerArgs
    from trnrt.cli.serve_engine import build_engine

    engine, _ = build_engine(ServerArgs(model=str(tiny_dir), preset="batch8", max_running_requests=8, **kw))
    return engine


@pytest.mark.skipif(SUBSET, reason="TRNRT_TEST_COMPILE=subset: batch8 is not compiled whole")
def test_serve_runs_the_cached_graphs_and_falls_back_to_eager(tiny_dir, cache, caplog):
    engine = _engine(tiny_dir)
    try:
        assert engine.runner.compiled, "the cached graphs were not loaded"
    finally:
        engine.shutdown()
    engine = _engine(tiny_dir, disable_compiled_cache=True)
    try:
        assert not engine.runner.compiled
    finally:
        engine.shutdown()
    raw = json.loads((cache / "manifest.json").read_text())
    raw["model_config_sha256"] = "0" * 64  # as if another checkpoint had been compiled at this path
    (cache / "manifest.json").write_text(json.dumps(raw))
    with caplog.at_level(logging.WARNING, logger="trnrt.serve"):
        engine = _engine(tiny_dir)
    try:
        assert not engine.runner.compiled
        assert any("running eagerly" in r.getMessage() and "another model config" in r.getMessage()
                   for r in caplog.records), caplog.text
    finally:
        engine.shutdown()


def test_no_cache_entry_runs_eagerly(tmp_path, monkeypatch, tiny_dir):
    monkeypatch.setenv("TRNRT_CACHE_DIR", str(tmp_path / "empty"))
    assert cached_artifacts(tiny_dir, "batch8") is None
    engine = _engine(tiny_dir)
    try:
        assert not engine.runner.compiled
    finally:
        engine.shutdown()
