"""Fixtures shared by the engine unit tests under this folder (tests/engine/<stage>/ follows
trnrt/engine/<stage>/): the tokenizer for the scripted-engine tests (no torch, no transformers) and
the tiny model for the tensor-level ones."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """The tiny model's tokenizer as a bare `tokenizers.Tokenizer` (Rust; no transformers, no torch)."""
    from tokenizers import Tokenizer

    from trnrt.models.tiny.tokenizer import write_tokenizer_files

    d = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(d)
    return Tokenizer.from_file(str(d / "tokenizer.json"))


@pytest.fixture(scope="module")
def eos(tok) -> int:
    from trnrt.models.tiny.tokenizer import EOS_TOKEN

    return tok.token_to_id(EOS_TOKEN)


@pytest.fixture(scope="module")
def tiny():
    """The embedded tiny model in fp32 and a small EngineConfig (the tensor-level tests: sampler,
    penalties, token bitmask, threads). torch is imported here, not at the top, so the scripted
    tests of this tree load none."""
    import torch

    from trnrt.config import EngineConfig
    from trnrt.models.glm5_next.weights import load_model
    from trnrt.models.tiny import default_model_dir

    torch.manual_seed(0)
    model = load_model(default_model_dir(), dtype=torch.float32)
    cfg = EngineConfig(max_model_len=128, decode_batch_buckets=(4,), prefill_token_buckets=(16,), num_blocks=40,
                       num_slots=6, max_top_logprobs=4)
    return model, cfg
