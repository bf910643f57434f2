"""Thinking budgets: after N reasoning tokens the engine emits `</think>`. Pure Python, host-only.

vLLM's `thinking_token_budget`, SGLang's `max_thinking_tokens` and the Messages API's
`thinking.budget_tokens` all become `SamplingParams.max_thinking_tokens`. A reasoning token is
an output token inside a think block: the block a prompt leaves open (a chat template that ends
the generation prompt with `<think>`, as GLM's does) or one the output opens with `<think>`.
The budget counts every reasoning token of the request (all blocks together). When it is spent
and the model is still reasoning, the engine replaces the token the step sampled with
`</think>` (the ids are read from the tokenizer, never hard-coded): no graph, no mask, so it
works with every flag off. The forced token is reported with logprob 0.0 and itself as the only
top entry (the distribution it came from is a point mass), consistent with logprobs being
reported after the logits processors.
"""

from __future__ import annotations


class ThinkingBudget:
    """One request's reasoning-token count (engine thread)."""

    __slots__ = ("budget", "start_id", "end_id", "reasoning", "count")

    def __init__(self, budget: int, start_id: int | None, end_id: int, prompt_token_ids=()):
        self.budget = budget
        self.start_id = start_id
        self.end_id = end_id
        # the prompt leaves a think block open when its last think marker is the opening one
        self.reasoning = False
        for t in reversed(prompt_token_ids):
            if t == end_id:
                break
            if t == start_id:
                self.reasoning = True
                break
        self.count = 0

    def forced_token(self) -> int | None:
        """`</think>` when the next token must close the think block, else None."""
        return self.end_id if self.reasoning and self.count >= self.budget else None

    def advance(self, token_ids) -> None:
        """Account the tokens the request just produced."""
        for t in token_ids:
            if self.reasoning:
                if t == self.end_id:
                    self.reasoning = False
                else:
                    self.count += 1
            elif t == self.start_id:
                self.reasoning = True
