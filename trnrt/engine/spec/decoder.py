"""SpecDecoder: one speculative decode step for a batch of decode rows, at the runner level.

    drafts   = drafter.propose(rows, k)                        # [B, k]
    ckpt     = save the rows' slots                            # rollback.SlotSnapshots
    verify   [last, d_1 .. d_k] per row -> tokens, n, hidden   # verify.VerifyFunction
    rollback rows with n < k: restore the slot, re-run [last, d_1 .. d_n]  (n = 0: a plain decode step)
    release  ckpt;  drafter.observe(hidden of L .. L+n, emitted tokens)

Each row emits n + 1 tokens (its accepted drafts, then the correction or bonus token) and ends at
computed length L + n + 1 with its last emitted token not yet in the cache: exactly where plain
decoding of the same tokens leaves a sequence. Groups of at most the largest decode bucket run
together, padded to a decode bucket (padding rows: slot 0, block 0), with the block table cut to
the decode context bucket holding L + k + 1 tokens; the verify shape is [bucket, k + 1] whatever
the rows' draft counts (the catalogue's `verify` graph, compiled when the runner loaded it; rows
with fewer drafts feed fewer tokens). The re-run of a partially accepted row runs the greedy
verify graph of its shape (its outputs dropped: the same forward over the same tokens), except a
row that accepted no draft: it re-feeds only its last token, which is a plain decode step (the
runner's decode graph of the batch bucket; on the 2-core CPU a b8 decode costs 0.9 ms, a b8
verify-shaped extend 9 ms), and leaves exactly the state plain decoding leaves.

Precondition per row (RowInput): token_ids = [the last sampled token], start_pos = L with
L + k + 1 <= max_model_len, block_ids covering L + k + 1 tokens (pages.ensure_lookahead),
request_id known to the drafter. The scheduler picks each row's k (fewer near max_new_tokens /
max_model_len) and applies stops inside the emitted tokens; requests needing logprobs, logits
processors, penalties or grammars never come here (Engine.speculative_ok).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch

from trnrt.engine.cache.cache_manager import IdPool, cdiv
from trnrt.engine.output.outputs import RowInput
from trnrt.engine.spec.drafter import Drafter
from trnrt.engine.spec.prefill import prefill_chunk
from trnrt.engine.spec.rollback import SlotSnapshots, rerun_row
from trnrt.engine.spec.verify import VerifyFunction


@dataclass
class SpecOutput:
    """One row's result: token_ids (1 .. k+1: accepted drafts, then the correction / bonus
    token), num_accepted (drafts accepted, 0 .. k), drafts (what the drafter proposed)."""

    token_ids: list[int]
    num_accepted: int
    drafts: list[int]


class SpecDecoder:
    """Speculative decoding over a ModelRunner's model and state (eager).

    runner: the ModelRunner (its `_pack`, `apply_cache_ops`, checkpoint pool); drafter: a
    Drafter; k: drafts per step (>= 1); checkpoints: the IdPool of the runner's checkpoint pool
    (one free id per row of a step, held only during the step).
    """

    def __init__(self, runner, drafter: Drafter, k: int, checkpoints: IdPool):
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.runner = runner
        self.drafter = drafter
        self.k = k
        self.snapshots = SlotSnapshots(runner, checkpoints)
        self.verify_fns = {g: VerifyFunction(runner.model, runner.state, greedy_only=g) for g in (False, True)}
        self.num_rollbacks = 0  # rows re-run (n < k), for tests and stats
        self.num_graph_verifies = 0  # verifies that ran a compiled verify graph
        self.num_plain_reruns = 0  # of the rolled-back rows, those re-run as a plain decode step (n = 0)

    def _graph(self, batch: int, context: int, greedy: bool):
        """The runner's compiled verify graph of this shape, or None (run eagerly). An all-greedy
        batch takes the greedy rule's graph, or the full rule's where only that one was compiled
        (the same tokens and state for greedy rows)."""
        from trnrt.engine.runner.step import GraphSpec

        compiled = getattr(self.runner, "compiled", None) or {}
        full = compiled.get(GraphSpec("verify", batch, self.k + 1, "base", "full", context))
        if not greedy:
            return full
        return compiled.get(GraphSpec("verify", batch, self.k + 1, "base", "greedy", context)) or full

    def _decode_step(self, rows: list[RowInput], context: int) -> None:
        """The runner's plain decode step over `rows` (each feeding its one last token at L), its
        outputs dropped: the greedy graph where the runner has it (it writes the same state as
        the full sampler's), compiled when loaded."""
        runner = self.runner
        spec = runner.greedy_decode_spec(runner.cfg.decode_bucket(len(rows)), context)
        runner._step_fn(spec)(*runner._pack(rows, spec.batch, 1, context))

    # -- prefill ------------------------------------------------------------------------------

    def prefill(self, row: RowInput) -> int:
        """Prefill a whole prompt (row.token_ids from row.start_pos, in chunks of the largest
        prefill bucket), feeding the drafter every position's hidden state. Returns the first
        sampled token (the row's block table must cover the prompt)."""
        ids = list(row.token_ids)
        C = self.runner.cfg.max_prefill_tokens
        tok = None
        for s in range(0, len(ids), C):
            chunk = replace(row, token_ids=ids[s: s + C], start_pos=row.start_pos + s)
            tok, hidden = prefill_chunk(self.runner, chunk)
            nxt = ids[s + 1: s + C + 1]
            if len(nxt) < len(chunk.token_ids):
                nxt = nxt + [tok]  # the last prompt position is followed by the sampled token
            self.drafter.observe(row.request_id, chunk.start_pos, nxt, hidden)
        return tok

    # -- the speculative step -----------------------------------------------------------------

    def step(self, rows: Sequence[RowInput], ks: Sequence[int] | None = None) -> list[SpecOutput]:
        """One speculative decode step for decode rows (see the module doc). `ks`: drafts per
        row (each 0 .. k; default k for every row; a row with 0 is a plain decode step through
        the verify, which still feeds the drafter). Returns one SpecOutput per row, in order."""
        bs, max_len = self.runner.cfg.block_size, self.runner.cfg.max_model_len
        ks = [self.k] * len(rows) if ks is None else [int(x) for x in ks]
        if len(ks) != len(rows) or any(not 0 <= x <= self.k for x in ks):
            raise ValueError(f"drafts per row must be 0..{self.k}, one per row: {ks}")
        for r, k in zip(rows, ks):
            if len(r.token_ids) != 1:
                raise ValueError(f"{r.request_id}: a speculative decode row feeds its one last token")
            if r.start_pos + k + 1 > max_len:  # past the table a position would alias its last page
                raise ValueError(f"{r.request_id}: a verify at {r.start_pos} with k={k} passes "
                                 f"max_model_len {max_len}")
            if len(r.block_ids) < cdiv(r.start_pos + k + 1, bs):
                raise ValueError(f"{r.request_id}: block table holds {len(r.block_ids)} pages, a verify at "
                                 f"{r.start_pos} with k={k} needs {cdiv(r.start_pos + k + 1, bs)}")
        out: list[SpecOutput] = []
        maxb = self.runner.cfg.max_decode_batch
        for g in range(0, len(rows), maxb):
            out.extend(self._step_group(list(rows[g: g + maxb]), ks[g: g + maxb]))
        return out

    def _step_group(self, rows: list[RowInput], ks: list[int]) -> list[SpecOutput]:
        runner = self.runner
        n_rows = len(rows)
        K = max(ks)  # the verify's width: K + 1 tokens per row (fewer fed in rows with fewer drafts)
        drafting = [i for i in range(n_rows) if ks[i] > 0]
        drafts: list[list[int]] = [[] for _ in rows]
        q_rows: dict[int, torch.Tensor] = {}
        # one proposal per distinct k, so that no draft position passes its row's look-ahead
        for k in sorted({ks[i] for i in drafting}):
            idx = [i for i in drafting if ks[i] == k]
            proposed = self.drafter.propose([rows[i] for i in idx], k).tolist()  # [b][k]
            q = self.drafter.draft_probs
            for j, (i, d) in enumerate(zip(idx, proposed)):
                drafts[i] = d
                if q is not None:
                    q_rows[i] = q[j]
        vrows = [replace(r, token_ids=[r.token_ids[0], *d]) for r, d in zip(rows, drafts)]
        batch = runner.cfg.decode_bucket(n_rows)
        context = runner.cfg.context_bucket(max(r.start_pos + k + 1 for r, k in zip(rows, ks)))
        greedy = all(r.temperature <= 0.0 for r in rows)
        # Always k + 1 tokens a row (num_new = 1 + the row's drafts): the verify graph's shape,
        # so the eager and the compiled step run the same computation.
        width = self.k + 1
        ckpt = self.snapshots.save([r.slot_id for r in rows]) if K else []
        try:
            with torch.inference_mode():
                inputs = runner._pack(vrows, batch, width, context)
                probs = None
                if q_rows:  # the drafters' q [n_rows, k, V] (zero rows past a row's drafts)
                    any_q = next(iter(q_rows.values()))
                    probs = any_q.new_zeros((batch, self.k) + tuple(any_q.shape[1:]))
                    for i, q in q_rows.items():
                        probs[i, : q.shape[0]] = q
                compiled = None if probs is not None else self._graph(batch, context, greedy)
                if compiled is not None:
                    token_ids, num_acc, hidden = compiled(*inputs)
                    self.num_graph_verifies += 1
                else:
                    token_ids, num_acc, hidden = self.verify_fns[greedy](*inputs, draft_probs=probs)
                token_ids, num_acc = token_ids[:n_rows].tolist(), num_acc[:n_rows].tolist()
                hidden = hidden[:n_rows]
                partial = [i for i in range(n_rows) if num_acc[i] < ks[i]]
                if partial:
                    self.snapshots.restore([ckpt[i] for i in partial], [rows[i].slot_id for i in partial])
                    # a row that accepted nothing re-feeds its one last token: a plain decode step
                    # (a fraction of a k + 1 wide extend, and exactly plain decoding's state)
                    none = [rows[i] for i in partial if num_acc[i] == 0]
                    again = [rerun_row(rows[i], drafts[i], num_acc[i]) for i in partial if num_acc[i] > 0]
                    if none:
                        self._decode_step(none, context)
                        self.num_plain_reruns += len(none)
                    if again:
                        rb = runner.cfg.decode_bucket(len(again))
                        rerun = self._graph(rb, context, True)  # the greedy verify graph writes the same state
                        if rerun is not None:
                            rerun(*runner._pack(again, rb, width, context))
                        else:
                            self.verify_fns[True].extend(*runner._pack(again, rb, width, context))
                    self.num_rollbacks += len(partial)
        finally:
            self.snapshots.release(ckpt)
        results = []
        for i, r in enumerate(rows):
            n = num_acc[i]
            emitted = token_ids[i][: n + 1]
            self.drafter.observe(r.request_id, r.start_pos, emitted, hidden[i, : n + 1])
            results.append(SpecOutput(token_ids=emitted, num_accepted=n, drafts=drafts[i]))
        return results
