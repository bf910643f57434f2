"""The OpenAI routes through the official `openai` client under strict response validation.

`any_server` tests run against the scripted engine and (once wired) the real one: they check
shapes, not text. `scripted_server` tests check exact outputs.
"""

from __future__ import annotations

import json
import re

import openai
import pytest

from serve_support import SCRIPTS, start_server, stop_server

MODEL = "trnrt-tiny"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]


def chat(client, content: str, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def collect_chat_stream(stream):
    """(role, reasoning, content, tool calls by index, finish_reason, usage, chunks)."""
    role, reasoning, content, finish, usage = None, "", "", None, None
    calls: dict[int, dict] = {}
    chunks = list(stream)
    for ch in chunks:
        assert ch.object == "chat.completion.chunk"
        if ch.usage is not None:
            assert ch.choices == []
            usage = ch.usage
        for c in ch.choices:
            d = c.delta
            role = role or d.role
            extra = d.model_extra or {}
            reasoning += extra.get("reasoning_content") or ""
            content += d.content or ""
            for tc in d.tool_calls or []:
                e = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    e["id"] = tc.id
                if tc.function and tc.function.name:
                    e["name"] = tc.function.name
                if tc.function and tc.function.arguments:
                    e["arguments"] += tc.function.arguments
            if c.finish_reason is not None:
                assert finish is None, "exactly one finish_reason per choice"
                finish = c.finish_reason
    return role, reasoning, content, calls, finish, usage, chunks


# --- models, health, stats ----------------------------------------------------------------------
def test_models(any_server):
    client = any_server.client()
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["type"] == "not_found_error"


def test_health_and_stats(any_server):
    status, body, _ = any_server.raw("GET", "/health")
    assert status == 200
    status, stats, _ = any_server.raw("GET", "/v1/stats")
    assert status == 200 and stats["version"] == 1
    for key in ("running", "queued", "pages_used", "pages_total", "slots_used", "slots_total"):
        assert isinstance(stats["live"][key], int)
    for key in ("prompt_tokens", "generation_tokens", "aborts", "errors"):
        assert isinstance(stats["counters"][key], int)


# --- chat -----------------------------------------------------------------------------------------
def test_chat_non_stream_shape(any_server):
    r = chat(any_server.client(), "Hello", max_tokens=8)
    assert r.object == "chat.completion" and r.model == MODEL
    c = r.choices[0]
    assert c.message.role == "assistant" and c.finish_reason in ("stop", "length")
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert 0 < r.usage.completion_tokens <= 8
    assert r.usage.completion_tokens_details.reasoning_tokens <= r.usage.completion_tokens


def test_chat_stream_shape(any_server):
    role, reasoning, content, calls, finish, usage, chunks = collect_chat_stream(
        chat(any_server.client(), "Hello", max_tokens=8, stream=True, stream_options={"include_usage": True}))
    assert role == "assistant"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert finish in ("stop", "length")
    assert usage is not None and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert chunks[-1].usage is not None  # the usage chunk comes last, after the finish chunk


def test_chat_reasoning_split(scripted_server):
    client = scripted_server.client()
    r = chat(client, "SCRIPT:reason What is the capital of France?")
    msg = r.choices[0].message
    assert msg.content == "The capital of France is Paris."
    assert msg.model_extra["reasoning_content"] == "Let me think about the capital."
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["matched_stop"] is not None  # the <|user|> stop token id
    tok_reasoning = len(client_tokenize(scripted_server, "Let me think about the capital."))
    assert r.usage.completion_tokens_details.reasoning_tokens == tok_reasoning
    assert r.usage.model_extra["reasoning_tokens"] == tok_reasoning
    # Streaming agrees with the non-streamed answer.
    _, reasoning, content, _, finish, usage, _ = collect_chat_stream(
        chat(client, "SCRIPT:reason again", stream=True, stream_options={"include_usage": True}))
    assert (reasoning, content, finish) == (msg.model_extra["reasoning_content"], msg.content, "stop")
    assert usage.completion_tokens_details.reasoning_tokens == tok_reasoning
    # The engine was asked to keep special tokens (the parser needs </think>).
    assert scripted_server.engine.submitted[-1].sampling_params.skip_special_tokens is False


def client_tokenize(server, text: str) -> list[int]:
    from trnrt.serve import get_state

    return get_state(server.app).tokinfo().tokenizer.encode(text, add_special_tokens=False)


def script_prefix(server, name: str, n: int) -> str:
    """The text of the first n tokens of SCRIPTS[name]."""
    from trnrt.serve import get_state

    tok = get_state(server.app).tokinfo().tokenizer
    return tok.decode(tok.encode(SCRIPTS[name], add_special_tokens=False)[:n])


def test_chat_thinking_disabled_is_all_content(scripted_server):
    client = scripted_server.client()
    r = chat(client, "SCRIPT:plain hi", extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content == "Hello world! How are you today?"
    assert r.choices[0].message.model_extra.get("reasoning_content") is None
    assert r.usage.completion_tokens_details.reasoning_tokens == 0
    # reasoning_effort "none" does the same.
    r = chat(client, "SCRIPT:plain hi", reasoning_effort="none")
    assert r.choices[0].message.model_extra.get("reasoning_content") is None


def test_chat_template_kwargs_reach_the_template(scripted_server):
    chat(scripted_server.client(), "SCRIPT:plain hi", reasoning_effort="low")
    from trnrt.serve import get_state

    tok = get_state(scripted_server.app).tokinfo().tokenizer
    prompt = tok.decode(scripted_server.engine.submitted[-1].prompt_token_ids, skip_special_tokens=False)
    assert prompt.endswith("<|assistant|><think>")
    assert "Low" in prompt or "low" in prompt


def test_tool_call_non_stream(scripted_server):
    r = chat(scripted_server.client(), "SCRIPT:tool Weather in Paris?", tools=TOOLS)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.content == ""
    assert c.message.model_extra["reasoning_content"] == "I should check the weather."
    (call,) = c.message.tool_calls
    assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.function.arguments == '{"city": "Paris", "days": 3}'  # days typed by the schema
    assert c.model_extra["matched_stop"] is None


def test_tool_call_stream(scripted_server):
    _, reasoning, content, calls, finish, _, chunks = collect_chat_stream(
        chat(scripted_server.client(), "SCRIPT:tool Weather?", tools=TOOLS, stream=True))
    assert finish == "tool_calls"
    assert reasoning == "I should check the weather." and content == ""
    assert list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and re.fullmatch(r"call_[0-9a-f]{24}", calls[0]["id"])
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": 3}
    n_arg_chunks = sum(1 for ch in chunks for c in ch.choices for tc in (c.delta.tool_calls or [])
                       if tc.function and tc.function.arguments)
    assert n_arg_chunks >= 2  # the arguments really arrive as deltas


def test_tool_call_glm45_server(tokenizer_factory):
    from serve_support import make_scripted_engine
    from trnrt.serve import ServeSettings

    server = start_server(make_scripted_engine(tokenizer_factory), tokenizer_factory,
                          ServeSettings(served_model_name=MODEL, tool_call_parser="glm45"))
    try:
        r = chat(server.client(), "SCRIPT:tool45 Weather in Beijing?", tools=TOOLS)
        (call,) = r.choices[0].message.tool_calls
        assert json.loads(call.function.arguments) == {"city": "北京", "days": 3}
        assert r.choices[0].finish_reason == "tool_calls"
    finally:
        stop_server(server)


def test_tool_choice_none_does_not_parse(scripted_server):
    r = chat(scripted_server.client(), "SCRIPT:tool Weather?", tools=TOOLS, tool_choice="none")
    msg = r.choices[0].message
    assert msg.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert "<" not in msg.content  # markers stripped (skip_special_tokens defaults to true)
    from trnrt.serve import get_state

    tok = get_state(scripted_server.app).tokinfo().tokenizer
    prompt = tok.decode(scripted_server.engine.submitted[-1].prompt_token_ids, skip_special_tokens=False)
    assert "get_weather" not in prompt  # tools left out of the prompt with tool_choice none


def test_chat_logprobs(scripted_server):
    r = chat(scripted_server.client(), "SCRIPT:plain hi", logprobs=True, top_logprobs=3,
             extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 3
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token or "\ufffd" in e.token
    # Streamed logprobs cover the same tokens.
    stream = chat(scripted_server.client(), "SCRIPT:plain hi", logprobs=True, top_logprobs=1, stream=True,
                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    n = sum(len(c.logprobs.content) for ch in stream for c in ch.choices if c.logprobs)
    assert n == len(content)


# vLLM's return_tokens_as_token_ids: every token of the logprobs output is "token_id:<id>"; the
# ids are checked against the completion's own (return_token_ids), the text against a plain answer.
CHAT, COMP = "/v1/chat/completions", "/v1/completions"
AS_IDS = {"return_tokens_as_token_ids": True, "return_token_ids": True}


def ids_of(labels) -> list[int]:
    """The ids of `token_id:<id>` labels; a label of any other form fails the test."""
    labels = list(labels)
    assert all(re.fullmatch(r"token_id:\d+", s) for s in labels), f"not all token_id labels: {labels!r}"
    return [int(s[len("token_id:"):]) for s in labels]


def test_chat_return_tokens_as_token_ids(scripted_server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "SCRIPT:unicode hi"}], "logprobs": True,
            "top_logprobs": 2, "chat_template_kwargs": {"enable_thinking": False}}
    s, plain = scripted_server.post(CHAT, body)
    s2, d = scripted_server.post(CHAT, {**body, **AS_IDS})
    assert s == s2 == 200, d
    c, p = d["choices"][0], plain["choices"][0]
    content = c["logprobs"]["content"]
    assert ids_of(e["token"] for e in content) == c["token_ids"]  # the completion's ids, in order
    assert c["message"]["content"] == p["message"]["content"] == "北京 天气 你好 世界"  # the text stays text
    for e, q in zip(content, p["logprobs"]["content"], strict=True):
        assert e["bytes"] == q["bytes"] and e["logprob"] == q["logprob"]  # vLLM: the token's text's UTF-8
        tops = ids_of(t["token"] for t in e["top_logprobs"])
        assert len(tops) == 2 and tops[0] == ids_of([e["token"]])[0]  # the scripted runner ranks it first
        assert all(t["bytes"] == list(t["token"].encode()) for t in e["top_logprobs"])  # vLLM: the label's
    # streamed: the same entries, and each chunk's labels are the ids behind its delta
    chunks = scripted_server.sse_events(CHAT, {**body, **AS_IDS, "stream": True})
    chs = [ch for ev in chunks for ch in ev["choices"] if ch["logprobs"]]
    assert [e for ch in chs for e in ch["logprobs"]["content"]] == content
    assert all(ids_of(e["token"] for e in ch["logprobs"]["content"]) == ch["token_ids"] for ch in chs)
    # through the official client's strict validation
    r = chat(scripted_server.client(), "SCRIPT:unicode hi", logprobs=True, top_logprobs=2,
             extra_body={"chat_template_kwargs": body["chat_template_kwargs"], "return_tokens_as_token_ids": True})
    assert [e.token for e in r.choices[0].logprobs.content] == [e["token"] for e in content]


def test_completions_return_tokens_as_token_ids(scripted_server):
    body = {"model": MODEL, "prompt": "SCRIPT:unicode", "max_tokens": 40, "logprobs": 2}
    s, plain = scripted_server.post(COMP, body)
    s2, d = scripted_server.post(COMP, {**body, **AS_IDS})
    assert s == s2 == 200, d
    c, p = d["choices"][0], plain["choices"][0]
    lp = c["logprobs"]
    assert ids_of(lp["tokens"]) == c["token_ids"] and len(c["token_ids"]) == d["usage"]["completion_tokens"]
    assert c["text"] == p["text"]  # the text stays text, and text_offset are offsets into it
    assert lp["text_offset"] == p["logprobs"]["text_offset"] and lp["token_logprobs"] == p["logprobs"]["token_logprobs"]
    for tid, top in zip(c["token_ids"], lp["top_logprobs"], strict=True):
        assert len(ids_of(top)) == 2 and f"token_id:{tid}" in top  # ids never collapse two keys
    chunks = scripted_server.sse_events(COMP, {**body, **AS_IDS, "stream": True})
    chs = [ch for ev in chunks for ch in ev["choices"]]
    for key in ("tokens", "top_logprobs", "text_offset"):
        assert [x for ch in chs for x in ch["logprobs"][key]] == lp[key], key
    assert all(ids_of(ch["logprobs"]["tokens"]) == ch["token_ids"] for ch in chs)


@pytest.mark.parametrize("route", [CHAT, COMP])
@pytest.mark.parametrize("value", ["true", 1, [True]])
def test_return_tokens_as_token_ids_must_be_a_boolean(scripted_server, route, value):
    body = {"model": MODEL, "max_tokens": 2, "logprobs": True if route == CHAT else 1,
            "return_tokens_as_token_ids": value}
    body.update({"prompt": "hi"} if route == COMP else {"messages": [{"role": "user", "content": "hi"}]})
    s, d = scripted_server.post(route, body)
    assert s == 400 and d["error"]["param"] == "return_tokens_as_token_ids" and d["error"]["code"] == 400, d
    assert "boolean" in d["error"]["message"]
    s, d = scripted_server.post(route, {**body, "return_tokens_as_token_ids": None})  # null: the default
    assert s == 200, d


def test_chat_max_tokens_and_stop(scripted_server):
    client = scripted_server.client()
    r = chat(client, "SCRIPT:long x", max_completion_tokens=5)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    r = chat(client, "SCRIPT:stopword x", stop=["STOP"], extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content == "one two three "
    assert r.choices[0].model_extra["matched_stop"] == "STOP"


def test_sampling_fields_reach_the_engine(scripted_server):
    chat(scripted_server.client(), "SCRIPT:plain x", temperature=0.5, top_p=0.9, seed=7, max_tokens=3,
         extra_body={"top_k": 5, "min_p": 0.1, "ignore_eos": True, "stop_token_ids": [1, 2]})
    sp = scripted_server.engine.submitted[-1].sampling_params
    assert (sp.temperature, sp.top_p, sp.seed, sp.max_new_tokens, sp.top_k, sp.min_p, sp.ignore_eos) == \
        (0.5, 0.9, 7, 3, 5, 0.1, True)
    assert sp.stop_token_ids == [1, 2]


def test_chat_multi_turn_with_tool_results(scripted_server):
    messages = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "user", "content": [{"type": "text", "text": "SCRIPT:plain "}, {"type": "text", "text": "thanks"}]},
    ]
    r = scripted_server.client().chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    assert r.choices[0].finish_reason == "stop"
    from trnrt.serve import get_state

    tok = get_state(scripted_server.app).tokinfo().tokenizer
    prompt = tok.decode(scripted_server.engine.submitted[-1].prompt_token_ids, skip_special_tokens=False)
    assert "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>" in prompt
    assert "<tool_response>sunny</tool_response>" in prompt


def test_engine_failure_is_reported(scripted_server):
    client = scripted_server.client()
    with pytest.raises(openai.InternalServerError) as e:
        chat(client, "SCRIPT:fail x")
    assert "scripted failure" in e.value.body["message"]
    with pytest.raises(openai.APIError):
        list(chat(client, "SCRIPT:fail x", stream=True))
    assert chat(client, "SCRIPT:plain x").choices[0].finish_reason == "stop"


# --- completions -------------------------------------------------------------------------------------
def test_completion_forms(scripted_server):
    client = scripted_server.client()
    tok = client_tokenize(scripted_server, "The capital of France is")
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4)
    assert r.object == "text_completion" and r.choices[0].text == script_prefix(scripted_server, "plain", 4)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    assert r.usage.prompt_tokens == len(tok)
    r = client.completions.create(model=MODEL, prompt=["a", "SCRIPT:unicode"], max_tokens=50)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[1].text == "北京 天气 你好 世界" and r.choices[1].finish_reason == "stop"
    r = client.completions.create(model=MODEL, prompt=tok, max_tokens=2)
    assert r.usage.prompt_tokens == len(tok)
    r = client.completions.create(model=MODEL, prompt=[tok, tok[:2]], max_tokens=2)
    assert len(r.choices) == 2 and r.usage.prompt_tokens == len(tok) + 2


