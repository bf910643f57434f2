"""ModelRunner: padded inputs from scheduled rows -> the step function per bucket -> sampled tokens.

Rows with one new token run in the decode graph (batch padded to a decode bucket); each prefill
chunk runs in the prefill graph (one sequence, tokens padded to a token bucket). Eager or
compiled, the runner always pads to the EngineConfig's buckets, so a test of the eager path is a
test of the compiled shapes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from trnrt.config import EngineConfig
from trnrt.engine.outputs import TokenLogprob
from trnrt.engine.step import SAMPLERS, GraphSpec, StepFunction

log = logging.getLogger(__name__)


@dataclass
class RowInput:
    """One sequence's work for this step."""

    token_ids: list[int]  # the new tokens fed this step
    start_pos: int  # num_computed_tokens before this step
    block_ids: list[int]  # the sequence's block table
    slot_id: int
    temperature: float
    top_p: float
    top_k: int  # -1 / 0 = disabled
    min_p: float
    seed: int
    num_logprobs: int | None  # None: no logprobs


@dataclass
class RowResult:
    token_id: int
    logprob: TokenLogprob | None


class ModelRunner:
    """Owns the model, its state tensors and the per-bucket step callables."""

    def __init__(self, model: torch.nn.Module, state, engine_config: EngineConfig, vocab_size: int,
                 compiled: dict[GraphSpec, Callable] | None = None):
        self.model = model
        self.state = state
        self.cfg = engine_config
        self.vocab_size = vocab_size
        self.device = next(model.parameters()).device
        self.step_fns = {sampling: StepFunction(model, state, engine_config.max_top_logprobs, sampling)
                         for sampling in SAMPLERS}
        self.step_fn = self.step_fns["full"]
        self.compiled = compiled or {}
        self.num_graph_calls: dict[str, int] = {}

    # -- padding -----------------------------------------------------------------------------

    def _pack(self, rows: list[RowInput], batch: int, tokens: int) -> tuple[torch.Tensor, ...]:
        # Plain lists, one torch.tensor per input: per-element tensor writes cost ~100 ops a step.
        mb = self.cfg.max_blocks_per_seq
        pad = batch - len(rows)
        ids = [r.token_ids + [0] * (tokens - len(r.token_ids)) for r in rows] + [[0] * tokens] * pad
        tables = [r.block_ids + [0] * (mb - len(r.block_ids)) for r in rows] + [[0] * mb] * pad
        vocab = self.vocab_size
        cols = (
            [r.start_pos for r in rows],
            [len(r.token_ids) for r in rows],
            [r.slot_id for r in rows],
            [r.temperature for r in rows],
            [r.top_p for r in rows],
            [min(r.top_k, vocab) if r.top_k > 0 else vocab for r in rows],
            [r.min_p for r in rows],
            [r.seed & ((1 << 63) - 1) for r in rows],  # any Python int maps into int64
            [r.start_pos + len(r.token_ids) for r in rows],
        )
        pads = (0, 0, 0, 0.0, 1.0, vocab, 0.0, 0, 0)  # padding rows: greedy, slot 0, no tokens
        dtypes = (torch.int64,) * 3 + (torch.float32, torch.float32, torch.int64, torch.float32, torch.int64, torch.int64)
        start, num_new, slots, temp, top_p, top_k, min_p, seeds, sample_pos = (
            torch.tensor(c + [p] * pad, dtype=dt) for c, p, dt in zip(cols, pads, dtypes))
        out = (torch.tensor(ids, dtype=torch.int64), start, num_new, torch.tensor(tables, dtype=torch.int64), slots,
               temp, top_p, top_k, min_p, seeds, sample_pos)
        if self.device.type != "cpu":
            out = tuple(t.to(self.device) for t in out)
        return out

    def _run(self, spec: GraphSpec, rows: list[RowInput]) -> list[RowResult]:
        inputs = self._pack(rows, spec.batch, spec.tokens)
        fn = self.compiled.get(spec) or self.step_fns[spec.sampling]
        self.num_graph_calls[spec.graph_id] = self.num_graph_calls.get(spec.graph_id, 0) + 1
        with torch.inference_mode():
            token_ids, token_lp, top_ids, top_lp = fn(*inputs)
        ids = token_ids.tolist()
        want = [r.num_logprobs is not None for r in rows]
        if any(want):
            lps, tids, tlps = token_lp.tolist(), top_ids.tolist(), top_lp.tolist()
        results = []
        for i, r in enumerate(rows):
            lp = None
            if want[i]:
                k = r.num_logprobs
                lp = TokenLogprob(token_id=ids[i], logprob=lps[i], top=list(zip(tids[i][:k], tlps[i][:k])))
            results.append(RowResult(token_id=ids[i], logprob=lp))
        return results

    def _sampling(self, rows: list[RowInput]) -> str:
        """"greedy" when every row is greedy and the greedy graph exists (compiled artifacts
        always hold both, unless a caller compiled a subset); else "full" (same greedy tokens)."""
        if all(r.temperature <= 0.0 for r in rows):
            if not self.compiled or GraphSpec("decode", self.cfg.decode_bucket(len(rows)), 1, sampling="greedy") in self.compiled:
                return "greedy"
        return "full"

    # -- public ------------------------------------------------------------------------------

    def execute(self, rows: list[RowInput]) -> list[RowResult]:
        """Run one scheduler step. Returns one result per row, in order (partial prefill chunks
        get a result too; the caller ignores it)."""
        results: list[RowResult | None] = [None] * len(rows)
        decode = [i for i, r in enumerate(rows) if len(r.token_ids) == 1]
        prefill = [i for i, r in enumerate(rows) if len(r.token_ids) > 1]
        maxb = self.cfg.max_decode_batch
        for k in range(0, len(decode), maxb):
            idx = decode[k : k + maxb]
            spec = GraphSpec("decode", self.cfg.decode_bucket(len(idx)), 1, sampling=self._sampling([rows[i] for i in idx]))
            for i, res in zip(idx, self._run(spec, [rows[i] for i in idx])):
                results[i] = res
        for i in prefill:
            spec = GraphSpec("prefill", 1, self.cfg.prefill_bucket(len(rows[i].token_ids)))
            results[i] = self._run(spec, [rows[i]])[0]
        return results  # type: ignore[return-value]
