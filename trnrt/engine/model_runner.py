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
from trnrt.engine.step import GraphSpec, StepFunction

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
        self.step_fn = StepFunction(model, state, engine_config.max_top_logprobs)
        self.compiled = compiled or {}
        self.num_graph_calls: dict[str, int] = {}

    # -- padding -----------------------------------------------------------------------------

    def _pack(self, rows: list[RowInput], batch: int, tokens: int) -> tuple[torch.Tensor, ...]:
        mb = self.cfg.max_blocks_per_seq
        ids = torch.zeros((batch, tokens), dtype=torch.int64)
        start = torch.zeros((batch,), dtype=torch.int64)
        num_new = torch.zeros((batch,), dtype=torch.int64)
        tables = torch.zeros((batch, mb), dtype=torch.int64)
        slots = torch.zeros((batch,), dtype=torch.int64)
        temp = torch.zeros((batch,), dtype=torch.float32)
        top_p = torch.ones((batch,), dtype=torch.float32)
        top_k = torch.full((batch,), self.vocab_size, dtype=torch.int64)
        min_p = torch.zeros((batch,), dtype=torch.float32)
        seeds = torch.zeros((batch,), dtype=torch.int64)
        sample_pos = torch.zeros((batch,), dtype=torch.int64)
        for i, r in enumerate(rows):
            n = len(r.token_ids)
            ids[i, :n] = torch.tensor(r.token_ids, dtype=torch.int64)
            start[i] = r.start_pos
            num_new[i] = n
            tables[i, : len(r.block_ids)] = torch.tensor(r.block_ids, dtype=torch.int64)
            slots[i] = r.slot_id
            temp[i] = r.temperature
            top_p[i] = r.top_p
            top_k[i] = min(r.top_k, self.vocab_size) if r.top_k > 0 else self.vocab_size
            min_p[i] = r.min_p
            seeds[i] = r.seed & ((1 << 63) - 1)  # any Python int maps into int64
            sample_pos[i] = r.start_pos + n
        return tuple(t.to(self.device) for t in (ids, start, num_new, tables, slots, temp, top_p, top_k, min_p, seeds, sample_pos))

    def _run(self, spec: GraphSpec, rows: list[RowInput]) -> list[RowResult]:
        inputs = self._pack(rows, spec.batch, spec.tokens)
        fn = self.compiled.get(spec, self.step_fn)
        self.num_graph_calls[spec.graph_id] = self.num_graph_calls.get(spec.graph_id, 0) + 1
        with torch.inference_mode():
            token_ids, token_lp, top_ids, top_lp = fn(*inputs)
        token_ids, token_lp, top_ids, top_lp = (t.cpu() for t in (token_ids, token_lp, top_ids, top_lp))
        results = []
        for i, r in enumerate(rows):
            lp = None
            if r.num_logprobs is not None:
                k = r.num_logprobs
                top = list(zip(top_ids[i, :k].tolist(), top_lp[i, :k].tolist()))
                lp = TokenLogprob(token_id=int(token_ids[i]), logprob=float(token_lp[i]), top=top)
            results.append(RowResult(token_id=int(token_ids[i]), logprob=lp))
        return results

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
            spec = GraphSpec("decode", self.cfg.decode_bucket(len(idx)), 1)
            for i, res in zip(idx, self._run(spec, [rows[i] for i in idx])):
                results[i] = res
        for i in prefill:
            spec = GraphSpec("prefill", 1, self.cfg.prefill_bucket(len(rows[i].token_ids)))
            results[i] = self._run(spec, [rows[i]])[0]
        return results  # type: ignore[return-value]
