"""Shared fixtures of the compile tests: one tiny checkpoint and AOTInductor compiles shared per session.

By default every graph of `default` and `batch8` is compiled (16 graphs, ~45-60 s each on a 2-core
CPU) and checked against eager. The compiles are split into two pytest-xdist groups of about the
same cost, so `pytest -n 2` (with `--dist loadgroup`, set in pyproject.toml) runs them on both
workers at once: "compile_a" = default's decode graphs, "compile_b" = batch8's graphs and default's
prefill graphs. Every test that needs an artifact carries its group's marker, so no worker compiles
a preset twice. `TRNRT_TEST_COMPILE=subset` compiles only FAST_SUBSET of batch8 (quick local runs;
the default-preset checks are then skipped).

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

from compile_groups import FAST_SUBSET, SUBSET  # noqa: E402


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


def _ids(preset: str, phase: str) -> list[str]:
    from trnrt.compile import expand
    from trnrt.config.presets import load_preset

    return [s.graph_id for s in expand(load_preset(preset)) if s.phase == phase]


@pytest.fixture(scope="session")
def compile_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("artifacts")


@pytest.fixture(scope="session")
def compiled_batch8(tiny_dir, compile_root) -> Path:
    """Group compile_b."""
    return _compile("batch8", tiny_dir, compile_root / "b8", FAST_SUBSET["batch8"] if SUBSET else None)


@pytest.fixture(scope="session")
def compiled_default_decode(tiny_dir, compile_root) -> Path:
    """Group compile_a."""
    if SUBSET:
        pytest.skip("TRNRT_TEST_COMPILE=subset: the default preset's graphs are not compiled")
    return _compile("default", tiny_dir, compile_root / "da", _ids("default", "decode"))


@pytest.fixture(scope="session")
def compiled_default_prefill(tiny_dir, compile_root) -> Path:
    """Group compile_b."""
    if SUBSET:
        pytest.skip("TRNRT_TEST_COMPILE=subset: the default preset's graphs are not compiled")
    return _compile("default", tiny_dir, compile_root / "dp", _ids("default", "prefill"))
