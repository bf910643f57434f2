"""Drafters: who proposes the k draft tokens of a speculative decode step.

A drafter sees the decode rows of a step (`RowInput`: token_ids = [the row's last token, the one
not in the cache yet], start_pos = the tokens already in the cache, block table, slot) and
returns k draft ids per row. Drafts are deterministic here (a one-hot q for the rejection rule):
the MTP drafter takes the argmax of each MTP step, whatever the row's temperature, which keeps the
output distribution exact for sampled rows (trnrt.engine.spec.rejection) at the cost of a lower
acceptance rate than drafting from q.

`observe` hands the drafter what the target computed: the final hidden states of positions
start_pos .. start_pos + n - 1 and the token that follows each one. The MTP drafter needs both
(its row p reads the target's h_p and the token at p + 1); others ignore them.
"""

from __future__ import annotations

from typing import Sequence

import torch

from trnrt.engine.output.outputs import RowInput


class Drafter:
    """The interface (and a no-op base): `propose` is required, the rest optional."""

    #: The drafter's distributions [B, k, V] of its last proposal, or None (deterministic drafts).
    draft_probs: torch.Tensor | None = None

    def propose(self, rows: Sequence[RowInput], k: int) -> torch.Tensor:
        """k draft tokens for each decode row -> [len(rows), k] int64 (CPU)."""
        raise NotImplementedError

    def observe(self, request_id: str, start_pos: int, next_ids: Sequence[int], hidden: torch.Tensor) -> None:
        """The target computed positions start_pos .. start_pos + n - 1: hidden [n, D] (final
        hidden state after the final norm), next_ids[i] = the token at start_pos + i + 1."""

    def release(self, request_ids: Sequence[str]) -> None:
        """These requests are finished: drop what the drafter keeps for them."""

    def num_requests(self) -> int | None:
        """How many requests the drafter keeps state for (None: it does not say)."""
        return None


