"""The acceptance rule of speculative decoding (pure torch, no model).

Verify feeds a row's last token and its k drafts, so the target produces k + 1 rows of logits:
row j (j = 0..k) is the target's distribution of the token at position start_pos + 1 + j, the
position draft j + 1 (1-based) claims. `accept` decides, per row:

* greedy rows (temperature <= 0): draft j is accepted while it equals the target's argmax; the
  emitted token after the accepted drafts is the target's argmax at the first mismatch (or, all
  accepted, at row k: the bonus token). So the output is exactly greedy decoding's.
* sampled rows: standard speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023).
  With p the target's distribution after temperature / top-k / top-p / min-p (the same filters as
  trnrt.engine.sample.sampler.sample) and q the drafter's, draft x is accepted with probability
  min(1, p(x) / q(x)); at the first rejection the token is drawn from norm(max(0, p - q)); after k
  acceptances the bonus is drawn from p. Every emitted token is then distributed exactly as p.
  A deterministic drafter (the oracle, greedy MTP drafts) has a one-hot q: accept with
  probability p(x), on rejection draw from p without x.

Randomness is counter-based, keyed by (seed, position) like the sampler's
(`trnrt.engine.sample.sampler.uniform_noise`), so a row's outcome does not depend on what else is in the
batch: the acceptance test of position t uses one uniform of a salted seed, the draw at t uses
the sampler's own Gumbel noise of (seed, t). Hence the bonus token after full acceptance is the
token `sample` would pick from the same logits.

No Python branch on tensor values: `draft_probs is None` and `greedy_only` are static.
"""

from __future__ import annotations

import torch

from trnrt.engine.sample.sampler import uniform_noise

# XORed into a row's seed for the acceptance uniforms: a stream apart from the sampler's noise
# of the same (seed, position), which keys the residual / bonus draws.
ACCEPT_SALT = 0x5EC_ACC_E97


def filtered_scores(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                    min_p: torch.Tensor) -> torch.Tensor:
    """Temperature-scaled logits with the sampler's filters applied (-inf where dropped), in
    vocabulary order: softmax of the result is the distribution `sample` draws from.

    logits [N, V]; temperature / top_p / min_p [N] fp32, top_k [N] int64 (>= 1; V = off).
    Greedy rows (temperature <= 0) are scaled by 1 (as the sampler does; callers use the argmax).
    Same arithmetic as trnrt.engine.sample.sampler.sample, step for step.
    """
    logits = logits.float()
    vocab = logits.shape[-1]
    temp = torch.where(temperature <= 0.0, torch.ones_like(temperature), temperature)
    scaled = logits / temp[:, None]  # [N, V]
    sorted_logits, sorted_idx = torch.sort(scaled, dim=-1, descending=True)  # [N, V]
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    ranks = torch.arange(vocab, device=logits.device)[None, :]  # [1, V]
    drop = ranks >= torch.clamp(top_k, 1, vocab)[:, None]
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop = drop | (mass_before >= top_p[:, None])
    drop = drop | (sorted_probs < min_p[:, None] * sorted_probs[:, :1])
    drop = drop & (ranks > 0)  # the best token always stays
    masked = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(1, sorted_idx, masked)  # [N, V]


def accept_uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The acceptance test's uniform (0, 1) of each (seed, position): seeds, positions [N] -> [N]."""
    return uniform_noise(seeds ^ ACCEPT_SALT, positions, 1)[:, 0]


