"""The prompt-token cache (TRNRT_PROMPT_CACHE_MB): ids identical to the full render over a long
conversation with tools and reasoning; a planted mismatch turns it off for good."""

from __future__ import annotations

import json
import logging
import random

import pytest

from trnrt.serve import prompt_cache
from trnrt.serve.prompt_cache import PromptCache, common_prefix_len
from trnrt.serve.protocol.chat_template import apply_template_defaults, render_chat
from trnrt.serve.protocol.openai import parse_chat

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "description": "Web search",
                                      "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


def conversation(turns: int, seed: int = 0) -> list[list[dict]]:
    """Per turn, the messages the client appends: assistant replies with reasoning, tool calls
    (JSON-string and object arguments), tool results, unicode and odd whitespace."""
    rng = random.Random(seed)
    words = ["Paris", "北京", "weather", "  spaced  ", "tab\there", "emoji 🙂", "<b>x</b>", "line\nbreak", "déjà vu"]
    out = [[{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Hello, what's the weather in Paris?"}]]
    for t in range(1, turns):
        kind = t % 4
        reasoning = " ".join(rng.choice(words) for _ in range(rng.randint(0, 6)))
        if kind == 1:
            args = json.dumps({"city": rng.choice(words), "days": t}) if t % 8 == 1 else {"city": "Paris", "days": t}
            out.append([{"role": "assistant", "content": "", "reasoning_content": reasoning,
                         "tool_calls": [{"id": f"c{t}", "type": "function",
                                         "function": {"name": "get_weather", "arguments": args}}]},
                        {"role": "tool", "tool_call_id": f"c{t}", "content": json.dumps({"temp": 20 + t})}])
        elif kind == 2:
            out.append([{"role": "assistant", "content": "", "reasoning_content": reasoning,
                         "tool_calls": [{"id": f"s{t}", "type": "function",
                                         "function": {"name": "search", "arguments": "{\"q\": \"a\"}"}},
                                        {"id": f"w{t}", "type": "function",
                                         "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]},
                        {"role": "tool", "tool_call_id": f"s{t}", "content": "results"},
                        {"role": "tool", "tool_call_id": f"w{t}", "content": "sunny"}])
        else:
            out.append([{"role": "assistant", "content": f" answer {t}: " + rng.choice(words),
                         "reasoning_content": reasoning},
                        {"role": "user", "content": " ".join(rng.choice(words) for _ in range(rng.randint(1, 8)))}])
    return out


def render(tokenizer, messages, **extra):
    creq = parse_chat({"model": "m", "messages": messages, "tools": TOOLS, **extra})
    apply_template_defaults(creq, {})
    return render_chat(tokenizer, creq, max_tokens=1 << 20)


@pytest.fixture
def cache():
    c = prompt_cache.configure(64)
    yield c
    prompt_cache.configure(0)


@pytest.mark.parametrize("extra", [{}, {"chat_template_kwargs": {"clear_thinking": True}},
                                   {"chat_template_kwargs": {"enable_thinking": False}}])
def test_twenty_turns_identical_to_the_full_render(tokenizer, cache, extra):
    messages: list = []
    for turn in conversation(20):
        messages = messages + turn
        prompt_cache.configure(0)
        full = render(tokenizer, messages, **extra)
        prompt_cache._ACTIVE = cache  # the same cache across turns
        got = render(tokenizer, messages, **extra)
        assert got.ids == full.ids and got.text == full.text, len(messages)
    st = cache.status()
    assert st["enabled"] and st["mismatches"] == 0
    assert st["hits"] == 19 and st["misses"] == 1  # every turn after the first built on the previous one
    assert st["tokens_reused"] > 0.8 * sum(len(t) for t in [full.ids]) * 1  # most of the last prompt reused
    assert st["audits"] >= 8  # the first hits are all audited


def test_other_tools_or_kwargs_never_share_entries(tokenizer, cache):
    msgs = conversation(3)[0]
    a = render(tokenizer, msgs)
    b = render(tokenizer, msgs, tool_choice="none")  # tools left out of the prompt
    prompt_cache.configure(0)
    assert b.ids == render(tokenizer, msgs, tool_choice="none").ids and a.ids != b.ids


def test_planted_mismatch_turns_it_off_for_good(tokenizer, cache, caplog):
    conv = conversation(6)
    messages = conv[0]
    render(tokenizer, messages)
    # plant: corrupt the stored ids of the entry the next turn builds on
    (entry,) = cache._entries.values()
    entry.ids[3] = (entry.ids[3] + 1) % 1000
    messages = messages + conv[1]
    with caplog.at_level(logging.WARNING, logger="trnrt.serve.prompt_cache"):
        got = render(tokenizer, messages)
    prompt_cache.configure(0)
    assert got.ids == render(tokenizer, messages).ids  # the audited hit returned the full render
    prompt_cache._ACTIVE = cache
    st = cache.status()
    assert not st["enabled"] and st["mismatches"] == 1 and "audit" in st["disabled_reason"]
    assert st["entries"] == 0
    assert any("turned off for good" in r.message for r in caplog.records)
    # for good: later turns are full renders, no hits
    for turn in conv[2:]:
        messages = messages + turn
        render(tokenizer, messages)
    assert cache.status()["hits"] == st["hits"] and not cache.enabled


def test_audits_sample_after_the_first_hits(tokenizer):
    c = PromptCache(1 << 24, audit_every=1000, audit_first=2, rng=random.Random(0))
    prompt_cache._ACTIVE = c
    try:
        messages: list = []
        for turn in conversation(10):
            messages = messages + turn
            render(tokenizer, messages)
    finally:
        prompt_cache.configure(0)
    assert c.hits == 9 and c.audits == 2


def test_self_check_at_start_turns_off_a_broken_tokenizer(tokenizer, caplog):
    class Broken:
        """The real tokenizer, but an encoding that depends on where the text starts (as a
        tokenizer that merges across added tokens would)."""

        def __init__(self, tok):
            self._tok = tok
            self.added_tokens_encoder = tok.added_tokens_encoder
            self.chat_template = tok.chat_template
            self.name_or_path = "broken"

        def __len__(self):
            return len(self._tok)

        def apply_chat_template(self, *a, **k):
            return self._tok.apply_chat_template(*a, **k)

        def encode(self, text, add_special_tokens=False):
            ids = self._tok.encode(text, add_special_tokens=add_special_tokens)
            return ids if text.startswith("[gMASK]") else ids + [0]

    c = PromptCache(1 << 24)
    with caplog.at_level(logging.WARNING, logger="trnrt.serve.prompt_cache"):
        ids = c.encode(Broken(tokenizer), [{"role": "user", "content": "hi"}], {}, "[gMASK]x", lambda: [7])
    assert ids == [7] and not c.enabled and "self-check" in c.status()["disabled_reason"]
    assert any("turned off for good" in r.message for r in caplog.records)
    # the real tokenizer passes it
    ok = PromptCache(1 << 24)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         tokenize=False)
    full = tokenizer.encode(text, add_special_tokens=False)
    assert ok.encode(tokenizer, [{"role": "user", "content": "hi"}], {}, text, lambda: list(full)) == full
    assert ok.enabled and ok.status()["misses"] == 1


def test_memory_bound_and_helpers(tokenizer):
    c = PromptCache(60_000, self_check=False)
    prompt_cache._ACTIVE = c
    try:
        for i in range(40):
            render(tokenizer, [{"role": "user", "content": f"conversation {i} " + "x" * 200}])
    finally:
        prompt_cache.configure(0)
    st = c.status()
    assert 0 < st["bytes"] <= 60_000 and 1 < st["entries"] < 40
    assert [common_prefix_len(a, b) for a, b in (("abc", "abd"), ("", "x"), ("same", "same"), ("ab", "abc"))] == [
        2, 0, 4, 2]


def test_server_stats_flag_and_served_prompts(tokenizer_factory, tokenizer):
    """Through the server: the chat route's prompts (usage) equal the cache-off ones, and the
    flag is published in /v1/stats."""
    from serve_support import make_scripted_engine, start_server, stop_server

    from trnrt.serve import ServeSettings

    server = start_server(make_scripted_engine(tokenizer_factory), tokenizer_factory,
                          ServeSettings(served_model_name="trnrt-tiny", prompt_cache_mb=16))
    try:
        messages: list = []
        for turn in conversation(8):
            messages = messages + turn
            st, body, _ = server.raw("POST", "/v1/chat/completions", {
                "model": "trnrt-tiny", "messages": messages, "tools": TOOLS, "max_tokens": 2})
            assert st == 200, body
            st, tok, _ = server.raw("POST", "/tokenize", {"model": "trnrt-tiny", "messages": messages, "tools": TOOLS})
            assert st == 200, tok
            prompt_cache_state = prompt_cache.active()
            prompt_cache._ACTIVE = None
            want = render(tokenizer, messages)
            prompt_cache._ACTIVE = prompt_cache_state
            assert body["usage"]["prompt_tokens"] == len(want.ids)
            assert tok["tokens"] == want.ids
        flag = server.stats()["engines"][0]["prompt_cache"]
        assert flag["enabled"] is True and flag["hits"] >= 7 and flag["mismatches"] == 0
    finally:
        stop_server(server)
        prompt_cache.configure(0, collector=server.engine.stats_collector)
    assert "prompt_cache" not in server.engine.stats_collector.engine_snapshot()
