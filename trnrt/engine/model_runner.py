"""ModelRunner: padded inputs from scheduled rows -> the step function per bucket -> sampled tokens.

Rows with one new token run in the decode graph (batch padded to a decode bucket, block tables cut
to the smallest decode context bucket that holds the longest row, the greedy-sampler graph when
every row is greedy); each prefill chunk runs in the prefill graph (one sequence, tokens padded to
a token bucket). Eager or compiled, the runner always pads to the EngineConfig's buckets, so a test
of the eager path is a test of the compiled shapes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import numpy as np
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
        self.compiled = compiled or {}
        self.num_graph_calls: dict[str, int] = {}

    # -- padding -----------------------------------------------------------------------------

    def _pack(self, rows: list[RowInput], batch: int, tokens: int, context: int = 0) -> tuple[torch.Tensor, ...]:
        # numpy arrays filled row by row, then shared with torch (zero copy): torch.tensor() on
        # Python lists costs ~0.1 ms a step for the block tables alone.
        mb = self.cfg.table_blocks(context)  # a row's blocks past the context bucket are never read
        n = len(rows)
        vocab = self.vocab_size
        ids = np.zeros((batch, tokens), np.int64)
        tables = np.zeros((batch, mb), np.int64)  # padding rows: block 0 (scratch)
        for i, r in enumerate(rows):
            ids[i, : len(r.token_ids)] = r.token_ids
            blocks = r.block_ids[:mb]
            tables[i, : len(blocks)] = blocks

        def col(values: list, pad, dtype) -> np.ndarray:
            return np.array(values + [pad] * (batch - n), dtype=dtype)

        num_new = [len(r.token_ids) for r in rows]
        start = [r.start_pos for r in rows]
        out = tuple(torch.from_numpy(a) for a in (
            ids,
            col(start, 0, np.int64),
            col(num_new, 0, np.int64),  # num_new 0 marks a padding row
            tables,
            col([r.slot_id for r in rows], 0, np.int64),  # padding rows use the scratch slot 0
            col([r.temperature for r in rows], 0.0, np.float32),  # padding rows: greedy
            col([r.top_p for r in rows], 1.0, np.float32),
            col([min(r.top_k, vocab) if r.top_k > 0 else vocab for r in rows], vocab, np.int64),
            col([r.min_p for r in rows], 0.0, np.float32),
            col([r.seed & ((1 << 63) - 1) for r in rows], 0, np.int64),  # any Python int maps into int64
            col([a + b for a, b in zip(start, num_new)], 0, np.int64),  # sample_pos
        ))
        if self.device.type != "cpu":
            out = tuple(t.to(self.device) for t in out)
        return out

    def _run(self, spec: GraphSpec, rows: list[RowInput]) -> list[RowResult]:
        inputs = self._pack(rows, spec.batch, spec.tokens, spec.context)
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

    def _sampling(self, rows: list[RowInput], context: int) -> str:
        """"greedy" when every row is greedy and the greedy graph exists (compiled artifacts
        always hold both, unless a caller compiled a subset); else "full" (same greedy tokens)."""
        if all(r.temperature <= 0.0 for r in rows):
            greedy = GraphSpec("decode", self.cfg.decode_bucket(len(rows)), 1, sampling="greedy", context=context)
            if not self.compiled or greedy in self.compiled:
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
            group = [rows[i] for i in idx]
            context = self.cfg.context_bucket(max(r.start_pos + 1 for r in group))
            spec = GraphSpec("decode", self.cfg.decode_bucket(len(idx)), 1, sampling=self._sampling(group, context),
                             context=context)
            for i, res in zip(idx, self._run(spec, [rows[i] for i in idx])):
                results[i] = res
        for i in prefill:
            spec = GraphSpec("prefill", 1, self.cfg.prefill_bucket(len(rows[i].token_ids)))
            results[i] = self._run(spec, [rows[i]])[0]
        return results  # type: ignore[return-value]
