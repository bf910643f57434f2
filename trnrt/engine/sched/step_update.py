"""update_from_output: advance the scheduled sequences by what the runner computed and sampled,
check token stops, commit the step's snapshots and forks, free what finished.

A mixin of Scheduler (sched/scheduler.py); SequenceUpdate is what it returns per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trnrt.engine.output.outputs import RunnerOutput, SchedulerOutput, TokenLogprob
from trnrt.engine.output.sequence import Sequence, SequenceStatus
from trnrt.engine.request import FinishReason


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


class StepUpdate:
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
        extras = runner_out.extra_token_ids or [()] * len(sched_out.scheduled)
        now = self.clock()
        updates: list[SequenceUpdate] = []
        for entry, token, lp, extra in zip(sched_out.scheduled, runner_out.sampled_token_ids, logprobs, extras):
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
            if self._pending_snapshots and seq.request_id in self._pending_snapshots:
                self._commit_snapshot(seq)
            if self._groups:
                self._commit_fork(seq)
            if not entry.do_sample:
                continue  # partial prefill chunk: state written, nothing sampled
            if seq.sampling_params.max_new_tokens == 0:  # a prompt scored for its logprobs only
                reason = FinishReason("length")
                self._finish(seq, reason)
                updates.append(SequenceUpdate(seq, finish_reason=reason))
                continue
            seq.append_token(int(token), lp)
            if seq.first_token_time_s is None:
                seq.first_token_time_s = now
            reason = self.stop_checker.check_token(seq)
            new_ids, new_lps = [int(token)], [lp]
            # A verify's accepted drafts and its correction: each emitted token's position was fed
            # (computed) before the next one is appended, as plain decoding leaves them; a stop
            # drops the rest.
            for t in extra if len(extra) <= entry.num_lookahead else ():
                if reason is not None:
                    break
                seq.num_computed_tokens += 1
                seq.append_token(int(t), None)
                new_ids.append(int(t))
                new_lps.append(None)
                reason = self.stop_checker.check_token(seq)
            if reason is not None:
                self._finish(seq, reason)
            updates.append(SequenceUpdate(seq, new_token_ids=new_ids, new_logprobs=new_lps, finish_reason=reason))
        return updates
