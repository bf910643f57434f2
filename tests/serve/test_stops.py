"""Stops on every generation route (scripted engine): SGLang's stop_regex (split across token
boundaries, trimmed or kept, streamed text never retracted), no_stop_trim /
include_stop_str_in_output, a kept stop token's text, matched_stop and vLLM's stop_reason, and the
bad inputs: each a 4xx in its API's own error shape."""

from __future__ import annotations

import json

import pytest

from serve_support import assert_idle

MODEL = "trnrt-tiny"
STOPWORD = "one two three STOP four five"  # SCRIPTS["stopword"], then <|endoftext|>


def sse(raw: str) -> list:
    events = [e[len("data: "):] for e in raw.split("\n\n") if e.strip()]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def gen(server, sp: dict, stream=False, text="SCRIPT:stopword"):
    status, data, _ = server.raw("POST", "/generate", {"text": text, "sampling_params": sp, "stream": stream})
    return status, (sse(data) if stream and status == 200 else data)


def cmpl(server, stream=False, **kw):
    body = {"model": MODEL, "prompt": "SCRIPT:stopword", "max_tokens": 40, "temperature": 0, "stream": stream, **kw}
    status, data, _ = server.raw("POST", "/v1/completions", body)
    return status, (sse(data) if stream and status == 200 else data)


def chat(server, stream=False, content="SCRIPT:stopword", **kw):
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 40,
            "temperature": 0, "stream": stream, "separate_reasoning": False, **kw}
    status, data, _ = server.raw("POST", "/v1/chat/completions", body)
    return status, (sse(data) if stream and status == 200 else data)


def test_the_script_splits_the_pattern_across_tokens(tokenizer):
    ids = tokenizer.encode(STOPWORD, add_special_tokens=False)
    starts = {len(tokenizer.decode(ids[:k])) for k in range(len(ids) + 1)}
    i = STOPWORD.index("TOP f")
    assert len([k for k in starts if i < k < i + 5]) >= 2  # "TOP f" spans three tokens or more


@pytest.mark.parametrize("keep", [False, True])
def test_generate_stop_regex_trimmed_or_kept(scripted_server, keep):
    pattern = r"T[O0]P\s+f"
    sp = {"max_new_tokens": 40, "temperature": 0, "stop_regex": [pattern, r"zz+"], "no_stop_trim": keep}
    status, body = gen(scripted_server, sp)
    assert status == 200, body
    want = "one two three S" + ("TOP f" if keep else "")
    assert body["text"] == want
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    status, chunks = gen(scripted_server, sp, stream=True)
    texts = [c["text"] for c in chunks]  # cumulative: each a prefix of the next (never retracted)
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])) and texts[-1] == want
    assert chunks[-1]["meta_info"]["finish_reason"]["matched"] == pattern
    assert_idle(scripted_server)


def test_generate_single_pattern_string_and_stop_token_text(scripted_server):
    status, body = gen(scripted_server, {"max_new_tokens": 40, "temperature": 0, "stop_regex": "f[aeiou]ur"})
    assert status == 200 and body["text"] == "one two three STOP " and body["meta_info"]["finish_reason"]["matched"] \
        == "f[aeiou]ur"
    # the EOS stop token's text only with no_stop_trim (and special tokens kept)
    base = {"max_new_tokens": 40, "temperature": 0, "skip_special_tokens": False}
    status, body = gen(scripted_server, base)
    assert status == 200 and body["text"] == STOPWORD
    status, body = gen(scripted_server, {**base, "no_stop_trim": True})
    assert status == 200 and body["text"] == STOPWORD + "<|endoftext|>"
    assert isinstance(body["meta_info"]["finish_reason"]["matched"], int)
    status, body = gen(scripted_server, {**base, "spaces_between_special_tokens": False})
    assert status == 200 and body["text"] == STOPWORD


@pytest.mark.parametrize("keep_field", ["include_stop_str_in_output", "no_stop_trim"])
def test_completions_stop_regex_stop_reason_and_stream(scripted_server, keep_field):
    status, body = cmpl(scripted_server, stop_regex=r"S\w+P", **{keep_field: True})
    assert status == 200, body
    c = body["choices"][0]
    assert c["text"] == "one two three STOP" and c["finish_reason"] == "stop"
    assert c["matched_stop"] == c["stop_reason"] == r"S\w+P"
    status, chunks = cmpl(scripted_server, stream=True, stop_regex=r"S\w+P")
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == "one two three "
    assert chunks[-1]["choices"][0]["stop_reason"] == r"S\w+P"
    assert all(ch["choices"][0]["stop_reason"] is None for ch in chunks[:-1])


def test_chat_stop_regex_streamed_equals_collected(scripted_server):
    status, body = chat(scripted_server, stop_regex=[r"\bth\w+"])
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["message"]["content"] == "one two " and choice["stop_reason"] == r"\bth\w+"
    status, chunks = chat(scripted_server, stream=True, stop_regex=[r"\bth\w+"])
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert content == "one two "
    final = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]][0]["choices"][0]
    assert final["matched_stop"] == final["stop_reason"] == r"\bth\w+"