def test_completion_echo_and_logprobs(scripted_server):
    client = scripted_server.client()
    r = client.completions.create(model=MODEL, prompt="Say:", max_tokens=3, echo=True)
    assert r.choices[0].text == "Say:" + script_prefix(scripted_server, "plain", 3)
    r = client.completions.create(model=MODEL, prompt="Say:", max_tokens=3, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 3
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and all(len(t) == 2 for t in lp.top_logprobs)


def test_completion_stream(scripted_server):
    # openai's CompletionChoice.finish_reason is not Optional, so strict validation rejects the
    # `null` that OpenAI itself sends on every non-final streamed chunk: parse these loosely and
    # check the fields by hand.
    client = scripted_server.client(_strict_response_validation=False)
    chunks = list(client.completions.create(model=MODEL, prompt="SCRIPT:stopword", max_tokens=50, stop=["STOP"],
                                            stream=True, echo=True, stream_options={"include_usage": True}))
    text = "".join(c.text for ch in chunks for c in ch.choices)
    assert text == "SCRIPT:stopwordone two three "
    finishes = [c.finish_reason for ch in chunks for c in ch.choices]
    assert finishes[-1] == "stop" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    for ch in chunks:
        assert ch.object == "text_completion" and isinstance(ch.created, int) and ch.model == MODEL


def test_usage_counts_match_engine(scripted_server):
    r = chat(scripted_server.client(), "SCRIPT:plain hi", extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    req = scripted_server.engine.submitted[-1]
    assert r.usage.prompt_tokens == len(req.prompt_token_ids)
    # the script's tokens including the <|endoftext|> stop token
    assert r.usage.completion_tokens == len(client_tokenize(scripted_server, SCRIPTS["plain"]))


# --- auth, shutdown -------------------------------------------------------------------------------
def test_api_key(tokenizer_factory):
    from serve_support import make_scripted_engine
    from trnrt.serve import ServeSettings

    server = start_server(make_scripted_engine(tokenizer_factory), tokenizer_factory,
                          ServeSettings(served_model_name=MODEL, api_key="s3cret"))
    try:
        with pytest.raises(openai.AuthenticationError) as e:
            server.client(api_key="wrong").models.list()
        assert e.value.body["type"] == "authentication_error"
        status, body, _ = server.raw("GET", "/v1/models")
        assert status == 401 and set(body["error"]) == {"message", "type", "param", "code"}
        assert server.raw("GET", "/health")[0] == 200
        assert chat(server.client(api_key="s3cret"), "hi").choices[0].finish_reason == "stop"
        # shutting down: 503 in OpenAI's shape
        from trnrt.serve import get_state

        get_state(server.app).shutting_down.set()
        with pytest.raises(openai.APIStatusError) as e:
            chat(server.client(api_key="s3cret"), "hi")
        assert e.value.status_code == 503
        assert server.raw("GET", "/health")[0] == 503
    finally:
        stop_server(server)


def test_completion_shapes(any_server):
    """Shapes only (any engine): every prompt form, logprobs, echo, a loosely parsed stream."""
    client = any_server.client()
    ids = client_tokenize(any_server, "The capital of France is")
    for prompt, n in [("Hello", 1), (["Hello", "World"], 2), (ids, 1), ([ids, ids[:3]], 2)]:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
        assert len(r.choices) == n and [c.index for c in r.choices] == list(range(n))
        assert all(c.finish_reason in ("stop", "length") for c in r.choices)
        assert 0 < r.usage.completion_tokens <= 3 * n
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, logprobs=2, temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) <= 2 for t in lp.top_logprobs)
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, echo=True)
    assert r.choices[0].text.startswith("Hello")
    loose = any_server.client(_strict_response_validation=False)
    chunks = list(loose.completions.create(model=MODEL, prompt="Hello", max_tokens=3, stream=True,
                                           stream_options={"include_usage": True}))
    assert [c.finish_reason for ch in chunks for c in ch.choices][-1] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens > 0


