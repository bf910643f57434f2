"""Sequence: the engine-internal state of one request (tokens, progress, cache resources). Pure Python.

Life cycle (owned by the Scheduler, on the engine thread only):

    WAITING --schedule--> RUNNING --update_from_output--> FINISHED
       ^                    |
       +---- PREEMPTED <----+   (out of pages: blocks and slot freed, num_computed_tokens = 0)

Token accounting follows vLLM v1: `all_token_ids = prompt + output`, and the runner has computed
state for the first `num_computed_tokens` of them. A step feeds `all_token_ids[num_computed_tokens:]`
(or a chunk of it); when the chunk reaches the end, a token is sampled and appended. So a decode is
just a one-token chunk, and a preempted sequence resumes by re-prefilling prompt + output.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from trnrt.engine.output.outputs import TokenLogprob
from trnrt.engine.request import FinishReason, SamplingParams

# Arrival order, process-wide: "most recently arrived" (the preemption victim) compares these,
# never wall-clock times, which can tie.
_arrival_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, never run (or run and fully released: see PREEMPTED)
    RUNNING = "running"  # holds blocks and a slot; scheduled every step the budget allows
    PREEMPTED = "preempted"  # back in the waiting queue, holds nothing, will re-prefill
    FINISHED = "finished"  # done; holds nothing; finish_reason is set


@dataclass(eq=False)
class Sequence:
    """One request inside the engine.

    NOTE: `block_ids` and `slot_id` are written only by the CacheManager; `status`,
    `num_computed_tokens` and the queues only by the Scheduler.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time_s: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    # One entry per output token when logprobs were requested, else stays empty.
    output_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    slot_id: int | None = None
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    first_scheduled_time_s: float | None = None
    first_token_time_s: float | None = None
    finished_time_s: float | None = None
    arrival_index: int = field(default_factory=lambda: next(_arrival_counter))
    priority: int | None = None  # GenerateRequest.priority
    # Prefix cache: prompt tokens served from the cache at the first admission (reported as
    # cached_tokens), split by tier; and the radix node this sequence holds a lock on.
    num_cached_tokens: int = 0
    num_cached_tokens_host: int = 0
    cache_node: object | None = None
    # n > 1: the prefix_group this sequence forks with (None once forked or released), and the
    # checkpoint id its slot is restored from when it is admitted as a fork
    cache_namespace: str | None = None  # GenerateRequest.cache_salt: the prefix cache's namespace
    fork_group: str | None = None
    fork_source: int | None = None
    # Speculative decoding: the drafter follows this request (Scheduler.add_request(speculative=))
    speculative: bool = False

    # -- sizes -------------------------------------------------------------------------------

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens known so far (the last output token is not yet computed)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to feed before the next token can be sampled (1 for a decode)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    # -- state -------------------------------------------------------------------------------

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_prefill(self) -> bool:
        """True while (re-)prefilling: state is empty, or more than one token is uncomputed."""
        return self.num_computed_tokens == 0 or self.num_uncomputed_tokens > 1

    def append_token(self, token_id: int, logprob: TokenLogprob | None = None) -> None:
        self.output_token_ids.append(token_id)
        if logprob is not None or self.output_logprobs:
            # Keep the list aligned with output_token_ids once any logprob was recorded.
            self.output_logprobs.extend([None] * (len(self.output_token_ids) - 1 - len(self.output_logprobs)))
            self.output_logprobs.append(logprob)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={self.block_ids}, slot={self.slot_id})"
        )