def _emit(draft_ids: torch.Tensor, correction: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    """[B, k+1] emitted ids: accepted drafts, then correction[num_accepted], then -1 padding."""
    B, K1 = correction.shape
    jj = torch.arange(K1, device=correction.device)[None, :]  # [1, K+1]
    n = num_accepted[:, None]  # [B, 1]
    drafts = torch.cat([draft_ids, draft_ids.new_zeros((B, 1))], 1)  # [B, K+1] (K may be 0)
    last = correction.gather(1, n)  # [B, 1]
    return torch.where(jj < n, drafts, torch.where(jj == n, last, torch.full_like(drafts, -1)))


def _leading(ok: torch.Tensor) -> torch.Tensor:
    """Number of leading True entries per row: ok [B, K] bool -> [B] int64."""
    return ok.long().cumprod(-1).sum(-1)


def accept_greedy(logits: torch.Tensor, draft_ids: torch.Tensor,
                  num_drafts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy rule only (every row greedy). logits [B, K+1, V], draft_ids [B, K] int64,
    num_drafts [B] (drafts past it count as rejected; None: all K). Returns (token_ids [B, K+1]
    int64: accepted drafts, the argmax at the first mismatch, then -1; num_accepted [B] int64)."""
    K = draft_ids.shape[1]
    target = logits.argmax(-1)  # [B, K+1]
    ok = draft_ids == target[:, :K]  # [B, K]
    if num_drafts is not None:
        ok = ok & (torch.arange(K, device=ok.device)[None, :] < num_drafts[:, None])
    n = _leading(ok)
    return _emit(draft_ids, target, n), n


def accept(logits: torch.Tensor, draft_ids: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
           top_k: torch.Tensor, min_p: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
           num_drafts: torch.Tensor | None = None,
           draft_probs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy rows by the greedy rule, sampled rows by rejection sampling (module doc).

    logits [B, K+1, V] (row j: the token at positions + j); draft_ids [B, K] int64; per-row
    sampling tensors [B] as in trnrt.engine.sample.sampler.SamplingTensors; positions [B] int64: the
    position of the token logits row 0 predicts (start_pos + 1, the sampler's sample_pos);
    num_drafts [B]: valid drafts per row (a row with fewer draws its next token from p at
    num_drafts, as after a full acceptance; None: all K); draft_probs [B, K, V]: the drafter's q
    (None: one-hot at the draft, a deterministic drafter).
    Returns (token_ids [B, K+1] int64, num_accepted [B] int64); row b emits token_ids[b, :n+1].
    """
    B, K1, V = logits.shape
    K = K1 - 1
    dev = logits.device
    logits = logits.float()
    rep = lambda t: t.repeat_interleave(K1)  # [B] -> [B*(K+1)], row-major over (b, j)
    scores = filtered_scores(logits.reshape(B * K1, V), rep(temperature), rep(top_p), rep(top_k),
                             rep(min_p)).view(B, K1, V)  # [B, K+1, V]
    probs = torch.softmax(scores, dim=-1)  # p, 0 where filtered
    pos = positions[:, None] + torch.arange(K1, device=dev)[None, :]  # [B, K+1]
    greedy = (temperature <= 0.0)[:, None]  # [B, 1]
    target = logits.argmax(-1)  # [B, K+1]
    jj = torch.arange(K, device=dev)[None, :]
    has = jj < (num_drafts[:, None] if num_drafts is not None else K)  # [B, K] draft j exists

    # acceptance of each draft: u < p(x) / q(x), written u * q(x) < p(x)
    p_x = probs[:, :K].gather(-1, draft_ids[..., None]).squeeze(-1)  # [B, K]
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs.gather(-1, draft_ids[..., None]).squeeze(-1)
    u = accept_uniform(seeds.repeat_interleave(K), pos[:, :K].reshape(-1)).view(B, K)
    ok = torch.where(greedy, draft_ids == target[:, :K], u * q_x < p_x) & has
    n = _leading(ok)  # [B]

    # the draw at each row j, if it is the first rejection: norm(max(0, p - q)) (one-hot q: p
    # without the draft); at j == num_drafts (no draft left) and at j == K: p itself
    if draft_probs is None:
        resid = scores[:, :K].scatter(-1, draft_ids[..., None], float("-inf"))
    else:
        resid = torch.log((probs[:, :K] - draft_probs).clamp(min=0.0))  # log 0 = -inf
    resid = torch.where(has[..., None], resid, scores[:, :K])
    cand = torch.cat([resid, scores[:, K:]], 1)  # [B, K+1, V]
    noise = uniform_noise(seeds.repeat_interleave(K1), pos.reshape(-1), V).view(B, K1, V)
    drawn = (cand - torch.log(-torch.log(noise))).argmax(-1)  # Gumbel-max, as the sampler
    correction = torch.where(greedy, target, drawn)  # [B, K+1]
    return _emit(draft_ids, correction, n), n
