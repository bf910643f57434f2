"""Sampling fields -> `SamplingParams`: the one place every API's sampling values are read.

Each API spells the fields its own way (OpenAI `seed`, SGLang `sampling_seed`; OpenAI
`max_tokens`, SGLang `max_new_tokens`); a `Spelling` maps the engine's names to the request's
keys, so the JSON types are checked here and the ranges by `SamplingParams.validate` (the
engine's own rule), and every error names the field as the client spelled it. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trnrt.engine.request import MAX_STOP_REGEX, InvalidRequestError, SamplingParams, compile_stop_regex
from trnrt.serve.http.errors import bad_request
from trnrt.serve.protocol.fields import (ErrorFactory, is_text, read_bool, read_id_list, read_int,
                                         read_logit_bias, read_num, read_str_list)

MAX_STOP_STRINGS = 32  # SGLang's limit
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 63 - 1  # vLLM's seed range (a signed 64-bit integer)


@dataclass(frozen=True)
class Spelling:
    """Request key per SamplingParams field (absent: the field is not read from this API)."""

    keys: dict = field(default_factory=dict)
    prefix: str = ""  # e.g. "sampling_params." in error messages
    # the request keys that keep the matched stop text (any of them true keeps it)
    keep_stop_keys: tuple = ("no_stop_trim",)

    def key(self, engine_name: str) -> str:
        return self.keys.get(engine_name, engine_name)

    def label(self, engine_name: str) -> str:
        return self.prefix + self.key(engine_name)


OPENAI = Spelling({"max_new_tokens": "max_tokens", "seed": "seed", "min_new_tokens": "min_tokens"},
                  keep_stop_keys=("include_stop_str_in_output", "no_stop_trim"))  # vLLM's and SGLang's
# SGLang's sampling_params object (error labels name the nesting).
SGLANG = Spelling({"max_new_tokens": "max_new_tokens", "seed": "sampling_seed"}, prefix="sampling_params.")


def read_sampling(body: dict, spelling: Spelling, *, err: ErrorFactory = bad_request,
                  max_new_tokens: int = 0) -> SamplingParams:
    """Read temperature, top_p, top_k, min_p, seed, stop, stop_regex, stop_token_ids, ignore_eos,
    skip_special_tokens, spaces_between_special_tokens, the keep-stop flags, the penalties
    (repetition/frequency/presence), logit_bias and min_new_tokens from `body` (type
    checks; stop_regex patterns are compiled here, once, so a bad one is a 400 before any work);
    the caller sets max_new_tokens and logprobs, then calls `check_sampling`."""
    def lab(n: str) -> str:
        return spelling.label(n)

    def k(n: str) -> str:
        return spelling.key(n)

    top_k = read_int(body, k("top_k"), -1, label=lab("top_k"), err=err)
    keep = False
    for key in spelling.keep_stop_keys:
        keep = read_bool(body, key, False, label=spelling.prefix + key, err=err) or keep
    # The engine decodes with the fast (Rust) tokenizer, which never puts spaces between special
    # tokens; with it SGLang and vLLM give the same text for both values. Type-checked only.
    read_bool(body, k("spaces_between_special_tokens"), True, label=lab("spaces_between_special_tokens"), err=err)
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=read_num(body, k("temperature"), 1.0, label=lab("temperature"), err=err),
        top_p=read_num(body, k("top_p"), 1.0, label=lab("top_p"), err=err),
        top_k=-1 if top_k == 0 else top_k,
        min_p=read_num(body, k("min_p"), 0.0, label=lab("min_p"), err=err),
        seed=read_int(body, k("seed"), None, SEED_MIN, SEED_MAX, label=lab("seed"), err=err),
        stop=read_str_list(body, k("stop"), max_items=MAX_STOP_STRINGS, label=lab("stop"), err=err),
        stop_regex=read_stop_regex(body, k("stop_regex"), lab("stop_regex"), err),
        include_stop_str_in_output=keep,
        stop_token_ids=read_id_list(body, k("stop_token_ids"), label=lab("stop_token_ids"), err=err),
        ignore_eos=read_bool(body, k("ignore_eos"), False, label=lab("ignore_eos"), err=err),
        skip_special_tokens=read_bool(body, k("skip_special_tokens"), True, label=lab("skip_special_tokens"),
                                      err=err),
        repetition_penalty=read_num(body, k("repetition_penalty"), 1.0, label=lab("repetition_penalty"), err=err),
        frequency_penalty=read_num(body, k("frequency_penalty"), 0.0, label=lab("frequency_penalty"), err=err),
        presence_penalty=read_num(body, k("presence_penalty"), 0.0, label=lab("presence_penalty"), err=err),
        logit_bias=read_logit_bias(body, k("logit_bias"), label=lab("logit_bias"), err=err),
        min_new_tokens=read_int(body, k("min_new_tokens"), 0, label=lab("min_new_tokens"), err=err),
    )


def read_stop_regex(body: dict, key: str, label: str, err: ErrorFactory = bad_request) -> list:
    """SGLang's stop_regex: a pattern or a list of at most 32, each at most 256 bytes, each one RE2
    can run; compiled here (cached: trnrt.engine.output.stop.compile_stop_regex), on the request thread.
    A wrong JSON type is `err` (SGLang's contract form on /generate); a pattern refused is a 400
    naming the field and saying why."""
    v = body.get(key)
    if v is None or v == "":
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(p, str) for p in v):
        raise err(f"{label} must be a string or a list of strings", label)
    if len(v) > MAX_STOP_REGEX:
        raise bad_request(f"{label} accepts at most {MAX_STOP_REGEX} patterns, got {len(v)}", label)
    out = []
    for p in v:
        if not is_text(p):
            raise bad_request(f"{label} is not valid Unicode (it holds a lone surrogate)", label)
        try:
            out.append(compile_stop_regex(p, label))
        except InvalidRequestError as e:
            raise bad_request(str(e), label)
    return out


def check_sampling(params: SamplingParams, vocab_size: int, spelling: Spelling,
                   renames: dict | None = None) -> SamplingParams:
    """`params.validate(vocab_size)` with the error naming the field in the request's spelling."""
    try:
        return params.validate(vocab_size)
    except InvalidRequestError as e:
        name = (renames or {}).get(e.field) or spelling.label(e.field or "")
        msg = str(e)
        if e.field and msg.startswith(e.field):
            msg = name + msg[len(e.field):]
        raise bad_request(msg, name)
