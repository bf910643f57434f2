"""SpecModelRunner: the ModelRunner with speculative decode steps for the requests the drafter follows.

The engine marks a request speculative (Scheduler.add_request(speculative=True)); every row of
such a request goes through this runner's speculative paths (the catalogue's `spec_prefill`,
`verify` and `draft` graphs, compiled where loaded, else eager), so the drafter sees every
position's hidden state:

* a prompt chunk runs `spec.prefill.prefill_chunk` (the runner's prefill with every hidden
  state kept) and the drafter observes its positions. The next token of a chunk's last position
  is the row's `next_token_id` (the next prompt token) or, for the chunk that ends the prompt,
  the sampled token. A chunk at position 0 starts the request over (a preempted request
  re-prefills): the drafter forgets what it had for it first;
* a decode row runs in `SpecDecoder.step` with its `num_lookahead` drafts (0: a plain step
  through the verify path) and returns every emitted token (`RowResult.extra_token_ids`).

Rows of other requests run exactly as in ModelRunner (its graphs, compiled when loaded). The
rollback checkpoints are `max_decode_batch` ids of the runner's checkpoint pool reserved past the
prefix cache's (`allocate_cache_tiers` adds them), so the two never share an id.
Counters for the stats: `num_verifies`, `num_draft_tokens`, `num_accepted_tokens` of the last
`execute` (`last_spec`), and per draft position (`accepted_per_position`).

`step_costs` (spec.policy.StepCosts) times every speculative call and every plain decode graph
call per decode batch bucket; each step with speculative rows gets its break-even tokens per
verify (`last_spec.line`) for dynamic speculation. Where a bucket that comparison needs has had
no plain decode call yet, the runner times one of padding rows (the scratch slot and page, as
every padded batch writes). A compiled runner's `warm_up` gives each bucket a first estimate
from its graphs' own times.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from trnrt.engine.cache.cache_manager import IdPool
from trnrt.engine.runner.model_runner import ModelRunner
from trnrt.engine.output.outputs import RowInput, RowResult
from trnrt.engine.spec.decoder import SpecDecoder
from trnrt.engine.spec.drafter import Drafter, MTPDrafter
from trnrt.engine.spec.policy import StepCosts
from trnrt.engine.spec.prefill import prefill_chunk
from trnrt.engine.runner.step import GraphSpec


class _OffsetPool:
    """`size` ids starting at `base`, with IdPool's allocate/free (the reserved checkpoint ids)."""

    def __init__(self, base: int, size: int, name: str = "speculative checkpoint"):
        self.base = base
        self._pool = IdPool(size, name)
        self.name = name

    @property
    def size(self) -> int:
        return self._pool.size + self.base  # SlotSnapshots checks the largest id fits the pool

    @property
    def num_free(self) -> int:
        return self._pool.num_free

    def allocate(self, n: int = 1):
        ids = self._pool.allocate(n)
        return None if ids is None else [self.base + i for i in ids]

    def free(self, ids) -> None:
        self._pool.free([i - self.base for i in ids])


@dataclass
class SpecStepStats:
    """What one `execute` verified: rows, drafts, accepted drafts, acceptances per position."""

    num_verifies: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    line: float | None = None  # this step's break-even tokens per verify (StepCosts.line)


