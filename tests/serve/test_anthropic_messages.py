"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through the official
`anthropic` client under strict response validation, on one scripted server (exact outputs:
reasoning, tool calls, stop sequences) plus a short pass on the real tiny model.
"""

from __future__ import annotations

import json

import anthropic
import pytest

from serve_support import make_scripted_engine, start_server, stop_server

MODEL = "trnrt-tiny"
KEY = "sk-anthropic-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
TOOLS = [{"name": "get_weather", "description": "Weather forecast",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                           "required": ["city"]}}]


@pytest.fixture(scope="module")
def server(tokenizer_factory):
    from trnrt.serve import ServeSettings

    engine = make_scripted_engine(tokenizer_factory)
    srv = start_server(engine, tokenizer_factory,
                       ServeSettings(served_model_name=MODEL, api_key=KEY, max_request_bytes=1 << 20))
    yield srv
    stop_server(srv)


def live(srv) -> dict:
    return srv.raw("GET", "/v1/stats", headers=AUTH)[1]["live"]


def aborts(srv) -> int:
    return srv.raw("GET", "/v1/stats", headers=AUTH)[1]["counters"]["aborts"]


def assert_idle(srv, timeout_s: float = 5.0) -> None:
    """serve_support.assert_idle with this server's key: nothing runs or waits, no page or slot used."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        s = live(srv)
        if s["running"] == 0 and s["queued"] == 0 and s["pages_used"] == 0 and s["slots_used"] == 0:
            return
        assert time.monotonic() < deadline, f"engine not idle: {s}"
        time.sleep(0.02)


def client(srv, **kw) -> anthropic.Anthropic:
    kw.setdefault("api_key", KEY)
    return anthropic.Anthropic(base_url=srv.url, max_retries=0, timeout=30, _strict_response_validation=True, **kw)


def create(srv, content: str, max_tokens: int = 64, **kw):
    return client(srv).messages.create(model=MODEL, max_tokens=max_tokens,
                                       messages=[{"role": "user", "content": content}], **kw)


def create_messages(srv, messages, max_tokens: int = 64, **kw):
    return client(srv).messages.create(model=MODEL, max_tokens=max_tokens, messages=messages, **kw)


def post(srv, body, path: str = "/v1/messages", headers: dict | None = None):
    return srv.raw("POST", path, body, {**AUTH, **(headers or {})})


def comparable(msg) -> dict:
    """A Message without what differs between two runs of the same request (ids; how the prompt
    splits between fresh and cached tokens)."""
    d = msg.model_dump() if hasattr(msg, "model_dump") else dict(msg)
    d.pop("id")
    u = d["usage"]
    u["input_tokens"] += u.pop("cache_read_input_tokens") or 0
    for b in d["content"]:
        if b["type"] == "tool_use":
            assert b.pop("id").startswith("toolu_")
    return d


def sse_events(raw: bytes) -> list[tuple[str, dict]]:
    """(event line, data) of each frame; every frame must have both, with the same type."""
    out = []
    for chunk in raw.decode().split("\n\n"):
        if not chunk.strip():
            continue
        lines = chunk.split("\n")
        assert lines[0].startswith("event: ") and lines[1].startswith("data: "), chunk
        ev, data = lines[0][7:], json.loads(lines[1][6:])
        assert data["type"] == ev
        out.append((ev, data))
    return out


def raw_stream(srv, body: dict) -> list[tuple[str, dict]]:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    conn.request("POST", "/v1/messages", json.dumps({**body, "stream": True}),
                 {**AUTH, "Content-Type": "application/json", "anthropic-version": "2023-06-01"})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("Content-Type").startswith("text/event-stream")
    data = r.read()
    conn.close()
    return sse_events(data)


