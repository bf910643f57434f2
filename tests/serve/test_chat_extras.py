"""Chat extras (scripted engine): continue_final_message / add_generation_prompt (assistant
prefill), stream_options.continuous_usage_stats, --stream-response-default-include-usage,
return_token_ids / return_prompt_token_ids, and their misuse: 400s in OpenAI's envelope."""

from __future__ import annotations

import json

import pytest

from serve_support import make_scripted_engine, start_server, stop_server

MODEL = "trnrt-tiny"
PREFILL = "The capital of France is"


def sse(raw: str) -> list:
    events = [e[len("data: "):] for e in raw.split("\n\n") if e.strip()]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


@pytest.fixture(scope="module")
def usage_server(tokenizer_factory):
    """A server with --stream-response-default-include-usage."""
    from trnrt.serve import ServeSettings

    server = start_server(make_scripted_engine(tokenizer_factory), tokenizer_factory,
                          ServeSettings(served_model_name=MODEL, stream_response_default_include_usage=True))
    yield server
    stop_server(server)


def post(server, path, body):
    status, data, _ = server.raw("POST", path, body)
    return status, (sse(data) if body.get("stream") and status == 200 else data)


def chat_body(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "SCRIPT:stopword"}], "max_tokens": 40,
            "temperature": 0, **kw}


def last_prompt(server, tokenizer) -> str:
    return tokenizer.decode(server.engine.submitted[-1].prompt_token_ids, skip_special_tokens=False)


def test_continue_final_message_continues_the_assistant_message(scripted_server, tokenizer):
    msgs = [{"role": "user", "content": "SCRIPT:stopword"}, {"role": "assistant", "content": PREFILL}]
    status, body = post(scripted_server, "/v1/chat/completions", chat_body(messages=msgs, continue_final_message=True))
    assert status == 200, body
    prompt = last_prompt(scripted_server, tokenizer)
    assert prompt.endswith(PREFILL) and prompt.count("<|assistant|>") == 1  # no new turn, no generation prompt
    assert body["choices"][0]["message"]["content"] == "one two three STOP four five"
    # the same with add_generation_prompt false given explicitly (vLLM's spelling of it)
    status, _ = post(scripted_server, "/v1/chat/completions",
                     chat_body(messages=msgs, continue_final_message=True, add_generation_prompt=False))
    assert status == 200 and last_prompt(scripted_server, tokenizer) == prompt
    # without it, the assistant message is closed and a new assistant turn is opened
    status, _ = post(scripted_server, "/v1/chat/completions", chat_body(messages=msgs))
    assert status == 200 and last_prompt(scripted_server, tokenizer).count("<|assistant|>") == 2


def test_add_generation_prompt_false(scripted_server, tokenizer):
    status, _ = post(scripted_server, "/v1/chat/completions", chat_body(add_generation_prompt=False))
    assert status == 200 and not last_prompt(scripted_server, tokenizer).rstrip().endswith(("<|assistant|>", "<think>"))
    status, _ = post(scripted_server, "/v1/chat/completions", chat_body())
    assert "<|assistant|>" in last_prompt(scripted_server, tokenizer)


def test_continuous_usage_stats_puts_usage_on_every_chunk(scripted_server):
    for path, body in (("/v1/chat/completions", chat_body()),
                       ("/v1/completions", {"model": MODEL, "prompt": "SCRIPT:stopword", "max_tokens": 40})):
        status, chunks = post(scripted_server, path, {**body, "stream": True,
                                                      "stream_options": {"continuous_usage_stats": True,
                                                                         "include_usage": True}})
        assert status == 200
        assert all("usage" in c for c in chunks)
        done = [c["usage"]["completion_tokens"] for c in chunks]
        assert done == sorted(done) and done[-1] == chunks[-1]["usage"]["completion_tokens"] > 0
        assert chunks[-1]["choices"] == []  # the final usage chunk (include_usage)
        status, chunks = post(scripted_server, path, {**body, "stream": True})
        assert all("usage" not in c for c in chunks)  # off by default


def test_default_include_usage_flag(usage_server):
    for path, body in (("/v1/chat/completions", chat_body()),
                       ("/v1/completions", {"model": MODEL, "prompt": "SCRIPT:stopword", "max_tokens": 40})):
        status, chunks = post(usage_server, path, {**body, "stream": True})
        assert status == 200 and chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
        status, data = post(usage_server, path, body)  # non-streamed: usage as always
        assert status == 200 and data["usage"]["completion_tokens"] > 0
    status, data, _ = usage_server.raw("GET", "/server_info")
    assert data.get("stream_response_default_include_usage") in (True, None)