class SpecModelRunner(ModelRunner):
    """ModelRunner + speculative decoding (see the module doc).

    num_steps: k, the most drafts a decode row verifies; drafter_factory(runner) -> Drafter
    (default: the model's MTP layer, `MTPDrafter`; tests pass the oracle drafter).
    """

    def __init__(self, model, state, engine_config, vocab_size: int, *, num_steps: int,
                 drafter_factory: Callable[["SpecModelRunner"], Drafter] | None = None, compiled=None):
        super().__init__(model, state, engine_config, vocab_size, compiled=compiled)
        self.num_steps = int(num_steps)
        self._reserve = engine_config.max_decode_batch
        self.drafter = (drafter_factory or MTPDrafter)(self)
        self.decoder: SpecDecoder | None = None
        self.last_spec = SpecStepStats(accepted_per_position=[0] * self.num_steps)
        self.step_costs = StepCosts(engine_config.decode_bucket, engine_config.max_decode_batch)
        self.allocate_cache_tiers(0, 0, 0)  # the reserve alone, until a prefix cache asks for more

    def allocate_cache_tiers(self, num_checkpoints: int, num_host_pages: int, num_host_checkpoints: int) -> None:
        super().allocate_cache_tiers(num_checkpoints + self._reserve, num_host_pages, num_host_checkpoints)
        self.decoder = SpecDecoder(self, self.drafter, self.num_steps, _OffsetPool(num_checkpoints, self._reserve))

    def release(self, request_ids) -> None:
        self.drafter.release(list(request_ids))

    def execute(self, rows: list[RowInput]) -> list[RowResult]:
        results: list[RowResult | None] = [None] * len(rows)
        plain = [i for i, r in enumerate(rows) if not r.speculative]
        if plain:
            for i, res in zip(plain, super().execute([rows[i] for i in plain])):
                results[i] = res
        stats = SpecStepStats(accepted_per_position=[0] * self.num_steps)
        for i, r in enumerate(rows):
            if r.speculative and not r.spec_decode:
                results[i] = self._prefill(r)
        decode = [i for i, r in enumerate(rows) if r.speculative and r.spec_decode]
        if decode:
            drows = [rows[i] for i in decode]
            t0 = time.perf_counter()
            outs = self.decoder.step(drows, [r.num_lookahead for r in drows])
            dt = time.perf_counter() - t0  # the outputs are host lists: the step has finished
            costs = self.step_costs
            groups = costs.buckets(len(drows))
            if len(groups) == 1:  # (more rows than the largest bucket: not timed)
                costs.observe_spec(groups[0], dt)
            n_plain = sum(1 for i in plain if len(rows[i].token_ids) == 1 and rows[i].prompt_next_ids is None)
            for b in costs.missing_plain(n_plain, n_plain + len(drows)):
                self._time_plain_step(b, max(r.start_pos + 1 for r in drows))
            stats.line = costs.line(n_plain, len(drows))
            for i, r, o in zip(decode, drows, outs):
                results[i] = RowResult(token_id=o.token_ids[0], extra_token_ids=list(o.token_ids[1:]),
                                       num_drafts=len(o.drafts), num_accepted=o.num_accepted)
                if o.drafts:
                    stats.num_verifies += 1
                    stats.num_draft_tokens += len(o.drafts)
                    stats.num_accepted_tokens += o.num_accepted
                    for j in range(o.num_accepted):
                        stats.accepted_per_position[j] += 1
        self.last_spec = stats
        return results  # type: ignore[return-value]

    def _run(self, spec: GraphSpec, rows: list[RowInput]):
        if spec.phase != "decode" or spec.variant != "base":  # a variant's masks cost more: not a plain step
            return super()._run(spec, rows)
        t0 = time.perf_counter()
        out = super()._run(spec, rows)
        self.step_costs.observe_plain(spec.batch, time.perf_counter() - t0)
        return out

    def warm_up(self) -> dict[GraphSpec, float]:
        """ModelRunner.warm_up, then the first estimate of each decode bucket's costs (dynamic
        speculation's line before any request has run), at the smallest context, where the
        bucket has all three graphs: a plain call is its greedy decode graph; a speculative call
        is one that accepts nothing, the case dynamic speculation must not lose on: its draft
        and greedy verify graphs and the plain decode step that re-runs its rows. Where that is
        k + 1 plain calls or more (a 2-core CPU), no acceptance could pay and new requests start
        plain but for probes; where a verify costs about a decode step (GPU, Trainium) requests
        speculate from the first. Measured calls then move the estimate (StepCosts)."""
        times = super().warm_up()
        k1, ctx = self.num_steps + 1, self.cfg.context_bucket(1)
        for b in self.cfg.decode_batch_buckets:
            specs = [self.greedy_decode_spec(b, ctx), GraphSpec("verify", b, k1, "base", "greedy", ctx),
                     GraphSpec("draft", b, k1, "base", "greedy", ctx)]
            if all(s in self.compiled for s in specs):  # the least of 5 calls each: one call is noisy
                plain, verify, draft = (self.time_graph(s, self.compiled[s], calls=5) for s in specs)
                self.step_costs.seed(b, spec_s=draft + verify + plain, plain_s=plain)
        return times

    def _time_plain_step(self, bucket: int, length: int) -> None:
        """One plain decode step of `bucket` padding rows at the context of `length` tokens,
        timed on its second call (the first may load the graph); no sequence's state moves."""
        spec = self.greedy_decode_spec(bucket, self.cfg.context_bucket(length))
        super()._run(spec, [])
        self._run(spec, [])

    def _prefill(self, r: RowInput) -> RowResult:
        if r.start_pos == 0:
            self.drafter.release([r.request_id])  # a (re-)prefill from an empty state
        tok, hidden = prefill_chunk(self, r)
        after = tok if r.do_sample else r.next_token_id
        if after is None:
            raise ValueError(f"{r.request_id}: a partial prompt chunk without its next token")
        self.drafter.observe(r.request_id, r.start_pos, [*r.token_ids[1:], after], hidden)
        return RowResult(token_id=tok)

