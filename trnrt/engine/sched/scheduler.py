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
from typing import Callable, Iterable

from trnrt.engine.cache.cache_manager import CacheManager
from trnrt.engine.output.outputs import CacheOp, ScheduledSequence, SchedulerOutput
from trnrt.engine.request import FinishReason, GenerateRequest, InvalidRequestError, check_context_length
from trnrt.engine.sched import schedule_policy as policy
from trnrt.engine.output.sequence import Sequence, SequenceStatus
from trnrt.engine.output.stop import StopChecker
from trnrt.engine.sched.fork_groups import ForkGroups, _ForkGroup
from trnrt.engine.sched.prefix_matching import PrefixMatching
from trnrt.engine.sched.scheduler_config import SchedulerConfig
from trnrt.engine.sched.scheduler_stats import SchedulerStats
from trnrt.engine.sched.step_update import SequenceUpdate, StepUpdate

__all__ = ["Scheduler", "SchedulerConfig", "SequenceUpdate"]


def _cost(entry: ScheduledSequence) -> int:
    """Tokens an entry takes from the step's budget: fed tokens and verified drafts."""
    return entry.num_new_tokens + entry.num_lookahead


class Scheduler(ForkGroups, PrefixMatching, StepUpdate, SchedulerStats):
    """Waiting/running queues over a CacheManager.

    Its methods by job: admission, queries, schedule() and preemption here; the `n` > 1 forks in
    fork_groups.py, the prefix cache's matching and snapshots in prefix_matching.py,
    update_from_output in step_update.py, stats and check_integrity in scheduler_stats.py.

    Args:
        config: scheduling limits.
        cache: the page/slot allocator; must hold max_model_len tokens for one sequence, so the
            oldest request can always run alone (preemption then always makes progress).
        eos_token_ids: the model's EOS ids (ModelInfo.eos_token_ids).
        clock: time source for the *_time_s stamps (time.monotonic; a GenerateRequest's
            arrival_time_s, if set, must come from the same clock).
        prefix_cache: a RadixCache over `cache` (None: no prefix cache). With it, an admitted
            request resumes from its longest cached prefix that ends at a state checkpoint (pages
            shared, checkpoint restored into its slot: a `load_slot` CacheOp), prefill chunks are
            cut at multiples of `checkpoint_interval`, and a row whose computed length reaches such
            a multiple snapshots its slot (a `save_slot` CacheOp after the step) and inserts its
            prefix into the tree.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        cache: CacheManager,
        *,
        eos_token_ids: Iterable[int] = (),
        clock: Callable[[], float] = time.monotonic,
        prefix_cache=None,
        checkpoint_interval: int = 0,
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
        # Prefix cache (trnrt.engine.cache.radix_cache.RadixCache) and its checkpoint interval (tokens, a
        # multiple of the page size): None keeps every decision exactly as without it.
        self.prefix_cache = prefix_cache
        if prefix_cache is not None:
            if checkpoint_interval <= 0 or checkpoint_interval % cache.block_size:
                raise ValueError(f"checkpoint_interval must be a positive multiple of the block size "
                                 f"({cache.block_size}), got {checkpoint_interval!r}")
        self.checkpoint_interval = checkpoint_interval
        self.active_policy = policy.validate_policy(config, cache_enabled=prefix_cache is not None)
        self._rng = policy.make_rng(config)
        # fcfs without priorities is the queue's own order: no sort, decisions exactly as before
        self._reorders = config.schedule_policy != "fcfs" or config.enable_priority_scheduling
        # Requests the scheduler itself ended outside update_from_output (displaced from a full
        # queue by a better one): the engine takes them with take_finished() and emits their end.
        self._ended: list[Sequence] = []
        self.num_priority_preemptions = 0
        self.num_queue_full = 0
        self._groups: dict[str, _ForkGroup] = {}  # prefix_group -> its fork state (n > 1)
        self.num_forked = 0  # choices that forked from their leader's prompt
        # request id -> (end position, checkpoint id) of the snapshot its scheduled row will take
        self._pending_snapshots: dict[str, tuple[int, int]] = {}
        self.num_prompt_tokens_admitted = 0  # first admissions only
        self.num_cached_tokens_total = 0
        self.num_cached_tokens_host_total = 0
        self.num_prefix_hits = 0
        self.num_prefill_tokens_computed = 0  # tokens fed in prefill chunks (what the cache saves)

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

    def add_request(self, request: GenerateRequest, *, speculative: bool = False) -> Sequence:
        """Queue a request (FCFS). Returns its Sequence.

        speculative: the drafter follows it (with num_speculative_tokens > 0): its decode steps
        verify drafts, and it neither resumes from nor snapshots into the prefix cache while
        decoding (the drafter must see every position, and a verify's end is not known ahead).

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
        seq.priority = request.priority
        seq.cache_namespace = request.cache_salt
        seq.speculative = bool(speculative and self.config.num_speculative_tokens > 0)
        refusal = policy.priority_refusal(request.priority, self.config)
        # max_new_tokens 0 ends at once, unless the prompt's logprobs are wanted (scoring a prompt):
        # then the prompt runs and the request ends where its first token would be sampled
        runs = request.sampling_params.max_new_tokens != 0 or request.sampling_params.prompt_logprobs is not None
        if refusal is None and runs:
            ok, displaced = policy.queue_admission(self.waiting, seq, self.config)
            if not ok:
                refusal = policy.QUEUE_FULL_MESSAGE
                self.num_queue_full += 1
            for d in displaced:
                self._finish(d, FinishReason("abort", message=policy.DISPLACED_MESSAGE, status_code=503))
                self._ended.append(d)
        if refusal is not None:  # SGLang answers these with 503 before the request runs
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = FinishReason("abort", message=refusal, status_code=503)
            seq.finished_time_s = now
            return seq
        if not runs:
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = FinishReason("length")
            seq.finished_time_s = now
            return seq
        self.requests[seq.request_id] = seq
        group = request.prefix_group
        if (group is not None and self.prefix_cache is not None and seq.num_prompt_tokens > 1
                and request.sampling_params.prompt_logprobs is None and not seq.speculative):
            g = self._groups.get(group)
            if g is None:
                self._groups[group] = _ForkGroup(name=group, leader=seq, fork_pos=seq.num_prompt_tokens - 1)
                seq.fork_group = group
            elif (g.leader.prompt_token_ids == seq.prompt_token_ids and g.leader.cache_namespace == seq.cache_namespace
                  and not g.ready):
                seq.fork_group = group
                g.held.append(seq)  # waits for the leader's prompt
                return seq
        self.waiting.append(seq)
        return seq

    def take_finished(self) -> list[Sequence]:
        """Sequences the scheduler ended by itself since the last call (displaced from a full
        queue); the engine emits their final output."""
        ended, self._ended = self._ended, []
        return ended

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

    def stop_speculating(self, request_id: str) -> bool:
        """The request goes on with plain decode steps (dynamic speculation). Its state is where
        plain decoding leaves it after every step, so nothing moves; True if it was speculative."""
        seq = self.requests.get(request_id)
        if seq is None or not seq.speculative:
            return False
        seq.speculative = False
        return True

    def abort(self, request_id: str, message: str | None = None) -> Sequence | None:
        """Abort a request waiting, running or preempted; a no-op (None) if it is not live."""
        return self.finish_request(request_id, FinishReason("abort", message=message))

    # -- queries -----------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + sum(len(g.held) for g in self._groups.values())

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

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
            ahead = self._num_lookahead(seq, budget - num_new)
            while not self._can_allocate_for(seq, seq.num_computed_tokens + num_new + ahead):
                victim = max(self.running, key=lambda s: s.arrival_index)
                self._preempt(victim)
                preempted.append(victim)
                if victim.request_id in entries:  # already scheduled this step: take it back
                    budget += _cost(entries.pop(victim.request_id))
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            entries[seq.request_id] = self._schedule_seq(seq, num_new, out, lookahead=ahead)
            budget -= num_new + ahead

        # NOTE: no admissions in a step that preempted: the pages just freed belong to the
        # running sequences that needed them (admitting would preempt again next step).
        if not preempted:
            now = self.clock()
            if self._reorders and len(self.waiting) > 1:
                self.waiting = deque(policy.order_waiting(
                    self.waiting, cfg, match=self._match_for_policy if self.prefix_cache is not None else None,
                    rng=self._rng))
            while self.waiting and budget > 0:
                seq = self.waiting[0]
                if len(self.running) >= cfg.max_num_seqs:
                    if not self._preempt_for(seq, 0, entries, preempted):
                        break
                    budget = cfg.max_num_batched_tokens - sum(_cost(e) for e in entries.values())
                    continue
                g = self._group_of(seq) if self._groups else None
                if g is not None and g.ready and seq is not g.leader and not seq.num_computed_tokens \
                        and seq.num_preemptions == 0:
                    # a choice of an n > 1 request: fork from the leader's prompt
                    extra = 1  # the copy of the partial last page, or the page position fork_pos starts
                    if not self.cache.can_allocate(extra, 1):
                        self.prefix_cache.evict(extra)
                        if not self.cache.can_allocate(extra, 1):
                            break
                    self.waiting.popleft()
                    seq.status = SequenceStatus.RUNNING
                    if seq.first_scheduled_time_s is None:
                        seq.first_scheduled_time_s = now
                    self.num_prompt_tokens_admitted += seq.num_prompt_tokens
                    self._fork(seq, g)
                    seq.fork_group = None
                    self.running.append(seq)
                    num_new = self._num_new_tokens(seq, budget)
                    entries[seq.request_id] = self._schedule_seq(seq, num_new, out)
                    budget -= num_new
                    if not any(getattr(w, "fork_group", None) == g.name for w in self.waiting):
                        self._release_group(g.name, requeue=False)
                    continue
                match = self._match(seq)
                num_new = self._num_new_tokens(seq, budget)
                if num_new < seq.num_uncomputed_tokens and not cfg.chunked_prefill:
                    self._unmatch(seq, match)
                    break  # FCFS: the head waits for a step with room for its whole prompt
                extra = match.num_host_pages if match is not None else 0
                if not self._can_allocate_for(seq, seq.num_computed_tokens + num_new, extra_pages=extra,
                                              shared=match):
                    need = self.cache.num_blocks_for(seq.num_computed_tokens + num_new) + extra
                    self._unmatch(seq, match)
                    if self._preempt_for(seq, need * self.cache.block_size, entries, preempted):
                        budget = cfg.max_num_batched_tokens - sum(_cost(e) for e in entries.values())
                        continue
                    break
                self.waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                if seq.first_scheduled_time_s is None:
                    seq.first_scheduled_time_s = now
                first = seq.num_preemptions == 0
                if first:
                    self.num_prompt_tokens_admitted += seq.num_prompt_tokens
                if match is not None:
                    self._resume(seq, match, first)
                self.running.append(seq)
                entries[seq.request_id] = self._schedule_seq(seq, num_new, out)
                budget -= num_new

        out.scheduled = list(entries.values())
        out.preempted_request_ids = [s.request_id for s in preempted]
        self.num_prefill_tokens_computed += sum(e.num_new_tokens for e in out.scheduled if e.is_prefill)
        if self.prefix_cache is not None:
            out.cache_ops = self.prefix_cache.take_ops()
        return out

    def _preempt_for(self, incoming: Sequence, tokens_needed: int, entries: dict, preempted: list) -> bool:
        """Priority preemption (SGLang's preempt_to_schedule): preempt running sequences worse
        than `incoming` by more than the threshold until it fits. Victims scheduled earlier in
        this step are taken back. Returns whether anything was preempted."""
        if not self.config.enable_priority_scheduling or self.config.disable_priority_preemption:
            return False
        bs = self.cache.block_size
        victims = policy.preemption_victims(
            self.running, incoming, self.config, tokens_needed,
            # only pages no one else holds come free
            lambda s: bs * sum(1 for b in s.block_ids if self.cache.ref_count(b) == 1))
        if not victims:
            return False
        head = self.waiting.popleft()
        assert head is incoming
        for v in victims:
            self._preempt(v)
            preempted.append(v)
            entries.pop(v.request_id, None)  # (_preempt dropped its planned snapshot)
            self.num_priority_preemptions += 1
        self.waiting.appendleft(incoming)
        return True

    def _num_lookahead(self, seq: Sequence, budget: int) -> int:
        """Drafts a decode step of `seq` may verify: k, cut so that the verify's positions stay
        inside max_model_len, the emitted tokens (up to drafts + 1) inside max_new_tokens and
        max_model_len, and the drafts inside the step's remaining token budget. 0 for a prefill
        chunk or a request the drafter does not follow."""
        k = self.config.num_speculative_tokens
        if not k or not seq.speculative or seq.is_prefill:
            return 0
        sp = seq.sampling_params
        left = self.config.max_model_len - seq.num_tokens - 1  # emitted tokens past the next one
        if sp.max_new_tokens is not None:
            left = min(left, sp.max_new_tokens - seq.num_output_tokens - 1)
        return max(0, min(k, left, budget))

    def _num_new_tokens(self, seq: Sequence, budget: int) -> int:
        n = min(seq.num_uncomputed_tokens, budget)
        if seq.is_prefill:
            n = min(n, self.config.max_prefill_tokens)
            if self.prefix_cache is not None:
                # Cut the chunk at the next checkpoint position, so the state there can be kept.
                start = seq.num_computed_tokens
                boundary = (start // self.checkpoint_interval + 1) * self.checkpoint_interval
                if boundary < start + n:
                    n = boundary - start
                if self._groups:
                    g = self._group_of(seq)
                    if g is not None and g.leader is seq and not g.ready and start < g.fork_pos < start + n:
                        n = g.fork_pos - start  # stop where the choices fork
        return n

    def _schedule_seq(self, seq: Sequence, num_new: int, out: SchedulerOutput | None = None,
                      lookahead: int = 0) -> ScheduledSequence:
        start = seq.num_computed_tokens
        had_slot = seq.slot_id is not None
        self.cache.allocate_blocks_for(seq, start + num_new + lookahead)
        assert seq.slot_id is not None
        fork_source = getattr(seq, "fork_source", None)
        if fork_source is not None:  # forked from its leader's prompt (n > 1)
            self.prefix_cache._ops.append(CacheOp("load_slot", (fork_source,), (seq.slot_id,)))
            seq.fork_source = None
        elif not had_slot and start > 0 and self.prefix_cache is not None:
            # resumed through the cache: its slot starts from the checkpoint
            node = seq.cache_node
            if node.checkpoint is not None:
                self.prefix_cache._ops.append(CacheOp("load_slot", (node.checkpoint,), (seq.slot_id,)))
            else:
                self.prefix_cache._ops.append(CacheOp("load_slot_host", (node.host_checkpoint,), (seq.slot_id,)))
        spec_decode = seq.speculative and not seq.is_prefill
        if out is not None:
            if not spec_decode:  # a verify's end is known only after it ran
                self._plan_snapshot(seq, start + num_new, out)
            if self._groups:
                self._plan_fork_snapshot(seq, start + num_new, out)
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
            speculative=seq.speculative,
            num_lookahead=lookahead,
            next_token_id=seq.token_slice(start + num_new, start + num_new + 1)[0] if start + num_new < seq.num_tokens
            else None,
        )

    def _preempt(self, seq: Sequence) -> None:
        if self._groups:
            self._leave_group(seq)
        self.running.remove(seq)
        if self.prefix_cache is not None:
            self._release_cache_node(seq)
        self.cache.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions_total += 1
        # Victims are taken newest first, so appendleft leaves the waiting front in arrival order.
        self.waiting.appendleft(seq)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if self._groups:
            self._leave_group(seq)
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if self.prefix_cache is not None:
            self._release_cache_node(seq)
        self.cache.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finished_time_s = self.clock()
        del self.requests[seq.request_id]
        self._finished_since_schedule.append(seq.request_id)

