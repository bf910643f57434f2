"""Shared fixtures of the compile tests: one tiny checkpoint and AOTInductor compiles shared per session.

Which graphs are compiled is set by TRNRT_TEST_COMPILE (compile_groups.py, derived from the
catalogue): by default (CI) every bucket of `default` and `batch8` plus one graph of every other
kind. They compile in parallel background jobs (compile_jobs.py) that tests/conftest.py starts as
soon as a selected test needs them, so they overlap with every other test; the session fixture
`compiled` waits for them and returns one artifact directory per preset. Tests must not change
the shared artifacts (copy them first).

The compiles run with the fingerprint cache on (trnrt.compile.fingerprint_cache), so a later
`trnrt verify graph-equiv` in the same environment (CI) reads their graph hashes instead of
exporting every graph again; tests/conftest.py keeps it off for every other test.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # scenario and compile helpers

import compile_jobs  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    from trnrt.models.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("compile_tiny") / "ckpt", seed=0)


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    import torch

    from trnrt.models.glm5_next.weights import load_model

    return load_model(tiny_dir, torch.float32)


@pytest.fixture(scope="session")
def compiled(request) -> dict[str, Path]:
    """{artifact key: artifact directory} of the session's compiles: "default", "batch8" (and
    "PRESET+VARIANT" per flag set of compile_groups.FLAG_SETS); PRESET/cpu under one root.

    Compiled once per test session by background jobs (whichever pytest-xdist worker asks first
    starts them; every worker waits for the same jobs and reuses their artifacts). (pytest-xdist's
    `--dist loadgroup` cannot keep the compile tests on one worker under pytest 9.2: it tags
    `item._nodeid`, which pytest 9.2 no longer reads; so the group spread over both workers and
    each compiled every graph, at the same time, into the same Inductor cache directory.)
    """
    return compile_jobs.wait(request.config)


@pytest.fixture(scope="session")
def compile_log(request, compiled) -> str:
    """What the session's `trnrt compile` runs printed."""
    return compile_jobs.logs(request.config)


@pytest.fixture(scope="session")
def compiled_batch8(compiled) -> Path:
    return compiled["batch8"]
