"""Scheduler: continuous batching with chunked prefill and preemption by recompute. Pure Python.

Contract (vLLM v1 vocabulary), called on the engine thread only:

    seq = scheduler.add_request(GenerateRequest)       # raises InvalidRequestError
    sched_out = scheduler.schedule()                    # -> SchedulerOutput
    runner_out = model_runner(sched_out)                # -> RunnerOutput (fabricated in tests)
    updates = scheduler.update_from_output(sched_out, runner_out)   # -> list[SequenceUpdate]
    scheduler.finish_request(rid, reason) / scheduler.abort(rid)    # stop strings, client aborts

Each step gets `max_num_batched_tokens` tokens of budget. Running sequences go first (decodes,
then in-progress prefill chunks, or the reverse with decode_first=False), then waiting sequences
are admitted FCFS while the budget, `max_num_seqs`, pages and slots allow. A prompt longer than the
remaining budget is split into chunks; only the chunk that reaches the end samples a token.

When a running sequence needs a page and none is free, the most recently arrived running sequence
is preempted: its pages and slot are freed, num_computed_tokens is reset to 0 and it goes to the
front of the waiting queue. On resume it re-prefills prompt + generated tokens and samples the
next token, so its output is what it would have been (greedy; seeded sampling keyed by position).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

from trnrt.engine.cache_manager import CacheManager
from trnrt.engine.outputs import RunnerOutput, ScheduledSequence, SchedulerOutput, TokenLogprob
from trnrt.engine.request import FinishReason, GenerateRequest, InvalidRequestError, check_context_length
from trnrt.engine.sequence import Sequence, SequenceStatus
from trnrt.engine.stop import StopChecker


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
    schedule_policy: fcfs | lpm | dfs-weight | lof | random (cache-aware ones fall back to fcfs
        without the prefix cache or over 128 waiting requests).
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
    random_seed: seed of the `random` policy's shuffles (tests).
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
    random_seed: int | None = None

    def __post_init__(self) -> None:
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


@dataclass
class SequenceUpdate:
    """What changed for one sequence in update_from_output: new tokens and/or its finish.

    `seq` is the live Sequence (read-only for the caller: prompt/output lengths, timestamps).
    """

    seq: Sequence
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Scheduler:
    """Waiting/running queues over a CacheManager.

    Args:
        config: scheduling limits.
        cache: the page/slot allocator; must hold max_model_len tokens for one sequence, so the
            oldest request can always run alone (preemption then always makes progress).
        eos_token_ids: the model's EOS ids (ModelInfo.eos_token_ids).
        clock: time source for the *_time_s stamps (time.monotonic; a GenerateRequest's
            arrival_time_s, if set, must come from the same clock).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        cache: CacheManager,
        *,
        eos_token_ids: Iterable[int] = (),
        clock: Callable[[], float] = time.monotonic,
    ):
        if cache.max_num_tokens_per_seq < config.max_model_len:
            raise ValueError(
                f"the cache holds {cache.max_num_tokens_per_seq} tokens ({cache.num_usable_blocks} usable pages "
                f"of {cache.block_size}), fewer than max_model_len ({config.max_model_len})"
            )
        self.config = config
        self.cache = cache
        self.stop_checker = StopChecker(eos_token_ids, config.max_model_len)
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.requests: dict[str, Sequence] = {}  # every unfinished sequence
        self._finished_since_schedule: list[str] = []
        self._step_id = 0
        self.num_preemptions_total = 0

    # -- requests ----------------------------------------------------------------------------

    def validate_request(self, request: GenerateRequest) -> None:
        """Raise InvalidRequestError (naming the field) if `request` can never run.

        Reads only the immutable config, so a submitting thread may call it.
        """
        ids = request.prompt_token_ids
        if not isinstance(ids, list) or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
            raise InvalidRequestError("prompt_token_ids must be a list of non-negative integers", field="prompt_token_ids")
        request.sampling_params.validate()
        check_context_length(len(ids), request.sampling_params.max_new_tokens, self.config.max_model_len)

    def add_request(self, request: GenerateRequest) -> Sequence:
        """Queue a request (FCFS). Returns its Sequence.

        A request with max_new_tokens == 0 is returned already FINISHED ("length") and never
        queued; the caller emits its final output directly.

        Raises:
            InvalidRequestError: see validate_request; also a request_id that is still live.
        """
        self.validate_request(request)
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request_id {request.request_id!r} is already in use", field="request_id")
        now = self.clock()
        seq = Sequence(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            sampling_params=request.sampling_params,
            arrival_time_s=request.arrival_time_s if request.arrival_time_s is not None else now,
        )
        if request.sampling_params.max_new_tokens == 0:
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = FinishReason("length")
            seq.finished_time_s = now
            return seq
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)
        return seq

    def get_sequence(self, request_id: str) -> Sequence | None:
        return self.requests.get(request_id)

    def finish_request(self, request_id: str, reason: FinishReason) -> Sequence | None:
        """Finish a live request in any state, freeing its pages and slot.

        Used for stop strings (found by the detokenizer after update_from_output) and aborts.
        Returns the finished Sequence, or None if the request is unknown or already finished.
        """
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        self._finish(seq, reason)
        return seq

    def abort(self, request_id: str, message: str | None = None) -> Sequence | None:
        """Abort a request waiting, running or preempted; a no-op (None) if it is not live."""
        return self.finish_request(request_id, FinishReason("abort", message=message))

    # -- queries -----------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def stats(self) -> dict:
        """Scheduler gauges for /v1/stats."""
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "num_preempted_waiting": sum(s.status is SequenceStatus.PREEMPTED for s in self.waiting),
            "num_preemptions_total": self.num_preemptions_total,
            "num_used_blocks": self.cache.num_used_blocks,
            "num_free_blocks": self.cache.num_free_blocks,
            "num_used_slots": self.cache.num_used_slots,
            "cache_usage": self.cache.usage,
        }

    def check_integrity(self) -> None:
        """Cache books balance against the live sequences; queues hold exactly the live ones."""
        self.cache.check_integrity(self.requests.values())
        live = set(self.requests)
        queued = [s.request_id for s in self.waiting] + [s.request_id for s in self.running]
        assert len(queued) == len(set(queued)) and set(queued) == live, (queued, live)
        for s in self.waiting:
            assert not s.block_ids and s.slot_id is None and s.num_computed_tokens == 0, s
        for s in self.running:
            assert s.status is SequenceStatus.RUNNING and s.slot_id is not None, s

    # -- schedule ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work under the token budget. Allocates pages/slots; may preempt."""
        cfg = self.config
        self._step_id += 1
        out = SchedulerOutput(step_id=self._step_id, finished_request_ids=self._finished_since_schedule)
        self._finished_since_schedule = []
        budget = cfg.max_num_batched_tokens
        entries: dict[str, ScheduledSequence] = {}  # insertion order = batch order
        preempted: list[Sequence] = []

        decodes = [s for s in self.running if not s.is_prefill]
        prefills = [s for s in self.running if s.is_prefill]
        for seq in (decodes + prefills) if cfg.decode_first else (prefills + decodes):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = self._num_new_tokens(seq, budget)
            while not self.cache.can_allocate_for(seq, seq.num_computed_tokens + num_new):
                victim = max(self.running, key=lambda s: s.arrival_index)
                self._preempt(victim)
                preempted.append(victim)
                if victim.request_id in entries:  # already scheduled this step: take it back
                    budget += entries.pop(victim.request_id).num_new_tokens
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            entries[seq.request_id] = self._schedule_seq(seq, num_new)
            budget -= num_new

        # NOTE: no admissions in a step that preempted: the pages just freed belong to the
        # running sequences that needed them (admitting would preempt again next step).
        if not preempted:
            now = self.clock()
            while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
                seq = self.waiting[0]
                num_new = self._num_new_tokens(seq, budget)
                if num_new < seq.num_uncomputed_tokens and not cfg.chunked_prefill:
                    break  # FCFS: the head waits for a step with room for its whole prompt
                if not self.cache.can_allocate_for(seq, num_new):
                    break
                self.waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                if seq.first_scheduled_time_s is None:
                    seq.first_scheduled_time_s = now
                self.running.append(seq)
                entries[seq.request_id] = self._schedule_seq(seq, num_new)
                budget -= num_new

        out.scheduled = list(entries.values())
        out.preempted_request_ids = [s.request_id for s in preempted]
        return out

    def _num_new_tokens(self, seq: Sequence, budget: int) -> int:
        n = min(seq.num_uncomputed_tokens, budget)
        if seq.is_prefill:
            n = min(n, self.config.max_prefill_tokens)
        return n

    def _schedule_seq(self, seq: Sequence, num_new: int) -> ScheduledSequence:
        start = seq.num_computed_tokens
        self.cache.allocate_blocks_for(seq, start + num_new)
        assert seq.slot_id is not None
        return ScheduledSequence(
            request_id=seq.request_id,
            token_ids=seq.token_slice(start, start + num_new),
            num_computed_tokens=start,
            block_table=list(seq.block_ids),
            slot_id=seq.slot_id,
            is_prefill=seq.is_prefill,
            do_sample=start + num_new == seq.num_tokens,
            sampling_params=seq.sampling_params,
            num_output_tokens=seq.num_output_tokens,
        )

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.cache.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions_total += 1
        # Victims are taken newest first, so appendleft leaves the waiting front in arrival order.
        self.waiting.appendleft(seq)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.cache.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finished_time_s = self.clock()
        del self.requests[seq.request_id]
        self._finished_since_schedule.append(seq.request_id)

    # -- update ------------------------------------------------------------------------------

    def update_from_output(self, sched_out: SchedulerOutput, runner_out: RunnerOutput) -> list[SequenceUpdate]:
        """Advance the scheduled sequences by what the runner computed and sampled.

        Appends sampled tokens, checks token stops (max_new_tokens, max_model_len, stop_token_ids,
        EOS) and frees finished sequences. Sequences finished or aborted since schedule() are
        skipped. Returns one update per sequence that got a token or finished, in batch order.
        """
        if len(runner_out.sampled_token_ids) != len(sched_out.scheduled):
            raise ValueError(
                f"RunnerOutput has {len(runner_out.sampled_token_ids)} rows for "
                f"{len(sched_out.scheduled)} scheduled sequences"
            )
        logprobs = runner_out.logprobs or [None] * len(sched_out.scheduled)
        now = self.clock()
        updates: list[SequenceUpdate] = []
        for entry, token, lp in zip(sched_out.scheduled, runner_out.sampled_token_ids, logprobs):
            seq = self.requests.get(entry.request_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue  # aborted/finished in between: its pages are already free
            if seq.num_computed_tokens != entry.num_computed_tokens:
                continue  # stale entry (e.g. a request id reused after an abort)
            error = runner_out.failed.get(entry.request_id)
            if error is None and entry.do_sample and token is None:
                error = "the model runner returned no token"
            if error is not None:
                reason = FinishReason("abort", message=error)
                self._finish(seq, reason)
                updates.append(SequenceUpdate(seq, finish_reason=reason, error=error))
                continue
            seq.num_computed_tokens += entry.num_new_tokens
            if not entry.do_sample:
                continue  # partial prefill chunk: state written, nothing sampled
            seq.append_token(int(token), lp)
            if seq.first_token_time_s is None:
                seq.first_token_time_s = now
            reason = self.stop_checker.check_token(seq)
            if reason is not None:
                self._finish(seq, reason)
            updates.append(
                SequenceUpdate(seq, new_token_ids=[int(token)], new_logprobs=[lp], finish_reason=reason)
            )
        return updates
