"""Request-side types shared by every stage: SamplingParams, FinishReason, GenerateRequest.

A leaf: it imports nothing of trnrt, so every stage (the server's adapters, the scheduler, the
stop checks, the output types) can depend on it without a circle. Validation of a request's own
fields lives here too, compiled stop patterns (StopRegex) included.
Pure Python (no torch): the scheduler, the server and the tests build these without a model.
Names follow SGLang's sampling parameters (max_new_tokens, stop_token_ids, ignore_eos, ...);
the server maps OpenAI/vLLM spellings onto them.
"""

from __future__ import annotations

import dataclasses
import functools
import uuid
from dataclasses import dataclass, field
from typing import Literal


class InvalidRequestError(ValueError):
    """A request field is out of range. `field` names the offending field (a 4xx, never a 500)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


def check_new_request_ids(ids: list[str], live) -> None:
    """Refuse a batch whose ids are in flight (`rid in live`) or repeated within it: SGLang's
    message, naming the field `rid`."""
    seen: set[str] = set()
    for rid in ids:
        if rid in live or rid in seen:
            raise InvalidRequestError(f"Duplicate request ID detected: {rid}", field="rid")
        seen.add(rid)


@dataclass
class SamplingParams:
    """How to sample one request. Defaults match SGLang's (`srt/sampling/sampling_params.py`).

    temperature == 0 means greedy. top_k == -1 (or 0) disables top-k. `logprobs` is None (off),
    0 (the chosen token's logprob only) or N (the chosen token plus the top-N alternatives).
    `seed` makes sampling reproducible per request, whatever else is in the batch.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    # SGLang's stop_regex: pattern strings, compiled by validate() into StopRegex (below)
    # (RE2, cached) on the caller's thread, never on the engine thread.
    stop_regex: list = field(default_factory=list)
    # Keep the matched stop string / regex match / stop token's text (vLLM's
    # include_stop_str_in_output, SGLang's no_stop_trim).
    include_stop_str_in_output: bool = False
    # Structured output (trnrt.engine.sample.grammar_spec.GrammarSpec); None: unconstrained. Needs an
    # engine started with structured outputs (the "structured_outputs" variant graphs).
    grammar: object = None
    # Penalties (SGLang's / vLLM's definitions; trnrt.engine.sample.penalties). Any non-neutral value, a
    # logit_bias or min_new_tokens > 0 needs an engine started with penalties (the "penalties"
    # variant graphs). repetition_penalty counts prompt and output tokens, frequency/presence
    # output tokens only (vLLM).
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict | None = None  # {token_id (int): bias in [-100, 100]}, added to the logits
    # EOS (unless ignore_eos) and stop_token_ids are banned, and stop strings / regexes cannot
    # match in the text of the first min_new_tokens tokens (vLLM's min_tokens).
    min_new_tokens: int = 0
    # After this many reasoning tokens (output tokens inside a think block the prompt opens) the
    # engine emits `</think>` instead of the sampled token (vLLM's thinking_token_budget, SGLang's
    # max_thinking_tokens). None: unlimited. Host-only: no graph needed.
    max_thinking_tokens: int | None = None
    # Prompt logprobs (vLLM's prompt_logprobs, SGLang's logprob_start_len >= 0, completions echo
    # with logprobs): None = off; N = each prompt position's token logprob plus the top-N
    # alternatives (0: the token's only), from position `prompt_logprobs_start` on (position 0 has
    # none: nothing precedes it). Needs an engine started with prompt logprobs (the
    # "prompt_logprobs" prefill variant graphs); such a request bypasses the prefix cache, whose
    # cached positions have no logits.
    prompt_logprobs: int | None = None
    prompt_logprobs_start: int = 0

    MAX_TOP_LOGPROBS = 20
    MAX_LOGIT_BIAS = 100.0  # OpenAI's range: [-100, 100]
    MAX_PENALTY = 2.0  # frequency/presence in [-2, 2]; repetition in (0, 2] (SGLang's ranges)

    # the fields that need the penalties variant, with their neutral value
    PENALTY_FIELDS = (("repetition_penalty", 1.0), ("frequency_penalty", 0.0), ("presence_penalty", 0.0),
                      ("logit_bias", None), ("min_new_tokens", 0))

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.stop_regex, str):
            self.stop_regex = [self.stop_regex]
        self.stop_regex = list(self.stop_regex or [])

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """Raise InvalidRequestError naming the field when a value is out of range. With
        `vocab_size` (the final check, once max_new_tokens is known) token ids are checked against
        the vocabulary and min_new_tokens against max_new_tokens."""
        def bad(name: str, msg: str) -> None:
            raise InvalidRequestError(f"{name} {msg}", field=name)

        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 0:
            bad("max_new_tokens", f"must be a non-negative integer, got {self.max_new_tokens!r}")
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            bad("temperature", f"must be >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            bad("top_k", f"must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        if not (0.0 <= self.min_p <= 1.0):
            bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            bad("seed", f"must be an integer, got {self.seed!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                bad("stop", "must be a non-empty string or a list of non-empty strings")
        if self.stop_regex:
            if len(self.stop_regex) > MAX_STOP_REGEX:
                bad("stop_regex", f"accepts at most {MAX_STOP_REGEX} patterns")
            self.stop_regex = [r if isinstance(r, StopRegex) else compile_stop_regex(r) for r in self.stop_regex]
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0 or (vocab_size is not None and t >= vocab_size):
                bad("stop_token_ids", f"contains an invalid token id {t!r}")
        num = (int, float)
        rp = self.repetition_penalty
        if not isinstance(rp, num) or isinstance(rp, bool) or not (0.0 < rp <= self.MAX_PENALTY):
            bad("repetition_penalty", f"must be in (0, {self.MAX_PENALTY:g}], got {rp!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not isinstance(v, num) or isinstance(v, bool) or not (-self.MAX_PENALTY <= v <= self.MAX_PENALTY):
                bad(name, f"must be in [-{self.MAX_PENALTY:g}, {self.MAX_PENALTY:g}], got {v!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad("logit_bias", "must map token ids to biases")
            for t, v in self.logit_bias.items():
                if not isinstance(t, int) or isinstance(t, bool) or t < 0 or (vocab_size is not None and t >= vocab_size):
                    bad("logit_bias", f"holds token id {t!r}, outside the vocabulary [0, {vocab_size})")
                if not isinstance(v, num) or isinstance(v, bool) or not (-self.MAX_LOGIT_BIAS <= v <= self.MAX_LOGIT_BIAS):
                    bad("logit_bias", f"bias of token {t} must be in [-{self.MAX_LOGIT_BIAS:g}, "
                                      f"{self.MAX_LOGIT_BIAS:g}], got {v!r}")
        mn = self.min_new_tokens
        if not isinstance(mn, int) or isinstance(mn, bool) or mn < 0:
            bad("min_new_tokens", f"must be a non-negative integer, got {mn!r}")
        if vocab_size is not None and mn > self.max_new_tokens:  # the final check: max_new_tokens is known
            bad("min_new_tokens", f"({mn}) must not exceed max_new_tokens ({self.max_new_tokens})")
        mt = self.max_thinking_tokens
        if mt is not None and (not isinstance(mt, int) or isinstance(mt, bool) or mt < 0):
            bad("max_thinking_tokens", f"must be a non-negative integer, got {mt!r}")
        pl = self.prompt_logprobs
        if pl is not None and (not isinstance(pl, int) or isinstance(pl, bool) or not (0 <= pl <= self.MAX_TOP_LOGPROBS)):
            bad("prompt_logprobs", f"must be an integer in [0, {self.MAX_TOP_LOGPROBS}], got {pl!r}")
        ps = self.prompt_logprobs_start
        if not isinstance(ps, int) or isinstance(ps, bool) or ps < 0:
            bad("prompt_logprobs_start", f"must be a non-negative integer, got {ps!r}")
        if self.logprobs is not None:
            if not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool) or not (0 <= self.logprobs <= self.MAX_TOP_LOGPROBS):
                bad("logprobs", f"must be an integer in [0, {self.MAX_TOP_LOGPROBS}], got {self.logprobs!r}")
        return self

    def penalty_field(self) -> str | None:
        """The first field that needs the penalties variant (a non-neutral value), or None."""
        for name, neutral in self.PENALTY_FIELDS:
            v = getattr(self, name)
            if v != neutral and not (name == "logit_bias" and not v):
                return name
        return None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def clone(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class FinishReason:
    """Why a request ended. `type` is "stop" | "length" | "abort" (errors are aborts with a message).

    `matched` is the token id or stop string that ended a "stop" finish (None for EOS-free stops).
    `status_code` is the HTTP status a system abort carries (SGLang's FINISH_ABORT: 503 when the
    engine shuts down); a client or admin abort carries none.
    """

    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    message: str | None = None
    status_code: int | None = None

    def to_dict(self) -> dict:
        d: dict = {"type": self.type}
        if self.type == "stop":
            d["matched"] = self.matched
        if self.message is not None:
            d["message"] = self.message
        if self.status_code is not None:
            d["status_code"] = self.status_code
        return d


def new_request_id() -> str:
    """A process-unique request id (32 hex chars, like SGLang's uuid4().hex)."""
    return uuid.uuid4().hex


@dataclass
class GenerateRequest:
    """What a client submits to the engine: token ids (already tokenized) and sampling params."""

    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=new_request_id)
    arrival_time_s: float | None = None
    # True: the client reads outputs as they come (every `stream_interval`-th step, SSE); False:
    # only the final output matters, delivered once, merged (a non-streamed HTTP response, offline
    # generate). Same tokens and text either way; see trnrt.engine.output.stream.
    stream: bool = True
    # Outputs per delivery for a streamed request (SGLang's sampling_params.stream_interval);
    # None: the engine's --stream-interval.
    stream_interval: int | None = None
    # Scheduling priority (SGLang's `priority`; larger is preferred unless the server runs with
    # --schedule-low-priority-values-first). None: the server's default. Read only under priority
    # scheduling, and by the `priority` eviction policy.
    priority: int | None = None
    # `n` > 1: the n choices of one client request are n GenerateRequests with the same
    # `prefix_group` (e.g. the client's request id), the same prompt, submitted in one submit_many.
    # The engine computes the shared prompt once and forks the others from it (their own sampling,
    # seeds and stops). None: an ordinary request.
    prefix_group: str | None = None
    # Prefix-cache namespace (SGLang's extra_key / cache_salt, vLLM's cache_salt): requests with
    # different values never share cached state. None: the default namespace.
    cache_salt: str | None = None
    # Set by Engine.submit when sampling_params.grammar is set: the request's compiled grammar
    # and matcher (trnrt.engine.sample.grammar.GrammarState), handed to the engine thread with the request.
    grammar_state: object = field(default=None, repr=False, compare=False)
    # Set by Engine.submit, handed to the engine thread like grammar_state: the request's
    # PenaltyState (trnrt.engine.sample.penalties) and ThinkingBudget (trnrt.engine.sample.thinking_budget).
    penalty_state: object = field(default=None, repr=False, compare=False)
    thinking_state: object = field(default=None, repr=False, compare=False)


def check_context_length(
    num_prompt_tokens: int, max_new_tokens: int, max_model_len: int, *, strict_max_new_tokens: bool = False
) -> None:
    """Refuse a request that cannot fit the model's context; raise InvalidRequestError naming the field.

    A prompt must leave room for at least one generated token: `num_prompt_tokens < max_model_len`
    (SGLang's rule; the message follows its wording). Generation then stops with "length" when
    prompt + output reach max_model_len, so by default a large `max_new_tokens` is capped, not
    refused: SamplingParams.max_new_tokens has a default, and only the server knows whether the
    client set it. With `strict_max_new_tokens` (the client set max_tokens explicitly, OpenAI/vLLM
    style) prompt + max_new_tokens > max_model_len is refused too.
    """
    if num_prompt_tokens <= 0:
        raise InvalidRequestError("prompt_token_ids must not be empty", field="prompt_token_ids")
    if num_prompt_tokens >= max_model_len:
        raise InvalidRequestError(
            f"The input ({num_prompt_tokens} tokens) is longer than the model's context length "
            f"({max_model_len} tokens): prompt_token_ids must hold fewer than {max_model_len} tokens.",
            field="prompt_token_ids",
        )
    if strict_max_new_tokens and num_prompt_tokens + max_new_tokens > max_model_len:
        raise InvalidRequestError(
            f"Requested token count exceeds the model's maximum context length of {max_model_len} tokens. "
            f"You requested a total of {num_prompt_tokens + max_new_tokens} tokens: {num_prompt_tokens} tokens "
            f"from the input and {max_new_tokens} tokens for the completion (max_new_tokens). Please reduce "
            f"the number of tokens in the input or the completion to fit within the limit.",
            field="max_new_tokens",
        )


#
# SGLang's `stop_regex`: patterns matched on the output text. Every pattern runs on RE2
# (google-re2), whose search time is linear in the text searched whatever the pattern, so no
# pattern can stall the engine thread (`(a+)+$` costs what `a` costs). A pattern RE2 cannot run
# (backreferences, lookaround, atomic groups, possessive quantifiers) is refused, never run on
# Python's backtracking `re`. Patterns are compiled on the client thread (SamplingParams.validate,
# which submit() calls) and cached; the engine thread only searches.

MAX_STOP_REGEX = 32  # SGLang's limits: at most 32 patterns, each at most 256 bytes
MAX_STOP_REGEX_BYTES = 256


class StopRegex:
    """One compiled stop pattern: `pattern` (what `matched_stop` reports, as SGLang does),
    `regex` (an RE2 object with `search(text, pos)`), and `max_len`: the longest text a match can
    span, in characters (None: unbounded), from Python's own pattern parser."""

    __slots__ = ("pattern", "regex", "max_len")

    def __init__(self, pattern: str, regex, max_len: int | None):
        self.pattern = pattern
        self.regex = regex
        self.max_len = max_len

    def __repr__(self) -> str:
        return f"StopRegex({self.pattern!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, StopRegex) and other.pattern == self.pattern

    def __hash__(self) -> int:
        return hash(self.pattern)


def _width(pattern: str) -> tuple[int, int | None] | None:
    """(min, max) length of a match per Python's `re` parser (max None: unbounded); None when
    Python's `re` does not accept the pattern either."""
    import re

    try:
        parser = re._parser  # type: ignore[attr-defined]  # sre_parse since 3.11
    except AttributeError:  # pragma: no cover
        import sre_parse as parser  # type: ignore[no-redef]
    try:
        lo, hi = parser.parse(pattern).getwidth()
    except Exception:
        return None
    return lo, (None if hi >= (1 << 31) else hi)


@functools.lru_cache(maxsize=4096)
def compile_stop_regex(pattern: str, label: str = "stop_regex") -> StopRegex:
    """Compile one stop pattern (cached), or raise InvalidRequestError naming `label` and why."""
    import re2

    if not isinstance(pattern, str) or not pattern:
        raise InvalidRequestError(f"{label} must be a non-empty string", field=label)
    if len(pattern.encode("utf-8", "surrogatepass")) > MAX_STOP_REGEX_BYTES:
        raise InvalidRequestError(f"{label} pattern is longer than {MAX_STOP_REGEX_BYTES} bytes", field=label)
    width = _width(pattern)
    options = re2.Options()
    options.log_errors = False
    try:
        regex = re2.compile(pattern, options)
    except re2.error as e:
        why = e.args[0].decode("utf-8", "replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        if width is None:
            raise InvalidRequestError(f"{label} {pattern!r} is not a valid regular expression: {why}", field=label)
        raise InvalidRequestError(
            f"{label} {pattern!r} cannot be run in linear time ({why}): this server matches stop patterns with "
            "RE2, which has no backreferences, lookahead/lookbehind, atomic groups or possessive quantifiers",
            field=label)
    if width is None:  # RE2 takes it but Python's re (SGLang's syntax) does not: refuse, do not guess
        raise InvalidRequestError(f"{label} {pattern!r} is not a valid Python regular expression", field=label)
    lo, hi = width
    if lo == 0:
        raise InvalidRequestError(f"{label} {pattern!r} can match the empty string, which would stop every "
                                  "request at once", field=label)
    return StopRegex(pattern, regex, hi)
