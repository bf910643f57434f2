"""Pages for speculative steps: the look-ahead a verify writes into, and nothing more.

A verify of k drafts at computed length L writes positions L .. L+k, so the sequence's block
table must cover L + k + 1 tokens first. Rejected positions are written into those same pages
and overwritten later (trnrt.engine.spec.rollback), so a step never needs more; after it the
sequence is at L' = L + n + 1 and the next step's look-ahead L' + k + 1 covers at least as much.
The look-ahead pages are ordinary pages of the sequence (CacheManager-owned, freed with it).
"""

from __future__ import annotations

from trnrt.engine.cache.cache_manager import CacheManager
from trnrt.engine.output.sequence import Sequence


def lookahead_tokens(num_computed: int, k: int) -> int:
    """Tokens a verify of k drafts at num_computed must find in the block table."""
    return num_computed + k + 1


def ensure_lookahead(cm: CacheManager, seq: Sequence, k: int) -> list[int]:
    """Grow seq's block table (and give it a slot) for a verify of k drafts at
    seq.num_computed_tokens; returns the pages it allocated (raises NoFreeBlocksError)."""
    return cm.allocate_blocks_for(seq, lookahead_tokens(seq.num_computed_tokens, k))
