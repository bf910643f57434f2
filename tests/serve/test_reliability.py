"""Reliability: a generated corpus of malformed requests over every route, fault injection, and
client chat templates (--trust-request-chat-template).

The corpus (`build_corpus`) is generated from a table of every JSON route's fields: each field gets
every JSON type (string, number, float, bool, null, list, object, a list nested 40 deep), numeric
fields also their boundaries (0, -1, 10**30, 1e-300, NaN, Infinity, -Infinity and 1e400 as raw JSON
tokens), every string field a lone surrogate (`\\ud800` as a raw escape), and each case carries the
class it must get: "2xx" where the value is legitimately accepted, "4xx" (or an exact status)
where it must be refused. Around that: bad Content-Types, malformed and deeply nested bodies, bodies
near the 1 MiB limit, bad tool schemas, odd query strings, wrong methods and unknown routes. Every
response must be in its class, every refusal a JSON error body, no response a 5xx, and afterwards
the server serves a normal request and is idle.

The expectations are written from the APIs (OpenAI, SGLang 0.5.23, vLLM), not read from the
server's validators: `accepts` in each field's row says which values a client may send.

Everything runs against the scripted server on loopback, one request at a time (about 2400 cases,
~10 s); a subset of ~150 runs once against the real tiny model too (`any_server`).
"""

from __future__ import annotations

import collections
import http.client
import json
import logging
import math
import os
import time
from dataclasses import dataclass

import pytest

from serve_support import assert_idle

MODEL = "trnrt-tiny"
CHAT, COMP, GEN = "/v1/chat/completions", "/v1/completions", "/generate"
MSGS = [{"role": "user", "content": "hi"}]
LIMIT = 1 << 20  # the test servers' max_request_bytes
VOCAB_OOV = 10**9
SURROGATE = "hi\ud800"  # json.dumps writes it as the raw escape "hi\ud800"
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


# --- one case -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One request and the answer it must get: `expect` is "2xx", "4xx" or an exact status."""

    id: str
    method: str
    path: str
    body: bytes | None = None
    expect: str | int = "4xx"
    headers: tuple = (("Content-Type", "application/json"),)


def dumps(obj) -> bytes:
    # allow_nan writes NaN/Infinity as the raw (invalid) JSON tokens; ensure_ascii writes a lone
    # surrogate as the raw escape \ud800, which is valid JSON but not valid Unicode.
    return json.dumps(obj, allow_nan=True).encode()


def nest_list(depth: int):
    v: object = 1
    for _ in range(depth):
        v = [v]
    return v


def nest_obj(depth: int):
    v: object = 1
    for _ in range(depth):
        v = {"a": v}
    return v


# The JSON types every field gets.
TYPES = {"str": "x", "int": 3, "float": 2.5, "bool": True, "null": None, "list": [1], "obj": {"a": 1},
         "deep": nest_list(40)}
# Numeric boundaries; the last four are written as raw tokens (NaN, Infinity, -Infinity, 1e400).
NUMBERS = {"zero": 0, "neg": -1, "huge": 10**30, "tiny": 1e-300, "intfloat": 2.0, "nan": math.nan,
           "inf": math.inf, "ninf": -math.inf}
RAW_1E400 = "1e400"  # parses to float('inf'): must be refused like Infinity


# --- what a field accepts (written from the API, not read from the server's code) ---------------
def is_int(v) -> bool:
    return (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and math.isfinite(v)
                                                                 and v.is_integer())


def is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def int_in(lo=None, hi=None):
    return lambda v: v is None or (is_int(v) and (lo is None or v >= lo) and (hi is None or v <= hi))


def num_in(lo=None, hi=None, lo_open=False):
    def ok(v):
        if v is None:
            return True
        if not is_num(v):
            return False
        if lo is not None and (v <= lo if lo_open else v < lo):
            return False
        return hi is None or v <= hi
    return ok


def strict_int_in(lo=None, hi=None):  # SGLang's contract: 2.0 is not an integer
    return lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)
                                   and (lo is None or v >= lo) and (hi is None or v <= hi))


def is_bool(v) -> bool:
    return v is None or isinstance(v, bool)


def is_str(v) -> bool:
    return v is None or isinstance(v, str)


def nonempty_str(v) -> bool:
    return v is None or (isinstance(v, str) and bool(v))


def only_null(v) -> bool:
    return v is None


def anything(v) -> bool:
    return True


def stop_ok(v) -> bool:
    if v is None or (isinstance(v, str) and v):
        return True
    return isinstance(v, list) and len(v) <= 32 and all(isinstance(s, str) and s for s in v)


def stop_regex_ok(v) -> bool:
    """SGLang's stop_regex: a pattern or up to 32, each one RE2 runs (the engine's own check)."""
    from trnrt.engine.request import InvalidRequestError
    from trnrt.engine.output.stop import compile_stop_regex

    if v is None or v == "":
        return True
    pats = [v] if isinstance(v, str) else v
    if not isinstance(pats, list) or len(pats) > 32 or not all(isinstance(p, str) for p in pats):
        return False
    try:
        for p in pats:
            p.encode("utf-8")
            compile_stop_regex(p)
    except (InvalidRequestError, UnicodeEncodeError):
        return False
    return True


def ids_ok(v) -> bool:
    return v is None or (isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                                     and 0 <= t < 1000 for t in v))


def neutral(want):
    """A field the engine cannot serve yet: accepted only as its "off" value, of the same JSON type
    (numbers compare as numbers, a bool is never a number)."""
    def ok(v):
        if v is None:
            return True
        if isinstance(want, bool) or isinstance(v, bool):
            return isinstance(v, bool) and isinstance(want, bool) and v == want
        if isinstance(want, (int, float)):
            return is_num(v) and v == want
        return type(v) is type(want) and v == want
    return ok


def strict_neutral(*wants):
    """SGLang's top-level refusals: null or one of `wants`, same Python type exactly."""
    return lambda v: v is None or any(type(v) is type(w) and v == w for w in wants)


@dataclass(frozen=True)
class Field:
    """A body field: `accepts(value)` is whether that value, in an otherwise valid body, is served."""

    name: str
    accepts: object
    numeric: bool = False
    text: bool = False  # a string field: a lone surrogate in it is a 400
    required: bool = False
    extra: tuple = ()  # (label, value, expect)


def fld(name, accepts, *, numeric=False, text=False, required=False, extra=()):
    if required:
        base = accepts
        accepts = lambda v: v is not None and base(v)  # noqa: E731
    return Field(name, accepts, numeric, text, required, tuple(extra))


SAMPLING_OPENAI = [
    fld("temperature", num_in(0), numeric=True, extra=[("large", 1e300, "2xx"), ("negzero", -0.0, "2xx")]),
    fld("top_p", num_in(0, 1, lo_open=True), numeric=True, extra=[("one", 1, "2xx"), ("half", 0.5, "2xx")]),
    fld("top_k", int_in(-1), numeric=True, extra=[("minus-two", -2, "4xx"), ("one", 1, "2xx")]),
    fld("min_p", num_in(0, 1), numeric=True, extra=[("above-one", 1.5, "4xx")]),
    fld("n", int_in(1, 128), numeric=True, extra=[("two", 2, "2xx"), ("max", 128, "2xx"), ("over", 129, "4xx")]),
    fld("priority", int_in(-(2**63), 2**63 - 1), numeric=True),  # served (ignored without --enable-priority-scheduling)
    fld("seed", int_in(-(2**63), 2**63 - 1), numeric=True,
        extra=[("int64-max", 2**63 - 1, "2xx"), ("below-int64", -(2**63) - 1, "4xx"), ("above-int64", 2**63, "4xx")]),
    fld("stop", stop_ok, text=True, extra=[("empty-string", "", "4xx"), ("empty-in-list", ["a", ""], "4xx"),
                                           ("32", ["s"] * 32, "2xx"), ("33", ["s"] * 33, "4xx"), ("empty-list", [], "2xx")]),
    fld("stop_token_ids", ids_ok, extra=[("negative", [-1], "4xx"), ("oov", [VOCAB_OOV], "4xx"),
                                         ("bool-ids", [True], "4xx"), ("float-ids", [1.0], "4xx")]),
    fld("ignore_eos", is_bool),
    fld("skip_special_tokens", is_bool),
    fld("user", is_str, text=True, extra=[("large", "u" * 200_000, "2xx")]),
    fld("rid", nonempty_str, text=True, extra=[("empty", "", "4xx")]),
    fld("request_id", nonempty_str, text=True, extra=[("empty", "", "4xx")]),
    fld("stream", is_bool),
    fld("stream_options", only_null, extra=[("without-stream", {"include_usage": True}, "4xx")]),
]
NEUTRAL_COMMON = [
    ("frequency_penalty", 0), ("presence_penalty", 0), ("repetition_penalty", 1), ("logit_bias", {}),
    ("min_tokens", 0), ("return_hidden_states", False),
]
NEVER_COMMON = ["regex", "ebnf", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                "guided_grammar", "prompt_logprobs", "lora_path", "custom_logit_processor", "custom_params"]


