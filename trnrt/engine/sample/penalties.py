"""Host side of the `penalties` variant: per-request token counts -> dense per-row scale and bias.

The device side (trnrt.engine.sample.logits_processors.PenaltiesProcessor) applies, per row,

    logits = where(logits > 0, logits / scale, logits * scale) + bias      # [B, V]

where `scale` [V] is the repetition penalty on every token seen in the prompt or the output
(vLLM's definition: prompt tokens count for repetition; 1 elsewhere) and `bias` [V] is
`-frequency_penalty * count - presence_penalty * (count > 0)` over OUTPUT tokens only, plus the
request's `logit_bias`, plus -inf on the stop ids (EOS unless ignore_eos, and stop_token_ids)
while fewer than `min_new_tokens` tokens have been generated.

Cost: `PenaltyState.add` is O(1) per new token (a dict lookup and two array writes); `fill` writes
only the row's distinct tokens, the logit_bias ids and the stop ids (vectorized numpy fancy
indexing, no pass over the sequence), and the processor resets exactly the entries it wrote the
step before, so a step never touches the whole [B, V] buffer. Only a request that uses a
penalty gets a state. numpy only (no torch): tested without a model.
"""

from __future__ import annotations

import numpy as np

_INITIAL_CAPACITY = 64


class PenaltyState:
    """One request's penalty inputs, kept incrementally on the engine thread.

    Args:
        repetition_penalty, frequency_penalty, presence_penalty: SGLang's / vLLM's values
            (neutral: 1, 0, 0).
        logit_bias: {token_id: bias} (OpenAI's, ids already checked against the vocabulary).
        min_new_tokens: stop ids are banned until this many tokens were generated.
        stop_ids: the ids banned while min_new_tokens is not reached.
        prompt_token_ids: counted for the repetition penalty only.
    """

    __slots__ = ("rep", "freq", "pres", "min_new_tokens", "num_output", "_lb_ids", "_lb_vals", "_stop_ids",
                 "_track", "_track_prompt", "_pos", "_ids", "_count", "_bias", "_n")

    def __init__(self, *, repetition_penalty: float = 1.0, frequency_penalty: float = 0.0,
                 presence_penalty: float = 0.0, logit_bias: dict | None = None, min_new_tokens: int = 0,
                 stop_ids=(), prompt_token_ids=()):
        self.rep = float(repetition_penalty)
        self.freq = float(frequency_penalty)
        self.pres = float(presence_penalty)
        self.min_new_tokens = int(min_new_tokens)
        self.num_output = 0
        lb = logit_bias or {}
        self._lb_ids = np.fromiter((int(k) for k in lb), np.int64, len(lb))
        self._lb_vals = np.fromiter((float(v) for v in lb.values()), np.float32, len(lb))
        self._stop_ids = np.array(sorted({int(t) for t in stop_ids}), np.int64)
        # distinct tokens seen: position in the arrays below (only when a count-based penalty is on)
        self._track_prompt = self.rep != 1.0
        self._track = self._track_prompt or self.freq != 0.0 or self.pres != 0.0
        self._pos: dict[int, int] = {}
        self._ids = np.empty(_INITIAL_CAPACITY, np.int64)  # [N] distinct token ids
        self._count = np.zeros(_INITIAL_CAPACITY, np.float32)  # [N] output occurrences
        self._bias = np.zeros(_INITIAL_CAPACITY, np.float32)  # [N] -freq*count - pres*(count>0)
        self._n = 0
        if self._track_prompt:
            for t in prompt_token_ids:  # once, at submit (the caller's thread)
                self._slot(int(t))

    @classmethod
    def from_params(cls, sp, prompt_token_ids, eos_token_ids) -> "PenaltyState":
        """The state of a request's SamplingParams (trnrt.engine.request.SamplingParams)."""
        stop = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(eos_token_ids))
        return cls(repetition_penalty=sp.repetition_penalty, frequency_penalty=sp.frequency_penalty,
                   presence_penalty=sp.presence_penalty, logit_bias=sp.logit_bias,
                   min_new_tokens=sp.min_new_tokens, stop_ids=stop, prompt_token_ids=prompt_token_ids)

    def _slot(self, t: int) -> int:
        i = self._pos.get(t)
        if i is None:
            i = self._n
            if i == len(self._ids):  # amortized O(1): double the arrays
                self._ids = np.concatenate([self._ids, np.empty_like(self._ids)])
                self._count = np.concatenate([self._count, np.zeros_like(self._count)])
                self._bias = np.concatenate([self._bias, np.zeros_like(self._bias)])
            self._ids[i] = t
            self._pos[t] = i
            self._n = i + 1
        return i

    def add(self, token_ids) -> None:
        """Count newly generated tokens (O(1) each)."""
        for t in token_ids:
            self.num_output += 1
            if self._track:
                i = self._slot(int(t))
                c = self._count[i] + 1
                self._count[i] = c
                self._bias[i] = -self.freq * c - self.pres
        # NOTE: float32 like the device input, so the reference tests compare like with like

    @property
    def active(self) -> bool:
        """The row's inputs differ from neutral now (else it may run in the base graph)."""
        return (self._track or len(self._lb_ids) > 0
                or (self.num_output < self.min_new_tokens and len(self._stop_ids) > 0))

    def fill(self, scale_row: np.ndarray, bias_row: np.ndarray) -> tuple[np.ndarray, ...]:
        """Write this request's entries into neutral rows scale [V] (ones) and bias [V] (zeros).
        Returns the index arrays it wrote, (scale ids, bias ids...), for the caller to reset."""
        n = self._n
        ids = self._ids[:n]
        written_scale = ids if self._track_prompt and n else ids[:0]
        if len(written_scale):
            scale_row[ids] = self.rep
        bias_written = []
        if (self.freq != 0.0 or self.pres != 0.0) and n:
            bias_row[ids] = self._bias[:n]
            bias_written.append(ids)
        if len(self._lb_ids):
            bias_row[self._lb_ids] += self._lb_vals  # ids are unique (dict keys)
            bias_written.append(self._lb_ids)
        if self.num_output < self.min_new_tokens and len(self._stop_ids):
            bias_row[self._stop_ids] = -np.inf
            bias_written.append(self._stop_ids)
        return (written_scale, *bias_written)

    def is_banned(self, token: int) -> bool:
        """The token gets -inf now (a stop id before min_new_tokens)."""
        return self.num_output < self.min_new_tokens and bool(np.any(self._stop_ids == token))


