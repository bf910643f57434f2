"""`n` > 1 on /v1/chat/completions and /v1/completions: one engine request per choice, the prompt
computed once (the engine forks the other choices from it), choice i seeded seed + i, usage counts
the prompt once, streamed chunks carry each choice's index, a disconnect aborts every choice."""

from __future__ import annotations

import json
import socket
import time

import pytest

from serve_support import assert_idle

MODEL = "trnrt-tiny"


def post(server, path, body):
    import urllib.request

    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def is_real(server) -> bool:
    return server.engine.model_info.backend != "scripted"


def chat(n, seed=7, **kw):
    b = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story about a red fox " * 6}],
         "max_tokens": 8, "temperature": 1.0, "seed": seed, "n": n}
    b.update(kw)
    return b


def test_chat_n_choices_share_the_prompt(any_server):
    forked = any_server.engine.scheduler.num_forked
    status, d = post(any_server, "/v1/chat/completions", chat(8))
    assert status == 200, d
    assert [c["index"] for c in d["choices"]] == list(range(8))
    assert any_server.engine.scheduler.num_forked - forked == 7  # the prompt was computed once
    status, single = post(any_server, "/v1/chat/completions", chat(1))
    u = d["usage"]
    assert u["prompt_tokens"] == single["usage"]["prompt_tokens"]  # counted once
    assert u["completion_tokens"] == 8 * 8
    texts = [c["message"]["content"] + (c["message"].get("reasoning_content") or "") for c in d["choices"]]
    _, again = post(any_server, "/v1/chat/completions", chat(8))
    assert [c["message"] for c in again["choices"]] == [c["message"] for c in d["choices"]]  # reproducible
    if is_real(any_server):
        assert len(set(texts)) == 8, texts  # seed + i: pairwise different
        # choice 0 is the n=1 answer with the same seed
        assert d["choices"][0]["message"] == single["choices"][0]["message"]
    assert_idle(any_server)


