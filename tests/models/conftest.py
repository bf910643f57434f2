"""One tiny glm5_next checkpoint per session (transformers save_pretrained output), the
transformers reference model loaded from it, and the serving model loaded from it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # glm5_helpers


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    from trnrt.models.tiny import build_hf_model

    d = tmp_path_factory.mktemp("glm5_tiny")
    model = build_hf_model(seed=0)
    model.save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def hf_model(tiny_dir):
    import torch
    from transformers import Glm5NextForConditionalGeneration

    return Glm5NextForConditionalGeneration.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def model(tiny_dir):
    from trnrt.models.glm5_next.weights import load_model

    return load_model(tiny_dir)


@pytest.fixture(scope="session")
def report():
    """Collects measured max |Δlogit| per test; printed at the end of the session (-s or -rA)."""
    rows: dict[str, float] = {}
    yield rows
    if rows:
        print("\nglm5_next measurements (max |dlogit| unless named a rate):")
        for k, v in rows.items():
            print(f"  {k:55s} {v:.2e}")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny GEMMs: intra-op threads only add synchronisation, badly so on a shared 2-core box
    (bf16 linears were ~100x slower with 2 contended threads)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
