"""SGLang's native POST /generate: shapes, the cumulative stream, parity with /v1/completions, bad input.

`any_server` tests run against the scripted runner and the real tiny model; `scripted_server`
tests check exact outputs of the scripts in serve_support.SCRIPTS.
"""

from __future__ import annotations

import http.client
import json

import pytest

from serve_support import SCRIPTS, assert_idle

PROMPTS = [
    "The capital of France is", "Once upon a time", "def fib(n):", "北京 天气", "1 2 3 4 5",
    "Hello", "A quick brown fox", "SCRIPT:stopword please",
]


def sse_events(raw: str) -> list:
    """The JSON payloads of an SSE body, in order; asserts the [DONE] terminator."""
    events = [e[len("data: "):] for e in raw.split("\n\n") if e.strip()]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def generate(server, body: dict, method: str = "POST"):
    status, data, headers = server.raw(method, "/generate", body)
    if body.get("stream") and status == 200:
        return status, sse_events(data), headers
    return status, data, headers


def last_per_index(chunks: list) -> dict:
    """The final cumulative chunk of each batch index (0 for a single request)."""
    out = {}
    for c in chunks:
        out[c.get("index", 0)] = c
    return out


# --- shapes ---------------------------------------------------------------------------------------
def test_single_shape(any_server):
    status, d, _ = generate(any_server, {"text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                                              "ignore_eos": True}})
    assert status == 200, d
    assert set(d) == {"text", "output_ids", "meta_info"}
    m = d["meta_info"]
    assert m["finish_reason"] == {"type": "length", "length": 4}
    assert m["completion_tokens"] == len(d["output_ids"]) == 4
    assert m["prompt_tokens"] >= 1 and m["cached_tokens"] == 0 and m["weight_version"] == "default"
    assert isinstance(m["id"], str) and len(m["id"]) == 32
    assert m["e2e_latency"] > 0 and isinstance(m["response_sent_to_client_ts"], float)


def test_put_and_input_ids_and_prompt_token_ids(any_server, tokenizer):
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    status, d, _ = generate(any_server, {"input_ids": ids, "return_prompt_token_ids": True,
                                         "sampling_params": {"max_new_tokens": 2, "temperature": 0}}, method="PUT")
    assert status == 200, d
    assert d["prompt_token_ids"] == ids and d["meta_info"]["prompt_tokens"] == len(ids)


def test_default_max_new_tokens_is_128(scripted_server):
    status, d, _ = generate(scripted_server, {"text": "SCRIPT:long", "sampling_params": {"temperature": 0}})
    assert status == 200, d
    assert d["meta_info"]["finish_reason"] == {"type": "length", "length": 128}


def test_finish_reasons(scripted_server, tokenizer):
    # a stop string: the matched string, cut from the text
    _, d, _ = generate(scripted_server, {"text": "SCRIPT:stopword", "sampling_params": {"stop": ["STOP"]}})
    assert d["meta_info"]["finish_reason"] == {"type": "stop", "matched": "STOP"}
    assert d["text"] == "one two three "
    # EOS: the matched token id is the last output id, and its text is not in `text`
    _, d, _ = generate(scripted_server, {"text": "SCRIPT:plain", "sampling_params": {"max_new_tokens": 64}})
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert d["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    assert d["output_ids"][-1] == eos and "<|endoftext|>" not in d["text"]
    assert d["text"] == SCRIPTS["plain"].replace("<|endoftext|>", "")


def test_batch_with_rid_prefix_and_list(scripted_server):
    status, d, _ = generate(scripted_server, {"text": ["SCRIPT:plain", "SCRIPT:unicode"], "rid": "job7",
                                              "sampling_params": {"max_new_tokens": 3}})
    assert status == 200 and isinstance(d, list) and len(d) == 2
    assert [x["meta_info"]["id"] for x in d] == ["job7_0", "job7_1"]
    status, d, _ = generate(scripted_server, {"text": ["a", "b"], "rid": ["r-a", "r-b"],
                                              "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}]})
    assert status == 200, d
    assert [x["meta_info"]["id"] for x in d] == ["r-a", "r-b"]
    assert [x["meta_info"]["completion_tokens"] for x in d] == [1, 2]


def test_logprob_tuples(any_server):
    body = {"text": "The capital of France is", "return_logprob": True, "top_logprobs_num": 3,
            "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 5, "temperature": 0,
                                                                 "ignore_eos": True}}
    status, d, _ = generate(any_server, body)
    assert status == 200, d
    m = d["meta_info"]
    out = m["output_token_logprobs"]
    assert len(out) == m["completion_tokens"] == m["output_token_logprobs_length"] == 5
    assert [t[1] for t in out] == d["output_ids"]
    assert "".join(t[2] for t in out) == d["text"]
    for tok, tops in zip(out, m["output_top_logprobs"]):
        assert len(tops) == 3 and tops[0] == tok  # greedy: the chosen token is the best one
        assert all(isinstance(t[0], float) and t[0] <= 0 for t in tops)
    # without return_text_in_logprobs the third element is null
    body.pop("return_text_in_logprobs")
    _, d, _ = generate(any_server, body)
    assert all(t[2] is None for t in d["meta_info"]["output_token_logprobs"])


# --- the stream ---------------------------------------------------------------------------------
@pytest.mark.parametrize("batch", [False, True], ids=["single", "batch"])
def test_cumulative_stream_reassembles_to_the_answer(any_server, batch):
    text = ["Once upon a time", "SCRIPT:unicode"] if batch else "Once upon a time"
    body = {"text": text, "return_logprob": True, "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    _, whole, _ = generate(any_server, body)
    status, chunks, headers = generate(any_server, {**body, "stream": True})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    whole = whole if batch else [whole]
    finals = last_per_index(chunks)
    assert sorted(finals) == list(range(len(whole)))
    for i, w in enumerate(whole):
        mine = [c for c in chunks if c.get("index", 0) == i]
        assert len(mine) >= 2, "one chunk per token (stream interval 1)"
        # cumulative: each chunk extends the previous one
        for a, b in zip(mine, mine[1:]):
            assert b["text"].startswith(a["text"]) and b["output_ids"][:len(a["output_ids"])] == a["output_ids"]
            assert a["meta_info"]["finish_reason"] is None
            assert b["meta_info"]["completion_tokens"] == len(b["output_ids"])
        f = finals[i]
        assert f["text"] == w["text"] and f["output_ids"] == w["output_ids"]
        assert f["meta_info"]["finish_reason"] == w["meta_info"]["finish_reason"]
        assert f["meta_info"]["output_token_logprobs"] == w["meta_info"]["output_token_logprobs"]
        assert f["meta_info"]["output_top_logprobs"] == w["meta_info"]["output_top_logprobs"]
        assert ("index" in f) == batch


def test_incremental_stream(tokenizer_factory):
    """--incremental-streaming-output: chunks are deltas that concatenate to the answer."""
    from serve_support import make_scripted_engine, start_server, stop_server
    from trnrt.serve import ServeSettings

    srv = start_server(make_scripted_engine(tokenizer_factory), tokenizer_factory,
                       ServeSettings(served_model_name="trnrt-tiny", incremental_streaming_output=True))
    try:
        body = {"text": "SCRIPT:unicode", "return_logprob": True, "sampling_params": {"max_new_tokens": 6}}
        _, whole, _ = generate(srv, body)
        _, chunks, _ = generate(srv, {**body, "stream": True})
        assert "".join(c["text"] for c in chunks) == whole["text"]
        assert sum((c["output_ids"] for c in chunks), []) == whole["output_ids"]
        assert sum((c["meta_info"]["output_token_logprobs"] for c in chunks), []) == \
            whole["meta_info"]["output_token_logprobs"]
        assert len(chunks) >= 2 and len(chunks[0]["output_ids"]) < len(whole["output_ids"])
    finally:
        stop_server(srv)


def test_per_request_stream_interval(scripted_server):
    """sampling_params.stream_interval: a chunk every N tokens (and the last), same final answer."""
    body = {"text": "SCRIPT:long", "sampling_params": {"max_new_tokens": 10, "stream_interval": 3}}
    _, whole, _ = generate(scripted_server, body)
    _, chunks, _ = generate(scripted_server, {**body, "stream": True})
    assert [len(c["output_ids"]) for c in chunks] == [3, 6, 9, 10]
    assert chunks[-1]["text"] == whole["text"] and chunks[-1]["output_ids"] == whole["output_ids"]


# --- parity with /v1/completions ----------------------------------------------------------------
def _completions(server, prompts, stream: bool):
    body = {"model": "trnrt-tiny", "prompt": prompts, "max_tokens": 6, "temperature": 0, "logprobs": 2,
            "stream": stream}
    status, data, _ = server.raw("POST", "/v1/completions", body)
    assert status == 200, data
    if not stream:
        return [(c["text"], c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"]) for c in
                sorted(data["choices"], key=lambda c: c["index"])]
    texts, toks, lps = {}, {}, {}
    for ev in sse_events(data):
        for c in ev["choices"]:
            i = c["index"]
            texts[i] = texts.get(i, "") + c["text"]
            toks.setdefault(i, []).extend(c["logprobs"]["tokens"])
            lps.setdefault(i, []).extend(c["logprobs"]["token_logprobs"])
    return [(texts[i], toks[i], lps[i]) for i in sorted(texts)]


def _generate_answers(server, tokenizer, prompts, batched: bool, stream: bool):
    def one(text):
        body = {"text": text, "return_logprob": True, "top_logprobs_num": 2, "stream": stream,
                "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
        status, d, _ = generate(server, body)
        assert status == 200, d
        if stream:
            d = last_per_index(d)
            d = [d[i] for i in sorted(d)] if batched else d[0]
        return d
    ds = one(prompts) if batched else [one(p) for p in prompts]
    # SGLang's tuples carry ids; completions carries token texts: compare ids through their text
    return [(d["text"], [tokenizer.decode([t[1]], skip_special_tokens=False) for t in
                         d["meta_info"]["output_token_logprobs"]],
             [t[0] for t in d["meta_info"]["output_token_logprobs"]]) for d in ds]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("batched", [False, True], ids=["single", "batched"])
def test_greedy_generate_equals_completions(any_server, tokenizer, batched, stream):
    want = _completions(any_server, PROMPTS, stream=False)
    got = _generate_answers(any_server, tokenizer, PROMPTS, batched, stream)
    assert len(got) == len(want) == 8
    for (gt, gtoks, glps), (wt, wtoks, wlps) in zip(got, want):
        assert gt == wt
        assert gtoks[:len(wtoks)] == wtoks
        # batch composition changes fp32 reduction order (fused kernels): 1e-4, the parity rule
        assert glps[:len(wlps)] == pytest.approx(wlps, abs=1e-4)
    if stream:
        assert _completions(any_server, PROMPTS, stream=True) == want


# --- request ids ----------------------------------------------------------------------------------
def test_in_flight_rid_is_refused(slow_server):
    """A client rid already in flight is a 400 naming rid (SGLang's "Duplicate request ID")."""
    conn = http.client.HTTPConnection("127.0.0.1", slow_server.port, timeout=30)
    conn.request("POST", "/generate", json.dumps({"text": "SCRIPT:long", "rid": "dup-1", "stream": True,
                                                  "sampling_params": {"max_new_tokens": 200}}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    resp.fp.readline()  # the first chunk: the request is in flight
    status, d, _ = generate(slow_server, {"text": "x", "rid": "dup-1", "sampling_params": {"max_new_tokens": 1}})
    assert status == 400 and d["error"]["param"] == "rid" and "Duplicate request ID" in d["error"]["message"], d
    conn.close()  # the client leaves: its request is aborted
    assert_idle(slow_server)
    status, d, _ = generate(slow_server, {"text": "x", "rid": "dup-1", "sampling_params": {"max_new_tokens": 1}})
    assert status == 200, d  # the id is free again


@pytest.fixture(scope="module")
def slow_server(tokenizer_factory):
    from serve_support import make_scripted_engine, start_server, stop_server
    from trnrt.serve import ServeSettings

    srv = start_server(make_scripted_engine(tokenizer_factory, step_delay_s=0.01), tokenizer_factory,
                       ServeSettings(served_model_name="trnrt-tiny"))
    yield srv
    stop_server(srv)


# --- bad input ------------------------------------------------------------------------------------
SP = "sampling_params"
CONTRACT = "contract"  # {"error": "<text>"} (SGLang's contract check)
VALUE = "value"  # {"error": {"message", "param", ...}}

BAD = [
    # (id, body, status, shape, field named)
    ("no-prompt", {SP: {}}, 400, VALUE, "text"),
    ("both-prompts", {"text": "a", "input_ids": [1]}, 400, VALUE, "text"),
    ("text-int", {"text": 5}, 400, CONTRACT, "text"),
    ("text-empty", {"text": ""}, 400, VALUE, "text"),
    ("text-list-mixed", {"text": ["a", 1]}, 400, CONTRACT, "text"),
    ("text-batch-empty-item", {"text": ["a", ""]}, 400, VALUE, "text"),
    ("text-surrogate", '{"text": "hi\\ud800"}', 400, VALUE, "text"),
    ("ids-empty", {"input_ids": []}, 400, VALUE, "input_ids"),
    ("ids-strings", {"input_ids": ["a"]}, 400, CONTRACT, "input_ids"),
    ("ids-bools", {"input_ids": [True, False]}, 400, CONTRACT, "input_ids"),
    ("ids-oov", {"input_ids": [10 ** 9]}, 400, VALUE, "input_ids"),
    ("ids-negative", {"input_ids": [-1]}, 400, VALUE, "input_ids"),
    ("ids-batch-empty-item", {"input_ids": [[1], []]}, 400, VALUE, "input_ids"),
    ("ids-float", {"input_ids": [1.5]}, 400, CONTRACT, "input_ids"),
    ("unknown-sp-key", {"text": "a", SP: {"foo": 1}}, 400, CONTRACT, "foo"),
    ("unknown-sp-key-2", {"text": "a", SP: {"max_tokens": 5}}, 400, CONTRACT, "max_tokens"),
    ("sp-not-object", {"text": "a", SP: "x"}, 400, CONTRACT, SP),
    ("sp-list-single", {"text": "a", SP: [{}]}, 400, CONTRACT, SP),
    ("sp-list-wrong-len", {"text": ["a", "b"], SP: [{}]}, 400, VALUE, SP),
    ("temperature-str", {"text": "a", SP: {"temperature": "x"}}, 400, CONTRACT, "temperature"),
    ("temperature-neg", {"text": "a", SP: {"temperature": -1}}, 400, VALUE, "temperature"),
    ("temperature-bool", {"text": "a", SP: {"temperature": True}}, 400, CONTRACT, "temperature"),
    ("top-p-zero", {"text": "a", SP: {"top_p": 0}}, 400, VALUE, "top_p"),
    ("top-p-big", {"text": "a", SP: {"top_p": 1.5}}, 400, VALUE, "top_p"),
    ("top-k-neg", {"text": "a", SP: {"top_k": -5}}, 400, VALUE, "top_k"),
    ("top-k-float", {"text": "a", SP: {"top_k": 2.5}}, 400, CONTRACT, "top_k"),
    ("min-p-big", {"text": "a", SP: {"min_p": 2}}, 400, VALUE, "min_p"),
    ("max-new-neg", {"text": "a", SP: {"max_new_tokens": -1}}, 400, CONTRACT, "max_new_tokens"),
    ("max-new-str", {"text": "a", SP: {"max_new_tokens": "10"}}, 400, CONTRACT, "max_new_tokens"),
    ("max-new-over-context", {"text": "a", SP: {"max_new_tokens": 10 ** 6}}, 400, VALUE, "max_new_tokens"),
    ("stop-int", {"text": "a", SP: {"stop": 3}}, 400, CONTRACT, "stop"),
    ("stop-empty-string", {"text": "a", SP: {"stop": [""]}}, 400, CONTRACT, "stop"),
    ("stop-too-many", {"text": "a", SP: {"stop": [str(i) for i in range(33)]}}, 400, CONTRACT, "stop"),
    ("stop-ids-neg", {"text": "a", SP: {"stop_token_ids": [-1]}}, 400, CONTRACT, "stop_token_ids"),
    ("stop-ids-oov", {"text": "a", SP: {"stop_token_ids": [10 ** 9]}}, 400, VALUE, "stop_token_ids"),
    ("seed-str", {"text": "a", SP: {"sampling_seed": "x"}}, 400, CONTRACT, "sampling_seed"),
    ("ignore-eos-int", {"text": "a", SP: {"ignore_eos": 1}}, 400, CONTRACT, "ignore_eos"),
    ("skip-special-str", {"text": "a", SP: {"skip_special_tokens": "no"}}, 400, CONTRACT, "skip_special_tokens"),
    ("stream-interval-zero", {"text": "a", SP: {"stream_interval": 0}}, 400, CONTRACT, "stream_interval"),
    ("n-0", {"text": "a", SP: {"n": 0}}, 400, CONTRACT, "n"),
    ("n-129", {"text": "a", SP: {"n": 129}}, 400, CONTRACT, "n"),
    ("n-true", {"text": "a", SP: {"n": True}}, 400, CONTRACT, "n"),
    ("penalty", {"text": "a", SP: {"frequency_penalty": 0.5}}, 400, VALUE, "frequency_penalty"),
    ("repetition-penalty-true", {"text": "a", SP: {"repetition_penalty": True}}, 400, CONTRACT, "repetition_penalty"),
    ("min-new", {"text": "a", SP: {"min_new_tokens": 3}}, 400, VALUE, "min_new_tokens"),
    ("regex", {"text": "a", SP: {"regex": "a+"}}, 400, VALUE, "regex"),
    ("json-schema", {"text": "a", SP: {"json_schema": "{}"}}, 400, VALUE, "json_schema"),
    ("stop-regex-backref", {"text": "a", SP: {"stop_regex": r"(a)\1"}}, 400, VALUE, "stop_regex"),
    ("logit-bias", {"text": "a", SP: {"logit_bias": {"1": 2.0}}}, 400, VALUE, "logit_bias"),
    ("no-stop-trim-str", {"text": "a", SP: {"no_stop_trim": "yes"}}, 400, CONTRACT, "no_stop_trim"),
    ("rid-int", {"text": "a", "rid": 5}, 400, CONTRACT, "rid"),
    ("rid-empty", {"text": "a", "rid": ""}, 400, VALUE, "rid"),
    ("rid-list-single", {"text": "a", "rid": ["x"]}, 400, CONTRACT, "rid"),
    ("rid-list-wrong-len", {"text": ["a", "b"], "rid": ["x"]}, 400, VALUE, "rid"),
    ("rid-duplicate-in-batch", {"text": ["a", "b"], "rid": ["x", "x"]}, 400, VALUE, "rid"),
    ("stream-str", {"text": "a", "stream": "yes"}, 400, CONTRACT, "stream"),
    ("return-logprob-int", {"text": "a", "return_logprob": 1}, 400, CONTRACT, "return_logprob"),
    ("top-logprobs-big", {"text": "a", "return_logprob": True, "top_logprobs_num": 21}, 400, VALUE,
     "top_logprobs_num"),
    ("top-logprobs-str", {"text": "a", "top_logprobs_num": "2"}, 400, CONTRACT, "top_logprobs_num"),
    ("logprob-start-len", {"text": "a", "return_logprob": True, "logprob_start_len": 0}, 400, VALUE,
     "logprob_start_len"),
    ("token-ids-logprob", {"text": "a", "token_ids_logprob": [1, 2]}, 400, VALUE, "token_ids_logprob"),
    ("input-embeds", {"input_embeds": [[0.1]]}, 400, VALUE, "input_embeds"),
    ("image-data", {"text": "a", "image_data": "http://x/y.png"}, 400, VALUE, "image_data"),
    ("lora", {"text": "a", "lora_path": "x"}, 400, VALUE, "lora_path"),
    ("hidden-states", {"text": "a", "return_hidden_states": True}, 400, VALUE, "return_hidden_states"),
    ("max-thinking", {"text": "a", "max_thinking_tokens": -1}, 400, CONTRACT, "max_thinking_tokens"),
    ("dp-rank", {"text": "a", "routed_dp_rank": 1}, 400, VALUE, "routed_dp_rank"),
    ("text-in-logprobs-str", {"text": "a", "return_text_in_logprobs": "y"}, 400, CONTRACT,
     "return_text_in_logprobs"),
    ("prompt-token-ids-int", {"text": "a", "return_prompt_token_ids": 1}, 400, CONTRACT, "return_prompt_token_ids"),
    ("not-object", "[1, 2]", 400, VALUE, None),
    ("not-json", "{nope", 400, VALUE, None),
    ("empty-body", "", 400, VALUE, None),
    ("batch-too-big", {"input_ids": [[1]] * 1025}, 400, VALUE, "input_ids"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input(any_server, case):
    _, body, status, shape, field = case
    raw = body if isinstance(body, str) else json.dumps(body)
    got, data, _ = any_server.raw("POST", "/generate", raw)
    assert got == status, data
    assert isinstance(data, dict) and "error" in data, data
    err = data["error"]
    if shape == CONTRACT:
        assert isinstance(err, str), data
        text = err
    else:
        assert isinstance(err, dict) and isinstance(err["message"], str), data
        text = (err.get("param") or "") + " " + err["message"]
    if field is not None:
        assert field in text, data


def test_serves_after_bad_input(any_server):
    for case in BAD[:10]:
        body = case[1]
        any_server.raw("POST", "/generate", body if isinstance(body, str) else json.dumps(body))
    status, d, _ = generate(any_server, {"text": "Hello", "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and d["meta_info"]["completion_tokens"] == 2
    assert_idle(any_server)


def test_unknown_top_level_field_is_ignored_with_warning(scripted_server, caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="trnrt.serve"):
        status, d, _ = generate(scripted_server, {"text": "a", "my_field": 1, "sampling_params": {"max_new_tokens": 1}})
    assert status == 200, d
    assert any("my_field" in r.getMessage() for r in caplog.records)