def test_completions_n_with_two_prompts(any_server):
    b = {"model": MODEL, "prompt": ["Once upon a time", "The weather in Paris"], "max_tokens": 4, "n": 3,
         "temperature": 0.8, "seed": 1}
    status, d = post(any_server, "/v1/completions", b)
    assert status == 200, d
    assert [c["index"] for c in d["choices"]] == list(range(6))
    _, one = post(any_server, "/v1/completions", {**b, "n": 1})
    assert d["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    assert d["usage"]["completion_tokens"] == 6 * 4
    if is_real(any_server):
        assert d["choices"][0]["text"] == one["choices"][0]["text"]
        assert d["choices"][3]["text"] == one["choices"][1]["text"]
    assert_idle(any_server)


def test_streamed_n_carries_indices_with_the_official_client(any_server):
    from openai import OpenAI

    client = OpenAI(base_url=any_server.url + "/v1", api_key="x", _strict_response_validation=True)
    stream = client.chat.completions.create(**chat(4), stream=True, stream_options={"include_usage": True})
    text = {i: "" for i in range(4)}
    finished = set()
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text[c.index] += (c.delta.content or "") + (getattr(c.delta, "reasoning_content", None) or "")
            if c.finish_reason is not None:
                finished.add(c.index)
    assert finished == {0, 1, 2, 3}
    assert usage is not None and usage.completion_tokens == 4 * 8
    full = client.chat.completions.create(**chat(4))
    assert [c.message.content + (getattr(c.message, "reasoning_content", None) or "") for c in full.choices] == \
        [text[i] for i in range(4)]
    assert_idle(any_server)


@pytest.mark.parametrize("extra,field", [
    ({"n": 0}, "n"), ({"n": 129}, "n"), ({"n": 1.5}, "n"), ({"n": True}, "n"), ({"n": "2"}, "n"),
    ({"n": 2, "best_of": 3}, "best_of"), ({"n": 2, "best_of": 0}, "best_of"),
])
def test_bad_n(scripted_server, extra, field):
    path = "/v1/completions" if "best_of" in extra else "/v1/chat/completions"
    b = {**chat(1), **extra} if path.endswith("chat/completions") else {"model": MODEL, "prompt": "hi",
                                                                         "max_tokens": 2, **extra}
    status, d = post(scripted_server, path, b)
    assert status == 400 and d["error"]["param"] == field, d


def test_disconnect_mid_stream_aborts_every_choice(scripted_server):
    server = scripted_server
    body = json.dumps({**chat(4), "stream": True, "max_tokens": 400,
                       "messages": [{"role": "user", "content": "SCRIPT:long x"}]})
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
    f = sock.makefile("rb")
    seen = 0
    while seen < 12:  # a few chunks of every choice
        line = f.readline()
        assert line, "stream ended early"
        seen += line.startswith(b"data: ")
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()
    assert_idle(server, timeout_s=10.0)
    server.engine.scheduler.check_integrity()
    assert not server.engine.scheduler._groups


def test_generate_n_is_a_list_grouped_by_prompt(any_server):
    forked = any_server.engine.scheduler.num_forked
    b = {"text": ["Once upon a time there was", "The weather in Paris is"],
         "sampling_params": {"max_new_tokens": 4, "n": 3, "temperature": 0.9, "sampling_seed": 5}}
    status, d = post(any_server, "/generate", b)
    assert status == 200, d
    assert isinstance(d, list) and len(d) == 6
    assert len({o["meta_info"]["id"] for o in d}) == 6
    assert any_server.engine.scheduler.num_forked - forked == 4  # 2 per prompt
    status, single = post(any_server, "/generate", {"text": "Once upon a time there was",
                                                    "sampling_params": {"max_new_tokens": 4, "n": 3}})
    assert status == 200 and isinstance(single, list) and len(single) == 3
    status, bad = post(any_server, "/generate", {"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 3}]})
    assert status == 400, bad
    assert_idle(any_server)


def test_cache_salt_isolates_the_prefix_cache(scripted_server):
    """Same long prompt: a different cache_salt (OpenAI routes) or extra_key (/generate) never
    reuses cached state; the same one does."""
    long = "SCRIPT:plain " + "lorem ipsum dolor " * 60
    base = {"model": MODEL, "prompt": long, "max_tokens": 2}
    cached = lambda d: (d["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)  # noqa: E731
    _, a = post(scripted_server, "/v1/completions", {**base, "cache_salt": "tenant-a"})
    _, a2 = post(scripted_server, "/v1/completions", {**base, "cache_salt": "tenant-a"})
    _, b = post(scripted_server, "/v1/completions", {**base, "cache_salt": "tenant-b"})
    _, none = post(scripted_server, "/v1/completions", base)
    assert cached(a) == 0 and cached(a2) > 0 and cached(b) == 0 and cached(none) == 0
    g = {"text": long + " generate", "sampling_params": {"max_new_tokens": 2}}
    _, x = post(scripted_server, "/generate", {**g, "extra_key": "k1"})
    _, y = post(scripted_server, "/generate", {**g, "extra_key": "k2"})
    _, z = post(scripted_server, "/generate", {**g, "extra_key": "k1"})
    assert x["meta_info"]["cached_tokens"] == 0 and y["meta_info"]["cached_tokens"] == 0
    assert z["meta_info"]["cached_tokens"] > 0
    status, bad = post(scripted_server, "/v1/completions", {**base, "cache_salt": ""})
    assert status == 400 and bad["error"]["param"] == "cache_salt"


def test_routing_key_is_a_known_field(scripted_server, caplog):
    """sglang-router forwards SGLang's routing_key: accepted without the unknown-field warning."""
    import logging

    with caplog.at_level(logging.WARNING):
        s1, _ = post(scripted_server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                           "routing_key": "conv-1"})
        s2, _ = post(scripted_server, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2},
                                                    "routing_key": "conv-1"})
        s3, _ = post(scripted_server, "/v1/chat/completions", {**chat(1), "routing_key": "conv-1"})
    assert (s1, s2, s3) == (200, 200, 200)
    assert not [r for r in caplog.records if "routing_key" in r.getMessage()]
    assert post(scripted_server, "/v1/completions", {"model": MODEL, "prompt": "hi", "routing_key": 3})[0] == 400
    assert post(scripted_server, "/generate", {"text": "hi", "routing_key": 3})[0] == 400