# --- messages.create ----------------------------------------------------------------------------
def test_create_thinking_and_text(server):
    m = create(server, "SCRIPT:reason Where?")
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == "Let me think about the capital."
    assert m.content[0].signature  # opaque, non-empty
    assert m.content[1].text == "The capital of France is Paris."
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    u = m.usage
    assert u.output_tokens > 0 and u.cache_creation_input_tokens == 0
    assert u.input_tokens + u.cache_read_input_tokens == len(server.engine.submitted[-1].prompt_token_ids)


def test_create_tool_use(server):
    m = create(server, "SCRIPT:tool weather?", tools=TOOLS)
    assert [b.type for b in m.content] == ["thinking", "tool_use"]
    call = m.content[1]
    assert call.id.startswith("toolu_") and call.name == "get_weather" and call.input == {"city": "Paris", "days": 3}
    assert m.stop_reason == "tool_use"


def test_thinking_disabled_and_omitted(server):
    m = create(server, "SCRIPT:reason Where?", thinking={"type": "disabled"})
    assert [b.type for b in m.content] == ["text"]  # no parser: everything is text, markers stripped
    assert server.engine.submitted[-1].sampling_params.skip_special_tokens is True
    m = create(server, "SCRIPT:reason Where?", thinking={"type": "adaptive", "display": "omitted"})
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == "" and m.content[0].signature
    # a budget that cannot bind (>= max_tokens) is accepted
    m = create(server, "SCRIPT:reason Where?", max_tokens=64, thinking={"type": "enabled", "budget_tokens": 64})
    assert m.content[0].thinking == "Let me think about the capital."


def test_stop_sequence_and_max_tokens(server):
    m = create(server, "SCRIPT:stopword go", stop_sequences=["STOP"], thinking={"type": "disabled"})
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "STOP"
    assert m.content[0].text == "one two three"
    m = create(server, "SCRIPT:plain go", max_tokens=3, thinking={"type": "disabled"})
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


def test_sampling_fields_and_ignored_fields(server):
    """temperature/top_p/top_k are wire-only in the SDK (extra_body); metadata, service_tier and
    cache_control are accepted and not used."""
    m = create(server, "SCRIPT:plain hi", metadata={"user_id": "u1"}, service_tier="auto",
               system=[{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}],
               thinking={"type": "disabled"}, extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 5})
    p = server.engine.submitted[-1].sampling_params
    assert (p.temperature, p.top_p, p.top_k) == (0.5, 0.9, 5)
    assert m.content[0].text.startswith("Hello world")


def test_tool_choice_none_leaves_tools_out(server, tokenizer):
    m = create(server, "SCRIPT:plain hi", tools=TOOLS, tool_choice={"type": "none"})
    prompt = tokenizer.decode(server.engine.submitted[-1].prompt_token_ids, skip_special_tokens=False)
    assert "get_weather" not in prompt and m.stop_reason == "end_turn"


def test_prefill_is_continued(server, tokenizer):
    """A final assistant message is a prefill: the prompt ends inside it, the answer continues it."""
    messages = [{"role": "user", "content": "SCRIPT:plain hi"}, {"role": "assistant", "content": "Sure:"}]
    m = create_messages(server, messages, thinking={"type": "disabled"})
    prompt = tokenizer.decode(server.engine.submitted[-1].prompt_token_ids, skip_special_tokens=False)
    assert prompt.endswith("<|assistant|><think></think>Sure:")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text.startswith("Hello world")
    n = client(server).messages.count_tokens(model=MODEL, messages=messages, thinking={"type": "disabled"})
    assert n.input_tokens == len(server.engine.submitted[-1].prompt_token_ids)


# --- streaming ----------------------------------------------------------------------------------
@pytest.mark.parametrize("script,kw", [("reason", {}), ("tool", {"tools": TOOLS}),
                                        ("stopword", {"stop_sequences": ["STOP"], "thinking": {"type": "disabled"}})])
def test_stream_final_message_equals_create(server, script, kw):
    c = client(server)
    body = dict(model=MODEL, max_tokens=64, messages=[{"role": "user", "content": f"SCRIPT:{script} go"}], **kw)
    with c.messages.stream(**body) as s:
        kinds = [ev.type for ev in s]
        final = s.get_final_message()
    assert comparable(final) == comparable(c.messages.create(**body))
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"


