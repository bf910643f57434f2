"""Request intake: `submit` / `submit_many` validate a request on the caller's thread and post it
to the engine thread's inbox; `_add` (engine thread) hands it to the scheduler and sets up its
per-request state.

IntakeMixin is one of the mixins of trnrt.engine.core.engine.Engine.

Caller's thread (`submit`, `submit_many`, `_prepare*`): reads `_accepting`, `thread`,
`model_info`, `scheduler` (`validate_request`: immutable config only), `grammar_service`,
`penalties`, `prompt_logprobs`, `_think_ids`, `stream_interval`, `stream_factory`; writes
`_live_ids` (under `_live_lock`) and `submitted`, and fills the request's own `grammar_state`,
`penalty_state`, `thinking_state`, seed and arrival time; the request then travels in a SubmitMsg.

Engine thread (`_add`): the scheduler, `stats_collector`, and the per-request maps `_streams`,
`_detoks`, `_grammars`, `_penalties`, `_thinking`, `_prompt_lps` (it takes the states out of the
request: the engine thread owns them from then on).
"""

from __future__ import annotations

import os
import time

from trnrt.engine.core.client import EngineDeadError
from trnrt.engine.core.messages import SubmitMsg
from trnrt.engine.output.detokenizer import IncrementalDetokenizer
from trnrt.engine.output.outputs import RequestOutput
from trnrt.engine.output.stream import OutputStream
from trnrt.engine.request import FinishReason, GenerateRequest, InvalidRequestError, check_new_request_ids

_SEED_MASK = (1 << 63) - 1

STRUCTURED_OUTPUTS_OFF_MESSAGE = "{param} needs structured outputs: start the server with --structured-outputs"
PENALTIES_OFF_MESSAGE = "{param} needs penalties: start the server with --penalties"
PROMPT_LOGPROBS_OFF_MESSAGE = "{param} needs prompt logprobs: start the server with --prompt-logprobs"