def reference_logits(logits: np.ndarray, prompt: list[list[int]], output: list[list[int]], *,
                     repetition_penalty, frequency_penalty, presence_penalty, logit_bias=None,
                     min_new_tokens=None, stop_ids=()) -> np.ndarray:
    """A plain, loop-per-token statement of the formulas (tests compare the device path with it).

    logits [B, V] fp32; per row b: prompt[b], output[b] token lists and the per-row parameters
    as lists. Repetition (vLLM, SGLang): a token seen in the prompt or output has its logit
    divided by the penalty if positive, multiplied if not. Then frequency/presence over output
    counts, then logit_bias, then -inf on stop ids while len(output) < min_new_tokens.
    """
    out = logits.astype(np.float32).copy()
    B, V = out.shape
    for b in range(B):
        seen = set(prompt[b]) | set(output[b])
        for t in seen:
            x = out[b, t]
            out[b, t] = x / repetition_penalty[b] if x > 0 else x * repetition_penalty[b]
        counts: dict[int, int] = {}
        for t in output[b]:
            counts[t] = counts.get(t, 0) + 1
        for t, c in counts.items():
            out[b, t] -= frequency_penalty[b] * c + presence_penalty[b]
        for t, v in ((logit_bias or [{}] * B)[b] or {}).items():
            out[b, int(t)] += v
        if min_new_tokens is not None and len(output[b]) < min_new_tokens[b]:
            for t in stop_ids:
                out[b, t] = -np.inf
    return out
