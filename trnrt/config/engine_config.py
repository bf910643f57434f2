"""EngineConfig: the settings a compiled graph depends on."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


class EngineConfigError(ValueError):
    """An EngineConfig value is invalid; `field` names it."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


def _check_buckets(name: str, buckets: tuple[int, ...]) -> None:
    if not buckets:
        raise EngineConfigError(f"{name} must not be empty", field=name)
    if any((not isinstance(b, int)) or b <= 0 for b in buckets):
        raise EngineConfigError(f"{name} must hold positive integers, got {list(buckets)}", field=name)
    if list(buckets) != sorted(set(buckets)):
        raise EngineConfigError(f"{name} must be strictly increasing, got {list(buckets)}", field=name)


@dataclass(frozen=True)
class EngineConfig:
    """Graph-shaping settings. Every graph the runner runs is padded to these buckets.

    decode_batch_buckets: batch sizes of the decode graph (B sequences x 1 token).
    prefill_token_buckets: token counts of the prefill graph (one sequence chunk x S tokens).
    block_size: tokens per page of the paged state; a multiple of the model's index_kpool.
    num_blocks / num_slots: sizes of the paged cache and the per-sequence slot pool, including the
    reserved scratch block 0 and slot 0 that padding rows write to.
    speculative_num_steps: k > 0 adds the MTP speculative graphs (`verify`: the target over k + 1
    tokens per decode row; `draft`: the MTP layer's k steps) per decode batch bucket and context;
    0 (default): none. speculative_mode / speculative_min_accept_length are the serving defaults
    such a preset starts `trnrt serve` with ("always": every eligible request speculates and the
    grammar / penalty flags are refused; "dynamic": requests whose verifies emit fewer tokens than
    the minimum fall back to the plain graphs). They shape no graph (graph_settings leaves them out).
    """

    dtype: str = "float32"
    block_size: int = 16
    max_model_len: int = 1024
    decode_batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    prefill_token_buckets: tuple[int, ...] = (16, 32, 64, 128, 256)
    # Shorter block tables for decode graphs (tokens, multiples of block_size, < max_model_len):
    # a decode batch whose longest sequence fits in one runs attention and the indexer over that
    # many tokens instead of max_model_len (as NxDI buckets token generation by sequence length).
    decode_context_buckets: tuple[int, ...] = ()
    # The same for prefill graphs: a chunk whose sequence ends within one of these (start_pos + chunk
    # tokens) runs over that many table tokens. The prefill graph's attention, indexer and mask cost
    # scale with the table (at 1024 tokens, ~40% of a 64-token prefill of the tiny model).
    prefill_context_buckets: tuple[int, ...] = ()
    num_blocks: int = 1025
    num_slots: int = 33
    max_top_logprobs: int = 20
    preset: str = "default"
    variants: tuple[str, ...] = ()
    # Set from a preset (trnrt.config.presets). tensor_parallel shards every graph; compiler_args
    # holds per-backend compiler settings as ((backend, canonical JSON), ...) so the config stays
    # hashable; read them with trnrt.config.presets.compiler_options(config, backend).
    tensor_parallel: int = 1
    compiler_args: tuple[tuple[str, str], ...] = ()
    speculative_num_steps: int = 0
    speculative_mode: str = ""  # "" (no speculative graphs), "always" or "dynamic"
    speculative_min_accept_length: float = 0.0

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise EngineConfigError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}", field="dtype")
        for name in ("block_size", "max_model_len", "num_blocks", "num_slots", "tensor_parallel"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise EngineConfigError(f"{name} must be a positive integer, got {v!r}", field=name)
        object.__setattr__(self, "decode_batch_buckets", tuple(self.decode_batch_buckets))
        object.__setattr__(self, "prefill_token_buckets", tuple(self.prefill_token_buckets))
        _check_buckets("decode_batch_buckets", self.decode_batch_buckets)
        _check_buckets("prefill_token_buckets", self.prefill_token_buckets)
        for name in ("decode_context_buckets", "prefill_context_buckets"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
            buckets = getattr(self, name)
            if not buckets:
                continue
            _check_buckets(name, buckets)
            bad = [c for c in buckets if c % self.block_size or c >= self.max_model_len]
            if bad:
                raise EngineConfigError(
                    f"{name} must be multiples of block_size ({self.block_size}) below max_model_len "
                    f"({self.max_model_len}), got {list(buckets)}", field=name)
        object.__setattr__(self, "variants", tuple(self.variants))
        object.__setattr__(self, "compiler_args", tuple((str(b), str(a)) for b, a in self.compiler_args))
        k = self.speculative_num_steps
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= 8:
            raise EngineConfigError(f"speculative_num_steps must be 0..8, got {k!r}", field="speculative_num_steps")
        if (k > 0) != (self.speculative_mode in ("always", "dynamic")):
            raise EngineConfigError(
                "speculative_mode must be \"always\" or \"dynamic\" exactly when speculative_num_steps > 0, got "
                f"{self.speculative_mode!r} with {k} steps", field="speculative_mode")
        mal = self.speculative_min_accept_length
        if not isinstance(mal, (int, float)) or isinstance(mal, bool) or not 0.0 <= mal <= k + 1:
            raise EngineConfigError(f"speculative_min_accept_length must be 0..{k + 1}, got {mal!r}",
                                    field="speculative_min_accept_length")
        object.__setattr__(self, "speculative_min_accept_length", float(mal))
        if self.num_slots < 2:
            raise EngineConfigError("num_slots must be >= 2 (slot 0 is reserved scratch)", field="num_slots")
        if self.num_blocks < 2:
            raise EngineConfigError("num_blocks must be >= 2 (block 0 is reserved scratch)", field="num_blocks")

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def max_decode_batch(self) -> int:
        return self.decode_batch_buckets[-1]

    @property
    def max_prefill_tokens(self) -> int:
        return self.prefill_token_buckets[-1]

    @property
    def context_buckets(self) -> tuple[int, ...]:
        """Decode context lengths with a graph: decode_context_buckets, then max_model_len."""
        return (*self.decode_context_buckets, self.max_model_len)

    def context_bucket(self, num_tokens: int) -> int:
        """The decode graph context for a batch whose longest sequence holds `num_tokens` tokens
        (after this step): 0 (the full table) or the smallest shorter bucket that fits."""
        for c in self.decode_context_buckets:
            if c >= num_tokens:
                return c
        return 0

    @property
    def prefill_contexts(self) -> tuple[int, ...]:
        """Prefill graph contexts: each prefill_context_bucket, then 0 (the full table)."""
        return (*self.prefill_context_buckets, 0)

    def prefill_context_bucket(self, num_tokens: int) -> int:
        """The prefill graph context for a chunk ending at `num_tokens` tokens (start_pos + chunk;
        callers pass at least the chunk's token bucket, so the padded chunk fits the table too):
        0 (the full table) or the smallest prefill context bucket that holds it."""
        for c in self.prefill_context_buckets:
            if c >= num_tokens:
                return c
        return 0

    def table_blocks(self, context: int = 0) -> int:
        """Block-table width of a graph with `context` (0: the full table, max_blocks_per_seq)."""
        return -(-context // self.block_size) if context else self.max_blocks_per_seq

    def decode_bucket(self, batch: int) -> int:
        """Smallest decode batch bucket >= batch."""
        for b in self.decode_batch_buckets:
            if b >= batch:
                return b
        raise ValueError(f"decode batch {batch} exceeds the largest bucket {self.max_decode_batch}")

    def prefill_bucket(self, num_tokens: int) -> int:
        """Smallest prefill token bucket >= num_tokens."""
        for s in self.prefill_token_buckets:
            if s >= num_tokens:
                return s
        raise ValueError(f"prefill chunk {num_tokens} exceeds the largest bucket {self.max_prefill_tokens}")

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)
