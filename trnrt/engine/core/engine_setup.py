"""What an engine is built from: its resolved configs, the variant flags, and what the tokenizer
and checkpoint say (EOS ids, special tokens, the decoder the detokenizers call).

Pure functions, no engine state: `resolve_configs` is shared by `Engine.from_model_dir` and
`Engine.scripted` (trnrt.engine.core.engine_builder), so a scripted engine schedules exactly like a
real one.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from trnrt.config import EngineConfig
from trnrt.engine.sched.scheduler import SchedulerConfig

log = logging.getLogger(__name__)

STRUCTURED_OUTPUTS = "structured_outputs"  # the feature flag (and variant) of grammars
PENALTIES = "penalties"  # the feature flag (and variant) of penalties, logit_bias and min_tokens



def with_flag(ecfg: EngineConfig, flag: str, on: bool) -> EngineConfig:
    """`ecfg` with the variant flag `flag` added (on) or left as it is."""
    if not on or flag in ecfg.variants:
        return ecfg
    return ecfg.replace(variants=tuple(sorted({*ecfg.variants, flag})))


def with_structured_outputs(ecfg: EngineConfig, on: bool) -> EngineConfig:
    """`ecfg` with the structured_outputs variant flag added (on) or left as it is."""
    return with_flag(ecfg, STRUCTURED_OUTPUTS, on)


def special_token_id(tokenizer, text: str) -> int | None:
    """The id of a single (special) token spelled `text` in the tokenizer, or None."""
    for name in ("token_to_id", "convert_tokens_to_ids"):
        fn = getattr(tokenizer, name, None)
        if fn is not None:
            try:
                i = fn(text)
            except Exception:
                continue
            unk = getattr(tokenizer, "unk_token_id", None)
            if isinstance(i, int) and i >= 0 and (i != unk or unk is None):
                return i
    return None


def read_eos_token_ids(model_dir: Path, tokenizer) -> tuple[int, ...]:
    """EOS ids from generation_config.json (int or list), else the tokenizer's eos token."""
    ids: list[int] = []
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if isinstance(eos, int):
            ids = [eos]
        elif isinstance(eos, list):
            ids = [int(t) for t in eos]
    if not ids and getattr(tokenizer, "eos_token_id", None) is not None:
        ids = [int(tokenizer.eos_token_id)]
    return tuple(dict.fromkeys(ids))


def fast_decoder(tokenizer):
    """The object the detokenizers call `decode(ids, skip_special_tokens=...)` on: the Rust
    `tokenizers.Tokenizer` behind a transformers fast tokenizer when that gives the same text (no
    clean-up of tokenization spaces), else the tokenizer itself. The transformers wrapper checks
    every id in Python on each call: ~4x the cost of the decode, and two decodes per token per
    request (measured: 1.6 ms of a 1.65 ms batch-8 engine step with an instant model)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return backend
    return tokenizer


def resolve_configs(
    engine_config: EngineConfig | None = None,
    *,
    preset: str | None = None,
    scheduler_config: SchedulerConfig | None = None,
    max_running_requests: int | None = None,
    context_length: int | None = None,
    compiled: bool = False,
) -> tuple[EngineConfig, SchedulerConfig]:
    """The EngineConfig and SchedulerConfig an engine runs with (shared by `from_model_dir` and
    `scripted`, so a scripted engine schedules exactly like a real one).

    `preset` (a presets/*.toml name or path) gives the EngineConfig when `engine_config` is not
    passed. `max_running_requests` (SGLang's flag) sizes the slot pool and max_num_seqs;
    `context_length` caps max_model_len. With `compiled` graphs the cache sizes and max_model_len
    are graph inputs, so they stay the preset's: max_running_requests only caps max_num_seqs at
    the preset's slots, and context_length only caps the scheduler's max_model_len.
    """
    if engine_config is None:
        from trnrt.config.presets import load_preset

        engine_config = load_preset(preset or "default")
    ecfg = engine_config
    if context_length is not None and not compiled:
        # context buckets at or past the new length would be the full table: drop them
        ecfg = ecfg.replace(max_model_len=context_length,
                            decode_context_buckets=tuple(c for c in ecfg.decode_context_buckets if c < context_length),
                            prefill_context_buckets=tuple(c for c in ecfg.prefill_context_buckets if c < context_length))
    if max_running_requests is not None and compiled:
        if max_running_requests > ecfg.num_slots - 1:
            log.warning("compiled graphs hold %d slots: running at most %d requests, not %d",
                        ecfg.num_slots - 1, ecfg.num_slots - 1, max_running_requests)
            max_running_requests = ecfg.num_slots - 1
    elif max_running_requests is not None:
        blocks_per_seq = ecfg.max_blocks_per_seq
        ecfg = ecfg.replace(
            num_slots=max_running_requests + 1,
            # enough pages for every running request at a quarter of the context, and at
            # least one full-length request (preemption always makes progress)
            num_blocks=max(ecfg.num_blocks, blocks_per_seq * max(1, max_running_requests // 4) + 1,
                           blocks_per_seq + 1),
        )
    max_model_len = min(ecfg.max_model_len, ecfg.max_blocks_per_seq * ecfg.block_size)
    if context_length is not None:
        max_model_len = min(max_model_len, context_length)
    scfg = scheduler_config or SchedulerConfig(
        max_num_seqs=max_running_requests or min(ecfg.max_decode_batch, ecfg.num_slots - 1),
        max_num_batched_tokens=default_token_budget(ecfg),
        max_model_len=max_model_len,
        max_prefill_chunk_tokens=ecfg.max_prefill_tokens,
    )
    if scfg.max_num_seqs > ecfg.num_slots - 1:
        raise ValueError(f"max_num_seqs {scfg.max_num_seqs} exceeds the {ecfg.num_slots - 1} usable slots")
    return ecfg, scfg


def default_token_budget(ecfg: EngineConfig) -> int:
    """A step's default token budget: a full decode batch plus four largest prefill chunks.

    A budget of one chunk (the old default, 64 tokens) left a loaded server 32 tokens of prefill a
    step, so queued prompts waited seconds for their first token; four chunks admit a typical chat
    prompt in one step while a step stays a few prefill graph calls long (docs/PERFORMANCE.md)."""
    return ecfg.max_decode_batch + 4 * ecfg.max_prefill_tokens


def default_checkpoint_interval(ecfg: EngineConfig) -> int:
    """Checkpoints every largest prefill chunk (at least 64 tokens), rounded up to a page: prefill
    chunks are cut there, so at the largest chunk size the cut costs no extra graph call."""
    bs = ecfg.block_size
    return -(-max(64, ecfg.max_prefill_tokens) // bs) * bs