def test_chat_logprobs_shape(any_server):
    r = chat(any_server.client(), "Hello", max_tokens=4, logprobs=True, top_logprobs=2, temperature=0)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(e.top_logprobs) <= 2 and e.logprob <= 0 for e in content)


def test_concurrent_streams_then_idle(any_server):
    """16 streams at once, 4 of them cut off after the first delta: every survivor ends with
    [DONE], and the engine ends idle (meaningful on the real engine: pages and slots freed)."""
    import threading

    from serve_support import assert_idle
    from test_concurrency import RawStream, stream_body

    results, errors = {}, []

    def run(i):
        try:
            st = RawStream(any_server.port, stream_body(f"SCRIPT:long Hello {i}", 24, ignore_eos=True))
            if i % 4 == 0:
                st.events(2)
                st.hang_up()
                return
            results[i] = st.events()
            st.hang_up()
        except Exception as e:  # reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert len(results) == 12 and all(ev[-1] == "[DONE]" for ev in results.values())
    assert all(ev[-2]["usage"]["completion_tokens"] == 24 for ev in results.values())
    assert_idle(any_server)


def test_default_chat_template_kwargs(tokenizer_factory):
    """--default-chat-template-kwargs apply under the request's own kwargs."""
    from serve_support import make_scripted_engine
    from trnrt.serve import ServeSettings

    server = start_server(make_scripted_engine(tokenizer_factory), tokenizer_factory,
                          ServeSettings(served_model_name=MODEL,
                                        default_chat_template_kwargs={"enable_thinking": False}))
    try:
        r = chat(server.client(), "SCRIPT:plain hi")
        assert r.choices[0].message.model_extra.get("reasoning_content") is None
        assert r.choices[0].message.content == "Hello world! How are you today?"
        r = chat(server.client(), "SCRIPT:reason hi", extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        assert r.choices[0].message.model_extra["reasoning_content"] == "Let me think about the capital."
    finally:
        stop_server(server)
