"""TEST ONLY: a drafter that replays a recorded greedy continuation, with chosen positions wrong.

With the target's own greedy output as drafts every draft is accepted; corrupting the draft of a
chosen absolute position makes the verify of that position reject it (and accept the ones before
it), so a test decides where full, partial and zero acceptance happen, and knows in advance how
many drafts each step must accept (`expected_accepted`). Nothing outside the tests uses it.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from trnrt.engine.output.outputs import RowInput
from trnrt.engine.spec.drafter import Drafter


class OracleDrafter(Drafter):
    """sequences: request id -> every token of its greedy run (prompt + output), so position p's
    token is sequences[rid][p]; corrupt: request id -> absolute positions whose draft is replaced
    by another token ((t + 1) % vocab_size). Past the recorded run it drafts token 0. check: a
    row's last token must be the recorded one (off for sampled rows, which leave the greedy run)."""

    def __init__(self, sequences: Mapping[str, Sequence[int]], vocab_size: int,
                 corrupt: Mapping[str, set[int]] | None = None, check: bool = True):
        self.sequences = {k: list(v) for k, v in sequences.items()}
        self.check = check
        self.vocab_size = vocab_size
        self.corrupt = {k: set(v) for k, v in (corrupt or {}).items()}
        self.proposals: list[tuple[str, int, list[int]]] = []  # (request, start_pos, drafts) log

    def draft_at(self, request_id: str, pos: int) -> int:
        seq = self.sequences[request_id]
        tok = seq[pos] if pos < len(seq) else 0
        return (tok + 1) % self.vocab_size if pos in self.corrupt.get(request_id, ()) else tok

    def expected_accepted(self, request_id: str, start_pos: int, k: int) -> int:
        """Drafts a greedy verify at start_pos accepts: up to the first corrupted (or unrecorded)
        position among start_pos + 1 .. start_pos + k."""
        seq, bad = self.sequences[request_id], self.corrupt.get(request_id, set())
        n = 0
        while n < k and start_pos + n + 1 < len(seq) and start_pos + n + 1 not in bad:
            n += 1
        return n

    def propose(self, rows: Sequence[RowInput], k: int) -> torch.Tensor:
        out = []
        for r in rows:
            seq = self.sequences[r.request_id]
            L = r.start_pos
            if self.check and L < len(seq) and seq[L] != r.token_ids[0]:
                raise AssertionError(f"{r.request_id}: last token {r.token_ids[0]} at {L}, "
                                     f"the recorded run has {seq[L]}")
            drafts = [self.draft_at(r.request_id, L + j) for j in range(1, k + 1)]
            self.proposals.append((r.request_id, L, drafts))
            out.append(drafts)
        return torch.tensor(out, dtype=torch.long).view(len(rows), k)