def neutral_fields(pairs, never, extra_neutral=()) -> list[Field]:
    out = [fld(k, neutral(v), extra=[("neutral", v, "2xx")]) for k, v in list(pairs) + list(extra_neutral)]
    out += [fld(k, only_null) for k in never]
    # served with every flag off (host-only): -1 unlimited, N >= 0 a budget
    out.append(fld("thinking_token_budget", int_in(-1), numeric=True))
    out.append(fld("stop_regex", stop_regex_ok,
                   extra=[("empty-list", [], "2xx"), ("empty-string", "", "2xx"), ("pattern", "a+", "2xx"),
                          ("backref", r"(a)\1", "4xx"), ("33", ["a"] * 33, "4xx")]))
    out += [fld(k, is_bool) for k in ("no_stop_trim", "include_stop_str_in_output", "spaces_between_special_tokens")]
    out.append(fld("response_format", lambda v: v is None or v == {"type": "text"},
                   extra=[("text", {"type": "text"}, "2xx"), ("json", {"type": "json_object"}, "4xx"),
                          ("schema", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}, "4xx")]))
    return out


TOOL = {"type": "function", "function": {"name": "get_weather", "description": "weather",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def tool(**fn):
    return {"type": "function", "function": {"name": "f", **fn}}


BAD_TOOLS = [
    # (label, tools, expect)
    ("no-function", [{"type": "function"}], "4xx"),
    ("function-string", [{"type": "function", "function": "f"}], "4xx"),
    ("type-other", [{"type": "retrieval", "function": {"name": "f"}}], "4xx"),
    ("name-int", [{"type": "function", "function": {"name": 5}}], "4xx"),
    ("name-empty", [tool(name="")], "4xx"),
    ("name-dot", [tool(name="a.b")], "4xx"),
    ("name-65", [tool(name="a" * 65)], "4xx"),
    ("name-64", [tool(name="a" * 64)], "2xx"),
    ("name-unicode", [tool(name="ünï")], "4xx"),
    ("description-int", [tool(description=5)], "4xx"),
    ("params-list", [tool(parameters=[])], "4xx"),
    ("params-string", [tool(parameters="{}")], "4xx"),
    ("params-type-int", [tool(parameters={"type": 5})], "4xx"),
    ("params-type-unknown", [tool(parameters={"type": "object", "properties": {"a": {"type": "nope"}}})], "4xx"),
    ("params-required-string", [tool(parameters={"type": "object", "required": "a"})], "4xx"),
    ("params-properties-list", [tool(parameters={"type": "object", "properties": ["a"]})], "4xx"),
    ("params-minimum-string", [tool(parameters={"type": "integer", "minimum": "3"})], "4xx"),
    ("params-draft04-exclusive-bool", [tool(parameters={"$schema": "http://json-schema.org/draft-04/schema#",
                                                        "type": "number", "minimum": 0, "exclusiveMinimum": True})],
     "2xx"),
    ("params-2020-exclusive-bool", [tool(parameters={"type": "number", "exclusiveMinimum": True})], "4xx"),
    ("params-unresolved-ref", [tool(parameters={"$ref": "http://127.0.0.1:1/never-fetched"})], "2xx"),
    ("params-nested-500", [tool(parameters=nest_obj(500))], "4xx"),
    ("params-surrogate-key", [tool(parameters={"type": "object", "properties": {SURROGATE: {}}})], "4xx"),
    ("tool-not-object", [5], "4xx"),
    ("two-tools", [TOOL, tool(name="g")], "2xx"),
    ("too-many-for-context", [tool(name=f"f{i}", description="d" * 200) for i in range(400)], "4xx"),
]

CHAT_FIELDS = [
    fld("model", lambda v: v is None or v == MODEL, text=True, extra=[("served", MODEL, "2xx"), ("other", "gpt-9", 404)]),
    fld("messages", lambda v: False, required=True, extra=[
        ("empty", [], "4xx"), ("role-wizard", [{"role": "wizard", "content": "x"}], "4xx"),
        ("role-int", [{"role": 1, "content": "x"}], "4xx"), ("content-int", [{"role": "user", "content": 5}], "4xx"),
        ("content-null-user", [{"role": "user", "content": None}], "4xx"),
        ("content-parts", [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
         "2xx"),
        ("content-part-image", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "4xx"),
        ("content-part-no-text", [{"role": "user", "content": [{"type": "text"}]}], "4xx"),
        ("content-deep", [{"role": "user", "content": nest_list(40)}], "4xx"),
        ("developer-role", [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}], "2xx"),
        ("assistant-null-content", [{"role": "user", "content": "a"}, {"role": "assistant", "content": None},
                                    {"role": "user", "content": "b"}], "2xx"),
        ("tool-call-args-not-json", [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{x"}}]}], "4xx"),
        ("tool-call-args-list", [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}], "4xx"),
        ("tool-calls-string", [{"role": "assistant", "content": "x", "tool_calls": "no"}], "4xx"),
        ("name-list", [{"role": "user", "content": "x", "name": []}], "4xx"),
        ("nul-char", [{"role": "user", "content": "a\u0000b"}], "2xx"),
        ("astral-pair", [{"role": "user", "content": "\U0001f600"}], "2xx"),
        ("surrogate-content", [{"role": "user", "content": SURROGATE}], "4xx"),
        ("surrogate-low", [{"role": "user", "content": "\udc00"}], "4xx"),
        ("surrogate-part", [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}], "4xx"),
        ("surrogate-name", [{"role": "user", "content": "a", "name": SURROGATE}], "4xx"),
        ("surrogate-reasoning", [{"role": "assistant", "content": "a", "reasoning_content": SURROGATE}], "4xx"),
        ("surrogate-tool-call-id", [{"role": "tool", "content": "a", "tool_call_id": SURROGATE}], "4xx"),
        ("over-context", [{"role": "user", "content": "word " * 150_000}], "4xx"),
        ("20k-messages", [{"role": "user", "content": "a"}] * 20_000, "4xx"),
    ]),
    fld("max_tokens", int_in(1, 500), numeric=True, extra=[("one", 1, "2xx"), ("over-context", 1024, "4xx")]),
    fld("max_completion_tokens", int_in(1, 500), numeric=True, extra=[("one", 1, "2xx")]),
    *SAMPLING_OPENAI,
    fld("logprobs", is_bool),
    fld("top_logprobs", int_in(0, 0), numeric=True),  # > 0 needs logprobs (see the logprobs cases below)
    fld("tools", lambda v: v is None or v == [], extra=[(label, t, e) for label, t, e in BAD_TOOLS]
        + [("empty", [], "2xx"), ("one", [TOOL], "2xx")]),
    fld("tool_choice", lambda v: v is None or v in ("auto", "none"),
        extra=[("auto", "auto", "2xx"), ("none", "none", "2xx"), ("required", "required", "4xx"),
               ("named", {"type": "function", "function": {"name": "f"}}, "4xx")]),
    fld("chat_template_kwargs", lambda v: v is None or (isinstance(v, dict)),
        extra=[("nested-40", nest_obj(40), "2xx"), ("nested-70", nest_obj(70), "4xx"),
               ("enable-thinking-false", {"enable_thinking": False}, "2xx"),
               ("enable-thinking-string", {"enable_thinking": "no"}, "4xx"),
               ("reserved-messages", {"messages": []}, "4xx"), ("reserved-tokenize", {"tokenize": True}, "4xx"),
               ("surrogate-value", {"x": SURROGATE}, "4xx"), ("surrogate-key", {SURROGATE: 1}, "4xx"),
               ("client-template", {"chat_template": "{{ 'a' * 100000000 }}"}, "4xx"),
               ("client-template-int", {"chat_template": 5}, "4xx"),
               ("client-template-null", {"chat_template": None}, "2xx")]),
    fld("reasoning_effort", lambda v: v is None or v in REASONING_EFFORTS, text=True,
        extra=[("low", "low", "2xx"), ("none", "none", "2xx"), ("extreme", "extreme", "4xx")]),
    fld("separate_reasoning", is_bool),
    fld("stream_reasoning", is_bool),
    fld("chat_template", only_null, text=True, extra=[("template", "{{ messages }}", "4xx"), ("empty", "", "4xx")]),
    *neutral_fields(NEUTRAL_COMMON, NEVER_COMMON + ["audio", "functions", "function_call", "prediction",
                                                    "web_search_options", "verbosity"],
                    [("parallel_tool_calls", True), ("continue_final_message", False)]),
    fld("modalities", lambda v: v is None or v == ["text"], extra=[("text", ["text"], "2xx"), ("image", ["image"], "4xx")]),
]

COMPLETION_FIELDS = [
    fld("model", lambda v: v is None or v == MODEL, text=True, extra=[("other", "gpt-9", 404)]),
    fld("prompt", lambda v: (isinstance(v, str) and v) or v == [1], required=True, text=True, extra=[
        ("empty", "", "4xx"), ("empty-list", [], "4xx"), ("strings", ["a", "b"], "2xx"), ("id-lists", [[1, 2], [3]], "2xx"),
        ("empty-id-list", [[]], "4xx"), ("mixed", [1, "a"], "4xx"), ("bool-ids", [True], "4xx"), ("oov", [VOCAB_OOV], "4xx"),
        ("negative-id", [-1], "4xx"), ("float-id", [1.5], "4xx"), ("ids-over-context", [5] * 2000, "4xx"),
        ("surrogate-in-list", ["a", SURROGATE], "4xx"), ("over-context", "word " * 150_000, "4xx")]),
    fld("max_tokens", int_in(1, 500), numeric=True, extra=[("over-context", 1024, "4xx")]),
    *SAMPLING_OPENAI,
    fld("echo", is_bool),
    fld("logprobs", int_in(0, 20), numeric=True, extra=[("max", 20, "2xx"), ("over-max", 21, "4xx")]),
    fld("best_of", lambda v: v is None or (is_int(v) and v == 1), extra=[("one", 1, "2xx"), ("two", 2, "4xx")]),
    fld("suffix", neutral(""), text=True, extra=[("empty", "", "2xx")]),
    *neutral_fields(NEUTRAL_COMMON, NEVER_COMMON + ["json_schema", "logprob_start_len"]),
]

SP = "sampling_params"
GENERATE_TOP = [
    fld("text", lambda v: isinstance(v, str) and bool(v), required=True, text=True, extra=[
        ("empty", "", "4xx"), ("batch", ["a", "b"], "2xx"), ("batch-empty-item", ["a", ""], "4xx"),
        ("batch-empty", [], "4xx"), ("batch-1025", ["a"] * 1025, "4xx"), ("batch-surrogate", ["a", SURROGATE], "4xx"),
        ("over-context", "word " * 150_000, "4xx")]),
    fld("input_ids", only_null),  # beside text: exactly one of them
    fld(SP, lambda v: v is None or v == {}, extra=[("empty", {}, "2xx"), ("unknown-key", {"max_new_token": 2}, "4xx"),
                                                   ("per-item-not-batch", [{"max_new_tokens": 2}], "4xx")]),
    fld("rid", nonempty_str, text=True, extra=[("empty", "", "4xx"), ("list-not-batch", ["r"], "4xx")]),
    fld("stream", is_bool),
    fld("return_logprob", is_bool),
    fld("top_logprobs_num", strict_int_in(0, 20), numeric=True, extra=[("max", 20, "2xx"), ("over-max", 21, "4xx")]),
    # -1, or a prompt position: without return_logprob it is ignored (SGLang); with it a position
    # needs --prompt-logprobs (test_prompt_logprobs_routes.py)
    fld("logprob_start_len", strict_int_in(-1), numeric=True,
        extra=[("minus-one", -1, "2xx"), ("minus-two", -2, "4xx"), ("position", 5, "2xx")]),
    fld("token_ids_logprob", lambda v: v is None or v == [], extra=[("empty", [], "2xx"), ("ids", [1, 2], "4xx")]),
    fld("return_text_in_logprobs", is_bool),
    fld("return_prompt_token_ids", is_bool),
    fld("log_metrics", is_bool),
    fld("extra_key", is_str, text=True),
    fld("cache_salt", is_str, text=True),
    fld("model", is_str, text=True, extra=[("other", "gpt-9", "2xx")]),  # SGLang's /generate ignores it
    fld("priority", strict_int_in(-(2**63), 2**63 - 1), numeric=True),
    fld("max_thinking_tokens", strict_int_in(0), numeric=True),
    *[fld(k, strict_neutral(*w)) for k, w in [
        ("input_embeds", ()), ("image_data", ([],)), ("video_data", ([],)), ("audio_data", ([],)),
        ("modalities", ([], ["text"])), ("return_hidden_states", (False,)),
        ("custom_logit_processor", ()), ("lora_path", ()), ("lora_id", ()), ("session_params", ()), ("session_id", ()),
        ("routed_dp_rank", (0,)), ("data_parallel_rank", (0,)), ("require_reasoning", (False,)),
        ("return_entropy", (False,)), ("return_routed_experts", (False,)),
        ("bootstrap_host", ()), ("bootstrap_port", ()), ("bootstrap_room", ())]],
]
# SGLang's pydantic fields take 2.0 for an int (lax mode), as the OpenAI routes do.
GENERATE_SAMPLING = [
    fld("max_new_tokens", int_in(0, 500), numeric=True, extra=[("zero-tokens", 0, "2xx"), ("over-context", 1024, "4xx")]),
    fld("temperature", num_in(0), numeric=True),
    fld("top_p", num_in(0, 1, lo_open=True), numeric=True),
    fld("top_k", int_in(-1), numeric=True),
    fld("min_p", num_in(0, 1), numeric=True),
    fld("sampling_seed", int_in(-(2**63), 2**63 - 1), numeric=True),
    fld("n", int_in(1, 128), numeric=True, extra=[("two", 2, "2xx")]),
    fld("stop", stop_ok, text=True, extra=[("33", ["s"] * 33, "4xx")]),
    fld("stop_token_ids", ids_ok, extra=[("oov", [VOCAB_OOV], "4xx")]),
    fld("ignore_eos", is_bool),
    fld("skip_special_tokens", is_bool),
    fld("stream_interval", int_in(1), numeric=True),
    *[fld(k, neutral(v), extra=[("neutral", v, "2xx")]) for k, v in [
        ("min_new_tokens", 0), ("frequency_penalty", 0), ("presence_penalty", 0), ("repetition_penalty", 1),
        ("logit_bias", {})]],
    *[fld(k, is_bool) for k in ("spaces_between_special_tokens", "no_stop_trim")],
    *[fld(k, only_null) for k in ("json_schema", "regex", "ebnf", "structural_tag", "custom_params", "beam_width",
                                  "watermark")],
    fld("stop_regex", stop_regex_ok, extra=[("pattern", "a+", "2xx"), ("lookahead", "a(?=b)", "4xx")]),
    fld("choice", lambda v: v is None or v == [], extra=[("empty", [], "2xx")]),
]

TOKENIZE_PROMPT = [
    fld("prompt", lambda v: isinstance(v, str), required=True, text=True, extra=[
        ("batch", ["a", "b"], "2xx"), ("batch-empty", [], "4xx"), ("batch-1024", ["a"] * 1024, "2xx"),
        ("batch-1025", ["a"] * 1025, "4xx"), ("batch-surrogate", ["a", SURROGATE], "4xx"), ("empty", "", "2xx")]),
    fld("messages", only_null),  # beside prompt: exactly one of them
    fld("model", lambda v: v is None or v == MODEL, text=True, extra=[("other", "gpt-9", 404)]),
    fld("add_special_tokens", is_bool),
    fld("return_token_strs", is_bool),
    fld("add_generation_prompt", is_bool),
    fld("chat_template", only_null),
    fld("continue_final_message", neutral(False)),
    # vLLM's multimodal options: read by nothing on a text-only server, whatever their value
    fld("mm_processor_kwargs", anything),
    fld("media_io_kwargs", anything),
]
TOKENIZE_MESSAGES = [
    fld("messages", lambda v: False, required=True, extra=[
        ("one", MSGS, "2xx"), ("empty", [], "4xx"), ("surrogate", [{"role": "user", "content": SURROGATE}], "4xx")]),
    fld("tools", lambda v: v is None or v == [], extra=[("one", [TOOL], "2xx"), ("bad-schema", [tool(parameters={"type": 5})], "4xx")]),
    fld("tool_choice", lambda v: v is None or v in ("auto", "none")),
    fld("chat_template_kwargs", lambda v: v is None or isinstance(v, dict),
        extra=[("client-template", {"chat_template": "{{ messages }}"}, "4xx")]),
    fld("reasoning_effort", lambda v: v is None or v in REASONING_EFFORTS, text=True),
    fld("add_generation_prompt", is_bool),
]
DETOKENIZE = [
    fld("tokens", lambda v: v == [1], required=True, extra=[
        ("empty", [], "2xx"), ("batch", [[1], [2, 3]], "2xx"), ("batch-empty-seq", [[]], "2xx"), ("mixed", [1, [2]], "4xx"),
        ("negative", [-1], "4xx"), ("oov", [VOCAB_OOV], "4xx"), ("float-ids", [1.0], "4xx"), ("bool-ids", [True], "4xx"),
        ("batch-1025", [[1]] * 1025, "4xx"), ("100k-ids", [5] * 100_000, "2xx")]),
    fld("skip_special_tokens", is_bool),
    fld("model", lambda v: v is None or v == MODEL, text=True, extra=[("other", "gpt-9", 404)]),
]
ABORT = [
    fld("rid", is_str, text=True, extra=[("empty", "", "2xx")]),
    fld("abort_all", is_bool),
]

# route -> (base body, fields[, nested key])
# Anthropic Messages and OpenAI Responses (their own suites hold the detailed cases; these keep
# the corpus' guarantees — a class per field type, JSON errors, no 5xx — on the new routes too).
MESSAGES_FIELDS = [
    fld("model", lambda v: v == MODEL, required=True, text=True, extra=[("other", "gpt-9", "4xx")]),
    fld("max_tokens", int_in(1, 500), numeric=True, required=True),
    fld("messages", lambda v: v == MSGS, required=True),
    fld("system", lambda v: v is None or (isinstance(v, str)), text=True),
    fld("temperature", num_in(0, 1), numeric=True),
    fld("top_p", num_in(0, 1, lo_open=True), numeric=True),
    fld("top_k", int_in(0), numeric=True),
    fld("stop_sequences", lambda v: v is None or v == [], extra=[("one", ["x"], "2xx")]),
    fld("stream", is_bool),
]
COUNT_TOKENS_FIELDS = [
    fld("model", lambda v: v == MODEL, required=True, text=True, extra=[("other", "gpt-9", "4xx")]),
    fld("messages", lambda v: v == MSGS, required=True),
]
RESPONSES_FIELDS = [
    fld("input", lambda v: isinstance(v, str) and bool(v), required=True, text=True,
        extra=[("items", [{"role": "user", "content": "hi"}], "2xx")]),
    fld("max_output_tokens", int_in(1, 500), numeric=True),
    fld("temperature", num_in(0), numeric=True),
    fld("top_p", num_in(0, 1, lo_open=True), numeric=True),
    fld("instructions", lambda v: v is None or isinstance(v, str), text=True),
    fld("stream", is_bool),
]
MESSAGES, RESPONSES = "/v1/messages", "/v1/responses"

JSON_ROUTES = {
    "messages": (MESSAGES, {"model": MODEL, "max_tokens": 2, "messages": MSGS}, MESSAGES_FIELDS, None),
    "count-tokens": (MESSAGES + "/count_tokens", {"model": MODEL, "messages": MSGS}, COUNT_TOKENS_FIELDS, None),
    "responses": (RESPONSES, {"model": MODEL, "input": "hi", "max_output_tokens": 2}, RESPONSES_FIELDS, None),
    "chat": (CHAT, {"model": MODEL, "messages": MSGS, "max_tokens": 2}, CHAT_FIELDS, None),
    "completion": (COMP, {"model": MODEL, "prompt": "hi", "max_tokens": 2}, COMPLETION_FIELDS, None),
    "generate": (GEN, {"text": "hi", SP: {"max_new_tokens": 2}}, GENERATE_TOP, None),
    "generate-sampling": (GEN, {"text": "hi", SP: {"max_new_tokens": 2}}, GENERATE_SAMPLING, SP),
    "tokenize": ("/tokenize", {"prompt": "hi"}, TOKENIZE_PROMPT, None),
    "tokenize-messages": ("/v1/tokenize", {"messages": MSGS}, TOKENIZE_MESSAGES, None),
    "detokenize": ("/detokenize", {"tokens": [1, 2]}, DETOKENIZE, None),
    "abort": ("/abort_request", {"rid": "no-such-request"}, ABORT, None),
}
JSON_POST_PATHS = [CHAT, COMP, GEN, "/tokenize", "/v1/tokenize", "/detokenize", "/v1/detokenize", "/abort_request",
                   MESSAGES, MESSAGES + "/count_tokens", RESPONSES]


def _field_cases(key: str, path: str, base: dict, f: Field, nested: str | None) -> list[Case]:
    def with_value(v) -> dict:
        body = json.loads(json.dumps(base))
        target = body[nested] if nested else body
        if v is _ABSENT:
            target.pop(f.name, None)
        else:
            target[f.name] = v
        return body

    out = []
    values = dict(TYPES)
    if f.numeric:
        values.update(NUMBERS)
    for label, v in values.items():
        expect = "2xx" if f.accepts(v) else "4xx"
        out.append(Case(f"{key}.{f.name}={label}", "POST", path, dumps(with_value(v)), expect))
    if f.numeric:
        raw = dumps(with_value("@@")).replace(b'"@@"', RAW_1E400.encode())
        out.append(Case(f"{key}.{f.name}=1e400", "POST", path, raw, "4xx"))
    if f.text:
        out.append(Case(f"{key}.{f.name}=surrogate", "POST", path, dumps(with_value(SURROGATE)), "4xx"))
    if f.required:
        out.append(Case(f"{key}.{f.name}=absent", "POST", path, dumps(with_value(_ABSENT)), "4xx"))
    for label, v, expect in f.extra:
        out.append(Case(f"{key}.{f.name}={label}", "POST", path, dumps(with_value(v)), expect))
    return out


_ABSENT = object()


def build_corpus() -> list[Case]:
    """Every case, in a fixed order (ids are unique)."""
    cases: list[Case] = []
    for key, (path, base, fields, nested) in JSON_ROUTES.items():
        cases.append(Case(f"{key}.baseline", "POST", path, dumps(base), "2xx"))
        for f in fields:
            cases.extend(_field_cases(key, path, base, f, nested))
    chat_base = JSON_ROUTES["chat"][1]
    cases += [
        Case("chat.stream-options-with-stream", "POST", CHAT,
             dumps({**chat_base, "stream": True, "stream_options": {"include_usage": True}}), "2xx"),
        Case("chat.stream-options-unknown", "POST", CHAT,
             dumps({**chat_base, "stream": True, "stream_options": {"x": 1}}), "4xx"),
        Case("chat.stream-options-continuous", "POST", CHAT,
             dumps({**chat_base, "stream": True, "stream_options": {"continuous_usage_stats": True}}), "2xx"),
        Case("chat.top-logprobs-with-logprobs-20", "POST", CHAT, dumps({**chat_base, "logprobs": True, "top_logprobs": 20}),
             "2xx"),
        Case("chat.top-logprobs-with-logprobs-21", "POST", CHAT, dumps({**chat_base, "logprobs": True, "top_logprobs": 21}),
             "4xx"),
        Case("chat.both-template-fields", "POST", CHAT,
             dumps({**chat_base, "chat_template": "x", "chat_template_kwargs": {"chat_template": "x"}}), "4xx"),
        Case("chat.unknown-field", "POST", CHAT, dumps({**chat_base, "foo": {"deep": nest_list(40)}}), "2xx"),
        Case("chat.surrogate-unknown-key", "POST", CHAT, dumps({**chat_base, SURROGATE: 1}), "2xx"),
        Case("chat.duplicate-key-last-wins", "POST", CHAT,
             dumps(chat_base)[:-1] + b', "max_tokens": -1}', "4xx"),
        Case("generate.input-ids", "POST", GEN, dumps({"input_ids": [1, 2], SP: {"max_new_tokens": 2}}), "2xx"),
        Case("generate.input-ids-batch", "POST", GEN, dumps({"input_ids": [[1], [2]], SP: {"max_new_tokens": 2}}), "2xx"),
        Case("generate.input-ids-empty", "POST", GEN, dumps({"input_ids": []}), "4xx"),
        Case("generate.input-ids-oov", "POST", GEN, dumps({"input_ids": [VOCAB_OOV]}), "4xx"),
        Case("generate.input-ids-negative", "POST", GEN, dumps({"input_ids": [-1]}), "4xx"),
        Case("generate.input-ids-strings", "POST", GEN, dumps({"input_ids": ["a"]}), "4xx"),
        Case("generate.input-ids-over-context", "POST", GEN, dumps({"input_ids": [5] * 100_000}), "4xx"),
        Case("generate.put", "PUT", GEN, dumps({"text": "hi", SP: {"max_new_tokens": 2}}), "2xx"),
        Case("generate.batch-duplicate-rids", "POST", GEN, dumps({"text": ["a", "b"], "rid": ["r", "r"]}), "4xx"),
        Case("generate.batch-rid-count", "POST", GEN, dumps({"text": ["a", "b"], "rid": ["r"]}), "4xx"),
        Case("generate.batch-sampling-count", "POST", GEN, dumps({"text": ["a", "b"], SP: [{}]}), "4xx"),
        Case("generate.batch-per-item-sampling", "POST", GEN,
             dumps({"text": ["a", "b"], SP: [{"max_new_tokens": 1}, {"max_new_tokens": 2}]}), "2xx"),
        Case("tokenize.messages-and-prompt", "POST", "/tokenize", dumps({"prompt": "a", "messages": MSGS}), "4xx"),
        Case("tokenize.neither", "POST", "/tokenize", dumps({}), "4xx"),
        # without --enable-response-store the stored-response routes are SGLang's 400
        Case("responses.get-without-store", "GET", RESPONSES + "/resp_abc", None, 400),
        Case("responses.cancel-without-store", "POST", RESPONSES + "/resp_abc/cancel", b"{}", 400,
             (("Content-Type", "application/json"),)),
        Case("responses.previous-id-without-store", "POST", RESPONSES,
             dumps({"model": MODEL, "input": "hi", "previous_response_id": "resp_abc"}), 400),
        Case("messages.unknown-subpath", "POST", MESSAGES + "/batches", b"{}", 404,
             (("Content-Type", "application/json"),)),
    ]
    # Bodies that are not a JSON object, on every JSON route.
    for path in JSON_POST_PATHS:
        p = path.strip("/").replace("/", "-")
        for label, raw in [("empty", b""), ("spaces", b"   "), ("truncated", b'{"model": '), ("array", b"[1, 2]"),
                           ("null", b"null"), ("string", b'"x"'), ("number", b"1"), ("trailing-garbage", b'{"a": 1} x'),
                           ("bom", b"\xef\xbb\xbf{}"), ("invalid-utf8", b'{"model": "\xff\xfe"}'),
                           ("utf16", '{"prompt": "hi"}'.encode("utf-16")), ("nan-only", b"NaN"),
                           ("deep-array", b"[" * 100_000), ("deep-object", b'{"a":' * 50_000),
                           ("single-quotes", b"{'a': 1}"), ("comment", b'{"a": 1 /* x */}')]:
            cases.append(Case(f"body.{p}.{label}", "POST", path, raw, 400))
        cases.append(Case(f"body.{p}.over-limit", "POST", path, b'{"x": "' + b"a" * LIMIT + b'"}', 413))
        for label, ctype in [("none", None), ("text-plain", "text/plain"), ("form", "application/x-www-form-urlencoded"),
                             ("multipart", "multipart/form-data; boundary=x"), ("xml", "application/xml"),
                             ("latin1", "application/json; charset=latin-1"), ("utf16", "application/json; charset=utf-16"),
                             ("jsonx", "application/jsonx"), ("ndjson", "application/x-ndjson")]:
            headers = (("Content-Type", ctype),) if ctype else ()
            cases.append(Case(f"ctype.{p}.{label}", "POST", path, b"{}", 415, headers))
    # Query-string routes.
    for method in ("GET", "POST"):
        for label, q, expect in [("none", "", "2xx"), ("zero", "?timeout=0", "2xx"), ("half", "?timeout=0.5", "2xx"),
                                 ("blank", "?timeout=", "2xx"), ("text", "?timeout=x", 400), ("negative", "?timeout=-1", 400),
                                 ("nan", "?timeout=nan", 400), ("inf", "?timeout=inf", 400), ("1e400", "?timeout=1e400", 400),
                                 ("twice", "?timeout=1&timeout=2", 400), ("emoji", "?timeout=%F0%9F%98%80", 400),
                                 ("bad-percent", "?timeout=%ff", 400)]:
            cases.append(Case(f"flush.{method}.{label}", method, "/flush_cache" + q, None, expect))
    cases.append(Case("flush.POST.text-body-ignored", "POST", "/flush_cache", b"hello", "2xx",
                      (("Content-Type", "text/plain"),)))
    for label, q, expect in [("core", "?include=core", "2xx"), ("all", "?include=core,all", "2xx"),
                             ("repeated", "?include=core&include=memory", "2xx"), ("bogus", "?include=bogus", 400),
                             ("empty-section", "?include=core,,memory", 400), ("rank-0", "?dp_rank=0", "2xx"),
                             ("rank-other", "?dp_rank=7", "2xx"), ("rank-negative", "?dp_rank=-1", "2xx"),
                             ("rank-text", "?dp_rank=x", 400), ("rank-float", "?dp_rank=1.5", 400),
                             ("rank-twice", "?dp_rank=0&dp_rank=1", 400), ("rank-huge", "?dp_rank=" + "9" * 40, "2xx"),
                             ("format-prometheus", "?format=prometheus", "2xx"), ("format-json", "?format=json", "2xx"),
                             ("format-xml", "?format=xml", 400), ("format-twice", "?format=json&format=json", 400),
                             ("junk", "?x=%00&y=%C3%A9&z", "2xx")]:
        cases.append(Case(f"loads.{label}", "GET", "/v1/loads" + q, None, expect))
    for label, mid, expect in [("served", MODEL, "2xx"), ("other", "other", 404), ("traversal", "../../etc/passwd", 404),
                               ("nul", "%00", 404), ("long", "m" * 4000, 404), ("surrogate-escape", "%ED%A0%80", 404),
                               ("slash", "trnrt-tiny/extra", 404)]:
        cases.append(Case(f"model.{label}", "GET", "/v1/models/" + mid, None, expect))
    # GET routes take no body and ignore unknown query parameters.
    gets = ["/health", "/v1/stats", "/metrics", "/v1/models", "/model_info", "/get_model_info", "/server_info",
            "/get_server_info", "/v1/loads", "/get_load", "/health_generate", "/dashboard"]
    for path in gets:
        p = path.strip("/").replace("/", "-")
        cases.append(Case(f"get.{p}", "GET", path, None, "2xx"))
        cases.append(Case(f"get.{p}.junk-query", "GET", path + "?a=1&a=2&b=%ff&c", None, "2xx"))
        cases.append(Case(f"get.{p}.json-body", "GET", path, b'{"a": 1}', "2xx"))
        for method in ("POST", "DELETE", "PATCH"):
            cases.append(Case(f"method.{p}.{method}", method, path, b"{}", 405))
    cases.append(Case("get.metrics.openmetrics", "GET", "/metrics", None, "2xx",
                      (("Accept", "application/openmetrics-text; version=1.0.0"),)))
    cases.append(Case("get.metrics.odd-accept", "GET", "/metrics", None, "2xx", (("Accept", "x/y;;;q=abc"),)))
    for path in JSON_POST_PATHS:
        p = path.strip("/").replace("/", "-")
        for method in ("GET", "DELETE", "PATCH") + (("PUT",) if path != GEN else ()):
            cases.append(Case(f"method.{p}.{method}", method, path, b"{}", 405))
    for path in ["/v2/chat/completions", "/v1/chat/completions/x", "/generate/x", "/v1", "/admin", "/.env",
                 "/v1/models/", "/%00", "/" + "x" * 4000]:
        cases.append(Case(f"route.unknown{path[:40].replace('/', '-')}", "GET", path, None, 404))
    return cases


CORPUS = build_corpus()


# --- running it -----------------------------------------------------------------------------------
def send(server, case: Case, timeout: float = 30.0) -> tuple[int, dict, bytes]:
    """One request with exactly the case's headers, over a fresh loopback connection."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    try:
        conn.putrequest(case.method, case.path, skip_accept_encoding=True)
        for k, v in case.headers:
            conn.putheader(k, v)
        if case.body is not None:
            conn.putheader("Content-Length", str(len(case.body)))
        conn.endheaders()
        if case.body:
            conn.send(case.body)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def check(case: Case, status: int, headers: dict, data: bytes) -> str | None:
    """What is wrong with the answer to `case`, or None."""
    if status >= 500:
        return f"{status} (a 5xx): {data[:300]!r}"
    if isinstance(case.expect, int):
        if status != case.expect:
            return f"expected {case.expect}, got {status}: {data[:300]!r}"
    elif str(status)[0] != case.expect[0]:
        return f"expected {case.expect}, got {status}: {data[:300]!r}"
    if status >= 400:
        if not headers.get("content-type", "").startswith("application/json"):
            return f"{status} without a JSON content type: {headers.get('content-type')!r}"
        try:
            body = json.loads(data)
        except ValueError:
            return f"{status} with a body that is not JSON: {data[:200]!r}"
        err = body.get("error") if isinstance(body, dict) else None
        message = err.get("message") if isinstance(err, dict) else err
        if body.get("object") == "error":  # SGLang's HTTPException envelope
            message = body.get("message")
        if not (isinstance(message, str) and message):
            return f"{status} without an error message: {body!r:.300}"
    return None


def run_cases(server, cases: list[Case]) -> tuple[collections.Counter, list[str]]:
    statuses: collections.Counter = collections.Counter()
    problems = []
    for case in cases:
        status, headers, data = send(server, case)
        statuses[status] += 1
        why = check(case, status, headers, data)
        if why:
            problems.append(f"{case.id}: {why}")
    return statuses, problems


def route_of(case: Case) -> str:
    return case.id.split(".")[0]


GROUPS = sorted({route_of(c) for c in CORPUS})


def test_corpus_is_generated_large_and_covers_every_route(scripted_server):
    import falcon.inspect

    assert len(CORPUS) >= 300, len(CORPUS)
    ids = [c.id for c in CORPUS]
    assert len(set(ids)) == len(ids), [i for i, n in collections.Counter(ids).items() if n > 1]
    assert all(len(c.body or b"") < LIMIT or c.expect == 413 for c in CORPUS)
    routes = {r.path for r in falcon.inspect.inspect_routes(scripted_server.app)}
    hit = set()
    for c in CORPUS:
        path = c.path.split("?")[0]
        if path.startswith("/v1/models/"):
            path = "/v1/models/{model_id:path}"
        elif path.startswith(RESPONSES + "/"):
            path = RESPONSES + ("/{response_id}/cancel" if path.endswith("/cancel") else "/{response_id}")
        elif path.startswith(MESSAGES + "/") and path != MESSAGES + "/count_tokens":
            path = MESSAGES + "/{rest:path}"
        hit.add(path)
    assert routes <= hit, routes - hit
    # both classes are really exercised, with refusals the majority
    expects = collections.Counter("2xx" if c.expect == "2xx" else "4xx" for c in CORPUS)
    assert expects["2xx"] >= 100 and expects["4xx"] >= 300, expects


@pytest.mark.parametrize("group", GROUPS)
def test_corpus(scripted_server, group):
    """Every case of one route family gets its class, with a JSON error body for refusals and no 5xx."""
    cases = [c for c in CORPUS if route_of(c) == group]
    statuses, problems = run_cases(scripted_server, cases)
    print(f"{group}: {len(cases)} cases, statuses {dict(sorted(statuses.items()))}")
    assert not problems, f"{len(problems)} of {len(cases)} cases wrong:\n" + "\n".join(problems[:40])
    serves_and_is_idle(scripted_server)


def serves_and_is_idle(server) -> None:
    """A normal request is served; nothing is left running, admitted or inside a handler."""
    from trnrt.serve import get_state

    status, data, _ = server.raw("POST", CHAT, {"model": MODEL, "messages": MSGS, "max_tokens": 2})
    assert status == 200 and data["choices"][0]["finish_reason"] in ("stop", "length"), data
    assert_idle(server)
    st = get_state(server.app)
    deadline = time.monotonic() + 2
    while st.active_requests and time.monotonic() < deadline:  # a stream's close() may trail its last byte
        time.sleep(0.01)
    assert st.active_requests == 0
    assert st.wait_http_idle(2.0)


# A subset for the real tiny model (a few seconds): every baseline, every extreme number (the model's
# sampler sees them: 1e300 temperature, 10**30 top_k and seed), and one case in 25 of the rest.
# Accepted length values (e.g. max_tokens 500, or null = up to the context) would make the real model
# generate hundreds of tokens per case: too slow for CI on 2 cores; the scripted run covers them.
REAL_SUBSET = [c for i, c in enumerate(CORPUS)
               if (i % 25 == 0 or c.id.endswith((".baseline", "=huge", "=large", "=tiny", "=int64-max")))
               and not (c.expect == "2xx" and "max_" in c.id)]


def test_corpus_subset_on_every_engine(any_server):
    # (on the scripted engine this repeats part of the full corpus above: cheap, and no skip)
    statuses, problems = run_cases(any_server, REAL_SUBSET)
    print(f"subset: {len(REAL_SUBSET)} cases, statuses {dict(sorted(statuses.items()))}")
    assert not problems, "\n".join(problems[:40])
    serves_and_is_idle(any_server)


# --- fault injection: an unexpected exception is a JSON 500 and a log line naming the route ----------
FAULT_SECRET = "injected fault: /etc/secret-path"


def _boom(*args, **kwargs):
    raise RuntimeError(FAULT_SECRET)


FAULTS = [
    # (id, method, path, body, module, attribute replaced by _boom)
    ("chat-parse", "POST", CHAT, {"model": MODEL, "messages": MSGS, "max_tokens": 2}, "trnrt.serve.handlers.openai",
     "parse_chat"),
    ("chat-render", "POST", CHAT, {"model": MODEL, "messages": MSGS, "max_tokens": 2}, "trnrt.serve.handlers.openai",
     "render_chat"),
    ("completion", "POST", COMP, {"model": MODEL, "prompt": "hi", "max_tokens": 2}, "trnrt.serve.handlers.openai",
     "parse_completion"),
    ("models", "GET", "/v1/models", None, "trnrt.serve.handlers.openai", "model_card"),
    ("generate", "POST", GEN, {"text": "hi"}, "trnrt.serve.handlers.generate", "parse_generate"),
    ("generate-put", "PUT", GEN, {"text": "hi"}, "trnrt.serve.handlers.generate", "to_engine_requests"),
    ("tokenize", "POST", "/v1/tokenize", {"prompt": "hi"}, "trnrt.serve.handlers.tokenize", "parse_tokenize"),
    ("detokenize", "POST", "/detokenize", {"tokens": [1]}, "trnrt.serve.handlers.tokenize", "parse_detokenize"),
    ("abort", "POST", "/abort_request", {"rid": "x"}, "trnrt.serve.handlers.admin", "parse_abort"),
    ("loads", "GET", "/v1/loads", None, "trnrt.serve.handlers.admin", "parse_loads_query"),
    ("get-load", "GET", "/get_load", None, "trnrt.serve.handlers.admin", "get_load_entry"),
    ("flush", "POST", "/flush_cache", None, "trnrt.serve.handlers.admin", "parse_flush_timeout"),
]


@pytest.mark.parametrize("fault", FAULTS, ids=[f[0] for f in FAULTS])
def test_unexpected_exception_is_a_json_500_naming_the_route(scripted_server, monkeypatch, caplog, fault):
    """A handler dependency that raises what nobody expected: the client gets a 500 in the JSON
    envelope (type internal_error, no traceback, no exception text), the log gets the method, the
    route and the traceback, admission is released and the next request is served."""
    import importlib

    _, method, path, body, module, attr = fault
    monkeypatch.setattr(importlib.import_module(module), attr, _boom)
    with caplog.at_level(logging.ERROR, logger="trnrt.serve"):
        status, headers, data = send(scripted_server, Case("fault", method, path,
                                                           dumps(body) if body is not None else None))
    assert status == 500, data
    assert headers["content-type"].startswith("application/json")
    err = json.loads(data)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == "internal_error" and err["code"] == 500 and err["message"] == "Internal server error: RuntimeError"
    assert FAULT_SECRET not in data.decode()
    records = [r for r in caplog.records if r.name == "trnrt.serve" and f"{method} {path}" in r.getMessage()]
    assert records, [r.getMessage() for r in caplog.records]
    assert records[0].exc_info and records[0].exc_info[0] is RuntimeError  # the traceback is in the log
    monkeypatch.undo()
    serves_and_is_idle(scripted_server)


def sse_payloads(data: bytes) -> list:
    out = []
    for block in data.split(b"\n\n"):
        if block.startswith(b"data: "):
            payload = block[6:]
            out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


@pytest.mark.parametrize("route", ["chat", "completion", "generate"])
def test_unexpected_exception_mid_stream_is_an_in_band_error_and_done(scripted_server, monkeypatch, caplog, route):
    """A renderer that fails after the first event: the stream carries the API's error event, then
    [DONE]; the engine request is aborted (the server is idle) and the failure is logged."""
    from trnrt.serve.output.openai import ChatRenderer, CompletionRenderer
    from trnrt.serve.output.sglang import GenerateRenderer

    cls, path, body = {
        "chat": (ChatRenderer, CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "SCRIPT:long go"}],
                                      "max_tokens": 200, "stream": True}),
        "completion": (CompletionRenderer, COMP, {"model": MODEL, "prompt": "SCRIPT:long go", "max_tokens": 200,
                                                  "stream": True}),
        "generate": (GenerateRenderer, GEN, {"text": "SCRIPT:long go", "stream": True,
                                             SP: {"max_new_tokens": 200}}),
    }[route]
    original = cls.sse

    def fails_after_one_event(self, outputs):
        events = original(self, outputs)
        yield next(events)
        raise RuntimeError(FAULT_SECRET)

    monkeypatch.setattr(cls, "sse", fails_after_one_event)
    with caplog.at_level(logging.ERROR, logger="trnrt.serve"):
        status, headers, data = send(scripted_server, Case("mid-stream", "POST", path, dumps(body)))
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = sse_payloads(data)
    assert events[-1] == "[DONE]", events[-3:]
    err = events[-2]["error"]
    assert err["type"] == "internal_error" and err["message"] == "Internal server error: RuntimeError", err
    assert len(events) == 3 and "error" not in events[0], events  # one real event, the error, [DONE]
    assert FAULT_SECRET not in data.decode()
    assert any("stream of" in r.getMessage() and r.exc_info for r in caplog.records), caplog.text
    monkeypatch.undo()
    serves_and_is_idle(scripted_server)


# --- client chat templates ----------------------------------------------------------------------
def rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


BOMB = "{{ 'a' * 100000000 }}"
SIMPLE = ("{{ bos_token or '' }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def chat_body(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "SCRIPT:plain hi"}], "max_tokens": 2, **kw}


@pytest.mark.parametrize("where", ["kwargs", "top-level"])
def test_client_template_is_refused_without_the_flag(scripted_server, where):
    body = chat_body(**({"chat_template_kwargs": {"chat_template": BOMB}} if where == "kwargs"
                        else {"chat_template": BOMB}))
    before, t0 = rss_mb(), time.monotonic()
    status, data, _ = scripted_server.raw("POST", CHAT, body)
    assert time.monotonic() - t0 < 1.0 and rss_mb() - before < 100
    param = "chat_template_kwargs" if where == "kwargs" else "chat_template"
    assert status == 400 and data["error"]["param"] == param, data
    assert "--trust-request-chat-template" in data["error"]["message"]
    # /tokenize renders through the same path: refused there too
    status, data, _ = scripted_server.raw("POST", "/tokenize", {"messages": MSGS,
                                                               "chat_template_kwargs": {"chat_template": SIMPLE}})
    assert status == 400 and data["error"]["param"] == "chat_template_kwargs", data


def _render(tokenizer, body: dict, *, trust=True, max_tokens=1024, add_generation_prompt=True):
    from trnrt.serve.protocol.chat_template import apply_template_defaults, render_chat
    from trnrt.serve.protocol.openai import parse_chat

    creq = parse_chat(body)
    apply_template_defaults(creq, {})
    return render_chat(tokenizer, creq, max_tokens=max_tokens, trust_request_template=trust,
                       add_generation_prompt=add_generation_prompt)


def test_render_chat_renders_a_client_template_with_hfs_variables(tokenizer):
    """With trust, the client's template sees what HF's apply_chat_template passes: messages, tools,
    add_generation_prompt, the tokenizer's special tokens and the template kwargs."""
    src = ("[{{ eos_token }}|{{ add_generation_prompt }}|{{ tools|length if tools else 0 }}|{{ greeting }}|"
           "{{ enable_thinking }}]{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}"
           "{{ tools[0].function.name if tools else '' }}")
    body = {"model": MODEL, "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
            "tools": [TOOL], "chat_template_kwargs": {"chat_template": src, "greeting": "hey"}}
    r = _render(tokenizer, body)
    assert r.text == f"[{tokenizer.eos_token}|True|1|hey|True]system:s;user:u;get_weather"
    assert r.ids == tokenizer.encode(r.text, add_special_tokens=False)
    r = _render(tokenizer, {**body, "chat_template_kwargs": None, "chat_template": src}, add_generation_prompt=False)
    assert r.text.startswith(f"[{tokenizer.eos_token}|False|1||True]")  # top-level field; undefined kwarg is empty
    with pytest.raises(Exception) as e:
        _render(tokenizer, body, trust=False)
    assert e.value.status == 400 and e.value.param == "chat_template_kwargs"


def test_sandbox_renders_the_models_own_template_exactly_as_hf(tokenizer):
    """The server's own chat template, sent as a client template, gives HF's text byte for byte:
    the sandbox changes no rendering, only what it may cost."""
    from trnrt.serve.protocol.template_sandbox import render_client_template, template_variables

    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "ok", "reasoning_content": "hmm", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "sunny", "tool_call_id": "c"}, {"role": "user", "content": "thanks"}]
    for kw in ({}, {"enable_thinking": False}, {"clear_thinking": False}):
        for agp in (True, False):
            hf = tokenizer.apply_chat_template(msgs, tools=[TOOL], add_generation_prompt=agp, tokenize=False, **kw)
            mine = render_client_template(tokenizer.chat_template, template_variables(tokenizer, msgs, [TOOL], agp, kw))
            assert mine == hf, (kw, agp)


ATTACKS = [
    # (id, template, what the refusal must say: the operation that was stopped)
    ("string-repeat", BOMB, "* would make a text of 100000000 characters"),
    ("list-repeat", "{{ [0] * 100000000 }}", "* would make 100000000 items"),
    ("power", "{{ 2 ** 100000000 }}", "** would make an integer"),
    ("center", "{{ 'a'|center(100000000) }}", "center would make"),
    ("ljust", "{{ 'a'.ljust(100000000) }}", "ljust would make"),
    ("printf-width", "{{ '%100000000s'|format(1) }}", "format would make"),
    ("format-width", "{{ '{:>{}}'.format(1, 100000000) }}", "format would make"),
    ("replace", "{{ ('x' * 1000000)|replace('x', 'yyyyyyyyyy') }}", "replace would make"),
    ("doubling", "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "~ would make"),
    ("batch-fill", "{{ [1]|batch(100000000, 'x')|list }}", "batch would make"),
    ("print-shared", "{% set l = ['x' * 1000000] * 100000 %}{{ l }}", "an output value"),
    ("accumulate", "{% set ns = namespace(l=[]) %}{% for i in range(100000) %}"
                   "{% set ns.l = ns.l + [('x' * 1000000).upper()] %}{% endfor %}", "MiB of values"),
    ("split", "{{ ('a,' * 1000000).split(',') }}", "split would make"),
    ("sum-lists", "{{ [[1]] * 100000|sum(start=[]) }}", "sum adds numbers only"),
    ("output", "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "rendered prompt passed"),
]


@pytest.mark.parametrize("attack", ATTACKS, ids=[a[0] for a in ATTACKS])
def test_sandbox_refuses_what_would_take_the_machine(attack):
    """Each is refused before it allocates much, in a fraction of the time limit."""
    from trnrt.serve.protocol.template_sandbox import TemplateLimitError, render_client_template

    _, src, names = attack
    before, t0 = rss_mb(), time.monotonic()
    with pytest.raises(TemplateLimitError) as e:
        render_client_template(src, {"messages": []})
    assert time.monotonic() - t0 < 1.0
    assert rss_mb() - before < 50
    assert names in str(e.value), str(e.value)


@pytest.mark.parametrize("src", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
    "{% set x %}{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}{% endset %}",
    "{% for x in [[1]] recursive %}{% for i in range(100000) %}{% endfor %}{{ loop([[1]]) }}{% endfor %}",
], ids=["nested-loops", "exponential-macro", "buffered-loops", "recursive-loop"])
def test_sandbox_stops_a_template_at_its_time_limit(src):
    from trnrt.serve.protocol.template_sandbox import Limits, TemplateLimitError, render_client_template

    t0 = time.monotonic()
    with pytest.raises((TemplateLimitError, RecursionError)):
        render_client_template(src, {}, Limits(timeout_s=0.3))
    assert time.monotonic() - t0 < 1.0


def test_sandbox_keeps_hfs_escape_protections():
    from jinja2.exceptions import SecurityError, TemplateError, UndefinedError

    from trnrt.serve.protocol.template_sandbox import render_client_template

    for src in ["{{ ''.__class__.__mro__[1].__subclasses__() }}", "{{ messages.append(1) }}",
                "{% set ns = namespace() %}{% set ns._x = 1 %}", "{{ cycler.__init__.__globals__ }}"]:
        with pytest.raises((SecurityError, UndefinedError, TemplateError)):
            render_client_template(src, {"messages": []})
    for src in ["{% include 'x' %}", "{{ lipsum(100000) }}"]:
        with pytest.raises(Exception):
            render_client_template(src, {})


def test_sandbox_charges_only_what_a_template_creates():
    """Reading the same large message many times costs nothing; copying it does (the reference-count
    test that tells the two apart is calibrated at import)."""
    from trnrt.serve.protocol.template_sandbox import Limits, TemplateLimitError, render_client_template

    big = {"content": "x" * 1_000_000}
    reads = "{% for i in range(200) %}{% if m.get('content') %}{% endif %}{% endfor %}ok"
    assert render_client_template(reads, {"m": big}, Limits(max_alloc_bytes=8 << 20)) == "ok"
    copies = "{% for i in range(200) %}{% if m.get('content').upper() %}{% endif %}{% endfor %}ok"
    with pytest.raises(TemplateLimitError, match="MiB"):
        render_client_template(copies, {"m": big}, Limits(max_alloc_bytes=8 << 20))


# A server that trusts request templates (ServeSettings.trust_request_chat_template, which the chat
# and tokenize handlers pass to render_chat).
@pytest.fixture(scope="module")
def trusted_server(tokenizer_factory):
    from serve_support import make_scripted_engine, start_server, stop_server
    from trnrt.serve import ServeSettings

    engine = make_scripted_engine(tokenizer_factory)
    server = start_server(engine, tokenizer_factory, ServeSettings(served_model_name=MODEL, max_request_bytes=LIMIT,
                                                                   trust_request_chat_template=True))
    yield server
    stop_server(server)


@pytest.mark.parametrize("where", ["kwargs", "top-level"])
def test_trusted_server_renders_a_client_template(trusted_server, tokenizer, where):
    tpl = {"chat_template_kwargs": {"chat_template": SIMPLE}} if where == "kwargs" else {"chat_template": SIMPLE}
    status, data, _ = trusted_server.raw("POST", CHAT, chat_body(**tpl))
    assert status == 200, data
    text = f"{tokenizer.bos_token or ''}<|user|>SCRIPT:plain hi<|assistant|>"
    assert data["usage"]["prompt_tokens"] == len(tokenizer.encode(text, add_special_tokens=False))
    # /tokenize renders it the same way, so its count is the chat request's prompt_tokens
    status, tok, _ = trusted_server.raw("POST", "/tokenize", {"messages": chat_body()["messages"],
                                                             "chat_template_kwargs": {"chat_template": SIMPLE}})
    assert status == 200 and tok["count"] == data["usage"]["prompt_tokens"], tok
    serves_and_is_idle(trusted_server)


def test_trusted_server_refuses_the_100m_character_template_fast_and_small(trusted_server):
    body = chat_body(chat_template_kwargs={"chat_template": BOMB})
    before, t0 = rss_mb(), time.monotonic()
    status, data, _ = trusted_server.raw("POST", CHAT, body)
    elapsed, grown = time.monotonic() - t0, rss_mb() - before
    assert status == 400 and data["error"]["param"] == "chat_template_kwargs", data
    assert "* would make a text of 100000000 characters" in data["error"]["message"], data
    assert elapsed < 1.0, elapsed
    assert grown < 100, grown
    serves_and_is_idle(trusted_server)


@pytest.mark.parametrize("case", [
    ("time", "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "time limit"),
    ("past-context", "{% for i in range(10000) %}word {% endfor %}", "rendered prompt"),
    ("raise", "{{ raise_exception('no system messages, please') }}", "no system messages, please"),
    ("syntax", "{% for %}", "TemplateSyntaxError"),
    ("undefined-call", "{{ nothing() }}", "UndefinedError"),
    ("recursion", "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recurses"),
    ("empty-output", "{% if false %}x{% endif %}", "empty prompt"),
], ids=lambda c: c[0])
def test_trusted_server_answers_a_bad_client_template_with_a_400(trusted_server, case):
    _, src, says = case
    t0 = time.monotonic()
    status, data, _ = trusted_server.raw("POST", CHAT, chat_body(chat_template=src))
    assert time.monotonic() - t0 < 3.0
    assert status == 400, data
    assert data["error"]["param"] in ("chat_template", "messages"), data
    assert says in data["error"]["message"], data
    serves_and_is_idle(trusted_server)


def test_cli_flag_reaches_the_settings(monkeypatch, tok_dir):
    """`trnrt serve --trust-request-chat-template` sets ServeSettings.trust_request_chat_template (off
    without it)."""
    from typer.testing import CliRunner

    import trnrt.serve.server as server_mod
    from trnrt.cli import app

    seen = {}

    def fake_run(wsgi, engine, **kw):
        seen["settings"] = wsgi.serve_state.settings
        engine.shutdown(0.0)
        return 0

    monkeypatch.setattr(server_mod, "run", fake_run)
    for args, want in ((["--trust-request-chat-template"], True), ([], False)):
        r = CliRunner().invoke(app, ["serve", "--scripted", "--model", str(tok_dir), "--port", "0", *args])
        assert r.exit_code == 0, r.output
        assert seen["settings"].trust_request_chat_template is want
    help_text = CliRunner().invoke(app, ["serve", "--help"], terminal_width=200, env={"COLUMNS": "200"}).output
    assert "--trust-request-chat-template" in help_text