def test_stop_reason_null_for_eos_and_length_the_id_for_stop_token_ids(scripted_server, tokenizer):
    status, body = cmpl(scripted_server)
    c = body["choices"][0]
    assert c["finish_reason"] == "stop" and isinstance(c["matched_stop"], int) and c["stop_reason"] is None
    status, body = cmpl(scripted_server, max_tokens=2)
    assert body["choices"][0]["finish_reason"] == "length" and body["choices"][0]["stop_reason"] is None
    three = tokenizer.encode(" three", add_special_tokens=False)[-1]
    status, body = cmpl(scripted_server, stop_token_ids=[three])
    c = body["choices"][0]
    assert c["stop_reason"] == c["matched_stop"] == three and "three" not in c["text"]
    status, body = cmpl(scripted_server, stop_token_ids=[three], include_stop_str_in_output=True)
    assert body["choices"][0]["text"].endswith("three")  # a kept stop token's text
    status, body = cmpl(scripted_server, stop="STOP")
    assert body["choices"][0]["stop_reason"] == "STOP"


def test_int64_seed_bounds_are_served(scripted_server):
    for seed in (2 ** 63 - 1, -(2 ** 63)):
        assert cmpl(scripted_server, seed=seed, temperature=1.0)[0] == 200
    assert gen(scripted_server, {"sampling_seed": 2 ** 63 - 1, "max_new_tokens": 2})[0] == 200


# --- bad inputs: each a 4xx in the route's own error shape ----------------------------------------
OPENAI_BAD = [
    ({"stop_regex": r"(a)\1"}, "stop_regex", "linear time"),
    ({"stop_regex": [r"ok", r"foo(?=bar)"]}, "stop_regex", "linear time"),
    ({"stop_regex": r"(?<=x)y"}, "stop_regex", "linear time"),
    ({"stop_regex": r"(?<!x)y"}, "stop_regex", "linear time"),
    ({"stop_regex": r"(?>ab)c"}, "stop_regex", "linear time"),
    ({"stop_regex": "a*"}, "stop_regex", "empty string"),
    ({"stop_regex": r"^"}, "stop_regex", "empty string"),
    ({"stop_regex": "(unclosed"}, "stop_regex", "not a valid"),
    ({"stop_regex": "x" * 257}, "stop_regex", "256 bytes"),
    ({"stop_regex": ["x"] * 33}, "stop_regex", "at most 32"),
    ({"stop_regex": 5}, "stop_regex", "string"),
    ({"stop_regex": ["ok", 5]}, "stop_regex", "string"),
    ({"stop_regex": True}, "stop_regex", "string"),
    ({"stop_regex": ["x", ""]}, "stop_regex", "non-empty"),
    ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output", "boolean"),
    ({"no_stop_trim": 1}, "no_stop_trim", "boolean"),
    ({"spaces_between_special_tokens": "no"}, "spaces_between_special_tokens", "boolean"),
    ({"seed": 2 ** 63}, "seed", "<="),
    ({"seed": -(2 ** 63) - 1}, "seed", ">="),
    ({"seed": 10 ** 30}, "seed", "<="),
    ({"return_token_ids": "yes"}, "return_token_ids", "boolean"),
]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("extra, param, why", OPENAI_BAD, ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(OPENAI_BAD)])
def test_openai_bad_stop_and_seed_inputs(scripted_server, route, extra, param, why):
    body = {"model": MODEL, "max_tokens": 4, **extra}
    body.update({"prompt": "hi"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})
    status, data, _ = scripted_server.raw("POST", route, body)
    assert status == 400, data
    err = data["error"]
    assert err["param"] == param and err["code"] == 400 and err["type"] == "invalid_request_error"
    assert why in err["message"], err["message"]


GENERATE_BAD = [  # (sampling_params, param, why, contract form: {"error": "<text>"})
    ({"stop_regex": r"(a)\1"}, "sampling_params.stop_regex", "linear time", False),
    ({"stop_regex": [r"x(?=y)"]}, "sampling_params.stop_regex", "linear time", False),
    ({"stop_regex": "b*"}, "sampling_params.stop_regex", "empty string", False),
    ({"stop_regex": "[z"}, "sampling_params.stop_regex", "not a valid", False),
    ({"stop_regex": ["q"] * 33}, "sampling_params.stop_regex", "at most 32", False),
    ({"stop_regex": 3.5}, "sampling_params.stop_regex", "string", True),
    ({"no_stop_trim": "true"}, "sampling_params.no_stop_trim", "boolean", True),
    ({"spaces_between_special_tokens": 0}, "sampling_params.spaces_between_special_tokens", "boolean", True),
    ({"sampling_seed": 2 ** 63}, "sampling_params.sampling_seed", "<=", True),
    ({"sampling_seed": -(2 ** 63) - 1}, "sampling_params.sampling_seed", ">=", True),
    ({"include_stop_str_in_output": True}, "sampling_params.include_stop_str_in_output", "unknown field", True),
]


@pytest.mark.parametrize("sp, param, why, contract", GENERATE_BAD,
                         ids=[f"{p}-{i}" for i, (_, p, _, _) in enumerate(GENERATE_BAD)])
def test_generate_bad_stop_and_seed_inputs(scripted_server, sp, param, why, contract):
    status, data = gen(scripted_server, {"max_new_tokens": 4, **sp})
    assert status == 400, data
    if contract:  # SGLang's contract check: a plain string
        assert isinstance(data["error"], str) and why in data["error"], data
    else:
        assert data["error"]["param"] == param and why in data["error"]["message"], data
