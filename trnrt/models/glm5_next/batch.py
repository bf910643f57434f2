"""What one forward of the glm5_next model reads and returns: the padded batch (`ForwardBatch`),
the output (`ModelOutput`), and the index metadata that all layers of one forward share
(`_Meta`, built once by `_make_meta`: write targets, masks and the indexer's pool gathers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import Glm5NextConfig


@dataclass
class ForwardBatch:
    """Padded inputs of one forward (extend if S > 1, decode if S == 1).

    input_ids    [B, S] int64  new tokens, right-padded (pad value is irrelevant)
    start_pos    [B]    int64  tokens already in the cache (num_computed_tokens); 0 = fresh start:
                               the row starts from zero KDA/conv/tail state whatever its slot held
    num_new      [B]    int64  valid new tokens of each row (0 for padding rows)
    block_tables [B, MB] int   physical block of each logical block (padded with 0)
    slot_ids     [B]    int64  per-sequence state slot (0 for padding rows)

    Rows are right-padded: tokens s >= num_new of a row are padding. Padding rows (num_new 0) must
    point at slot 0 and may carry any start_pos / block table (zeros is natural). In a decode
    batch (S == 1) a real row has num_new == 1: the decode graph shifts the conv window and the
    indexer tail by exactly one token (static slices), so num_new == 0 is only for padding rows.
    Every block a row's valid tokens touch (positions < start_pos + num_new) must be in its block
    table; the table's remaining entries may be 0.
    """

    input_ids: torch.Tensor
    start_pos: torch.Tensor
    num_new: torch.Tensor
    block_tables: torch.Tensor
    slot_ids: torch.Tensor


@dataclass
class ModelOutput:
    """logits: [B, V] fp32 at each row's last valid token, or [B, S, V] with all_logits.
    hidden: [B, D] final hidden state (after the mHC mean collapse and final norm) at that token.
    hidden_all: [B, S, D] that state at every position with all_logits (speculative verify feeds
    it to the MTP drafter), else None."""

    logits: torch.Tensor
    hidden: torch.Tensor
    hidden_all: torch.Tensor | None = None


@dataclass
class _Meta:
    """Index tensors shared by all layers of one forward (computed once)."""

    B: int
    S: int
    T: int  # gathered key length = max_blocks * block_size
    valid: torch.Tensor  # [B, S] bool, token s < num_new
    pos: torch.Tensor  # [B, S] absolute position of each new token
    restart: torch.Tensor  # [B] bool, start_pos == 0
    num_new: torch.Tensor  # [B]
    slot_ids: torch.Tensor  # [B] int64
    block_tables: torch.Tensor  # [B, MB] int64
    tok_blk: torch.Tensor  # [B*S] physical block of each new token's latent; padded tokens -> block 0
    tok_off: torch.Tensor  # [B*S] offset of each new token in its block
    # indexer pooling (per forward, shared by all full-indexer layers)
    pool_gather: torch.Tensor | None  # [B, J*kpool] (extend only) ext index of each candidate pool's tokens
    pool_blk: torch.Tensor  # [B*J] block of each candidate pool's key; incomplete pools -> block 0
    pool_off: torch.Tensor  # [B*J] pool index within its block
    tail_gather: torch.Tensor | None  # [B, kpool-1] (extend only) index into ext of the new right-aligned tail
    pool_cand: torch.Tensor  # [B, S, P] bool, pool complete and its last token visible
    tail_mask: torch.Tensor  # [B, S, T] bool, visible open-pool tokens (always selected)
    # a short extend (a speculative verify or draft catch-up, S = k + 1): the KDA recurrence token
    # by token, experts gathered per token (forward's short_extend); a Python flag, fixed at trace time
    short: bool = False

    @property
    def block_size(self) -> int:
        return self.T // self.block_tables.shape[1]


def _make_meta(cfg: Glm5NextConfig, batch: ForwardBatch, block_size: int, short: bool = False) -> _Meta:
    ids = batch.input_ids
    B, S = ids.shape
    dev = ids.device
    kp = cfg.index_kpool
    bt = batch.block_tables.long()
    MB = bt.shape[1]
    T = MB * block_size
    start = batch.start_pos.long()
    num_new = batch.num_new.long()
    ar = torch.arange(S, device=dev)
    valid = ar[None, :] < num_new[:, None]  # [B, S]
    pos = start[:, None] + ar[None, :]  # [B, S]
    # latent write targets; padded tokens write into scratch block 0
    blk = bt.gather(1, (pos // block_size).clamp(max=MB - 1))
    blk = torch.where(valid, blk, torch.zeros_like(blk))
    tok_blk, tok_off = blk.reshape(-1), (pos % block_size).reshape(-1)

    # pools completed by this chunk: candidates j = 0..J-1 starting at the open pool P0
    J = (kp - 1 + S + kp - 1) // kp
    tail_len = start % kp  # [B] tokens already in the open pool
    p0 = start - tail_len  # [B] first position of the open pool
    jj = torch.arange(J, device=dev)
    mm = torch.arange(kp, device=dev)
    # ext index of position p is p - start + kp - 1
    if S > 1:  # decode reads static slices instead (see Indexer.forward)
        g = (jj[:, None] * kp + mm[None, :]).reshape(-1)[None, :] + (kp - 1 - tail_len)[:, None]  # [B, J*kp]
        pool_gather = g.clamp(max=kp - 2 + S)
        tail_gather = num_new[:, None] + torch.arange(kp - 1, device=dev)[None, :]  # [B, kp-1]
    else:
        pool_gather = tail_gather = None
    pool_start = p0[:, None] + jj[None, :] * kp  # [B, J]
    complete = pool_start + kp <= (start + num_new)[:, None]  # [B, J]
    pblk = bt.gather(1, (pool_start // block_size).clamp(max=MB - 1))
    pool_blk = torch.where(complete, pblk, torch.zeros_like(pblk)).reshape(-1)
    pool_off = ((pool_start % block_size) // kp).reshape(-1)

    P = T // kp
    pool_end = torch.arange(P, device=dev) * kp + (kp - 1)  # [P]
    pool_cand = pool_end[None, None, :] <= pos[:, :, None]  # [B, S, P]
    kpos = torch.arange(T, device=dev)
    tail_start = (pos + 1) // kp * kp  # [B, S]
    tail_mask = (kpos[None, None, :] >= tail_start[:, :, None]) & (kpos[None, None, :] <= pos[:, :, None])
    return _Meta(
        B=B, S=S, T=T, valid=valid, pos=pos, restart=start == 0, num_new=num_new,
        slot_ids=batch.slot_ids.long(), block_tables=bt, tok_blk=tok_blk, tok_off=tok_off,
        pool_gather=pool_gather, pool_blk=pool_blk, pool_off=pool_off, tail_gather=tail_gather,
        pool_cand=pool_cand, tail_mask=tail_mask, short=short and S > 1,
    )
