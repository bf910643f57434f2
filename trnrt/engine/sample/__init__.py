"""Choosing tokens: the in-graph sampler, logits processors (grammar masks, penalties), the
grammar service, thinking budgets and prompt-logprob collection."""