class IntakeMixin:
    """Engine's request intake: validation on the caller's thread, the inbox add on the engine thread."""

    # -- client API (any thread) -----------------------------------------------------------------

    def submit(self, request: GenerateRequest) -> OutputStream:
        """Queue a request. Raises InvalidRequestError naming the field if it can never run or if
        its request_id is in flight; EngineDeadError if the engine is shutting down."""
        return self.submit_many([request])[0]

    def submit_many(self, requests: list[GenerateRequest]) -> list[OutputStream]:
        """Validate every request first, then queue them together (one inbox message, so the engine
        thread admits them in the same step). Nothing is queued if any request is invalid or any
        request_id is in flight or repeated in the batch."""
        for request in requests:
            self._prepare(request)
        ids = [r.request_id for r in requests]
        with self._live_lock:
            check_new_request_ids(ids, self._live_ids)
            self._live_ids.update(ids)
        # A non-streamed request's client waits for the final output only: not waking it every
        # step keeps its thread off the GIL while the engine runs (trnrt.engine.output.stream).
        streams = [self.stream_factory(r.request_id, (r.stream_interval or self.stream_interval) if r.stream else 0)
                   for r in requests]
        if self.submitted is not None:
            self.submitted.extend(requests)
        self._post(SubmitMsg(list(requests), streams))
        return streams

    def _prepare(self, request: GenerateRequest) -> None:
        if not self._accepting or not self.thread.is_alive():
            raise EngineDeadError("the engine is not accepting requests (shutting down)")
        si = request.stream_interval
        if si is not None and (not isinstance(si, int) or isinstance(si, bool) or si < 1):
            raise InvalidRequestError(f"stream_interval must be an integer >= 1, got {si!r}", field="stream_interval")
        vocab = self.model_info.vocab_size
        for t in request.prompt_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not (0 <= t < vocab):
                raise InvalidRequestError(
                    f"prompt_token_ids contains {t!r}, outside the vocabulary [0, {vocab})", field="prompt_token_ids"
                )
        request.sampling_params.validate(vocab_size=vocab)
        self.scheduler.validate_request(request)  # reads only immutable config
        self._prepare_grammar(request)
        self._prepare_penalties(request)
        self._prepare_thinking(request)
        sp = request.sampling_params
        if sp.prompt_logprobs is not None:
            if not self.prompt_logprobs:
                raise InvalidRequestError(PROMPT_LOGPROBS_OFF_MESSAGE.format(param="prompt_logprobs"),
                                          field="prompt_logprobs")
            if sp.prompt_logprobs_start >= len(request.prompt_token_ids):
                raise InvalidRequestError(
                    f"prompt_logprobs_start ({sp.prompt_logprobs_start}) must be less than the prompt's "
                    f"{len(request.prompt_token_ids)} tokens", field="prompt_logprobs_start")
            request.prefix_group = None  # computed on its own: a fork would not compute the prompt
        if request.sampling_params.seed is None:
            # Unseeded requests still get a per-request seed: the in-graph sampler keys its noise
            # on (seed, position), so even random sampling is independent of batch composition.
            request.sampling_params = request.sampling_params.clone(seed=int.from_bytes(os.urandom(8), "little") & _SEED_MASK)
        if request.arrival_time_s is None:
            request.arrival_time_s = time.monotonic()

    def _prepare_grammar(self, request: GenerateRequest) -> None:
        """Caller's thread: compile the request's grammar and make its matcher (never on the
        engine thread). A grammar on an engine without structured outputs, or one xgrammar
        refuses, is an InvalidRequestError naming the client's field."""
        spec = request.sampling_params.grammar
        if spec is None:
            request.grammar_state = None
            return
        if self.grammar_service is None:
            raise InvalidRequestError(STRUCTURED_OUTPUTS_OFF_MESSAGE.format(param=spec.param), field=spec.param)
        request.grammar_state = self.grammar_service.new_state(spec)

    def _prepare_penalties(self, request: GenerateRequest) -> None:
        """Caller's thread: the request's PenaltyState (its prompt counted once, here). A penalty on
        an engine without the penalties variant is an InvalidRequestError naming the field and
        the flag."""
        sp = request.sampling_params
        name = sp.penalty_field()
        request.penalty_state = None
        if name is None:
            return
        if not self.penalties:
            raise InvalidRequestError(PENALTIES_OFF_MESSAGE.format(param=name), field=name)
        from trnrt.engine.sample.penalties import PenaltyState

        request.penalty_state = PenaltyState.from_params(sp, request.prompt_token_ids, self.model_info.eos_token_ids)

    def _prepare_thinking(self, request: GenerateRequest) -> None:
        """Caller's thread: the request's ThinkingBudget when it sets max_thinking_tokens."""
        budget = request.sampling_params.max_thinking_tokens
        request.thinking_state = None
        if budget is None:
            return
        start_id, end_id = self._think_ids
        if end_id is None:
            raise InvalidRequestError("max_thinking_tokens needs a model whose tokenizer has a </think> token",
                                      field="max_thinking_tokens")
        from trnrt.engine.sample.thinking_budget import ThinkingBudget

        request.thinking_state = ThinkingBudget(budget, start_id, end_id, request.prompt_token_ids)

    # -- engine thread ----------------------------------------------------------------------------

    def _add(self, request: GenerateRequest, stream: OutputStream) -> None:
        rid = request.request_id
        try:
            seq = self.scheduler.add_request(request, speculative=self.speculative_ok(request))
        except InvalidRequestError as e:
            self._finish_stream(rid, stream, RequestOutput(
                rid, finished=True, finish_reason=FinishReason("abort", message=str(e)), error=str(e)))
            return
        for displaced in self.scheduler.take_finished():  # a full queue gave its place to this one
            self._abort(displaced.request_id, displaced.finish_reason.message or "aborted",
                        status_code=displaced.finish_reason.status_code)
        # Stamp the arrival at submit() (arrival_time_s, time.monotonic like the collector's clock),
        # not now: a request submitted mid-step waited in the inbox, and TTFT/queue/E2E include that.
        self.stats_collector.on_request_arrived(rid, len(request.prompt_token_ids), now=request.arrival_time_s)
        if seq.is_finished:  # max_new_tokens == 0
            self.stats_collector.on_request_finished(rid, seq.finish_reason.type)
            self._finish_stream(rid, stream, RequestOutput(rid, finished=True, finish_reason=seq.finish_reason,
                                                           num_prompt_tokens=seq.num_prompt_tokens))
            return
        sp = request.sampling_params
        self._streams[rid] = stream
        if request.grammar_state is not None:
            self._grammars[rid] = request.grammar_state
            request.grammar_state = None  # the engine thread owns it now
        if request.penalty_state is not None:
            self._penalties[rid] = request.penalty_state
            request.penalty_state = None
        if request.thinking_state is not None:
            self._thinking[rid] = request.thinking_state
            request.thinking_state = None
        if sp.prompt_logprobs is not None:
            from trnrt.engine.sample.prompt_logprob_collector import PromptLogprobCollector

            self._prompt_lps[rid] = PromptLogprobCollector(request.prompt_token_ids, sp.prompt_logprobs,
                                                           sp.prompt_logprobs_start)
        self._detoks[rid] = IncrementalDetokenizer(
            self._decoder, request.prompt_token_ids, skip_special_tokens=sp.skip_special_tokens, stop=sp.stop,
            stop_regex=sp.stop_regex, include_stop_str_in_output=sp.include_stop_str_in_output,
            # nobody reads a non-streamed request's text before it ends: decode it once, at the end
            deferred=not request.stream and not any(sp.stop) and not sp.stop_regex,
            min_tokens=sp.min_new_tokens,
        )
