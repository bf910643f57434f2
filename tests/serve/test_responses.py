"""POST /v1/responses (and the stored-response routes) through the official `openai` client under
strict response validation: plain, reasoning and tool answers; streams reassembled by the SDK to
the non-streamed answer; a function-call round trip; the response store (previous_response_id,
GET, cancel); a table of bad inputs (4xx in OpenAI's envelope, never 500); a client that leaves
mid-stream; and a short pass on the real tiny model."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import openai
import pytest

from serve_support import assert_idle, counters, eos_ids, make_script, start_server, stop_server

MODEL = "trnrt-tiny"
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather forecast", "strict": False,
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                         "required": ["city"]}}]
# Scripts of this module, on top of serve_support.SCRIPTS.
EXTRA_SCRIPTS = {
    "mixed": ("Check the weather.</think>Let me look that up.<tool_call>get_weather<arg_key>city</arg_key>"
              "<arg_value>Paris</arg_value></tool_call><|observation|>"),
    "twocalls": ("Two cities.</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
                 "</tool_call><tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value></tool_call>"
                 "<|observation|>"),
}
STORE_DISABLED = ("Response store is disabled. Stateful Responses require --enable-response-store on a standalone "
                  "server; response storage is unavailable in PD mode.")


def scripted_engine(tokenizer_factory, **kw):
    from trnrt.engine.cache.cache_config import PrefixCacheConfig
    from trnrt.engine.core.engine import Engine

    tok = tokenizer_factory()
    base = make_script(tok)

    def script(ids):
        text = tok.decode(ids, skip_special_tokens=False)
        if "SCRIPT:" in text:
            name = text.rsplit("SCRIPT:", 1)[1].split()[0]
            for k, v in EXTRA_SCRIPTS.items():
                if name.startswith(k):
                    return tok.encode(v, add_special_tokens=False)
        return base(ids)

    return Engine.scripted(tok, script, eos_token_ids=eos_ids(tok), max_model_len=1024,
                           prefix_cache_config=PrefixCacheConfig(), **kw)


@pytest.fixture(scope="module")
def srv(tokenizer_factory):
    """A scripted server with the response store (2 ms per step: a 400-token answer takes ~1 s)."""
    from trnrt.serve import ServeSettings

    server = start_server(scripted_engine(tokenizer_factory, step_delay_s=0.002), tokenizer_factory,
                          ServeSettings(served_model_name=MODEL, enable_response_store=True,
                                        max_request_bytes=1 << 20))
    yield server
    stop_server(server)


def create(client, content, **kw):
    kw.setdefault("model", MODEL)
    return client.responses.create(input=content, **kw)


def prompt_text(server) -> str:
    tok = server.engine.tokenizer
    return tok.decode(server.engine.submitted[-1].prompt_token_ids, skip_special_tokens=False)


def shape(items) -> list[tuple]:
    """Output items without their random ids."""
    out = []
    for it in items:
        d = it.model_dump() if hasattr(it, "model_dump") else dict(it)
        d.pop("id", None)
        d.pop("call_id", None)
        d.pop("parsed_arguments", None)
        for p in d.get("content") or []:
            p.pop("parsed", None)
        out.append(json.dumps(d, sort_keys=True))
    return out


def no_cache(usage) -> dict:
    u = usage.model_dump()
    u["input_tokens_details"]["cached_tokens"] = 0
    return u


# --- non-streamed ------------------------------------------------------------------------------
def test_plain(srv):
    r = create(srv.client(), "SCRIPT:plain hi", reasoning={"effort": "none"}, max_output_tokens=64)
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert [it.type for it in r.output] == ["message"]
    assert r.output_text == "Hello world! How are you today?"
    part = r.output[0].content[0]
    assert part.annotations == [] and r.output[0].status == "completed" and r.output[0].id.startswith("msg_")
    u = r.usage
    assert u.output_tokens_details.reasoning_tokens == 0
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.input_tokens > 0
    assert r.incomplete_details is None and r.error is None
    assert r.max_output_tokens == 64 and r.reasoning.effort == "none" and r.store is True
    assert prompt_text(srv).endswith("<|assistant|></think>")  # effort none: thinking off


def test_reasoning_and_text(srv):
    r = create(srv.client(), "SCRIPT:reason capital?", reasoning={"effort": "low"})
    assert [it.type for it in r.output] == ["reasoning", "message"]
    rs = r.output[0]
    assert rs.id.startswith("rs_") and rs.summary == [] and rs.status == "completed"
    assert rs.content[0].type == "reasoning_text" and rs.content[0].text == "Let me think about the capital."
    assert r.output_text == "The capital of France is Paris."
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    assert "Reasoning Effort: Low" in prompt_text(srv) and prompt_text(srv).endswith("<think>")


def test_instructions_are_a_system_message(srv):
    r = create(srv.client(), "SCRIPT:reason x", instructions="be brief")
    assert "<|system|>be brief<|user|>SCRIPT:reason x" in prompt_text(srv)
    assert r.instructions == "be brief"


def test_tool_call(srv):
    r = create(srv.client(), "SCRIPT:tool weather?", tools=TOOLS)
    assert [it.type for it in r.output] == ["reasoning", "function_call"]
    fc = r.output[1]
    assert fc.name == "get_weather" and json.loads(fc.arguments) == {"city": "Paris", "days": 3}
    assert fc.call_id.startswith("call_") and fc.id.startswith("fc_") and fc.status == "completed"
    assert r.status == "completed" and r.output_text == ""
    assert r.tools[0].name == "get_weather" and r.tool_choice == "auto"
    assert "get_weather" in prompt_text(srv)  # the tools reached the template


def test_text_then_tool_call_keeps_order(srv):
    r = create(srv.client(), "SCRIPT:mixed w", tools=TOOLS)
    assert [it.type for it in r.output] == ["reasoning", "message", "function_call"]
    assert r.output_text == "Let me look that up."


@pytest.mark.parametrize("parallel,n", [(True, 2), (False, 1)])
def test_parallel_tool_calls(srv, parallel, n):
    r = create(srv.client(), "SCRIPT:twocalls w", tools=TOOLS, parallel_tool_calls=parallel)
    calls = [it for it in r.output if it.type == "function_call"]
    assert len(calls) == n and r.parallel_tool_calls is parallel
    assert json.loads(calls[0].arguments) == {"city": "Paris"}


def test_tool_choice_none_leaves_tools_out(srv):
    r = create(srv.client(), "SCRIPT:reason w", tools=TOOLS, tool_choice="none")
    assert "get_weather" not in prompt_text(srv) and r.tool_choice == "none"


def test_max_output_tokens_is_incomplete(srv):
    r = create(srv.client(), "SCRIPT:reason capital?", max_output_tokens=4)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[-1].status == "incomplete" and r.usage.output_tokens == 4


def test_logprobs(srv):
    r = create(srv.client(), "SCRIPT:plain hi", reasoning={"effort": "none"}, top_logprobs=2,
               include=["message.output_text.logprobs"])
    part = r.output[0].content[0]
    assert part.logprobs and "".join(lp.token for lp in part.logprobs) == part.text
    assert all(len(lp.top_logprobs) == 2 for lp in part.logprobs)


def test_sampling_fields_are_echoed(srv):
    r = create(srv.client(), "SCRIPT:plain hi", temperature=0.5, top_p=0.9, metadata={"k": "v"}, user="u1",
               truncation="auto", text={"format": {"type": "text"}})
    assert (r.temperature, r.top_p, r.metadata, r.user, r.truncation) == (0.5, 0.9, {"k": "v"}, "u1", "auto")
    assert srv.engine.submitted[-1].sampling_params.temperature == 0.5


def test_unknown_field_is_ignored_with_one_warning(srv, caplog):
    with caplog.at_level(logging.WARNING, logger="trnrt.serve"):
        status, body, _ = srv.raw("POST", "/v1/responses", {"model": MODEL, "input": "SCRIPT:plain hi",
                                                            "frobnicate": 1, "max_tool_calls": 3})
    assert status == 200, body
    lines = [r for r in caplog.records if "unknown request fields" in r.getMessage()]
    assert len(lines) == 1 and "frobnicate" in lines[0].getMessage() and "max_tool_calls" not in lines[0].getMessage()


# --- streaming ----------------------------------------------------------------------------------
def stream(client, content, **kw):
    kw.setdefault("model", MODEL)
    with client.responses.stream(input=content, **kw) as s:
        events = list(s)
        final = s.get_final_response() if events[-1].type == "response.completed" else None
    return events, final


@pytest.mark.parametrize("script,kw", [
    ("plain", {"reasoning": {"effort": "none"}}), ("reason", {}), ("tool", {"tools": TOOLS}),
    ("mixed", {"tools": TOOLS}), ("twocalls", {"tools": TOOLS}),
    ("plain", {"reasoning": {"effort": "none"}, "include": ["message.output_text.logprobs"], "top_logprobs": 1}),
])
def test_stream_reassembles_to_the_non_streamed_answer(srv, script, kw):
    client = srv.client()
    events, final = stream(client, f"SCRIPT:{script} s", **kw)
    r = create(client, f"SCRIPT:{script} s", **kw)
    assert final is not None
    assert shape(final.output) == shape(r.output) and final.output_text == r.output_text
    assert no_cache(final.usage) == no_cache(r.usage)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert {e.response.id for e in events if e.type.startswith("response.") and hasattr(e, "response")} == {final.id}
    # Items are never interleaved: each is done before the next is added.
    opened = [(e.type, e.output_index) for e in events if e.type in ("response.output_item.added",
                                                                     "response.output_item.done")]
    assert opened == [(t, i) for i in range(len(final.output))
                      for t in ("response.output_item.added", "response.output_item.done")]


def test_stream_event_order_reasoning_then_text(srv):
    events, final = stream(srv.client(), "SCRIPT:reason s")
    types = [e.type for e in events]
    collapsed = [t for i, t in enumerate(types) if i == 0 or t != types[i - 1]]
    assert collapsed == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert final.output[0].content[0].text == "Let me think about the capital."


def test_stream_function_call_events(srv):
    events, final = stream(srv.client(), "SCRIPT:tool s", tools=TOOLS)
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done[0].arguments == final.output[1].arguments
    assert not any(e.type == "response.output_text.delta" for e in events)  # no markup leaks as text


def test_stream_incomplete_ends_with_response_incomplete(srv):
    events, final = stream(srv.client(), "SCRIPT:reason s", max_output_tokens=4)
    assert final is None and events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_raw_sse_frames_carry_event_lines(srv):
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    conn.request("POST", "/v1/responses", json.dumps({"model": MODEL, "input": "SCRIPT:reason r", "stream": True}),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("Content-Type").startswith("text/event-stream")
    frames = [f for f in r.read().decode().split("\n\n") if f.strip()]
    conn.close()
    for f in frames:
        ev, data = f.split("\n")
        assert ev == "event: " + json.loads(data[len("data: "):])["type"]


# --- function-call round trip -------------------------------------------------------------------
def test_function_call_round_trip(srv):
    client = srv.client()
    first = create(client, [{"role": "user", "content": "SCRIPT:tool weather in Paris?"}], tools=TOOLS)
    call = first.output[-1]
    assert call.type == "function_call"
    follow = [{"role": "user", "content": "SCRIPT:tool weather in Paris?"}, *first.output,
              {"type": "function_call_output", "call_id": call.call_id, "output": "18C sunny SCRIPT:reason"}]
    final = create(client, follow, tools=TOOLS)
    assert final.output_text == "The capital of France is Paris." and final.status == "completed"
    p = prompt_text(srv)
    assert "<think>I should check the weather.</think><tool_call>get_weather<arg_key>city</arg_key>" in p
    assert "<|observation|><tool_response>18C sunny SCRIPT:reason</tool_response>" in p


def test_codex_style_history_without_ids_or_status(srv):
    """Items as lenient clients send them: no id/status, empty assistant content, malformed arguments."""
    items = [{"role": "user", "content": [{"type": "input_text", "text": "SCRIPT:tool a"}]},
             {"type": "reasoning", "summary": [{"type": "summary_text", "text": "hmm"}]},
             {"type": "message", "role": "assistant", "content": []},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{not json"},
             {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "ok"}]},
             {"role": "developer", "content": "SCRIPT:reason dev"}]
    r = create(srv.client(), items, tools=TOOLS)
    assert r.status == "completed", r


# --- the response store -------------------------------------------------------------------------
def test_previous_response_id_continues_the_conversation(srv):
    client = srv.client()
    r1 = create(client, "SCRIPT:reason capital?", instructions="first instructions")
    r2 = create(client, "SCRIPT:plain and Italy?", previous_response_id=r1.id)
    assert r2.previous_response_id == r1.id and r2.status == "completed"
    p = prompt_text(srv)
    assert ("<|user|>SCRIPT:reason capital?<|assistant|><think>Let me think about the capital.</think>"
            "The capital of France is Paris.<|user|>SCRIPT:plain and Italy?") in p
    assert "first instructions" not in p  # instructions are not carried over (OpenAI's rule)
    r3 = create(client, "SCRIPT:plain third", previous_response_id=r2.id)
    assert "SCRIPT:reason capital?" in prompt_text(srv) and r3.status == "completed"


def test_retrieve_returns_the_stored_response(srv):
    client = srv.client()
    r = create(client, "SCRIPT:tool w", tools=TOOLS)
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    events, final = stream(client, "SCRIPT:reason w")
    got = client.responses.retrieve(final.id)
    assert got.id == final.id and shape(got.output) == shape(final.output) and got.usage == final.usage


def test_store_false_is_not_kept(srv):
    client = srv.client()
    r = create(client, "SCRIPT:plain x", store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        create(client, "SCRIPT:plain y", previous_response_id=r.id)


def test_delete(srv):
    client = srv.client()
    r = create(client, "SCRIPT:plain x")
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_cancel_a_running_stream(srv):
    client = srv.client()
    before = counters(srv)["aborts"]
    s = client.responses.create(model=MODEL, input="SCRIPT:long go", stream=True, max_output_tokens=400,
                                reasoning={"effort": "none"})
    it = iter(s)
    rid = next(it).response.id
    assert client.responses.retrieve(rid).status == "in_progress"
    for _ in range(5):
        next(it)
    cancelled = client.responses.cancel(rid)
    assert cancelled.status == "cancelled"
    rest = list(it)
    assert rest[-1].type == "response.incomplete" and rest[-1].response.status == "cancelled"
    assert rest[-1].response.usage.output_tokens < 400
    assert client.responses.retrieve(rid).status == "cancelled"
    assert counters(srv)["aborts"] >= before + 1
    assert_idle(srv)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.cancel(rid)  # no longer in progress
    assert e.value.param == "response_id"


def test_cancel_a_running_non_streamed_request(srv):
    client = srv.client()
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("r", create(client, "SCRIPT:long go", max_output_tokens=400,
                                                                      reasoning={"effort": "none"})))
    t.start()
    deadline = time.monotonic() + 5
    rid = None
    while rid is None and time.monotonic() < deadline:
        rid = next((k for k, v in _store(srv)._entries.items() if v.in_progress), None)
        time.sleep(0.01)
    assert rid is not None
    assert client.responses.cancel(rid).status == "cancelled"
    t.join(10)
    assert result["r"].status == "cancelled" and result["r"].id == rid
    assert_idle(srv)


def _store(server):
    """The ResponseStore behind a server's /v1/responses route."""
    return server.app._router.find("/v1/responses")[0].store


