"""SGLang's native `/generate` body (GenerateReqInput, SGLang 0.5.23) -> engine requests.

Validation in SGLang's two layers:
- the contract check: `sampling_params` accepts exactly SGLang's keys (an unknown key is a 400
  `{"error": "unknown field ..."}`), and the JSON type of each known field is checked
  (`SGLangContractError`);
- value checks (ranges, context length, duplicate rids): 400 `{"error": {"message", ...}}`, the
  OpenAI envelope, which is a superset of SGLang's `{"error": {"message"}}`.
Known fields the engine cannot serve yet (per-token-id logprobs, LoRA, multimodal inputs, ...) are a
400 naming them unless they carry their neutral value; unknown *top-level* keys are ignored with a
warning, as SGLang ignores them. Pure Python apart from the tokenizer passed in.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from trnrt.engine.request import GenerateRequest, SamplingParams
from trnrt.serve.http.errors import SGLangContractError, bad_request, safe, unsupported
from trnrt.serve.protocol.chat_template import encode_text
from trnrt.serve.protocol.fields import (NEUTRAL, check_priority, is_int, is_text, read_bool, read_int,
                                         refuse_unserved)
from trnrt.serve.protocol.sampling import SGLANG, check_sampling, read_sampling
from trnrt.serve.protocol import structured

log = logging.getLogger("trnrt.serve")

MAX_BATCH = 1024  # items per /generate body: bounds the work one request can queue
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default

# The keys SGLang 0.5.23's contract accepts inside sampling_params, in its order.
SAMPLING_KEYS = (
    "max_new_tokens", "min_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "n", "json_schema", "regex", "ebnf",
    "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
)
# Served by the engine today; the rest are refused unless neutral (fields.NEUTRAL).
SERVED_SAMPLING_KEYS = {"max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
                        "min_p", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
                        "sampling_seed", "stream_interval", "json_schema", "regex", "ebnf", "structural_tag",
                        "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias",
                        "min_new_tokens"}
_UNSERVED_SAMPLING = [k for k in SAMPLING_KEYS if k not in SERVED_SAMPLING_KEYS]

# Top-level GenerateReqInput fields trnrt serves, and those it knows but refuses unless neutral
# (value -> neutral test). Anything else at the top level is ignored with a warning.
_TOP_SERVED = {"text", "input_ids", "sampling_params", "rid", "stream", "return_logprob", "logprob_start_len",
               "top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs", "return_prompt_token_ids",
               "log_metrics", "extra_key", "cache_salt", "model", "priority", "routing_key", "no_logs",
               "max_thinking_tokens"}
# routing_key (SGLang): the router's session-affinity key; one engine has nothing to route, so it
# is accepted (type-checked) and has no effect here.


def _none_or(*neutral):
    return lambda v: v is None or any(type(v) is type(n) and v == n for n in neutral)


_TOP_REFUSED = {
    "input_embeds": _none_or(),
    "image_data": _none_or([]),
    "video_data": _none_or([]),
    "audio_data": _none_or([]),
    "modalities": _none_or([], ["text"]),
    "return_hidden_states": _none_or(False),
    "custom_logit_processor": _none_or(),
    "lora_path": _none_or(),
    "lora_id": _none_or(),
    "session_params": _none_or(),
    "session_id": _none_or(),
    "routed_dp_rank": _none_or(0),
    "data_parallel_rank": _none_or(0),
    "require_reasoning": _none_or(False),
    "return_entropy": _none_or(False),
    "return_routed_experts": _none_or(False),
    "bootstrap_host": _none_or(),
    "bootstrap_port": _none_or(),
    "bootstrap_room": _none_or(),
}
_WHY = {
    "token_ids_logprob": "needs per-token-id logprobs, which this server does not serve yet",
}


def contract_error(message: str, label: str | None = None) -> SGLangContractError:
    return SGLangContractError(message, label)


@dataclass
class GenerateItem:
    """One prompt of a /generate body, validated (token ids known once tokenized)."""

    text: str | None
    input_ids: list[int] | None
    params: SamplingParams
    max_new_tokens: int | None  # None: the client asked for "up to the context" (null)
    max_new_tokens_given: bool
    rid: str | None
    return_logprob: bool
    top_logprobs_num: int
    stream_interval: int | None = None  # None: the server's --stream-interval
    priority: int | None = None  # SGLang's scheduling priority (None: the server's default)
    prefix_group: str | None = None  # sampling_params.n > 1: the choices of one prompt share it
    cache_salt: str | None = None  # extra_key + cache_salt: the prefix cache's namespace
    # SGLang's logprob_start_len: -1 = output logprobs only; k >= 0 (with return_logprob) = also
    # the prompt's from position k (meta_info.input_token_logprobs / input_top_logprobs)
    logprob_start_len: int = -1

    @property
    def input_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0


@dataclass
class GenerateRequestIn:
    """A parsed /generate body: one item (`is_batch` False) or a batch."""

    items: list[GenerateItem]
    is_batch: bool
    stream: bool = False
    return_text_in_logprobs: bool = False
    return_prompt_token_ids: bool = False


def _per_item(body: dict, name: str, n: int, is_batch: bool, check, default):
    """A field that is one value for every item or (batch only) a list with one per item."""
    v = body.get(name)
    if v is None:
        return [default] * n
    if is_batch and isinstance(v, list):
        if len(v) != n:
            raise bad_request(f"{name} has {len(v)} entries but the batch has {n} prompts", name)
        return [check(x) for x in v]
    return [check(v)] * n


def _check_bool(name):
    def f(v):
        if not isinstance(v, bool):
            raise contract_error(f"invalid type for {name}: {v!r}, expected a boolean", name)
        return v
    return f


def _check_priority(v):
    return check_priority(v, "priority", contract_error)


def _check_top_n(v):
    if not is_int(v):
        raise contract_error(f"invalid type for top_logprobs_num: {v!r}, expected an integer", "top_logprobs_num")
    if not (0 <= v <= SamplingParams.MAX_TOP_LOGPROBS):
        raise bad_request(f"top_logprobs_num must be in [0, {SamplingParams.MAX_TOP_LOGPROBS}], got {v}",
                          "top_logprobs_num")
    return v


def _check_start_len(v):
    if not is_int(v):
        raise contract_error(f"invalid type for logprob_start_len: {v!r}, expected an integer", "logprob_start_len")
    if v < -1:
        raise bad_request(f"logprob_start_len must be -1 (output logprobs only) or a prompt position >= 0, "
                          f"got {v}", "logprob_start_len")
    return v


def _sampling_dict(sp, label: str) -> dict:
    if sp is None:
        return {}
    if not isinstance(sp, dict):
        raise contract_error(f"invalid type for {label}: expected an object", label)
    for key in sp:
        if key not in SAMPLING_KEYS:
            expected = ", ".join(f"`{k}`" for k in SAMPLING_KEYS)
            raise contract_error(f"unknown field `{safe(str(key))}` in {label}, expected one of {expected}",
                                 f"{label}.{safe(str(key))}")
    return sp


def _read_item_sampling(sp: dict, label: str) -> tuple[SamplingParams, int | None, bool, int | None]:
    spelling = SGLANG

    def err(msg, lab):
        return contract_error(msg, lab)

    refuse_unserved(sp, [k for k in _UNSERVED_SAMPLING if k in NEUTRAL], prefix=label + ".")
    params = read_sampling(sp, spelling, err=err)
    params.grammar = structured.read_sglang_one(sp, label + ".", err=err)
    given = "max_new_tokens" in sp
    max_new = read_int(sp, "max_new_tokens", None, lo=0, label=label + ".max_new_tokens", err=err)
    if not given:
        max_new = DEFAULT_MAX_NEW_TOKENS
    si = read_int(sp, "stream_interval", None, lo=1, label=label + ".stream_interval", err=err)
    check_sampling(params, None, spelling)
    return params, max_new, given, si


def parse_generate(body: dict) -> GenerateRequestIn:
    """Validate a /generate body (no tokenization yet)."""
    unknown = [k for k in body if k not in _TOP_SERVED and k not in _TOP_REFUSED]
    if unknown:
        log.warning("/generate: ignoring unknown request fields: %s", ", ".join(safe(repr(k)) for k in unknown[:16]))
    for key, neutral in _TOP_REFUSED.items():
        if key in body:
            try:
                ok = neutral(body[key])
            except Exception:
                ok = False
            if not ok:
                raise unsupported(key, _WHY.get(key, "is not supported by this server yet"))

    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise bad_request("Either text or input_ids should be provided (exactly one of them).",
                          "text" if text is not None else "input_ids")
    texts: list[str] | None = None
    id_lists: list[list[int]] | None = None
    if text is not None:
        if isinstance(text, str):
            texts, is_batch = [text], False
        elif isinstance(text, list) and all(isinstance(t, str) for t in text):
            texts, is_batch = list(text), True
        else:
            raise contract_error("invalid type for text: expected a string or a list of strings", "text")
        for t in texts:
            if not t:
                raise bad_request("text must not be empty", "text")
            if not is_text(t):
                raise bad_request("text is not valid Unicode (it holds a lone surrogate)", "text")
    else:
        if isinstance(ids, list) and ids and all(is_int(t) for t in ids):
            id_lists, is_batch = [list(ids)], False
        elif isinstance(ids, list) and ids and all(isinstance(x, list) for x in ids):
            if not all(x and all(is_int(t) for t in x) for x in ids):
                raise bad_request("input_ids must be a non-empty list of integers or a list of such lists", "input_ids")
            id_lists, is_batch = [list(x) for x in ids], True
        elif isinstance(ids, list) and not ids:
            raise bad_request("input_ids cannot be empty.", "input_ids")
        else:
            raise contract_error("invalid type for input_ids: expected a list of integers or a list of lists",
                                 "input_ids")
    n = len(texts if texts is not None else id_lists)
    if n == 0:
        raise bad_request("the batch is empty", "text" if texts is not None else "input_ids")
    if n > MAX_BATCH:
        raise bad_request(f"a /generate batch holds at most {MAX_BATCH} prompts, got {n}",
                          "text" if texts is not None else "input_ids")

    sp = body.get("sampling_params")
    if is_batch and isinstance(sp, list):
        if len(sp) != n:
            raise bad_request(f"sampling_params has {len(sp)} entries but the batch has {n} prompts",
                              "sampling_params")
        sps = [_sampling_dict(x, "sampling_params") for x in sp]
    else:
        sps = [_sampling_dict(sp, "sampling_params")] * n

    rid = body.get("rid")
    if rid is None:
        rids: list[str | None] = [None] * n
    elif isinstance(rid, str):
        if not rid or not is_text(rid):
            raise bad_request("rid must be a non-empty, valid Unicode string", "rid")
        rids = [f"{rid}_{i}" for i in range(n)] if is_batch else [rid]
    elif is_batch and isinstance(rid, list) and all(isinstance(r, str) and r and is_text(r) for r in rid):
        if len(rid) != n:
            raise bad_request(f"rid has {len(rid)} entries but the batch has {n} prompts", "rid")
        rids = list(rid)
    else:
        raise contract_error("invalid type for rid: expected a string (or, for a batch, a list of strings)", "rid")
    named = [r for r in rids if r is not None]
    if len(set(named)) != len(named):
        raise bad_request("Duplicate request ID detected in the batch", "rid")

    stream = read_bool(body, "stream", False, err=contract_error)
    return_lp = _per_item(body, "return_logprob", n, is_batch, _check_bool("return_logprob"), False)
    top_n = _per_item(body, "top_logprobs_num", n, is_batch, _check_top_n, 0)
    start_lens = _per_item(body, "logprob_start_len", n, is_batch, _check_start_len, -1)
    priorities = _per_item(body, "priority", n, is_batch, _check_priority, None)
    tid = body.get("token_ids_logprob")
    if tid not in (None, []) and not (isinstance(tid, list) and all(x in (None, []) for x in tid)):
        raise unsupported("token_ids_logprob", _WHY["token_ids_logprob"])
    salts: list[list[str | None]] = []
    for key in ("extra_key", "cache_salt"):
        # Prefix-cache namespaces: requests with different values never share cached state.
        v = body.get(key)
        if v is not None and not (isinstance(v, str) and is_text(v)) and not (
                is_batch and isinstance(v, list) and all(isinstance(x, str) and is_text(x) for x in v)):
            raise contract_error(f"invalid type for {key}: expected a string", key)
        if isinstance(v, list):
            if len(v) != n:
                raise bad_request(f"{key} has {len(v)} entries but the batch has {n} prompts", key)
            salts.append(list(v))
        else:
            salts.append([v] * n)
    namespaces = [None if a is None and b is None else f"{a or ''}\x00{b or ''}" for a, b in zip(*salts)]
    rk = body.get("routing_key")
    if rk is not None and not (isinstance(rk, str) and is_text(rk)):
        raise contract_error("invalid type for routing_key: expected a string", "routing_key")
    read_bool(body, "log_metrics", True, err=contract_error)
    model = body.get("model")  # SGLang's /generate ignores it (one model per server)
    if model is not None and not (isinstance(model, str) and is_text(model)):
        raise contract_error("invalid type for model: expected a string", "model")

    # SGLang's max_thinking_tokens (served without --enable-strict-thinking: the engine forces
    # </think> itself); null: unlimited
    think_budget = body.get("max_thinking_tokens")
    if think_budget is not None and (not is_int(think_budget) or think_budget < 0):
        # SGLang's top-level ints are strict (2.0 is not one), as for priority
        raise contract_error(f"max_thinking_tokens must be an integer >= 0, got {think_budget!r}", "max_thinking_tokens")
    items = []
    for i in range(n):
        params, max_new, given, si = _read_item_sampling(sps[i], "sampling_params")
        params.logprobs = top_n[i] if return_lp[i] else None
        if return_lp[i] and start_lens[i] >= 0:  # without return_logprob it is ignored, as in SGLang
            params.prompt_logprobs, params.prompt_logprobs_start = top_n[i], start_lens[i]
        params.max_thinking_tokens = think_budget
        items.append(GenerateItem(text=texts[i] if texts is not None else None,
                                  input_ids=id_lists[i] if id_lists is not None else None,
                                  params=params, max_new_tokens=max_new, max_new_tokens_given=given,
                                  rid=rids[i], return_logprob=return_lp[i], top_logprobs_num=top_n[i],
                                  stream_interval=si, priority=priorities[i], cache_salt=namespaces[i],
                                  logprob_start_len=start_lens[i]))
    items, is_batch = _expand_n(items, sps, is_batch)
    return GenerateRequestIn(
        items=items, is_batch=is_batch, stream=stream,
        return_text_in_logprobs=read_bool(body, "return_text_in_logprobs", False, err=contract_error),
        return_prompt_token_ids=read_bool(body, "return_prompt_token_ids", False, err=contract_error),
    )


def _expand_n(items: list[GenerateItem], sps: list[dict], is_batch: bool) -> tuple[list[GenerateItem], bool]:
    """sampling_params.n > 1 (SGLang's parallel sampling): each prompt becomes n items, grouped by
    prompt (all of prompt 0, then prompt 1, ...), each with a fresh rid; the response is a list.
    Choice i of a seeded prompt samples with seed + i. The engine computes each prompt once."""
    import dataclasses
    import uuid

    from trnrt.serve.protocol.openai import MAX_N

    ns = [read_int(sp, "n", 1, lo=1, hi=MAX_N, label="sampling_params.n", err=contract_error) for sp in sps]
    if all(n == 1 for n in ns):
        return items, is_batch
    if len(set(ns)) > 1:
        raise bad_request("sampling_params.n must be the same for every prompt of a batch", "sampling_params.n")
    n = ns[0]
    if len(items) * n > MAX_BATCH:
        raise bad_request(f"a /generate batch holds at most {MAX_BATCH} outputs (prompts x n), "
                          f"got {len(items) * n}", "sampling_params.n")
    out = []
    for item in items:
        group = "gen-" + uuid.uuid4().hex
        for i in range(n):
            params = item.params.clone()
            if params.seed is not None:
                params.seed = (params.seed + i) & ((1 << 64) - 1)
            out.append(dataclasses.replace(item, params=params, rid=None, prefix_group=group))
    return out, True


def _context_max_new(item: GenerateItem, n_prompt: int, ctx: int) -> int:
    """max_new_tokens after SGLang's context rules (a 400 naming the field when it cannot fit)."""
    if n_prompt >= ctx:
        raise bad_request(f"The input ({n_prompt} tokens) is longer than the model's context length ({ctx} tokens).",
                          "input_ids" if item.input_ids is not None else "text")
    room = ctx - n_prompt
    if item.max_new_tokens is None:  # null: up to the context
        return room
    if item.max_new_tokens_given and item.max_new_tokens > room:
        raise bad_request(
            f"Requested token count exceeds the model's maximum context length of {ctx} tokens. You requested a "
            f"total of {n_prompt + item.max_new_tokens} tokens: {n_prompt} tokens from the input messages and "
            f"{item.max_new_tokens} tokens for the completion. Please reduce the number of tokens in the input "
            f"messages or the completion to fit within the limit.", "sampling_params.max_new_tokens")
    return min(item.max_new_tokens, room)  # the default 128 is clipped, as SGLang's scheduler does


def to_engine_requests(greq: GenerateRequestIn, tokenizer, ctx: int, vocab_size: int) -> list[GenerateRequest]:
    """Tokenize and build one engine request per item (all validated before any is submitted)."""
    out = []
    for item in greq.items:
        if item.input_ids is not None:
            bad = next((t for t in item.input_ids if not (0 <= t < vocab_size)), None)
            if bad is not None:
                raise bad_request(f"input_ids contains the token id {bad}, outside the vocabulary [0, {vocab_size})",
                                  "input_ids")
            ids = item.input_ids
        else:
            # No special tokens added, like /v1/completions: both routes then give the same ids for
            # the same text (GLM's tokenizers add none; its chat template writes [gMASK]<sop>).
            ids = encode_text(tokenizer, item.text, "text", add_special_tokens=False, max_tokens=ctx)
            if not ids:
                raise bad_request("text tokenized to no tokens", "text")
        if item.input_logprobs and item.logprob_start_len >= len(ids):
            raise bad_request(f"logprob_start_len ({item.logprob_start_len}) must be less than the number of "
                              f"input tokens ({len(ids)}). Please use a smaller logprob_start_len.",
                              "logprob_start_len")
        params = item.params.clone(max_new_tokens=_context_max_new(item, len(ids), ctx))
        check_sampling(params, vocab_size, SGLANG, renames={"logprobs": "top_logprobs_num"})
        kw = {"request_id": item.rid} if item.rid is not None else {}
        out.append(GenerateRequest(list(ids), params, stream=greq.stream, stream_interval=item.stream_interval,
                                   priority=item.priority, prefix_group=item.prefix_group,
                                   cache_salt=item.cache_salt, **kw))
    return out


def engine_field_to_sglang(name: str | None, greq: GenerateRequestIn) -> str | None:
    """Engine field names back to /generate's spelling, for error messages."""
    if name == "prompt_token_ids":
        return "input_ids" if greq.items[0].input_ids is not None else "text"
    if name == "rid":
        return "rid"
    if name in ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "stop_regex",
                "repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias", "min_new_tokens"):
        return "sampling_params." + name
    if name == "seed":
        return "sampling_params.sampling_seed"
    if name in ("prompt_logprobs", "prompt_logprobs_start"):
        return "logprob_start_len"
    return name
