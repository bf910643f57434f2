"""`trnrt verify graph-equiv`'s parallel exports (trnrt.verify.export_pool) and its fingerprint
cache keyed by the traced sources, on a copy of the source tree: a cold check exports in two
processes, an edit outside the traced files keeps every entry, and a planted change to a traced
line misses the warm cache and is reported.

Runs the CLI as a subprocess on the copy (PYTHONPATH), so the edits are real files, as a
contributor makes them. The graphs are the two smallest a lock holds (the MTP drafts).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trnrt.verify import export_pool

ROOT = Path(__file__).resolve().parents[2]
PRESET = "mtp-always"
GRAPHS = ("draft-b1-t4-base-greedy", "draft-b8-t4-base-greedy")


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    d = tmp_path_factory.mktemp("tree")
    shutil.copytree(ROOT / "trnrt", d / "trnrt", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "presets", d / "presets")
    return d


def verify(tree: Path, *args: str, graphs=GRAPHS) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(tree), TRNRT_CACHE_DIR=str(tree / "cache"), TRNRT_GRAPH_CACHE="1",
               TRNRT_PRESETS_DIR=str(tree / "presets"), TRNRT_VERIFY_JOBS="", COLUMNS="200")
    cmd = [sys.executable, "-c", "from trnrt.cli import main; main()", "verify", "graph-equiv", "--preset", PRESET, *args]
    for g in graphs:
        cmd += ["--only", g]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree, timeout=600)


def test_parallel_cold_then_warm_then_planted_change(tree):
    r = verify(tree, "--jobs", "2")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "exporting 2 graphs in 2 processes" in out and out.count("exported and hashed") == 2, out
    assert "2 exported in 2 processes" in out and "DIFFERENT" not in out, out
    assert len(list((tree / "cache" / "graph-fingerprints").glob("*.json"))) == 2  # the workers stored them

    # an edit outside the traced sources (the HTTP server) keeps every entry
    app = tree / "trnrt" / "serve" / "app.py"
    app.write_text(app.read_text() + "\n# an edit no graph traces\n")
    r = verify(tree)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "2 from the fingerprint cache" in out and "0 exported" in out, out

    # a planted change to a traced line: the warm cache misses, the graph is exported and differs
    layers = tree / "trnrt" / "models" / "glm5_next" / "layers.py"
    layers.write_text(_plant_eps(layers.read_text()))
    r = verify(tree, graphs=GRAPHS[:1])
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "exported and hashed" in out and "DIFFERENT" in out and "first difference at node" in out, out


def _plant_eps(src: str) -> str:
    """rms_norm's epsilon times 10 (a changed constant): the first line of its body reads `eps`."""
    head, sep, body = src.partition("def rms_norm(")
    assert sep, "layers.py has no rms_norm"
    sig, colon, rest = body.partition(":\n")
    return head + sep + sig + colon + "    eps = eps * 10\n" + rest


def test_worker_count_is_bounded_by_cores_memory_and_jobs(monkeypatch):
    monkeypatch.setattr(export_pool, "available_cores", lambda: 8)
    monkeypatch.setattr(export_pool, "available_memory", lambda: 64 << 30)
    assert export_pool.worker_count(20, {"tiny"}) == 8
    assert export_pool.worker_count(3, {"tiny"}) == 3  # never more than there are graphs
    assert export_pool.worker_count(20, {"tiny"}, requested=2) == 2
    monkeypatch.setattr(export_pool, "available_memory", lambda: 3 << 30)  # 2.4 GiB usable
    assert export_pool.worker_count(20, {"tiny"}) == 2
    assert export_pool.worker_count(20, {"real"}) == 1  # 1.5 GiB a worker at real dims
    monkeypatch.setattr(export_pool, "available_memory", lambda: 256 << 20)
    assert export_pool.worker_count(20, {"tiny"}) == 1  # always at least one
    monkeypatch.setattr(export_pool, "available_memory", lambda: None)
    assert export_pool.worker_count(20, {"tiny"}) == 8