def test_stream_event_order(server):
    """Every event in Anthropic's order, each with its `event:` line: message_start, ping, blocks
    (start, deltas, stop; thinking ends with its signature_delta), message_delta, message_stop."""
    evs = raw_stream(server, {"model": MODEL, "max_tokens": 64, "tools": TOOLS,
                              "messages": [{"role": "user", "content": "SCRIPT:tool go"}]})
    names = [e for e, _ in evs]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    start = evs[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and "input_tokens" in start["usage"]
    blocks, open_index = [], None
    for name, d in evs[2:-2]:
        if name == "content_block_start":
            assert open_index is None and d["index"] == len(blocks)
            open_index = d["index"]
            blocks.append((d["content_block"]["type"], []))
        elif name == "content_block_delta":
            assert d["index"] == open_index
            blocks[-1][1].append(d["delta"]["type"])
        elif name == "content_block_stop":
            assert d["index"] == open_index
            open_index = None
        else:
            assert name == "ping"
    assert open_index is None
    assert blocks[0][0] == "thinking" and blocks[0][1][-1] == "signature_delta"
    assert set(blocks[0][1][:-1]) == {"thinking_delta"}
    assert blocks[1] == ("tool_use", ["input_json_delta"])
    delta = evs[-2][1]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] > 0


def test_stream_text_deltas(server):
    evs = raw_stream(server, {"model": MODEL, "max_tokens": 64, "thinking": {"type": "disabled"},
                              "messages": [{"role": "user", "content": "SCRIPT:plain go"}]})
    text = "".join(d["delta"]["text"] for e, d in evs if e == "content_block_delta")
    assert text == "Hello world! How are you today?"
    assert {d["delta"]["type"] for e, d in evs if e == "content_block_delta"} == {"text_delta"}


def test_async_client_stream(server):
    import asyncio

    async def run():
        c = anthropic.AsyncAnthropic(base_url=server.url, api_key=KEY, max_retries=0,
                                     _strict_response_validation=True)
        async with c.messages.stream(model=MODEL, max_tokens=64,
                                     messages=[{"role": "user", "content": "SCRIPT:reason go"}]) as s:
            return await s.get_final_message()

    m = asyncio.run(run())
    assert [b.type for b in m.content] == ["thinking", "text"]


# --- tools round trip ---------------------------------------------------------------------------
def test_tool_use_tool_result_round_trip(server, tokenizer):
    c = client(server)
    first = [{"role": "user", "content": "SCRIPT:tool weather in Paris?"}]
    m = c.messages.create(model=MODEL, max_tokens=64, tools=TOOLS, messages=first,
                          thinking={"type": "enabled", "budget_tokens": 64})
    call = next(b for b in m.content if b.type == "tool_use")
    second = first + [{"role": "assistant", "content": m.content},  # the SDK echoes the blocks back
                      {"role": "user", "content": [
                          {"type": "tool_result", "tool_use_id": call.id, "content": "18C sunny"},
                          {"type": "text", "text": "SCRIPT:reason and so?"}]}]
    m2 = c.messages.create(model=MODEL, max_tokens=64, tools=TOOLS, messages=second, system="be brief",
                           thinking={"type": "enabled", "budget_tokens": 64})
    assert [b.type for b in m2.content] == ["thinking", "text"] and m2.stop_reason == "end_turn"
    prompt = tokenizer.decode(server.engine.submitted[-1].prompt_token_ids, skip_special_tokens=False)
    assert "<|system|>be brief" in prompt
    assert ("<|assistant|><think>I should check the weather.</think><tool_call>get_weather<arg_key>city</arg_key>"
            "<arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>") in prompt
    assert "<|observation|><tool_response>18C sunny</tool_response><|user|>SCRIPT:reason and so?" in prompt
    # the same history, counted: the prompt the engine received
    n = c.messages.count_tokens(model=MODEL, tools=TOOLS, messages=second, system="be brief",
                                thinking={"type": "enabled", "budget_tokens": 64})
    assert n.input_tokens == len(server.engine.submitted[-1].prompt_token_ids)


