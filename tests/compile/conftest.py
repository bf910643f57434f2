"""Shared fixtures of the compile tests: one tiny checkpoint and one AOTInductor compile per session.

AOTInductor takes ~30-60 s per graph of the tiny model on a 2-core CPU (the first one in a
process longer), so by default the session compiles a fast subset of `batch8` (two of its
decode graphs and its smallest prefill graph, see FAST_SUBSET) with `trnrt compile`, and every compile test shares it. Set
TRNRT_TEST_COMPILE_ALL=1 to compile every graph of `default` and `batch8` and check them all.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # scenario helper

COMPILE_ALL = os.environ.get("TRNRT_TEST_COMPILE_ALL") == "1"
# The full sampler over the full block table, the greedy sampler over the short one (what a greedy
# batch of short sequences runs, e.g. `trnrt bench`), and the smallest prefill graph.
FAST_SUBSET = {"batch8": ["decode-b8-t1-base", "decode-b8-t1-c128-base-greedy", "prefill-b1-t32-base"]}


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    from trnrt.models.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("compile_tiny") / "ckpt", seed=0)


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    import torch

    from trnrt.models.glm5_next.weights import load_model

    return load_model(tiny_dir, torch.float32)


def _compile(preset: str, tiny_dir: Path, out: Path) -> Path:
    from typer.testing import CliRunner

    from trnrt.cli import app

    args = ["compile", "--preset", preset, "--model", str(tiny_dir), "--out", str(out), "--backend", "cpu"]
    if not COMPILE_ALL:
        for gid in FAST_SUBSET.get(preset, []):
            args += ["--only", gid]
    r = CliRunner().invoke(app, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return out / preset / "cpu"


@pytest.fixture(scope="session")
def compile_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("artifacts")


@pytest.fixture(scope="session")
def compiled_batch8(tiny_dir, compile_root) -> Path:
    return _compile("batch8", tiny_dir, compile_root)


@pytest.fixture(scope="session")
def compiled_default(tiny_dir, compile_root) -> Path:
    if not COMPILE_ALL:
        pytest.skip("set TRNRT_TEST_COMPILE_ALL=1 to compile every graph of the default preset")
    return _compile("default", tiny_dir, compile_root)
