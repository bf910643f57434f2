"""Stop conditions: token stops (in the Scheduler) and stop strings (from the detokenizer). Pure Python.

Token stops are checked by `StopChecker.check_token` right after a sampled token is appended, in
this order (length first, as SGLang's `check_finished` and vLLM's `check_stop` do):
1. `max_new_tokens` reached              -> FinishReason("length")
2. `max_model_len` reached (prompt+out)  -> FinishReason("length")
3. token in `stop_token_ids`             -> FinishReason("stop", matched=token_id)
4. token in the model's EOS ids          -> FinishReason("stop", matched=token_id), unless ignore_eos
Before `min_new_tokens` output tokens, 3 and 4 do not apply (vLLM's min_tokens; the penalties
variant bans those ids on the device meanwhile, so this guard matters only for a runner that
does not apply the ban, such as the scripted one). Stop strings and regexes cannot match in the
text of the first min_new_tokens tokens either (IncrementalDetokenizer's `min_tokens`).

NOTE: `ignore_eos` ignores only the model's EOS ids; a request's explicit `stop_token_ids` still
stop it (vLLM's semantics; SGLang's `_check_token_based_finish` returns early under ignore_eos and
so ignores stop_token_ids too).

Stop strings are matched on the detokenized text (IncrementalDetokenizer); `merge` combines the
two sources into the request's final FinishReason. The engine thread, per step:

    for u in scheduler.update_from_output(sched_out, runner_out):
        detok = detokenizers[u.request_id]
        text = detok.step(u.new_token_ids, exclude_last=is_token_stop(u.finish_reason))
        reason = StopChecker.merge(u.finish_reason, detok.matched_stop)
        if reason is not None and not u.finished:       # a stop string ended a live request
            scheduler.finish_request(u.request_id, reason)
        if reason is not None:
            text += detok.flush()                       # release held-back text ("" if stopped)
        push RequestOutput(new_token_ids=u.new_token_ids, new_text=text, finished=reason is not None,
                           finish_reason=reason, error=u.error, ...)
"""

from __future__ import annotations

from typing import Iterable

from trnrt.engine.request import (  # noqa: F401  (StopRegex and its limits re-exported)
    MAX_STOP_REGEX, MAX_STOP_REGEX_BYTES, FinishReason, InvalidRequestError, StopRegex, compile_stop_regex,
)
from trnrt.engine.output.sequence import Sequence


class StopChecker:
    """Token-level stop conditions for every request of one model.

    Args:
        eos_token_ids: the model's EOS ids (ModelInfo.eos_token_ids / generation_config).
        max_model_len: context length; a sequence stops with "length" when prompt + output reach it.
    """

    def __init__(self, eos_token_ids: Iterable[int] = (), max_model_len: int | None = None):
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.max_model_len = max_model_len

    def check_token(self, seq: Sequence) -> FinishReason | None:
        """The finish reason caused by `seq`'s newest output token, or None to continue."""
        if not seq.output_token_ids:
            return None
        params = seq.sampling_params
        if seq.num_output_tokens >= params.max_new_tokens:
            return FinishReason("length")
        if self.max_model_len is not None and seq.num_tokens >= self.max_model_len:
            return FinishReason("length")
        if seq.num_output_tokens < params.min_new_tokens:
            return None
        token = seq.output_token_ids[-1]
        if token in params.stop_token_ids:
            return FinishReason("stop", matched=token)
        if not params.ignore_eos and token in self.eos_token_ids:
            return FinishReason("stop", matched=token)
        return None

    @staticmethod
    def merge(token_reason: FinishReason | None, matched_stop: str | None) -> FinishReason | None:
        """Combine a token-level finish with a stop string matched by the detokenizer.

        A stop string wins over "length" (its text is trimmed, so the output really ended there,
        as in vLLM); a token stop wins over a stop string (the stop token came first: the
        detokenizer never sees its text).
        """
        if matched_stop is not None and not is_token_stop(token_reason):
            return FinishReason("stop", matched=matched_stop)
        return token_reason


def is_token_stop(reason: FinishReason | None) -> bool:
    """True when `reason` is a stop on a token id (EOS or stop_token_ids).

    The engine passes this to `IncrementalDetokenizer.step(..., exclude_last=...)`: the matched stop
    token's text is not part of the output (SGLang trims it, vLLM skips it).
    """
    return reason is not None and reason.type == "stop" and isinstance(reason.matched, int)


# -- stop_regex ----------------------------------------------------------------------------------
# The stop patterns themselves (StopRegex, compile_stop_regex) are compiled with the request's
# sampling parameters (trnrt.engine.request): re-exported here for the stop checks' callers.
# A regex stop holds back at most this many trailing characters (see IncrementalDetokenizer).
REGEX_HOLD_CHARS = 64
