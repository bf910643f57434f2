"""Shared fixtures of the compile tests: one tiny checkpoint and AOTInductor compiles shared per session.

By default every graph of `default` and `batch8` is checked against eager (16 graphs, ~45-60 s a
compile on a 2-core CPU). The compiles are split into two pytest-xdist groups of 7 (compile_groups),
so `pytest -n 2` (with `--dist loadgroup`, set in pyproject.toml) runs them on both workers at
once: group A compiles default's DEFAULT_A and then batch8, whose full-table decode-b8 pair is the
same graph as default's and is copied (trnrt compile reuses an equal-hash artifact of another
preset under the same --out); group B compiles the rest of default. Every test that needs an
artifact carries its group's marker, so no worker compiles a preset twice.
`TRNRT_TEST_COMPILE=subset` compiles only FAST_SUBSET of batch8 (quick local runs; the
default-preset checks are then skipped).

The compiles run with the fingerprint cache on (trnrt.compile.fingerprint_cache), so a later
`trnrt verify graph-equiv` in the same environment (CI) reads their graph hashes instead of
exporting every graph again; tests/conftest.py keeps it off for every other test.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # scenario helper

from compile_groups import DEFAULT_A, DEFAULT_B, FAST_SUBSET, SUBSET  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    from trnrt.models.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("compile_tiny") / "ckpt", seed=0)


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    import torch

    from trnrt.models.glm5_next.weights import load_model

    return load_model(tiny_dir, torch.float32)


def _compile(preset: str, tiny_dir: Path, out: Path, only: list[str] | None = None) -> Path:
    from typer.testing import CliRunner

    from trnrt.cli import app

    args = ["compile", "--preset", preset, "--model", str(tiny_dir), "--out", str(out), "--backend", "cpu"]
    for gid in only or []:
        args += ["--only", gid]
    before = os.environ.get("TRNRT_GRAPH_CACHE")
    os.environ["TRNRT_GRAPH_CACHE"] = "1"  # store the fingerprints for a later graph-equiv (see above)
    try:
        r = CliRunner().invoke(app, args, catch_exceptions=False)
    finally:
        if before is None:
            os.environ.pop("TRNRT_GRAPH_CACHE", None)
        else:
            os.environ["TRNRT_GRAPH_CACHE"] = before
    assert r.exit_code == 0, r.output
    return out / preset / "cpu"


@pytest.fixture(scope="session")
def compile_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("artifacts")


@pytest.fixture(scope="session")
def compiled_default_a(tiny_dir, compile_root) -> Path:
    """Group compile_a: DEFAULT_A of the default preset."""
    if SUBSET:
        pytest.skip("TRNRT_TEST_COMPILE=subset: the default preset's graphs are not compiled")
    return _compile("default", tiny_dir, compile_root / "a", DEFAULT_A)


@pytest.fixture(scope="session")
def compiled_batch8(tiny_dir, compile_root, request) -> Path:
    """Group compile_a: after compiled_default_a, into the same --out (reuses its decode-b8 pair)."""
    if SUBSET:
        return _compile("batch8", tiny_dir, compile_root / "a", FAST_SUBSET["batch8"])
    request.getfixturevalue("compiled_default_a")
    return _compile("batch8", tiny_dir, compile_root / "a")


@pytest.fixture(scope="session")
def compiled_default_b(tiny_dir, compile_root) -> Path:
    """Group compile_b: DEFAULT_B of the default preset."""
    if SUBSET:
        pytest.skip("TRNRT_TEST_COMPILE=subset: the default preset's graphs are not compiled")
    return _compile("default", tiny_dir, compile_root / "b", DEFAULT_B)
