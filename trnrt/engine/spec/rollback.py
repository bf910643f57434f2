"""Rollback: leave a verified row's state exactly at its accepted length.

A verify writes the target's state for all k + 1 fed positions L .. L+k; with n drafts accepted
only L .. L+n are real. What each kind of state needs (spec §2, §6):

* per-slot state (KDA recurrent state, conv window, indexer tail): not positional, it is "after
  the last token fed". Before the verify the rows' slots are saved with the prefix cache's own
  checkpoint machinery (a `save_slot` CacheOp into `ModelRunner.allocate_cache_tiers`'s
  checkpoint pool, ids from an `IdPool`); a row that accepted fewer than k drafts gets its slot
  back (`load_slot`) and its accepted tokens [last, d_1 .. d_n] re-run, so its slot then holds
  exactly the state after position L+n: the conv window has slid by n+1 tokens and the tail holds
  the raw keys / gates of the open pool at L+n. A fully accepted row keeps the verify's state.
  The checkpoint ids go back to the pool in the same step, on success or failure.
* paged state (MLA latents, the indexer's pooled keys): positional. The re-run rewrites L .. L+n;
  latents of rejected positions L+n+1 .. L+k stay behind in the sequence's own pages and are
  overwritten by the next forward that feeds those positions, before any query can read them (a
  query at p reads latents at positions <= p only). A pooled key is written when its pool
  completes and is read only by queries after its last position, so a pool a rejected draft
  completed is rewritten by the forward that completes it again, before it is read.
* the indexer tail is why vLLM needs a ring (spec §6, PR #58454): it commits per-position state
  without re-running, and the drafts stashed into a one-pool tail would overwrite the keys that
  a rejected, pool-completing draft's redo reads. Here nothing is committed from the verify for a
  partially accepted row: the tail comes back from the checkpoint and is rebuilt by the re-run,
  so a plain right-aligned tail (state.py) is enough. Per-position snapshots (no re-run) would
  need either a tail per position or vLLM's ring of kpool * next_pow2(ceil((kpool + k) / kpool)).

Pages: a verify feeds positions up to L+k, so the row's block table must cover L+k+1 tokens
before it runs (trnrt.engine.spec.pages); no page is allocated for a rejected position beyond that
look-ahead, and the look-ahead pages stay in the sequence's block table (freed with it).
"""

from __future__ import annotations

from typing import Sequence

from trnrt.engine.cache.cache_manager import IdPool
from trnrt.engine.output.outputs import CacheOp, RowInput


class SlotSnapshots:
    """Save / restore slots through the runner's checkpoint pool (CacheOps, as the prefix cache
    does). `pool` hands out the checkpoint ids; it must have one free id per row of a step."""

    def __init__(self, runner, pool: IdPool):
        if getattr(runner, "_ckpt", None) is None:
            raise ValueError("speculative rollback needs the checkpoint pool: call "
                             "runner.allocate_cache_tiers(num_checkpoints, ...) first")
        n_ckpt = runner._ckpt["kda"].shape[1]
        if pool.size > n_ckpt:
            raise ValueError(f"{pool.name} pool of {pool.size} ids > the runner's {n_ckpt} checkpoints")
        self.runner = runner
        self.pool = pool

    def save(self, slots: Sequence[int]) -> list[int]:
        """Copy each slot's state into a fresh checkpoint id; returns the ids (same order)."""
        ids = self.pool.allocate(len(slots))
        if ids is None:
            raise RuntimeError(f"speculative verify needs {len(slots)} free checkpoint ids, "
                               f"{self.pool.num_free} free")
        try:
            self.runner.apply_cache_ops([CacheOp("save_slot", tuple(slots), tuple(ids))])
        except BaseException:
            self.pool.free(ids)
            raise
        return ids

    def restore(self, ids: Sequence[int], slots: Sequence[int]) -> None:
        """Copy checkpoints back into their slots."""
        if ids:
            self.runner.apply_cache_ops([CacheOp("load_slot", tuple(ids), tuple(slots))])

    def release(self, ids: Sequence[int]) -> None:
        self.pool.free(ids)


def rerun_row(row: RowInput, drafts: Sequence[int], num_accepted: int) -> RowInput:
    """The row that re-feeds the accepted tokens: [last token, d_1 .. d_n] from the same start."""
    from dataclasses import replace

    return replace(row, token_ids=[row.token_ids[0], *map(int, drafts[:num_accepted])])
