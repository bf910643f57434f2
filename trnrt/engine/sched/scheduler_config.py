"""SchedulerConfig: the host-only scheduling limits and policies, checked when built."""

from __future__ import annotations

from dataclasses import dataclass

from trnrt.engine.sched.schedule_policy import canonical_policy


@dataclass(frozen=True)
class SchedulerConfig:
    """Host-only scheduling settings (no graph depends on them; not part of EngineConfig).

    max_num_seqs: most sequences RUNNING at once (holding pages and a slot).
    max_num_batched_tokens: token budget of one step, decodes and prefill chunks together.
    max_model_len: context length; prompt + output never exceed it.
    chunked_prefill: split prompts over steps; when False a prompt is admitted only whole.
    decode_first: running decodes take the budget before in-progress prefill chunks (ITL over TTFT).
    max_prefill_chunk_tokens: cap on one prefill chunk (e.g. the runner's largest prefill bucket).

    Policies (SGLang 0.5.23's flags and semantics, ../docs/CONFIGURATION.md):
    schedule_policy: fcfs | lpm | dfs-weight | lof | random | shortest-prefill-first (alias spf,
        stored as its canonical name). lpm and dfs-weight fall back to fcfs without the prefix
        cache, lpm also over 128 waiting requests; shortest-prefill-first without the cache
        orders by prompt length.
    enable_priority_scheduling: order and preempt by GenerateRequest.priority (fcfs or lof only).
    schedule_low_priority_values_first: smaller priority values are preferred (default: larger).
    priority_preemption_threshold: a waiting request preempts a running one only when better by
        more than this; disable_priority_preemption turns preemption by priority off.
    default_priority_value: the priority of a request without one (None: the least preferred).
    abort_on_priority_when_disabled: a request carrying a priority is refused (503) when priority
        scheduling is off (default: the field is ignored).
    max_queued_requests: most requests waiting at once (None: unlimited); past it, 503
        "The request queue is full." (or, with priority scheduling, the worst waiting one is
        displaced by a better arrival).
    max_queued_tokens: most tokens waiting at once, summed over the waiting requests' prompts
        (None: unlimited; trnrt's, SGLang has no such limit). Refused and displaced as for
        max_queued_requests; a request arriving at an empty waiting queue is always queued.
    random_seed: seed of the `random` policy's shuffles (tests).
    num_speculative_tokens: drafts a speculative request's decode step verifies (k; 0: off). Its
        block table covers the k look-ahead positions and the step's token budget counts them;
        fewer near max_new_tokens / max_model_len or when the budget is short.
    """

    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    max_model_len: int = 1024
    chunked_prefill: bool = True
    decode_first: bool = True
    max_prefill_chunk_tokens: int | None = None
    schedule_policy: str = "fcfs"
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    priority_preemption_threshold: int = 10
    disable_priority_preemption: bool = False
    default_priority_value: int | None = None
    abort_on_priority_when_disabled: bool = False
    max_queued_requests: int | None = None
    max_queued_tokens: int | None = None
    random_seed: int | None = None
    num_speculative_tokens: int = 0

    def __post_init__(self) -> None:
        # one name per policy from here on (what the scheduler compares and server_info reports)
        object.__setattr__(self, "schedule_policy", canonical_policy(self.schedule_policy))
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        c = self.max_prefill_chunk_tokens
        if c is not None and (not isinstance(c, int) or isinstance(c, bool) or c <= 0):
            raise ValueError(f"max_prefill_chunk_tokens must be a positive integer or None, got {c!r}")
        if not self.chunked_prefill and self.max_prefill_tokens < self.max_model_len:
            # A resumed sequence re-prefills up to max_model_len - 1 tokens in one go.
            raise ValueError(
                "with chunked_prefill=False, max_num_batched_tokens (and max_prefill_chunk_tokens) "
                f"must be >= max_model_len ({self.max_model_len}), got {self.max_prefill_tokens}"
            )

    @property
    def max_prefill_tokens(self) -> int:
        """Most tokens one prefill chunk may hold."""
        if self.max_prefill_chunk_tokens is None:
            return self.max_num_batched_tokens
        return min(self.max_num_batched_tokens, self.max_prefill_chunk_tokens)