# --- without the store (the session's shared scripted server) ----------------------------------
def test_without_store_stateful_requests_get_sglangs_400(scripted_server):
    client = scripted_server.client()
    r = create(client, "SCRIPT:plain x", store=True)
    assert r.store is False  # ignored, as SGLang does without --enable-response-store
    for call in (lambda: create(client, "SCRIPT:plain y", previous_response_id=r.id),
                 lambda: client.responses.retrieve(r.id), lambda: client.responses.cancel(r.id)):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.body["message"] == STORE_DISABLED and e.value.status_code == 400


# --- bad inputs ---------------------------------------------------------------------------------
OK = {"model": MODEL, "input": "SCRIPT:plain hi"}
BAD = [
    ({"input": None, "model": MODEL}, 400, "input"),
    ({**OK, "input": []}, 400, "input"),
    ({**OK, "input": 5}, 400, "input"),
    ({**OK, "input": [5]}, 400, "input[0]"),
    ({**OK, "input": [{"role": "robot", "content": "x"}]}, 400, "input[0].role"),
    ({**OK, "input": [{"role": "user"}]}, 400, "input[0].content"),
    ({**OK, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, 400,
     "input[0].content[0].type"),
    ({**OK, "input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]}, 400,
     "input[0].content[0].type"),
    ({**OK, "input": [{"role": "user", "content": [{"type": "input_text", "text": 3}]}]}, 400,
     "input[0].content[0].text"),
    ({**OK, "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, 400, "input[0].call_id"),
    ({**OK, "input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}, 400, "input[0].name"),
    ({**OK, "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}]}, 400,
     "input[0].arguments"),
    ({**OK, "input": [{"type": "function_call_output", "output": "x"}]}, 400, "input[0].call_id"),
    ({**OK, "input": [{"type": "function_call_output", "call_id": "c"}]}, 400, "input[0].output"),
    ({**OK, "input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input[0].type"),
    ({**OK, "input": [{"type": "computer_call", "id": "x"}]}, 400, "input[0].type"),
    ({**OK, "input": [{"type": "reasoning", "summary": "x"}]}, 400, "input[0].summary"),
    ({**OK, "input": "\ud800"}, 400, "input"),
    ({**OK, "tools": {"a": 1}}, 400, "tools"),
    ({**OK, "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ({**OK, "tools": [{"type": "function", "name": "bad name!"}]}, 400, "tools[0].name"),
    ({**OK, "tools": [{"type": "function", "name": "f", "parameters": {"type": "nope"}}]}, 400,
     "tools[0].parameters"),
    ({**OK, "tools": [{"type": "function", "name": "f", "strict": "yes"}]}, 400, "tools[0].strict"),
    ({**OK, "tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "f"}]}, 400, "tools[1].name"),
    ({**OK, "tool_choice": "required"}, 400, "tool_choice"),
    ({**OK, "tool_choice": {"type": "function", "name": "get_weather"}}, 400, "tool_choice"),
    ({**OK, "tool_choice": "sometimes"}, 400, "tool_choice"),
    ({**OK, "text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, 400, "text.format.schema"),  # flag off: names the flag
    ({**OK, "text": {"format": {"type": "json_object"}}}, 400, "text.format"),
    ({**OK, "text": {"format": {"type": "yaml"}}}, 400, "text.format"),
    ({**OK, "text": {"verbosity": "high"}}, 400, "text.verbosity"),
    ({**OK, "reasoning": {"effort": "extreme"}}, 400, "reasoning.effort"),
    ({**OK, "reasoning": "high"}, 400, "reasoning"),
    ({**OK, "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({**OK, "max_output_tokens": "10"}, 400, "max_output_tokens"),
    ({**OK, "max_output_tokens": 5000}, 400, "max_output_tokens"),
    ({**OK, "temperature": -1}, 400, "temperature"),
    ({**OK, "temperature": True}, 400, "temperature"),
    ({**OK, "top_p": 2}, 400, "top_p"),
    ({**OK, "top_logprobs": 21}, 400, "top_logprobs"),
    ({**OK, "include": ["everything"]}, 400, "include"),
    ({**OK, "stream": "yes"}, 400, "stream"),
    ({**OK, "store": "yes"}, 400, "store"),
    ({**OK, "metadata": {"k": 1}}, 400, "metadata"),
    ({**OK, "metadata": {f"k{i}": "v" for i in range(17)}}, 400, "metadata"),
    ({**OK, "truncation": "middle"}, 400, "truncation"),
    ({**OK, "parallel_tool_calls": "no"}, 400, "parallel_tool_calls"),
    ({**OK, "background": True}, 400, "background"),
    ({**OK, "conversation": "conv_1"}, 400, "conversation"),
    ({**OK, "prompt": {"id": "pmpt_1"}}, 400, "prompt"),
    ({**OK, "previous_response_id": "resp_x"}, 400, "previous_response_id"),
    ({**OK, "instructions": 5}, 400, "instructions"),
    ({**OK, "user": 5}, 400, "user"),
    ({**OK, "stream_options": {"include_obfuscation": False}}, 400, "stream_options"),
    ({**OK, "model": "gpt-9"}, 404, "model"),
    ({**OK, "input": "SCRIPT:plain " + "word " * 3000}, 400, "input"),
]


def check_envelope(status, body, want_status, want_param):
    assert status == want_status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str), body
    assert err["param"] == want_param, body


@pytest.mark.parametrize("body,status,param", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_input_is_a_4xx_in_openais_envelope(scripted_server, body, status, param):
    got, data, _ = scripted_server.raw("POST", "/v1/responses", body)
    check_envelope(got, data, status, param)


@pytest.mark.parametrize("method,path,status,param", [
    ("GET", "/v1/responses/nope", 400, "response_id"),
    ("GET", "/v1/responses/resp_unknown", 404, "response_id"),
    ("POST", "/v1/responses/resp_unknown/cancel", 404, "response_id"),
    ("POST", "/v1/responses/nope/cancel", 400, "response_id"),
    ("DELETE", "/v1/responses/resp_unknown", 404, "response_id"),
    ("GET", "/v1/responses/resp_unknown?stream=true", 400, "stream"),
])
def test_bad_stored_response_requests(srv, method, path, status, param):
    got, data, _ = srv.raw(method, path)
    check_envelope(got, data, status, param)


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b'"text"'])
def test_bad_bodies(scripted_server, raw):
    got, data, _ = scripted_server.raw("POST", "/v1/responses", raw)
    assert 400 <= got < 500 and set(data["error"]) == {"message", "type", "param", "code"}, data


def test_in_progress_previous_response_is_refused(srv):
    s = srv.client().responses.create(model=MODEL, input="SCRIPT:long go", stream=True, max_output_tokens=300,
                                      reasoning={"effort": "none"})
    it = iter(s)
    rid = next(it).response.id
    got, data, _ = srv.raw("POST", "/v1/responses", {**OK, "previous_response_id": rid})
    check_envelope(got, data, 400, "previous_response_id")
    s.close()
    assert_idle(srv)


def test_truncation_auto_drops_the_oldest_items(srv):
    long = [{"role": "user", "content": "word " * 300}, {"role": "assistant", "content": "ok " * 300}] * 2
    body = {**OK, "input": [*long, {"role": "user", "content": "SCRIPT:plain last"}], "max_output_tokens": 16}
    got, data, _ = srv.raw("POST", "/v1/responses", body)
    check_envelope(got, data, 400, "input")  # disabled (the default): over the context is a 400
    got, data, _ = srv.raw("POST", "/v1/responses", {**body, "truncation": "auto"})
    assert got == 200 and data["status"] == "completed", data
    assert "SCRIPT:plain last" in prompt_text(srv)


# --- a client that leaves -----------------------------------------------------------------------
def test_disconnect_mid_stream_leaves_the_engine_idle(srv):
    before = counters(srv)["aborts"]
    body = json.dumps({"model": MODEL, "input": "SCRIPT:long bye", "stream": True, "max_output_tokens": 400,
                       "reasoning": {"effort": "none"}}).encode()
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
    sock.sendall(f"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    f = sock.makefile("rb")
    seen = 0
    while seen < 8:
        line = f.readline()
        assert line
        seen += line.startswith(b"data: ")
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()
    deadline = time.monotonic() + 5
    while counters(srv)["aborts"] < before + 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert counters(srv)["aborts"] >= before + 1
    assert_idle(srv)
    assert not [v for v in _store(srv)._entries.values() if v.in_progress]  # nothing stays in_progress


# --- the real tiny model ------------------------------------------------------------------------
def test_real_tiny_model(any_server):
    client = any_server.client()
    kw = dict(model=MODEL, input="Hello there", max_output_tokens=8, temperature=0)
    r = client.responses.create(**kw)
    assert r.status in ("completed", "incomplete") and r.usage.output_tokens <= 8
    with client.responses.stream(**kw) as s:
        events = list(s)
    last = events[-1].response
    assert shape(last.output) == shape(r.output) and no_cache(last.usage) == no_cache(r.usage)
    assert [e.sequence_number for e in events] == list(range(len(events)))
