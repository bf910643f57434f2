"""tool_choice "required" and a named tool end to end: the random tiny model with --structured-outputs.

Sampled at temperature 1 on 20 seeds, every request must give exactly one call (several, at least
one, for "required" with parallel_tool_calls), of the named function when one is named, whose
arguments validate against the tool's schema (jsonschema), with finish reason tool_calls /
stop_reason tool_use, through /v1/chat/completions, /v1/responses and /v1/messages, streamed and
not. All requests go in flight together (one shared server, batched decode). The tools' strings
and integers are bounded and JSON whitespace is capped, so a random model always finishes a call
within max_tokens. Errors: the
flag off, a name not among the tools, another constraint at once: 400s naming the field.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from serve_support import start_server, stop_server  # noqa: E402

WEATHER = {"name": "get_weather", "description": "weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 6},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    }, "required": ["city", "days"]}}
SEARCH = {"name": "search", "parameters": {
    "type": "object", "properties": {
        "q": {"type": "string", "maxLength": 5},
        "filters": {"type": "object", "properties": {"lang": {"enum": ["en", "fr"]},
                                                     "safe": {"type": "boolean"}}, "required": ["lang"],
                    "additionalProperties": False},
        "limit": {"type": "integer", "minimum": 0, "maximum": 10},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    }, "required": ["q", "filters"]}}
SCHEMAS = {t["name"]: t["parameters"] for t in (WEATHER, SEARCH)}
CHAT_TOOLS = [{"type": "function", "function": t} for t in (WEATHER, SEARCH)]
RESP_TOOLS = [{"type": "function", **t} for t in (WEATHER, SEARCH)]
MSG_TOOLS = [{"name": t["name"], "description": t.get("description", ""), "input_schema": t["parameters"]}
             for t in (WEATHER, SEARCH)]
SEEDS = range(20)
# Above the longest call the grammar allows: bounded strings, bounded integers (a JSON "number"
# has no digit bound: a random model once ran one past 160 tokens), 16 spaces at most per JSON gap.
MAX_TOKENS = 400
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    from trnrt.engine.core.engine import Engine
    from trnrt.models.tiny import default_model_dir
    from trnrt.serve import ServeSettings, hf_tokenizer_factory

    engine = Engine.from_model_dir(default_model_dir(), max_running_requests=64, structured_outputs=True)
    srv = start_server(engine, hf_tokenizer_factory(engine.model_info.model_path),
                       ServeSettings(served_model_name="trnrt-tiny"), threads=80)
    yield srv
    stop_server(srv)






# Each route's request -> [(name, arguments dict)] and whether the finish says "tool call".
def _chat(srv, seed, choice, stream, parallel):
    body = {"messages": MESSAGES, "tools": CHAT_TOOLS, "tool_choice": choice, "parallel_tool_calls": parallel,
            "temperature": 1.0, "seed": seed, "max_tokens": MAX_TOKENS,
            "chat_template_kwargs": {"enable_thinking": False}}
    if not stream:
        status, data = srv.post("/v1/chat/completions", body)
        assert status == 200, data
        ch = data["choices"][0]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in ch["message"].get("tool_calls") or []]
        return calls, ch["finish_reason"] == "tool_calls", ch["message"].get("content")
    calls: dict[int, list] = {}
    finish, content = None, ""
    for ev in srv.sse_events("/v1/chat/completions", {**body, "stream": True}):
        for ch in ev.get("choices", []):
            d = ch.get("delta") or {}
            content += d.get("content") or ""
            for tc in d.get("tool_calls") or []:
                c = calls.setdefault(tc["index"], ["", ""])
                c[0] += (tc.get("function") or {}).get("name") or ""
                c[1] += (tc.get("function") or {}).get("arguments") or ""
            finish = ch.get("finish_reason") or finish
    return [tuple(calls[i]) for i in sorted(calls)], finish == "tool_calls", content or None


def _responses(srv, seed, choice, stream, parallel):
    if isinstance(choice, dict):
        choice = {"type": "function", "name": choice["function"]["name"]}
    body = {"input": MESSAGES[0]["content"], "tools": RESP_TOOLS, "tool_choice": choice,
            "parallel_tool_calls": parallel, "temperature": 1.0, "seed": seed, "max_output_tokens": MAX_TOKENS,
            "reasoning": {"effort": "none"}, "store": False}
    if stream:
        events = srv.sse_events("/v1/responses", {**body, "stream": True})
        data = [e for e in events if e.get("type") == "response.completed"][0]["response"]
    else:
        status, data = srv.post("/v1/responses", body)
        assert status == 200, data
    calls = [(o["name"], o["arguments"]) for o in data["output"] if o["type"] == "function_call"]
    texts = [o for o in data["output"] if o["type"] == "message"]
    return calls, data["status"] == "completed", texts or None


def _messages(srv, seed, choice, stream, parallel):
    from trnrt.serve.output.anthropic import fold

    if choice == "required":
        tc = {"type": "any", "disable_parallel_tool_use": not parallel}
    else:
        tc = {"type": "tool", "name": choice["function"]["name"]}
    body = {"model": "trnrt-tiny", "messages": MESSAGES, "tools": MSG_TOOLS, "tool_choice": tc,
            "temperature": 1.0, "max_tokens": MAX_TOKENS, "thinking": {"type": "disabled"},
            "metadata": {"user_id": "t"}}
    if stream:
        data = fold(iter(srv.sse_events("/v1/messages", {**body, "stream": True})))
    else:
        status, data = srv.post("/v1/messages", body)
        assert status == 200, data
    calls = [(b["name"], json.dumps(b["input"])) for b in data["content"] if b["type"] == "tool_use"]
    texts = [b for b in data["content"] if b["type"] == "text" and b["text"]]
    return calls, data["stop_reason"] == "tool_use", texts or None


ROUTES = {"chat": _chat, "responses": _responses, "messages": _messages}
NAMED = {"type": "function", "function": {"name": "search"}}


def _run_all(jobs):
    with ThreadPoolExecutor(len(jobs)) as ex:
        return list(ex.map(lambda j: j[1](), jobs))


def test_required_and_named_give_exactly_one_valid_call(server):
    """20 seeds x (required, named), each seed on one of the 6 (route, streamed) cells in turn;
    plus "required" with parallel_tool_calls on each route. (Messages has no seed field: its
    requests get the engine's random seeds.)"""
    cells = [(route, stream) for stream in (False, True) for route in ROUTES]
    jobs = []
    for seed in SEEDS:
        route, stream = cells[seed % len(cells)]
        for choice in ("required", NAMED):
            jobs.append(((route, seed, choice, stream, False),
                         lambda fn=ROUTES[route], s=seed, c=choice, st=stream: fn(server, s, c, st, False)))
    for i, route in enumerate(ROUTES):
        jobs.append(((route, 100 + i, "required", i % 2 == 0, True),
                     lambda fn=ROUTES[route], s=100 + i: fn(server, s, "required", s % 2 == 0, True)))
    results = _run_all(jobs)
    seen = set()
    for (key, _), (calls, tool_finish, extra) in zip(jobs, results):
        route, seed, choice, stream, parallel = key
        seen.add((route, choice if isinstance(choice, str) else "named", stream))
        assert tool_finish or parallel, (key, calls, extra)  # parallel calls may run into max_tokens (the last one dropped)
        assert not extra, (key, extra)  # no text before, between or after the calls
        assert calls and (len(calls) == 1 or parallel), (key, calls)
        for name, args in calls:
            if choice == NAMED:
                assert name == "search", key
            jsonschema.validate(json.loads(args), SCHEMAS[name])
    assert len(seen) == 12  # every route, both choices, streamed and not


def test_the_flag_off_names_it_and_bad_choices_name_the_field(server):
    from trnrt.engine.core.engine import Engine
    from trnrt.models.tiny import default_model_dir
    from trnrt.serve import ServeSettings, hf_tokenizer_factory

    base = {"messages": MESSAGES, "tools": CHAT_TOOLS, "max_tokens": 8}
    status, data = server.post("/v1/chat/completions", {**base, "tool_choice": {
        "type": "function", "function": {"name": "nope"}}})
    assert status == 400 and data["error"]["param"] == "tool_choice.function.name", data
    status, data = server.post("/v1/chat/completions", {**base, "tool_choice": "required",
                                                          "response_format": {"type": "json_object"}})
    assert status == 400 and data["error"]["param"] == "tool_choice", data
    status, data = server.post("/v1/messages", {"model": "trnrt-tiny", "messages": MESSAGES, "tools": MSG_TOOLS,
                                                  "max_tokens": 8, "tool_choice": {"type": "tool", "name": "x"}})
    assert status == 400 and "tool_choice.name" in json.dumps(data), data
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "s": {"type": "string", "minLength": 3, "maxLength": 1}}}}}
    status, data = server.post("/v1/chat/completions", {**base, "tools": [bad], "tool_choice": "required"})
    assert status == 400 and "minLength 3 is greater than maxLength 1" in data["error"]["message"], data

    engine = Engine.from_model_dir(default_model_dir(), max_running_requests=4)
    off = start_server(engine, hf_tokenizer_factory(engine.model_info.model_path),
                       ServeSettings(served_model_name="trnrt-tiny"))
    try:
        for path, body in (("/v1/chat/completions", {**base, "tool_choice": "required"}),
                           ("/v1/responses", {"input": "hi", "tools": RESP_TOOLS, "tool_choice": "required"}),
                           ("/v1/messages", {"model": "trnrt-tiny", "messages": MESSAGES, "tools": MSG_TOOLS, "max_tokens": 8,
                                             "tool_choice": {"type": "any"}})):
            status, data = off.post(path, body)
            assert status == 400 and "--structured-outputs" in json.dumps(data) and "tool_choice" in json.dumps(data), \
                (path, data)
        assert off.raw("GET", "/health")[0] == 200  # the engine lives on
    finally:
        stop_server(off)
