"""Host side of prompt logprobs: which positions a prompt chunk must score, and the results. Pure Python.

A request with `SamplingParams.prompt_logprobs` set gets one `PromptLogprobCollector` on the
engine thread. For every prompt chunk the scheduler runs, `next_ids(start_pos, n)` says what the
chunk's rows predict (position q predicts the prompt token at q + 1: the prompt shifted by one,
and at the chunk's last position the first token of the next chunk, so a chunked prompt gets
every position with no branch in the graph) or None when the chunk holds no wanted position;
`record` keeps the runner's results by position. Recording is idempotent: a request preempted
before its first output re-prefills and records the same positions again. `entries()` is what
the first RequestOutput carries: positions `start` .. P-1 (position 0 has no logprob: None).

Memory is bounded by the prompt: one TokenLogprob of at most N + 1 pairs per position.
"""

from __future__ import annotations

import logging

from trnrt.engine.output.outputs import TokenLogprob

log = logging.getLogger(__name__)

PROMPT_LOGPROBS = "prompt_logprobs"  # the feature flag: its own prefill graphs (trnrt.engine.runner.prompt_logprobs)


class PromptLogprobCollector:
    def __init__(self, prompt_token_ids: list[int], num_top: int, start: int = 0):
        self.prompt = list(prompt_token_ids)
        self.num_top = num_top
        self.start = min(max(0, start), len(self.prompt))
        # position p (1 <= p < P) -> the logprob of prompt[p] given prompt[:p]
        self._got: dict[int, TokenLogprob] = {}
        self.delivered = False

    @property
    def first_scored(self) -> int:
        """The first position with a logprob to report (position 0 never has one)."""
        return max(self.start, 1)

    def next_ids(self, start_pos: int, n: int) -> list[int] | None:
        """The id each of the chunk's n positions predicts (0 where nothing is wanted), or None
        when no position of start_pos .. start_pos+n-1 predicts a wanted prompt token."""
        lo, hi = self.first_scored, len(self.prompt)  # wanted predicted positions p in [lo, hi)
        if self.delivered or start_pos + n < lo or start_pos + 1 >= hi:
            return None
        p = self.prompt
        return [p[q + 1] if lo <= q + 1 < hi else 0 for q in range(start_pos, start_pos + n)]

    def record(self, start_pos: int, results: list[TokenLogprob]) -> None:
        """The runner's per-position results of a chunk fed at start_pos (row i: position start_pos + i)."""
        lo, hi = self.first_scored, len(self.prompt)
        for i, r in enumerate(results):
            p = start_pos + i + 1
            if lo <= p < hi:
                self._got[p] = TokenLogprob(token_id=self.prompt[p], logprob=float(r.logprob),
                                            top=[(int(t), float(v)) for t, v in r.top[: self.num_top]], rank=r.rank)

    @property
    def complete(self) -> bool:
        return len(self._got) == len(self.prompt) - self.first_scored

    def entries(self) -> list[TokenLogprob | None]:
        """One entry per position start .. P-1: None for position 0, and (never expected: the
        scheduler feeds every position of such a request, the prefix cache bypassed) for a
        position no chunk scored, which is logged."""
        missing = [p for p in range(self.first_scored, len(self.prompt)) if p not in self._got]
        if missing:
            log.error("prompt logprobs missing for %d position(s), e.g. %s", len(missing), missing[:5])
        out: list[TokenLogprob | None] = [None] if self.start == 0 and self.prompt else []
        out += [self._got.get(p) for p in range(self.first_scored, len(self.prompt))]
        return out