class MTPDrafter(Drafter):
    """k steps of the model's MTP layer (`model.forward_mtp`, spec §6) over `state.mtp`.

    Per request it keeps the MTP's computed length M (positions 0..M-1 of the MTP cache hold
    target hidden states and real tokens) and the observed positions not yet fed to it. `propose`
    runs the draft step (trnrt.engine.spec.draft_step, the catalogue's `draft` graph: compiled when
    the runner loaded it, else the same module eagerly):

    1. catch-up: one MTP extend over each row's pending positions M .. L-1 (L = start_pos, the
       target's computed length: row L-1 reads the row's last token and h_{L-1}); its last row's
       argmax is draft 1, its h_next the next step's h_prev. The MTP cache now holds 0..L-1;
    2. k - 1 MTP decode steps at positions L .. L+k-2, fed the previous draft and the previous
       h_next (the MTP's own post-norm output, as vLLM / SGLang recycle it);
    3. the MTP's indexer tail (its only per-slot state) is put back as it was after step 1: the
       draft positions L.. are not verified yet. Their latent / pooled-key pages are positional
       and are rewritten by the next catch-up (which starts at L) before anything reads them.

    The step takes at most k + 1 pending positions a row (what a verify leaves); after a prompt
    more are pending, and an eager MTP extend over all but the last k + 1 runs first.
    So after every propose the MTP cache is consistent with the accepted tokens up to L-1. The
    layer runs its own indexer at every step (`index_share_for_mtp_iteration`, reusing step 0's
    top-k on later steps, is not implemented: it changes draft quality, not correctness).
    Padding: rows padded to the runner's decode bucket (slot 0, block 0), block tables cut to the
    decode context bucket that holds L + k + 1 tokens.
    """

    def __init__(self, runner):
        st = runner.state
        if runner.model.mtp is None or st.mtp is None:
            raise ValueError("MTPDrafter needs a model with its MTP layer and state allocated with mtp=True")
        self.runner = runner
        self._computed: dict[str, int] = {}  # request -> MTP computed length M
        self._pending: dict[str, tuple[list[int], list[torch.Tensor]]] = {}  # next ids, hidden rows
        self._eager: dict[int, torch.nn.Module] = {}  # k -> DraftFunction (no compiled graph of the shape)
        self.num_graph_drafts = 0  # proposals that ran a compiled draft graph

    def observe(self, request_id: str, start_pos: int, next_ids: Sequence[int], hidden: torch.Tensor) -> None:
        ids, hid = self._pending.setdefault(request_id, ([], []))
        m = self._computed.setdefault(request_id, start_pos)
        if start_pos != m + len(ids):
            raise ValueError(f"{request_id}: observed position {start_pos}, the MTP expects {m + len(ids)}")
        if hidden.shape[0] != len(next_ids):
            raise ValueError(f"{request_id}: {hidden.shape[0]} hidden rows for {len(next_ids)} tokens")
        ids.extend(int(t) for t in next_ids)
        hid.append(hidden.detach())

    def release(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._computed.pop(rid, None)
            self._pending.pop(rid, None)

    def num_requests(self) -> int:
        return len(self._computed.keys() | self._pending.keys())

    # -- the draft loop ---------------------------------------------------------------------

    def _batch(self, rows, ids, start, num, tokens: int, k: int):
        """ForwardBatch of len(rows) rows padded to the decode bucket (padding: slot 0, block 0)."""
        from trnrt.models.glm5_next.batch import ForwardBatch

        cfg, dev = self.runner.cfg, self.runner.device
        B = cfg.decode_bucket(len(rows))
        mb = cfg.table_blocks(cfg.context_bucket(max(r.start_pos + k + 1 for r in rows)))
        input_ids = torch.zeros(B, tokens, dtype=torch.long)
        tables = torch.zeros(B, mb, dtype=torch.long)
        start_pos, num_new, slots = (torch.zeros(B, dtype=torch.long) for _ in range(3))
        for i, r in enumerate(rows):
            input_ids[i, : len(ids[i])] = torch.tensor(ids[i], dtype=torch.long)
            blocks = r.block_ids[:mb]
            tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
            start_pos[i], num_new[i], slots[i] = start[i], num[i], r.slot_id
        return ForwardBatch(input_ids.to(dev), start_pos.to(dev), num_new.to(dev), tables.to(dev), slots.to(dev))

    def propose(self, rows: Sequence[RowInput], k: int) -> torch.Tensor:
        model, state = self.runner.model, self.runner.state
        n = len(rows)
        starts, ids, hids = [], [], []
        for r in rows:
            rid = r.request_id
            if rid not in self._pending:
                raise ValueError(f"{rid}: the MTP drafter has observed nothing for this request")
            p_ids, p_hid = self._pending[rid]
            m = self._computed[rid]
            if m + len(p_ids) != r.start_pos or not p_ids or p_ids[-1] != r.token_ids[0]:
                raise ValueError(f"{rid}: MTP at {m} + {len(p_ids)} pending, the row is at {r.start_pos} "
                                 f"with last token {r.token_ids[0]}")
            starts.append(m)
            ids.append(p_ids)
            hids.append(torch.cat(p_hid, 0))
        with torch.inference_mode():
            # 0. more than k + 1 positions pending (after a prompt): an eager MTP extend over all
            #    but the last k + 1, so the rest fits the draft graph's shape
            over = [i for i in range(n) if len(ids[i]) > k + 1]
            if over:
                cut = [len(ids[i]) - (k + 1) for i in over]
                S = max(cut)
                batch = self._batch([rows[i] for i in over], [ids[i][:c] for i, c in zip(over, cut)],
                                    [starts[i] for i in over], cut, S, k)
                prev = self._hidden([hids[i][:c] for i, c in zip(over, cut)], batch.input_ids.shape[0], S)
                model.forward_mtp(batch, prev, state)
                for i, c in zip(over, cut):
                    starts[i] += c
                    ids[i], hids[i] = ids[i][c:], hids[i][c:]
            # 1.-3. the draft step (spec.draft_step): catch-up extend, k - 1 MTP decode steps, the
            #    MTP's tail put back; the compiled `draft` graph of this shape when the runner has it
            batch = self._batch(rows, ids, starts, [len(x) for x in ids], k + 1, k)
            prev = self._hidden(hids, batch.input_ids.shape[0], k + 1)
            context = self.runner.cfg.context_bucket(max(r.start_pos + k + 1 for r in rows))  # as _batch's table
            fn = self._draft_fn(batch.input_ids.shape[0], k, context)
            (drafts,) = fn(batch.input_ids, batch.start_pos, batch.num_new, batch.block_tables, batch.slot_ids, prev)
        for r in rows:
            self._computed[r.request_id] = r.start_pos
            self._pending[r.request_id] = ([], [])
        return drafts[:n].cpu()  # [n, k]

    def _hidden(self, hids: list[torch.Tensor], batch: int, tokens: int) -> torch.Tensor:
        """The rows' hidden states padded to [batch, tokens, D]."""
        D = self.runner.model.config.hidden_size
        prev = torch.zeros(batch, tokens, D, dtype=hids[0].dtype, device=self.runner.device)
        for i, h in enumerate(hids):
            prev[i, : h.shape[0]] = h
        return prev

    def _draft_fn(self, batch: int, k: int, context: int):
        """The compiled draft graph of this shape, else the same step eagerly (one per k)."""
        from trnrt.engine.spec.draft_step import DraftFunction, DraftModel
        from trnrt.engine.runner.step import GraphSpec

        compiled = (getattr(self.runner, "compiled", None) or {}).get(
            GraphSpec("draft", batch, k + 1, "base", "greedy", context))
        if compiled is not None:
            self.num_graph_drafts += 1
            return compiled
        if k not in self._eager:
            self._eager[k] = DraftFunction(DraftModel(self.runner.model), self.runner.state.mtp, k)
        return self._eager[k]
