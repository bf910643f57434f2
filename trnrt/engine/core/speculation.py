"""The engine's side of speculative decoding: which requests may speculate (`speculative_ok`, at
admission), dynamic speculation's verdict after each step (`_judge_speculation`), and its /v1/stats
section (`_dynamic_speculation_status`). The policy itself is trnrt.engine.spec.policy.

SpeculationMixin is one of the mixins of trnrt.engine.core.engine.Engine. Engine thread: reads
`scheduler_config`, `scheduler` (running, waiting), `runner` (`step_costs`, `last_spec`) and
`spec_policy`; moves requests to plain steps (`scheduler.stop_speculating`, `runner.release`) and
counts them in `num_spec_fallbacks`. `_dynamic_speculation_status` is read from the HTTP side:
plain values and copies.
"""

from __future__ import annotations

from trnrt.engine.request import GenerateRequest


class SpeculationMixin:
    """Engine's speculation decisions (speculative decoding on: scheduler_config.num_speculative_tokens)."""

    def speculative_ok(self, request: GenerateRequest) -> bool:
        """Whether a request's decode steps may be speculative: speculative decoding is on and
        nothing the verify cannot serve is asked: per-token logits processing (a grammar,
        penalties, a thinking budget), logprobs, prompt logprobs, or n > 1 prompt sharing. Those
        requests run plain steps beside the speculative ones (as SGLang's dynamic fallback)."""
        if not self.scheduler_config.num_speculative_tokens:
            return False
        sp = request.sampling_params
        if not (request.grammar_state is None and request.penalty_state is None and request.thinking_state is None
                and sp.logprobs is None and sp.prompt_logprobs is None and request.prefix_group is None):
            return False
        if self.spec_policy is None:
            return True
        # the break-even of the decode step it would join: the running and waiting requests (a
        # batch submitted at once waits together), it speculating
        live = [*self.scheduler.running, *self.scheduler.waiting]
        n_spec = sum(1 for s in live if s.speculative)
        costs = getattr(self.runner, "step_costs", None)
        line = costs.line(len(live) - n_spec, n_spec + 1) if costs is not None else None
        return self.spec_policy.admit(request.request_id, line)

    def _judge_speculation(self, scheduled, results) -> None:
        """Dynamic speculation (trnrt.engine.spec.policy): take this step's measured break-even
        (the runner's StepCosts), record the step's verifies, then move the requests whose drafts
        do not pay to plain steps; the drafter forgets them."""
        policy = self.spec_policy
        last = getattr(self.runner, "last_spec", None)
        if last is not None and last.line is not None:
            policy.break_even = last.line
        verified = [(s.request_id, r.num_accepted) for s, r in zip(scheduled, results)
                    if s.speculative and not s.is_prefill and getattr(r, "num_drafts", 0)]
        for rid, num_accepted in verified:
            policy.record(rid, num_accepted)
        for rid, _ in verified:  # judged on the whole step's evidence
            if policy.should_fall_back(rid) and self.scheduler.stop_speculating(rid):
                self.num_spec_fallbacks += 1
                policy.fell_back(rid)
                self.runner.release([rid])

    def _dynamic_speculation_status(self) -> dict:
        """The /v1/stats `speculative_dynamic` section of an engine (dynamic speculation on):
        where the line stands and what it did. Read from the HTTP side: plain values and copies."""
        policy = self.spec_policy
        costs = getattr(self.runner, "step_costs", None)
        by_batch = {} if costs is None else {
            str(b): {k: (None if v is None else round(v, 6)) for k, v in c.items()} for b, c in costs.snapshot().items()}
        return {
            "line": policy.line,
            "min_accept_length": policy.min_accept_length,
            "recent_accept_length": policy.recent_accept_length,
            "num_fallbacks": self.num_spec_fallbacks,
            "num_started_plain": policy.num_gated,
            "probe_every": policy.probe_interval,
            "by_batch_bucket": by_batch,
        }
