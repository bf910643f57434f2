"""Sampling fields -> `SamplingParams`: the one place every API's sampling values are read.

Each API spells the fields its own way (OpenAI `seed`, SGLang `sampling_seed`; OpenAI
`max_tokens`, SGLang `max_new_tokens`); a `Spelling` maps the engine's names to the request's
keys, so the JSON types are checked here and the ranges by `SamplingParams.validate` (the
engine's own rule), and every error names the field as the client spelled it. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trnrt.engine.request import InvalidRequestError, SamplingParams
from trnrt.serve.http.errors import bad_request
from trnrt.serve.protocol.fields import (ErrorFactory, read_bool, read_id_list, read_int, read_num,
                                         read_str_list)

MAX_STOP_STRINGS = 32  # SGLang's limit


@dataclass(frozen=True)
class Spelling:
    """Request key per SamplingParams field (absent: the field is not read from this API)."""

    keys: dict = field(default_factory=dict)
    prefix: str = ""  # e.g. "sampling_params." in error messages

    def key(self, engine_name: str) -> str:
        return self.keys.get(engine_name, engine_name)

    def label(self, engine_name: str) -> str:
        return self.prefix + self.key(engine_name)


OPENAI = Spelling({"max_new_tokens": "max_tokens", "seed": "seed"})
# SGLang's sampling_params object (error labels name the nesting).
SGLANG = Spelling({"max_new_tokens": "max_new_tokens", "seed": "sampling_seed"}, prefix="sampling_params.")


def read_sampling(body: dict, spelling: Spelling, *, err: ErrorFactory = bad_request,
                  max_new_tokens: int = 0) -> SamplingParams:
    """Read temperature, top_p, top_k, min_p, seed, stop, stop_token_ids, ignore_eos and
    skip_special_tokens from `body` (type checks only); the caller sets max_new_tokens and
    logprobs, then calls `check_sampling`."""
    def lab(n: str) -> str:
        return spelling.label(n)

    def k(n: str) -> str:
        return spelling.key(n)

    top_k = read_int(body, k("top_k"), -1, label=lab("top_k"), err=err)
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=read_num(body, k("temperature"), 1.0, label=lab("temperature"), err=err),
        top_p=read_num(body, k("top_p"), 1.0, label=lab("top_p"), err=err),
        top_k=-1 if top_k == 0 else top_k,
        min_p=read_num(body, k("min_p"), 0.0, label=lab("min_p"), err=err),
        seed=read_int(body, k("seed"), None, label=lab("seed"), err=err),
        stop=read_str_list(body, k("stop"), max_items=MAX_STOP_STRINGS, label=lab("stop"), err=err),
        stop_token_ids=read_id_list(body, k("stop_token_ids"), label=lab("stop_token_ids"), err=err),
        ignore_eos=read_bool(body, k("ignore_eos"), False, label=lab("ignore_eos"), err=err),
        skip_special_tokens=read_bool(body, k("skip_special_tokens"), True, label=lab("skip_special_tokens"),
                                      err=err),
    )


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
