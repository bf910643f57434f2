"""End-to-end engine fixtures: the embedded tiny checkpoint, transformers loaded from it, and two
real engines shared by every test of this directory (shut down at the end of the session).

- `small_engine`: a cache so small that 16 staggered prompts of up to 200 tokens get queued
  (max_num_seqs 4 < prompts) and preempted (20 usable pages of 16 tokens for 4 sequences of up
  to 212 tokens); prefill chunks of <= 64 tokens, so a 200-token prompt takes 4 steps.
- `eos_engine`: a copy of the checkpoint whose generation_config.json adds an EOS id that greedy
  decoding of EOS_PROMPT emits (found with small_engine), with room for 16 sequences at once.

torch runs single-threaded in these tests: on a shared 2-core box two OpenMP threads competing
with other processes make every small op several times slower (transformers' reference
generate went from 5 s to 36 s); correctness does not depend on the thread count.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # e2e_helpers

from e2e_helpers import EOS_PROMPT, N_NEW, greedy  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from trnrt.models.tiny import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="session")
def hf_model(model_dir):
    import torch
    from transformers import Glm5NextForConditionalGeneration
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        return Glm5NextForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    finally:
        hf_logging.enable_progress_bar()


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="session")
def special_ids(tokenizer) -> set[int]:
    return set(tokenizer.all_special_ids)


@pytest.fixture(scope="session")
def small_engine(model_dir):
    from trnrt.config import EngineConfig
    from trnrt.engine.core.engine import Engine
    from trnrt.engine.sched.scheduler import SchedulerConfig

    ecfg = EngineConfig(max_model_len=256, block_size=16, num_blocks=256 // 16 + 1 + 4, num_slots=5,
                        decode_batch_buckets=(1, 2, 4), prefill_token_buckets=(16, 64))
    scfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, max_prefill_chunk_tokens=64)
    engine = Engine.from_model_dir(model_dir, engine_config=ecfg, scheduler_config=scfg)
    yield engine
    engine.shutdown()
    assert not engine.thread.is_alive()


@pytest.fixture(scope="session")
def eos_ref(small_engine, tokenizer):
    """(prompt ids, greedy output, index k, token) with output[k] the first occurrence of a token
    that is not already an EOS id; the eos_engine's checkpoint adds that token to its EOS ids."""
    ids = tokenizer.encode(EOS_PROMPT, add_special_tokens=False)
    out = greedy(small_engine, ids, N_NEW)
    eos = set(small_engine.model_info.eos_token_ids)
    for k in range(2, len(out)):
        if out[k] not in out[:k] and out[k] not in eos:
            return ids, out, k, out[k]
    pytest.fail(f"greedy output {out} has no fresh token to use as EOS")


@pytest.fixture(scope="session")
def eos_engine(model_dir, eos_ref, tmp_path_factory):
    from trnrt.config import EngineConfig
    from trnrt.engine.core.engine import Engine

    d = tmp_path_factory.mktemp("tiny_eos")
    for p in Path(model_dir).iterdir():
        if p.name == "generation_config.json":
            continue
        if p.name == "model.safetensors":
            (d / p.name).symlink_to(p)
        else:
            shutil.copy(p, d / p.name)
    gen = json.loads((Path(model_dir) / "generation_config.json").read_text())
    eos = gen["eos_token_id"]
    eos = [eos] if isinstance(eos, int) else list(eos)
    gen["eos_token_id"] = eos + [eos_ref[3]]
    (d / "generation_config.json").write_text(json.dumps(gen))
    ecfg = EngineConfig(max_model_len=256, block_size=16, num_blocks=16 * 16 + 1, num_slots=17,
                        decode_batch_buckets=(1, 2, 4, 8, 16), prefill_token_buckets=(16, 64))
    engine = Engine.from_model_dir(d, engine_config=ecfg)
    assert eos_ref[3] in engine.model_info.eos_token_ids
    yield engine
    engine.shutdown()
    assert not engine.thread.is_alive()


@pytest.fixture(scope="session")
def random_prompts(special_ids):
    """16 prompts of 1..200 ordinary token ids (seeded)."""
    rng = random.Random(1234)
    allowed = [i for i in range(4096) if i not in special_ids]
    lens = [1, 200, 3, 129, 5, 8, 150, 13, 17, 100, 31, 33, 47, 64, 65, 2]
    return [[rng.choice(allowed) for _ in range(n)] for n in lens]
