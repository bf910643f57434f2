"""Hardening of the request path: Content-Type, invalid Unicode, strict types, tool schemas, client
templates, prompts too long to tokenize. Each case asserts a 4xx JSON error naming the field, and
that the server serves a normal request afterwards.
"""

from __future__ import annotations

import http.client
import json
import os
import time

import pytest

from serve_support import assert_idle

MODEL = "trnrt-tiny"
CHAT, COMP, GEN = "/v1/chat/completions", "/v1/completions", "/generate"
MSGS = [{"role": "user", "content": "hi"}]


def post(server, path: str, body: bytes | str, headers: dict | None) -> tuple[int, object]:
    """A POST with exactly `headers` (serve_support.Server.raw always adds a JSON Content-Type)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    if isinstance(body, str):
        body = body.encode("utf-8", "surrogatepass")
    conn.putrequest("POST", path)
    for k, v in (headers or {}).items():
        conn.putheader(k, v)
    conn.putheader("Content-Length", str(len(body)))
    conn.endheaders()
    conn.send(body)
    r = conn.getresponse()
    data = r.read()
    conn.close()
    try:
        return r.status, json.loads(data)
    except ValueError:
        return r.status, data


def ok_body(path: str) -> dict:
    if path == CHAT:
        return {"model": MODEL, "messages": MSGS, "max_tokens": 2}
    if path == COMP:
        return {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    return {"text": "hi", "sampling_params": {"max_new_tokens": 2}}


@pytest.mark.parametrize("path", [CHAT, COMP, GEN])
@pytest.mark.parametrize("ctype", [None, "text/plain", "application/x-www-form-urlencoded", "application/xml",
                                   "application/json; charset=utf-16", "multipart/form-data; boundary=x"])
def test_json_routes_need_a_json_content_type(scripted_server, path, ctype):
    headers = {"Content-Type": ctype} if ctype else {}
    status, data = post(scripted_server, path, json.dumps(ok_body(path)), headers)
    assert status == 415, data
    assert data["error"]["param"] == "Content-Type", data


@pytest.mark.parametrize("ctype", ["application/json", "application/json; charset=utf-8", "Application/JSON"])
def test_json_content_types_are_served(scripted_server, ctype):
    status, data = post(scripted_server, CHAT, json.dumps(ok_body(CHAT)), {"Content-Type": ctype})
    assert status == 200, data


def test_utf16_body_is_refused(scripted_server):
    body = json.dumps(ok_body(CHAT)).encode("utf-16")
    status, data = post(scripted_server, CHAT, body, {"Content-Type": "application/json"})
    assert status == 400 and "UTF-8" in data["error"]["message"], data


SURROGATE = "hi\\ud800"
BAD = [
    # (id, path, raw JSON body, field named)
    ("chat-content", CHAT, '{"model": "%s", "messages": [{"role": "user", "content": "%s"}]}' % (MODEL, SURROGATE),
     "messages"),
    ("chat-content-part", CHAT, '{"model": "%s", "messages": [{"role": "user", "content": [{"type": "text", '
     '"text": "%s"}]}]}' % (MODEL, SURROGATE), "messages"),
    ("chat-name", CHAT, '{"model": "%s", "messages": [{"role": "user", "content": "a", "name": "%s"}]}'
     % (MODEL, SURROGATE), "messages"),
    ("chat-user", CHAT, '{"model": "%s", "messages": [{"role": "user", "content": "a"}], "user": "%s"}'
     % (MODEL, SURROGATE), "user"),
    ("chat-stop", CHAT, '{"model": "%s", "messages": [{"role": "user", "content": "a"}], "stop": ["%s"]}'
     % (MODEL, SURROGATE), "stop"),
    ("chat-model", CHAT, '{"model": "%s", "messages": [{"role": "user", "content": "a"}]}' % SURROGATE, "model"),
    ("chat-template-kwargs", CHAT, '{"model": "%s", "messages": [{"role": "user", "content": "a"}], '
     '"chat_template_kwargs": {"x": "%s"}}' % (MODEL, SURROGATE), "chat_template_kwargs"),
    ("tool-name", CHAT, '{"model": "%s", "messages": [{"role": "user", "content": "a"}], "tools": [{"type": '
     '"function", "function": {"name": "%s"}}]}' % (MODEL, SURROGATE), "tools"),
    ("tool-schema-string", CHAT, '{"model": "%s", "messages": [{"role": "user", "content": "a"}], "tools": '
     '[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "description": "%s"}}}]}'
     % (MODEL, SURROGATE), "tools"),
    ("completion-prompt", COMP, '{"model": "%s", "prompt": "%s"}' % (MODEL, SURROGATE), "prompt"),
    ("completion-prompt-list", COMP, '{"model": "%s", "prompt": ["a", "%s"]}' % (MODEL, SURROGATE), "prompt"),
    ("generate-text", GEN, '{"text": "%s"}' % SURROGATE, "text"),
    ("generate-stop", GEN, '{"text": "a", "sampling_params": {"stop": "%s"}}' % SURROGATE, "stop"),
    ("generate-rid", GEN, '{"text": "a", "rid": "%s"}' % SURROGATE, "rid"),
    ("unknown-field-name", CHAT, '{"model": "%s", "messages": [{"role": "user", "content": "a"}], "%s": 1, '
     '"n": 129}' % (MODEL, SURROGATE), "n"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_lone_surrogates_are_400s(scripted_server, case):
    _, path, raw, field = case
    status, data = post(scripted_server, path, raw, {"Content-Type": "application/json"})
    assert status == 400, data
    err = data["error"]
    text = err if isinstance(err, str) else (err.get("param") or "") + " " + err["message"]
    assert field in text, data


# Booleans are never numbers (True == 1 in Python: the neutral-value check compared with ==).
BOOLS = [("n", True), ("best_of", True), ("frequency_penalty", False), ("presence_penalty", False),
         ("repetition_penalty", True), ("min_tokens", False), ("priority", False), ("temperature", True),
         ("top_p", True), ("max_tokens", True), ("seed", False), ("top_k", True)]


BOOL_CASES = [(p, n, v) for p in (CHAT, COMP) for n, v in BOOLS if not (p == CHAT and n == "best_of")]


@pytest.mark.parametrize("path,name,value", BOOL_CASES, ids=[f"{p}-{n}={v}" for p, n, v in BOOL_CASES])
def test_booleans_are_not_numbers(scripted_server, path, name, value):
    body = {**ok_body(path), name: value}
    status, data, _ = scripted_server.raw("POST", path, body)
    assert status == 400, data
    assert data["error"]["param"] == name, data


SCHEMAS = [({"type": 5}, "type"), ({"properties": "x"}, "properties"), ({"required": "a"}, "required"),
           ({"type": "object", "properties": {"a": {"type": "nope"}}}, "nope"),
           ({"minimum": "3"}, "minimum")]


@pytest.mark.parametrize("schema,why", SCHEMAS, ids=[w for _, w in SCHEMAS])
def test_tool_parameters_must_be_json_schema(scripted_server, schema, why):
    body = {**ok_body(CHAT), "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]}
    status, data, _ = scripted_server.raw("POST", CHAT, body)
    assert status == 400 and data["error"]["param"] == "tools", data
    assert "JSON Schema" in data["error"]["message"]


@pytest.mark.parametrize("name", ["has space", "a" * 65, "dot.name", "", "ünï"])
def test_tool_names_follow_openai_rule(scripted_server, name):
    body = {**ok_body(CHAT), "tools": [{"type": "function", "function": {"name": name}}]}
    status, data, _ = scripted_server.raw("POST", CHAT, body)
    assert status == 400 and data["error"]["param"] == "tools", data


def test_valid_tool_schema_is_served(scripted_server):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
              "required": ["city"]}
    body = {**ok_body(CHAT), "tools": [{"type": "function", "function": {"name": "get_weather-2", "parameters": schema}}]}
    status, data, _ = scripted_server.raw("POST", CHAT, body)
    assert status == 200, data


def _rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def test_client_chat_template_is_refused(scripted_server):
    body = {**ok_body(CHAT), "chat_template_kwargs": {"chat_template": "{{ 'a' * 100000000 }}"}}
    before = _rss_mb()
    t0 = time.monotonic()
    status, data, _ = scripted_server.raw("POST", CHAT, body)
    assert status == 400 and data["error"]["param"] == "chat_template_kwargs", data
    assert time.monotonic() - t0 < 1.0
    assert _rss_mb() - before < 100


@pytest.mark.parametrize("path", [CHAT, COMP, GEN])
def test_prompt_that_cannot_fit_is_refused_before_tokenizing(scripted_server, path):
    """A prompt of ~0.9 MB (the test server's body limit is 1 MiB; the context is 1024 tokens) is
    refused in well under a second without growing the server by 100 MB: the lower bound on its
    token count already exceeds the context, so it is never tokenized."""
    big = "word " * (900 * 1024 // 5)
    body = ok_body(path)
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": big}]
    elif path == COMP:
        body["prompt"] = big
    else:
        body["text"] = big
    raw = json.dumps(body)
    before = _rss_mb()
    t0 = time.monotonic()
    status, data, _ = scripted_server.raw("POST", path, raw)
    elapsed = time.monotonic() - t0
    assert status == 400, data
    assert "at least" in data["error"]["message"] and "context length" in data["error"]["message"], data
    assert elapsed < 1.0, elapsed
    assert _rss_mb() - before < 100


def test_serves_after_hardening_cases(scripted_server):
    for _, path, raw, _ in BAD:
        post(scripted_server, path, raw, {"Content-Type": "application/json"})
    for path in (CHAT, COMP, GEN):
        status, data, _ = scripted_server.raw("POST", path, ok_body(path))
        assert status == 200, data
    assert_idle(scripted_server)


def test_tokenization_counts_against_admission(tokenizer_factory):
    """With the HTTP layer full, a request is refused (503) before its body is parsed or tokenized,
    on the generation routes and on /tokenize alike; the slot comes back when the holder ends."""
    import threading

    from serve_support import make_scripted_engine, start_server, stop_server
    from trnrt.serve import ServeSettings

    engine = make_scripted_engine(tokenizer_factory)
    srv = start_server(engine, tokenizer_factory, ServeSettings(served_model_name=MODEL, max_concurrent_requests=1))
    try:
        engine.runner.paused.set()
        holder = threading.Thread(target=srv.raw, args=("POST", COMP, ok_body(COMP)), daemon=True)
        holder.start()
        deadline = time.monotonic() + 5
        from trnrt.serve import get_state

        while get_state(srv.app).active_requests < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert get_state(srv.app).active_requests == 1
        for path, body in ((CHAT, ok_body(CHAT)), (GEN, ok_body(GEN)), ("/tokenize", {"prompt": "hi"})):
            status, data, _ = srv.raw("POST", path, body)
            assert status == 503, (path, data)
        # even a malformed body is refused for capacity first: nothing was read or tokenized
        status, _, _ = srv.raw("POST", CHAT, "{not json")
        assert status == 503
        engine.runner.paused.clear()
        holder.join(10)
        status, data, _ = srv.raw("POST", "/tokenize", {"prompt": "hi"})
        assert status == 200, data
        assert get_state(srv.app).active_requests == 0
    finally:
        engine.runner.paused.clear()
        stop_server(srv)


def test_completion_prompt_list_is_bounded(scripted_server):
    """One body cannot queue more than 1024 engine requests (20,000 prompts once took 9 s)."""
    status, data, _ = scripted_server.raw("POST", COMP, {"model": MODEL, "prompt": ["a"] * 1025, "max_tokens": 1})
    assert status == 400 and data["error"]["param"] == "prompt", data
