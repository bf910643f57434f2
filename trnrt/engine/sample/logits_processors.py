"""Logits processors: per-row device inputs a variant step graph applies to the logits before sampling.

Each feature flag that needs device inputs (`structured_outputs`: a token bitmask; `penalties`:
dense per-row scale and bias) is one `LogitsProcessor`, registered here under its flag. A variant
graph of a flag set runs the processors of its flags, in `order`, between the model's logits and
the sampler (trnrt.engine.runner.variant_step); the catalogue derives every variant (and the superset
variant of several flags) from this registry, so a new feature is one processor and no new step.

Contract of a processor (docs/COMPILE.md, "Logits processors"):
- `flag`: the feature flag ("structured_outputs"); `phases`: the phases whose graphs get the
  variant ("decode", "prefill": the prefill graph samples a prompt's first token); `order`: position in the chain (lower first;
  masks last, so nothing adds to a -inf logit).
- `input_names`: its extra graph inputs, in order (recorded in the manifest).
- `example_inputs(batch, vocab_size, device)`: the *neutral* value of each input at the graph's
  shapes (a row holding these values samples exactly as in the base graph).
- `apply(logits [B, V] fp32, *inputs) -> logits [B, V]`: tensor code, static shapes, no Python
  branch on tensor values.
- `row_value(row)`: the row's own value (host side, from a RowInput), or None (neutral).
- `host_buffers(batch, vocab_size)` / `pack(buffers, values)`: persistent host arrays of the
  inputs and how to fill them from the rows' values (None entries and padding rows get neutral).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch


class LogitsProcessor(Protocol):
    flag: str
    phases: tuple[str, ...]
    order: int
    input_names: tuple[str, ...]

    def example_inputs(self, batch: int, vocab_size: int, device) -> tuple[torch.Tensor, ...]: ...

    def apply(self, logits: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor: ...

    def row_value(self, row) -> Any: ...

    def host_buffers(self, batch: int, vocab_size: int) -> tuple[np.ndarray, ...]: ...

    def pack(self, buffers: tuple[np.ndarray, ...], values: list) -> None: ...


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a packed token bitmask (xgrammar's layout: bit j of word w is token 32w + j)."""
    return -(-vocab_size // 32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Packed int32 bitmask [B, W] -> allowed [B, V] bool (bit j of word w allows token 32w + j).

    Shifts and ands only (no gather, no data-dependent shape): the same ops on every backend.
    The arithmetic shift of a negative word sign-extends, but `& 1` keeps exactly bit j.
    """
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32]
    bits = (bitmask[:, :, None] >> shifts[None, None, :]) & 1  # [B, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size] != 0  # [B, V]


class TokenBitmaskProcessor:
    """structured_outputs: tokens whose bit is 0 get -inf (xgrammar's mask). Neutral: every bit set.

    A row whose mask is all zero (a grammar dead end) would sample from -inf everywhere: the
    engine never sends one (it ends that request with finish reason "stop" instead).
    """

    flag = "structured_outputs"
    phases = ("decode", "prefill")  # a grammar constrains a prompt's first token too
    order = 100  # last: a mask must see the final logits
    input_names = ("token_bitmask",)

    def example_inputs(self, batch: int, vocab_size: int, device) -> tuple[torch.Tensor, ...]:
        return (torch.full((batch, bitmask_width(vocab_size)), -1, dtype=torch.int32, device=device),)

    def apply(self, logits: torch.Tensor, token_bitmask: torch.Tensor) -> torch.Tensor:
        allowed = unpack_bitmask(token_bitmask, logits.shape[-1])  # [B, V]
        return logits.masked_fill(~allowed, float("-inf"))

    def row_value(self, row):
        return row.token_bitmask

    def host_buffers(self, batch: int, vocab_size: int) -> tuple[np.ndarray, ...]:
        return (np.full((batch, bitmask_width(vocab_size)), -1, np.int32),)

    def pack(self, buffers, values: list) -> None:
        (buf,) = buffers
        buf.fill(-1)
        for i, v in enumerate(values):
            if v is not None:
                buf[i] = v  # [W] int32 (numpy, torch or list)


class PenaltiesProcessor:
    """penalties: repetition (a factor per token), frequency/presence, logit_bias and the
    min_new_tokens stop-id ban, as two dense per-row inputs (trnrt.engine.sample.penalties fills them):

        logits = where(logits > 0, logits / logit_scale, logits * logit_scale) + logit_bias

    logit_scale [B, V] fp32 (neutral 1) and logit_bias [B, V] fp32 (neutral 0, -inf bans a token).
    With neutral inputs the result is the logits bit for bit (x / 1, x * 1, + 0). Dense inputs need
    no bound on the number of distinct tokens (no --penalty-buckets); the host writes only the
    entries a row uses and resets only the ones it wrote the step before.
    """

    flag = "penalties"
    phases = ("decode", "prefill")  # the prefill graph samples a prompt's first token
    order = 50  # before the grammar mask (100): a mask must see the final logits
    input_names = ("logit_scale", "logit_bias")

    def __init__(self):
        # per host buffer (id of its scale array): {row: index arrays written} to reset next pack
        self._written: dict[int, dict[int, tuple]] = {}

    def example_inputs(self, batch: int, vocab_size: int, device) -> tuple[torch.Tensor, ...]:
        return (torch.ones((batch, vocab_size), dtype=torch.float32, device=device),
                torch.zeros((batch, vocab_size), dtype=torch.float32, device=device))

    def apply(self, logits: torch.Tensor, logit_scale: torch.Tensor, logit_bias: torch.Tensor) -> torch.Tensor:
        # repetition first (vLLM's order: it sees the model's logits), then the additive terms
        scaled = torch.where(logits > 0, logits / logit_scale, logits * logit_scale)  # [B, V]
        return scaled + logit_bias  # [B, V]

    def row_value(self, row):
        state = row.penalties
        return state if state is not None and state.active else None

    def host_buffers(self, batch: int, vocab_size: int) -> tuple[np.ndarray, ...]:
        return (np.ones((batch, vocab_size), np.float32), np.zeros((batch, vocab_size), np.float32))

    def pack(self, buffers, values: list) -> None:
        scale, bias = buffers
        written = self._written.setdefault(id(scale), {})
        for i, (scale_ids, *bias_ids) in written.items():  # only what the previous step wrote
            scale[i, scale_ids] = 1.0
            for ids in bias_ids:
                bias[i, ids] = 0.0
        written.clear()
        for i, v in enumerate(values):
            if v is not None:
                written[i] = v.fill(scale[i], bias[i])


_PROCESSORS: dict[str, LogitsProcessor] = {}


def register_processor(proc: LogitsProcessor) -> None:
    """Register the processor of a feature flag (replaces an earlier one of the same flag)."""
    _PROCESSORS[proc.flag] = proc


def processor(flag: str) -> LogitsProcessor | None:
    return _PROCESSORS.get(flag)


def processors_for(flags) -> list[LogitsProcessor]:
    """The processors of `flags`, in chain order. KeyError for a flag without one."""
    return sorted((_PROCESSORS[f] for f in set(flags)), key=lambda p: (p.order, p.flag))


def apply_processors(processors, logits: torch.Tensor, extra) -> torch.Tensor:
    """Chain `processors` over last-token logits [B, V] fp32, each taking its own inputs from
    `extra` in order (a variant graph's inputs after STEP_INPUT_NAMES)."""
    k = 0
    for p in processors:
        n = len(p.input_names)
        logits = p.apply(logits.float(), *extra[k:k + n])
        k += n
    return logits


from trnrt.engine.sample.prompt_logprob_collector import PROMPT_LOGPROBS  # noqa: E402  (a flag, not a processor)


def processor_flags(flags) -> frozenset[str]:
    """The flags of `flags` that are logits processors (all but prompt_logprobs)."""
    return frozenset(flags) - {PROMPT_LOGPROBS}


def variant_name(flags) -> str:
    """A flag set's variant name: the sorted flags joined with "+" ("base" for none)."""
    return "+".join(sorted(set(flags))) or "base"


def registered_flags() -> tuple[str, ...]:
    return tuple(sorted(_PROCESSORS))


register_processor(TokenBitmaskProcessor())
register_processor(PenaltiesProcessor())
