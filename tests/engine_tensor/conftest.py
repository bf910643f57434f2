"""Shared fixtures of the tensor-level engine tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def tiny():
    from trnrt.config import EngineConfig
    from trnrt.models.glm5_next.weights import load_model
    from trnrt.models.tiny import default_model_dir

    torch.manual_seed(0)
    model = load_model(default_model_dir(), dtype=torch.float32)
    cfg = EngineConfig(max_model_len=128, decode_batch_buckets=(4,), prefill_token_buckets=(16,), num_blocks=40,
                       num_slots=6, max_top_logprobs=4)
    return model, cfg