# --- count_tokens -------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [{}, {"system": "You are terse."}, {"tools": TOOLS},
                                {"tools": TOOLS, "tool_choice": {"type": "none"}},
                                {"thinking": {"type": "disabled"}}, {"output_config": {"effort": "low"}}])
def test_count_tokens_equals_submitted_prompt(server, kw):
    c = client(server)
    messages = [{"role": "user", "content": "SCRIPT:plain count me"}]
    n = c.messages.count_tokens(model=MODEL, messages=messages, **kw)
    m = c.messages.create(model=MODEL, max_tokens=8, messages=messages, **kw)
    assert n.input_tokens == len(server.engine.submitted[-1].prompt_token_ids)
    assert n.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens


# --- errors -------------------------------------------------------------------------------------
U = [{"role": "user", "content": "hi"}]
OK = {"model": MODEL, "max_tokens": 16, "messages": U}


def _with(**kw) -> dict:
    return {**OK, **kw}


def _without(key: str) -> dict:
    return {k: v for k, v in OK.items() if k != key}


BAD = [  # (id, path, body, status, error type, a text the message must hold)
    ("no-max-tokens", "/v1/messages", _without("max_tokens"), 400, "invalid_request_error", "max_tokens"),
    ("max-tokens-0", "/v1/messages", _with(max_tokens=0), 400, "invalid_request_error", "max_tokens"),
    ("max-tokens-str", "/v1/messages", _with(max_tokens="16"), 400, "invalid_request_error", "max_tokens"),
    ("max-tokens-bool", "/v1/messages", _with(max_tokens=True), 400, "invalid_request_error", "max_tokens"),
    ("max-tokens-past-context", "/v1/messages", _with(max_tokens=5000), 400, "invalid_request_error",
     "max_tokens"),
    ("no-model", "/v1/messages", _without("model"), 400, "invalid_request_error", "model"),
    ("unknown-model", "/v1/messages", _with(model="claude-x"), 404, "not_found_error", "claude-x"),
    ("no-messages", "/v1/messages", _without("messages"), 400, "invalid_request_error", "messages"),
    ("empty-messages", "/v1/messages", _with(messages=[]), 400, "invalid_request_error", "messages"),
    ("messages-str", "/v1/messages", _with(messages="hi"), 400, "invalid_request_error", "messages"),
    ("role-tool", "/v1/messages", _with(messages=[{"role": "tool", "content": "x"}]), 400,
     "invalid_request_error", "messages[0].role"),
    ("no-content", "/v1/messages", _with(messages=[{"role": "user"}]), 400, "invalid_request_error",
     "messages[0].content"),
    ("empty-user", "/v1/messages", _with(messages=[{"role": "user", "content": ""}]), 400,
     "invalid_request_error", "messages[0].content"),
    ("image-block", "/v1/messages", _with(messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]), 400,
     "invalid_request_error", "text only"),
    ("unknown-block", "/v1/messages", _with(messages=[{"role": "user", "content": [{"type": "foo"}]}]), 400,
     "invalid_request_error", "messages[0].content[0]"),
    ("block-not-object", "/v1/messages", _with(messages=[{"role": "user", "content": ["hi"]}]), 400,
     "invalid_request_error", "messages[0].content[0]"),
    ("tool-use-in-user", "/v1/messages", _with(messages=[{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "get_weather", "input": {}}]}]), 400, "invalid_request_error",
     "assistant"),
    ("tool-result-in-assistant", "/v1/messages", _with(messages=U + [
        {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}]}] + U), 400,
     "invalid_request_error", "user message"),
    ("tool-result-no-id", "/v1/messages", _with(messages=[{"role": "user", "content": [
        {"type": "tool_result", "content": "x"}]}]), 400, "invalid_request_error", "tool_use_id"),
    ("tool-use-input-str", "/v1/messages", _with(messages=U + [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "get_weather", "input": "{}"}]}] + U), 400,
     "invalid_request_error", "input"),
    ("prefill-trailing-space", "/v1/messages", _with(messages=U + [{"role": "assistant", "content": "It is "}]),
     400, "invalid_request_error", "trailing whitespace"),
    ("prefill-tool-use", "/v1/messages", _with(messages=U + [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "get_weather", "input": {}}]}]), 400, "invalid_request_error",
     "prefill"),
    ("lone-surrogate", "/v1/messages",
     '{"model": "trnrt-tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "\\ud800"}]}', 400,
     "invalid_request_error", "Unicode"),
    ("system-number", "/v1/messages", _with(system=5), 400, "invalid_request_error", "system"),
    ("system-image", "/v1/messages", _with(system=[{"type": "image"}]), 400, "invalid_request_error", "system[0]"),
    ("tools-object", "/v1/messages", _with(tools={"name": "x"}), 400, "invalid_request_error", "tools"),
    ("tool-no-schema", "/v1/messages", _with(tools=[{"name": "x"}]), 400, "invalid_request_error",
     "input_schema"),
    ("tool-bad-name", "/v1/messages", _with(tools=[{**TOOLS[0], "name": "bad name!"}]), 400,
     "invalid_request_error", "tools[0].name"),
    ("tool-bad-schema", "/v1/messages", _with(tools=[{"name": "x", "input_schema": {
        "type": "object", "properties": {"a": {"type": "nope"}}}}]), 400, "invalid_request_error", "JSON Schema"),
    ("tool-schema-not-object", "/v1/messages", _with(tools=[{"name": "x", "input_schema": {"type": "array"}}]),
     400, "invalid_request_error", "input_schema.type"),
    ("server-tool", "/v1/messages", _with(tools=[{"type": "web_search_20250305", "name": "web_search"}]), 400,
     "invalid_request_error", "tools[0].type"),
    ("duplicate-tools", "/v1/messages", _with(tools=TOOLS + TOOLS), 400, "invalid_request_error", "unique"),
    ("tool-strict", "/v1/messages", _with(tools=[{**TOOLS[0], "strict": True}]), 400, "invalid_request_error",
     "--structured-outputs"),
    ("tool-choice-any", "/v1/messages", _with(tools=TOOLS, tool_choice={"type": "any"}), 400,
     "invalid_request_error", "--structured-outputs"),
    ("tool-choice-tool", "/v1/messages", _with(tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"}),
     400, "invalid_request_error", "tool_choice"),
    ("tool-choice-str", "/v1/messages", _with(tools=TOOLS, tool_choice="auto"), 400, "invalid_request_error",
     "tool_choice"),
    ("tool-choice-bogus", "/v1/messages", _with(tools=TOOLS, tool_choice={"type": "bogus"}), 400,
     "invalid_request_error", "tool_choice"),
    ("no-parallel-tools-str", "/v1/messages",
     _with(tools=TOOLS, tool_choice={"type": "auto", "disable_parallel_tool_use": "yes"}), 400,
     "invalid_request_error", "disable_parallel_tool_use"),
    ("thinking-no-budget", "/v1/messages", _with(thinking={"type": "enabled"}), 400, "invalid_request_error",
     "budget_tokens"),
    ("thinking-bogus", "/v1/messages", _with(thinking={"type": "sometimes"}), 400, "invalid_request_error",
     "thinking.type"),
    ("thinking-display", "/v1/messages", _with(thinking={"type": "adaptive", "display": "full"}), 400,
     "invalid_request_error", "thinking.display"),
    ("temperature-high", "/v1/messages", _with(temperature=1.5), 400, "invalid_request_error", "temperature"),
    ("temperature-str", "/v1/messages", _with(temperature="hot"), 400, "invalid_request_error", "temperature"),
    ("top-p-0", "/v1/messages", _with(top_p=0), 400, "invalid_request_error", "top_p"),
    ("top-k-negative", "/v1/messages", _with(top_k=-5), 400, "invalid_request_error", "top_k"),
    ("stop-sequences-str", "/v1/messages", _with(stop_sequences="STOP"), 400, "invalid_request_error",
     "stop_sequences"),
    ("stop-sequences-empty", "/v1/messages", _with(stop_sequences=[""]), 400, "invalid_request_error",
     "stop_sequences"),
    ("stream-str", "/v1/messages", _with(stream="yes"), 400, "invalid_request_error", "stream"),
    ("metadata-str", "/v1/messages", _with(metadata="u1"), 400, "invalid_request_error", "metadata"),
    ("service-tier", "/v1/messages", _with(service_tier="ultra"), 400, "invalid_request_error", "service_tier"),
    ("output-format", "/v1/messages", _with(output_config={"format": {"type": "json_schema", "schema": {}}}), 400,
     "invalid_request_error", "output_config.format"),
    ("output-effort", "/v1/messages", _with(output_config={"effort": "extreme"}), 400, "invalid_request_error",
     "output_config.effort"),
    ("malformed-json", "/v1/messages", '{"model": ', 400, "invalid_request_error", "JSON"),
    ("body-list", "/v1/messages", "[1, 2]", 400, "invalid_request_error", "object"),
    ("body-too-large", "/v1/messages", json.dumps(_with(system="x" * ((1 << 20) + 100))), 413, "request_too_large",
     "too large"),
    ("count-no-messages", "/v1/messages/count_tokens", {"model": MODEL}, 400, "invalid_request_error",
     "messages"),
    ("count-unknown-model", "/v1/messages/count_tokens", {"model": "m2", "messages": U}, 404, "not_found_error",
     "m2"),
    ("count-tool-choice-unknown-tool", "/v1/messages/count_tokens",
     {"model": MODEL, "messages": U, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, 400,
     "invalid_request_error", "tool_choice.name"),
    ("batches", "/v1/messages/batches", {"requests": []}, 404, "not_found_error", "/v1/messages/batches"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_gets_anthropic_error(server, case):
    _, path, body, status, etype, text = case
    got, resp, _ = post(server, body, path)
    assert got == status, resp
    assert set(resp) == {"type", "error"} and resp["type"] == "error", resp
    assert resp["error"]["type"] == etype and isinstance(resp["error"]["message"], str), resp
    assert text in resp["error"]["message"], resp


def test_bad_input_corpus_size():
    assert len(BAD) >= 25


def test_wrong_method_and_content_type(server):
    status, resp, _ = server.raw("GET", "/v1/messages", headers=AUTH)
    assert status == 405 and resp["type"] == "error" and resp["error"]["type"] == "invalid_request_error"
    status, resp, _ = server.raw("POST", "/v1/messages", json.dumps(OK), {**AUTH, "Content-Type": "text/plain"})
    assert status == 415 and resp["error"]["type"] == "invalid_request_error"


def test_sdk_error_classes(server):
    c = client(server)
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model=MODEL, max_tokens=16, messages=U, tools=TOOLS, tool_choice={"type": "any"})
    assert e.value.type == "invalid_request_error" and "tool_choice" in str(e.value)
    with pytest.raises(anthropic.NotFoundError):
        c.messages.create(model="nope", max_tokens=16, messages=U)
    with pytest.raises(anthropic.AuthenticationError):
        client(server, api_key="wrong").messages.create(model=MODEL, max_tokens=16, messages=U)


def test_engine_failure_is_api_error(server):
    c = client(server)
    fail = [{"role": "user", "content": "SCRIPT:fail x"}]
    with pytest.raises(anthropic.InternalServerError) as e:
        c.messages.create(model=MODEL, max_tokens=16, messages=fail)
    assert e.value.body["error"]["type"] == "api_error"
    evs = raw_stream(server, {"model": MODEL, "max_tokens": 16, "messages": fail})
    assert evs[-1][0] == "error" and evs[-1][1]["error"]["type"] == "api_error"
    with pytest.raises(anthropic.APIStatusError):
        with c.messages.stream(model=MODEL, max_tokens=16, messages=fail) as s:
            s.get_final_message()


def test_unavailable_is_overloaded_error(server):
    from trnrt.serve import get_state

    st = get_state(server.app)
    st.shutting_down.set()
    try:
        status, resp, _ = post(server, OK)
        status2, resp2, _ = post(server, {"model": MODEL, "messages": U}, "/v1/messages/count_tokens")
    finally:
        st.shutting_down.clear()
    assert status == status2 == 503
    assert resp["error"]["type"] == resp2["error"]["type"] == "overloaded_error"


# --- auth and headers ---------------------------------------------------------------------------
def test_auth(server):
    body = {"model": MODEL, "messages": U}
    for path in ("/v1/messages/count_tokens", "/v1/messages"):
        status, resp, headers = server.raw("POST", path, {**body, "max_tokens": 4})
        assert status == 401 and resp["type"] == "error" and resp["error"]["type"] == "authentication_error"
        assert server.raw("POST", path, {**body, "max_tokens": 4}, {"x-api-key": "wrong"})[0] == 401
    assert server.raw("POST", "/v1/messages/batches", {}, {})[1]["error"]["type"] == "authentication_error"
    assert server.raw("POST", "/v1/messages/count_tokens", body, {"x-api-key": KEY})[0] == 200
    assert server.raw("POST", "/v1/messages/count_tokens", body, AUTH)[0] == 200
    # other routes are unchanged: Bearer only, OpenAI's envelope
    chat = {"model": MODEL, "messages": U, "max_tokens": 2}
    status, resp, _ = server.raw("POST", "/v1/chat/completions", chat, {"x-api-key": KEY})
    assert status == 401 and resp["error"]["type"] == "authentication_error" and "type" not in resp


def test_anthropic_headers_accepted(server):
    status, resp, headers = post(server, OK, headers={"anthropic-version": "2023-06-01",
                                                      "anthropic-beta": "foo-2025-01-01,bar"})
    assert status == 200 and resp["type"] == "message"
    assert headers["Request-Id"].startswith("req_")


def test_unknown_fields_ignored_with_warning(server, caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="trnrt.serve"):
        status, resp, _ = post(server, _with(frobnicate=1, container=None, inference_geo="us"))
    assert status == 200 and resp["type"] == "message"
    assert [r.getMessage() for r in caplog.records if "unknown" in r.getMessage()] == [
        "ignoring unknown request fields: 'frobnicate'"]


# --- disconnects --------------------------------------------------------------------------------
def test_disconnect_mid_stream_leaves_engine_idle(server):
    import socket
    import time

    before = aborts(server)
    body = json.dumps({"model": MODEL, "max_tokens": 400, "stream": True, "thinking": {"type": "disabled"},
                       "messages": [{"role": "user", "content": "SCRIPT:long go"}]}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall((f"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body)
    f = sock.makefile("rb")
    assert b" 200 " in f.readline()
    server.engine.runner.paused.set()  # hold the engine mid-answer (400 tokens: far from done)
    try:
        seen = 0
        while seen < 4:  # message_start, ping, content_block_start, a delta
            if f.readline().startswith(b"event: "):
                seen += 1
        sock.shutdown(socket.SHUT_RDWR)
        f.close()
        sock.close()
        time.sleep(0.2)  # the worker notices the hang-up while the engine is held
    finally:
        server.engine.runner.paused.clear()
    deadline = time.monotonic() + 5
    while aborts(server) < before + 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert aborts(server) == before + 1
    assert_idle(server)


# --- unit: the shapes ---------------------------------------------------------------------------
def test_error_envelope_mapping():
    from trnrt.serve.http.errors import AnthropicError, APIError, SGLangObjectError, bad_request, unavailable

    def shape(e):
        return AnthropicError.of(e).to_dict()["error"]["type"]

    assert shape(bad_request("x")) == "invalid_request_error"
    assert shape(APIError(401, "x")) == "authentication_error"
    assert shape(APIError(404, "x")) == "not_found_error"
    assert shape(APIError(413, "x")) == "request_too_large"
    assert shape(unavailable("x")) == "overloaded_error"
    assert shape(SGLangObjectError(503, "The request queue is full.")) == "overloaded_error"
    assert shape(APIError(500, "x", type_="internal_error")) == "api_error"
    assert AnthropicError.of(SGLangObjectError(503, "q", headers={"Retry-After": "1"})).headers == {"Retry-After": "1"}


def test_renderer_same_blocks_however_the_output_is_cut(tokenizer):
    """Text before and after a call, in one merged output (non-streamed) or token by token: the
    same blocks in the same order (thinking, text, tool_use, text), whitespace trimmed."""
    from trnrt.engine.output.outputs import RequestOutput
    from trnrt.engine.request import FinishReason
    from trnrt.serve.http.state import TokenizerInfo
    from trnrt.serve.output.anthropic import MessagesRenderer
    from trnrt.serve.output.assembler import TokenCounter
    from trnrt.serve.output.reasoning import ReasoningParser
    from trnrt.serve.output.tool_calls import ToolCallParser
    from trnrt.serve.protocol.anthropic import parse_messages

    text = ("Think.</think> Sure, \n<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
            "</tool_call>\n Done. ")
    mreq = parse_messages({"model": MODEL, "max_tokens": 64, "messages": U, "tools": TOOLS})
    ti = TokenizerInfo(tokenizer)

    def render(pieces):
        r = MessagesRenderer(MODEL, ti, mreq, ReasoningParser(forced=True), ToolCallParser(mreq.tools, "glm47"),
                             TokenCounter(10, ti))
        outs = [RequestOutput("r", new_text=p) for p in pieces]
        outs[-1].finished, outs[-1].finish_reason = True, FinishReason("stop", matched=0)
        return r.collect(iter(enumerate(outs)))

    whole, split = render([text]), render(list(text))
    for m in (whole, split):
        m.pop("id")
        for b in m["content"]:
            b.pop("id", None)
    assert whole == split
    assert [(b["type"], b.get("text")) for b in whole["content"]] == [
        ("thinking", None), ("text", "Sure,"), ("tool_use", None), ("text", "Done.")]
    assert whole["content"][2]["input"] == {"city": "Paris"} and whole["stop_reason"] == "tool_use"
    # two calls; disable_parallel_tool_use keeps the first
    call = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>{}</arg_value></tool_call>"
    text = "</think>" + call.format("Paris") + call.format("Rome")
    assert [b["input"] for b in render([text])["content"]] == [{"city": "Paris"}, {"city": "Rome"}]
    mreq = parse_messages({"model": MODEL, "max_tokens": 64, "messages": U, "tools": TOOLS,
                           "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}})
    assert [b["input"] for b in render(list(text))["content"]] == [{"city": "Paris"}]


# --- the real tiny model ------------------------------------------------------------------------
def test_real_model_shapes(any_server):
    """Shapes on whatever the model says: create, stream == create, count_tokens == the prompt."""
    c = anthropic.Anthropic(base_url=any_server.url, api_key="unused", max_retries=0, timeout=60,
                            _strict_response_validation=True)
    body = dict(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hello"}], tools=TOOLS,
                extra_body={"temperature": 0})
    m = c.messages.create(**body)
    assert m.stop_reason in ("end_turn", "max_tokens", "tool_use", "stop_sequence")
    assert 0 < m.usage.output_tokens <= 8
    with c.messages.stream(**body) as s:
        final = s.get_final_message()
    assert comparable(final) == comparable(m)  # greedy: the same answer
    n = c.messages.count_tokens(model=MODEL, messages=body["messages"], tools=TOOLS)
    assert n.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens
    import serve_support

    serve_support.assert_idle(any_server)