def test_return_token_ids_chat_and_completions(scripted_server, tokenizer):
    want = tokenizer.encode("one two three STOP four five<|endoftext|>", add_special_tokens=False)
    status, body = post(scripted_server, "/v1/chat/completions", chat_body(return_token_ids=True))
    c = body["choices"][0]
    assert c["token_ids"] == c["response_token_ids"] == want  # the EOS stop token included, as in output_ids
    assert len(body["prompt_token_ids"]) == body["usage"]["prompt_tokens"]
    status, chunks = post(scripted_server, "/v1/chat/completions", chat_body(return_token_ids=True, stream=True))
    assert [i for ch in chunks for i in ch["choices"][0]["token_ids"]] == want
    assert chunks[0]["prompt_token_ids"] == body["prompt_token_ids"]
    assert all("prompt_token_ids" not in ch for ch in chunks[1:])
    status, body2 = post(scripted_server, "/v1/chat/completions", chat_body(return_prompt_token_ids=True))
    assert body2["prompt_token_ids"] == body["prompt_token_ids"] and "token_ids" not in body2["choices"][0]
    comp = {"model": MODEL, "prompt": "SCRIPT:stopword", "max_tokens": 40, "return_token_ids": True}
    status, body = post(scripted_server, "/v1/completions", comp)
    c = body["choices"][0]
    assert c["token_ids"] == want and c["prompt_token_ids"] == tokenizer.encode("SCRIPT:stopword",
                                                                                 add_special_tokens=False)
    status, chunks = post(scripted_server, "/v1/completions", {**comp, "stream": True})
    assert [i for ch in chunks for i in ch["choices"][0]["token_ids"]] == want
    assert chunks[0]["choices"][0]["prompt_token_ids"] == c["prompt_token_ids"]
    status, body = post(scripted_server, "/v1/completions", {**comp, "return_token_ids": False})
    assert "token_ids" not in body["choices"][0]


USER_LAST = [{"role": "user", "content": "hi"}]
ASSISTANT_LAST = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
BAD = [
    ({"messages": USER_LAST, "continue_final_message": True}, "continue_final_message", "last message"),
    ({"messages": ASSISTANT_LAST, "continue_final_message": True, "add_generation_prompt": True},
     "continue_final_message", "both be true"),
    ({"messages": ASSISTANT_LAST, "continue_final_message": "yes"}, "continue_final_message", "boolean"),
    ({"messages": ASSISTANT_LAST, "continue_final_message": 1}, "continue_final_message", "boolean"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
      "continue_final_message": True}, "continue_final_message", "tool_calls"),
    ({"messages": ASSISTANT_LAST, "continue_final_message": True, "chat_template": "{{ messages }}"},
     "continue_final_message", "server's chat template"),
    ({"messages": ASSISTANT_LAST, "chat_template_kwargs": {"continue_final_message": True}},
     "chat_template_kwargs", "set by the server"),
    ({"messages": USER_LAST, "add_generation_prompt": "no"}, "add_generation_prompt", "boolean"),
    ({"messages": USER_LAST, "stream": True, "stream_options": {"continuous_usage_stats": "yes"}},
     "stream_options.continuous_usage_stats", "boolean"),
    ({"messages": USER_LAST, "stream": True, "stream_options": {"include_usage": 1}},
     "stream_options.include_usage", "boolean"),
    ({"messages": USER_LAST, "stream_options": {"continuous_usage_stats": True}}, "stream_options", "stream is true"),
    ({"messages": USER_LAST, "stream": False, "stream_options": {"include_usage": True}}, "stream_options",
     "stream is true"),
    ({"messages": USER_LAST, "stream": True, "stream_options": ["include_usage"]}, "stream_options", "object"),
    ({"messages": USER_LAST, "stream": True, "stream_options": {"usage": True}}, "stream_options", "Unrecognized"),
    ({"messages": USER_LAST, "return_prompt_token_ids": "true"}, "return_prompt_token_ids", "boolean"),
    ({"messages": USER_LAST, "return_token_ids": 1}, "return_token_ids", "boolean"),
]


@pytest.mark.parametrize("extra, param, why", BAD, ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(BAD)])
def test_chat_extras_misuse_is_a_400_naming_the_field(scripted_server, extra, param, why):
    status, data = post(scripted_server, "/v1/chat/completions", {"model": MODEL, "max_tokens": 4, **extra})
    assert status == 400, data
    assert data["error"]["param"] == param and data["error"]["code"] == 400, data
    assert why in data["error"]["message"], data


@pytest.mark.parametrize("so, param", [({"continuous_usage_stats": "1"}, "stream_options.continuous_usage_stats"),
                                       ({"include_usage": True}, "stream_options")])
def test_completions_stream_options_misuse(scripted_server, so, param):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream_options": so,
            "stream": param != "stream_options"}
    status, data = post(scripted_server, "/v1/completions", body)
    assert status == 400 and data["error"]["param"] == param, data
