"""Sampler: greedy, temperature, top-k, top-p, min-p, with per-row seeds; logprobs.

Runs inside the step graph (static shapes, no Python branch on tensor values). Randomness is a
counter-based hash of (seed, position, vocab index), so a row's noise depends only on its own
seed and position: a seeded request gives the same tokens alone or batched with others, and the
graph needs no torch.Generator (which a traced graph cannot hold per row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2**31, so (x < 2**32) * _MUL fits in int64 without overflow


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """An avalanche hash of int64 tensors holding values in [0, 2**32)."""
    x = ((x ^ (x >> 16)) * _MUL) & _MASK32
    x = ((x ^ (x >> 16)) * _MUL) & _MASK32
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform (0, 1) noise [B, V] fp32 determined by (seed, position, vocab index) alone.

    seeds, positions: [B] int64 (seeds may be any int64; positions >= 0).
    """
    lo = seeds & _MASK32
    hi = (seeds >> 32) & _MASK32
    row = _hash32(_hash32(lo ^ _hash32(hi)) ^ (positions & _MASK32))  # [B]
    idx = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)  # [V]
    h = _hash32(row[:, None] ^ _hash32(idx[None, :] + 0x9E3779B1 & _MASK32))  # [B, V]
    return unit_open(h >> 8)


# The largest fp32 below 1. (2**24 - 0.5) / 2**24 is not an fp32: it rounded to 1.0, whose
# Gumbel noise -log(-log(1)) is +inf, and +inf + -inf (a masked token) is NaN, which argmax
# picks: a grammar-masked token was sampled about once per 2**24 (token, step) pairs.
_BELOW_ONE = 1.0 - 2.0 ** -24


def unit_open(bits24: torch.Tensor) -> torch.Tensor:
    """24-bit integers [0, 2**24) -> fp32 in the open interval (0, 1) (the cell centres
    (b + 0.5) / 2**24, the top one clamped to the largest fp32 below 1)."""
    return (((bits24.to(torch.float32) + 0.5) * (1.0 / (1 << 24)))).clamp_max(_BELOW_ONE)


@dataclass
class SamplingTensors:
    """Per-row sampling parameters as tensors (all [B]); padding rows use greedy defaults."""

    temperature: torch.Tensor  # fp32, 0 = greedy
    top_p: torch.Tensor  # fp32 in (0, 1]
    top_k: torch.Tensor  # int64, >= 1 (vocab_size when disabled)
    min_p: torch.Tensor  # fp32 in [0, 1]
    seeds: torch.Tensor  # int64
    positions: torch.Tensor  # int64: position of the token being sampled (keys the noise)


def sample(logits: torch.Tensor, st: SamplingTensors, num_top_logprobs: int):
    """Sample one token per row.

    logits: [B, V] fp32. Returns (token_ids [B] int64, token_logprobs [B] fp32,
    top_ids [B, N] int64, top_logprobs [B, N] fp32) with N = num_top_logprobs. Logprobs are of
    the model's raw distribution (log_softmax of the logits, before temperature and filters), as
    vLLM reports them by default.
    """
    logits = logits.float()
    vocab = logits.shape[-1]

    greedy = st.temperature <= 0.0  # [B]
    temp = torch.where(greedy, torch.ones_like(st.temperature), st.temperature)
    scaled = logits / temp[:, None]  # [B, V]

    # Filters act on the sorted distribution so top-k, top-p and min-p compose in one pass.
    sorted_logits, sorted_idx = torch.sort(scaled, dim=-1, descending=True)  # [B, V]
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    ranks = torch.arange(vocab, device=logits.device)[None, :]  # [1, V]
    top_k = torch.clamp(st.top_k, 1, vocab)
    drop = ranks >= top_k[:, None]
    # top-p: drop a token when the mass strictly before it already reaches top_p (keeps >= 1).
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop = drop | (mass_before >= st.top_p[:, None])
    drop = drop | (sorted_probs < st.min_p[:, None] * sorted_probs[:, :1])
    drop[:, 0] = False
    masked = sorted_logits.masked_fill(drop, float("-inf"))

    u = uniform_noise(st.seeds, st.positions, vocab)  # [B, V] by vocab index
    gumbel = -torch.log(-torch.log(torch.gather(u, 1, sorted_idx)))
    choice_sorted = torch.argmax(masked + gumbel, dim=-1)  # [B]
    sampled = torch.gather(sorted_idx, 1, choice_sorted[:, None]).squeeze(1)
    token_ids = torch.where(greedy, torch.argmax(logits, dim=-1), sampled)  # [B]

    return (token_ids, *_logprobs_of(logits, token_ids, num_top_logprobs))


def sample_greedy(logits: torch.Tensor, num_top_logprobs: int):
    """`sample` for a batch whose rows are all greedy: argmax, no sort, no noise. Same outputs
    (and the same values for greedy rows) as `sample`."""
    logits = logits.float()
    token_ids = torch.argmax(logits, dim=-1)  # [B]
    return (token_ids, *_logprobs_of(logits, token_ids, num_top_logprobs))


def _logprobs_of(logits: torch.Tensor, token_ids: torch.Tensor, num_top_logprobs: int):
    """(chosen token's logprob [B], top ids [B, N], top logprobs [B, N]) of fp32 logits [B, V]:
    logprob = logit - logsumexp(logits), computed for the N + 1 tokens reported only."""
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [B, 1]
    token_logprobs = (torch.gather(logits, 1, token_ids[:, None]) - lse).squeeze(1)
    n = max(1, min(num_top_logprobs, logits.shape[-1]))
    top_logits, top_ids = top_n(logits, n)
    return token_logprobs, top_ids, top_logits - lse


# Chunks of the two-stage top-n: chunk k of a row is {x[k], x[k + V/C], x[k + 2V/C], ...} (a
# strided chunk: its max is a vertical max across C vectors, no horizontal reduction); a
# vocabulary of fewer than _TOP_N_MIN_CHUNKS chunks gets a plain topk.
_TOP_N_CHUNK = 16
_TOP_N_MIN_CHUNKS = 64


def top_n(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(x, n, dim=-1) of x [B, V] -> (values [B, n], indices [B, n]), best first.

    Two stages when V splits into _TOP_N_CHUNK strided chunks: the n best chunk maxima pick n
    chunks, and the top-n of those n * chunk candidates is the top-n of the row (an element
    outside the picked chunks is at most its chunk's maximum, below n picked maxima). CPU topk
    costs about V ns per row whatever n (copy + select): 54 us for [8, 4096], vs ~15 us for the
    two small ones. Ties between equal values may resolve to other indices than torch.topk's.
    """
    B, V = x.shape
    C = _TOP_N_CHUNK
    W = V // C  # number of chunks
    if V % C or W < max(n, _TOP_N_MIN_CHUNKS):
        return torch.topk(x, n, dim=-1)
    xs = x.view(B, C, W)  # [B, C, W]: chunk k is column k
    _, chunk = torch.topk(xs.amax(1), n, dim=-1)  # [B, n] chunks holding the top-n
    cand = xs.gather(2, chunk[:, None, :].expand(B, C, n)).reshape(B, C * n)  # [B, C*n]: (row r, pick j)
    values, pos = torch.topk(cand, n, dim=-1)  # [B, n]
    ids = (pos // n) * W + chunk.gather(1, pos % n)
    return values, ids
