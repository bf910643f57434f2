"""Typed readers for JSON request bodies: a 400 naming the field for every wrong type.

Shared by every API's protocol module, so a field is read the same way on every route: a bool
is never a number, a float that is an integer (16.0) is an integer, numbers must be finite,
strings must be valid Unicode (no lone surrogates). Pure Python.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from trnrt.serve.http.errors import APIError, bad_request

# Builds the error for a field; protocol modules pass their API's own (e.g. SGLang's contract form).
ErrorFactory = Callable[[str, str], APIError]


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def is_text(v) -> bool:
    """A str that encodes to UTF-8 (JSON `"\\ud800"` decodes to a lone surrogate, which cannot)."""
    if not isinstance(v, str):
        return False
    try:
        v.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def check_unicode_tree(value, label: str, err: ErrorFactory = bad_request, _depth: int = 0) -> None:
    """Every string (keys included) inside a JSON value is valid Unicode, or a 400 naming `label`."""
    if _depth > 64:
        raise err(f"{label} is nested too deeply", label)
    if isinstance(value, str):
        if not is_text(value):
            raise err(f"{label} is not valid Unicode (it holds a lone surrogate)", label)
    elif isinstance(value, dict):
        for k, v in value.items():
            check_unicode_tree(k, label, err, _depth + 1)
            check_unicode_tree(v, label, err, _depth + 1)
    elif isinstance(value, list):
        for v in value:
            check_unicode_tree(v, label, err, _depth + 1)


def read_int(body: dict, name: str, default, lo: int | None = None, hi: int | None = None, *,
             label: str | None = None, err: ErrorFactory = bad_request):
    label = label or name
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)  # JSON clients sometimes print 16 as 16.0
    if not is_int(v):
        raise err(f"{label} must be an integer, got {v!r}", label)
    if lo is not None and v < lo:
        raise err(f"{label} must be >= {lo}, got {v}", label)
    if hi is not None and v > hi:
        raise err(f"{label} must be <= {hi}, got {v}", label)
    return v


def read_num(body: dict, name: str, default: float, *, label: str | None = None,
             err: ErrorFactory = bad_request) -> float:
    label = label or name
    v = body.get(name)
    if v is None:
        return default
    if not is_num(v):
        raise err(f"{label} must be a finite number, got {v!r}", label)
    return float(v)


def read_bool(body: dict, name: str, default: bool, *, label: str | None = None,
              err: ErrorFactory = bad_request) -> bool:
    label = label or name
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise err(f"{label} must be a boolean, got {v!r}", label)
    return v


def read_str(body: dict, name: str, default: str | None, *, label: str | None = None,
             err: ErrorFactory = bad_request) -> str | None:
    label = label or name
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, str):
        raise err(f"{label} must be a string, got {type(v).__name__}", label)
    if not is_text(v):
        raise err(f"{label} is not valid Unicode (it holds a lone surrogate)", label)
    return v


def read_str_list(body: dict, name: str, *, max_items: int, label: str | None = None,
                  err: ErrorFactory = bad_request) -> list[str]:
    """A string or a list of non-empty strings (e.g. `stop`); [] when absent."""
    label = label or name
    v = body.get(name)
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise err(f"{label} must be a non-empty string or a list of non-empty strings", label)
    if not all(is_text(s) for s in v):
        raise err(f"{label} is not valid Unicode (it holds a lone surrogate)", label)
    if len(v) > max_items:
        raise err(f"{label} accepts at most {max_items} strings", label)
    return list(v)


def read_id_list(body: dict, name: str, *, label: str | None = None, err: ErrorFactory = bad_request) -> list[int]:
    """A list of non-negative integers (token ids); [] when absent."""
    label = label or name
    v = body.get(name)
    if v is None:
        return []
    if not isinstance(v, list) or not all(is_int(t) and t >= 0 for t in v):
        raise err(f"{label} must be a list of non-negative integers", label)
    return list(v)


def read_logit_bias(body: dict, name: str, *, label: str | None = None,
                    err: ErrorFactory = bad_request) -> dict[int, float] | None:
    """OpenAI's / SGLang's logit_bias: an object mapping token ids (decimal strings, as JSON keys
    are) to finite numbers; None when absent or empty. The range ([-100, 100]) and the vocabulary
    are checked by SamplingParams.validate."""
    label = label or name
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, dict):
        raise err(f"{label} must be an object mapping token ids to biases", label)
    out: dict[int, float] = {}
    for k, b in v.items():
        key = k.strip() if isinstance(k, str) else k
        if isinstance(key, str) and key.lstrip("-").isdigit() and key.isascii():
            key = int(key)
        if not is_int(key):
            raise err(f"{label} keys must be token ids (integers), got {str(k)[:40]!r}", label)
        if not is_num(b):
            raise err(f"{label} values must be finite numbers, got {b!r} for token {key}", label)
        out[key] = float(b)
    return out or None


PRIORITY_MIN, PRIORITY_MAX = -(2 ** 63), 2 ** 63 - 1  # SGLang's priorities are C longs at most


def check_priority(v, label: str = "priority", err: ErrorFactory = bad_request, *,
                   lax: bool = False) -> int | None:
    """SGLang's `priority`: null or an integer within 64 bits; a bool or a fractional float is a
    400 naming the field. `lax` takes an integral float (2.0) as an integer, as the OpenAI
    routes read every integer (SGLang's pydantic models do); /generate's contract does not."""
    if v is None:
        return None
    if lax and isinstance(v, float) and v.is_integer():
        v = int(v)
    if not is_int(v):
        raise err(f"{label} must be an integer, got {v!r}", label)
    if not PRIORITY_MIN <= v <= PRIORITY_MAX:
        raise err(f"{label} must fit in 64 bits, got {v}", label)
    return v


def _neutral(want: Any) -> Callable[[Any], bool]:
    """A value test: equal to `want` *and* of its JSON type (True is not 1, False is not 0)."""
    def test(v) -> bool:
        if isinstance(want, bool) or isinstance(v, bool):
            return isinstance(v, bool) and isinstance(want, bool) and v == want
        if isinstance(want, (int, float)):
            return is_num(v) and v == want
        return type(v) is type(want) and v == want
    return test


def _never(v) -> bool:
    return False


# Fields the engine cannot serve yet, accepted only with the value that means "off" (an
# equivalent spelling included); anything else is a 400 naming the field. The test returns True
# when the given value is neutral. Shared by the OpenAI and SGLang adapters.
NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "frequency_penalty": _neutral(0),
    "presence_penalty": _neutral(0),
    "repetition_penalty": _neutral(1),
    "logit_bias": _neutral({}),
    "min_tokens": _neutral(0),
    "min_new_tokens": _neutral(0),
    "regex": _never,
    "ebnf": _never,
    "json_schema": _never,
    "structural_tag": _never,
    "structured_outputs": _never,
    "guided_json": _never,
    "guided_regex": _never,
    "guided_choice": _never,
    "guided_grammar": _never,
    "response_format": lambda v: isinstance(v, dict) and v.get("type") == "text" and len(v) == 1,
    "suffix": _neutral(""),
    "return_hidden_states": _neutral(False),
    "parallel_tool_calls": _neutral(True),
    # prompt_logprobs is served on the OpenAI routes (with --prompt-logprobs) and logprob_start_len
    # on /generate (its own check); /v1/completions does not read SGLang's logprob_start_len (echo
    # with logprobs asks for the prompt's there), so it stays refused on that route
    "logprob_start_len": _never,
    "lora_path": _never,
    "custom_logit_processor": _never,
    "custom_params": _never,
    "thinking_token_budget": _neutral(-1),
    "continue_final_message": _neutral(False),
    "modalities": lambda v: v == ["text"],
    "audio": _never,
    "functions": _never,
    "function_call": _never,
    "prediction": _never,
    "web_search_options": _never,
    "verbosity": _never,
    "beam_width": _never,
    "watermark": _never,
    "choice": lambda v: v == [],
}


def refuse_unserved(body: dict, names, *, prefix: str = "", err=None) -> None:
    """A 400 naming the first field of `names` present in `body` with a non-neutral value."""
    from trnrt.serve.http.errors import unsupported

    for key in names:
        if key in body and body[key] is not None:
            try:
                ok = NEUTRAL[key](body[key])
            except Exception:  # an odd type is simply not neutral
                ok = False
            if not ok:
                raise (err or unsupported)(prefix + key)
