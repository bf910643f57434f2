"""Prefix-cache reporting: `usage.prompt_tokens_details.cached_tokens` (OpenAI routes),
`meta_info.cached_tokens` and `meta_info.cached_tokens_details` (/generate, with the hierarchical
cache), the `prefix_cache` section of /v1/loads and /server_info's `prefix_cache`.

The numbers are fabricated around the scripted engine (its outputs get cached-token counts taken
from the request id, its load the prefix-cache gauges), so these tests pin the serve layer alone.
"""

from __future__ import annotations

import json
import re

import pytest

from serve_support import make_scripted_engine, start_server

MODEL = "trnrt-tiny"
GEN, COMP, CHAT = "/generate", "/v1/completions", "/v1/chat/completions"
GAUGES = dict(prefix_cache=True, num_cached_pages=5, num_evictable_pages=3, num_used_checkpoints=2,
              num_total_checkpoints=16, num_host_used_pages=4, num_host_total_pages=64, num_host_used_checkpoints=1,
              num_host_total_checkpoints=32, cache_hit_rate=0.421875)
PREFIX_CACHE_INFO = {"enabled": True, "eviction_policy": "slru", "checkpoint_interval": 64, "hierarchical": True}


class CachedStream:
    def __init__(self, stream, cached: int, host: int):
        self._s, self.cached, self.host = stream, cached, host
        self.request_id = stream.request_id

    def _mark(self, o):
        if o is not None:
            o.num_cached_tokens = self.cached
            o.num_cached_tokens_host = self.host
        return o

    def get(self, timeout=None):
        return self._mark(self._s.get(timeout=timeout))

    def __iter__(self):
        for o in self._s:
            yield self._mark(o)


class CachingEngine:
    """The scripted engine reporting a prefix cache: a request id `c<N>h<M>-...` gets N cached
    prompt tokens, M of them from the host tier; load() and server_info() carry the cache's figures."""

    def __init__(self, engine):
        self._e = engine

    def __getattr__(self, name):
        return getattr(self._e, name)

    def submit_many(self, reqs):
        out = []
        for r, s in zip(reqs, self._e.submit_many(reqs)):
            m = re.match(r"c(\d+)h(\d+)-", r.request_id)
            out.append(CachedStream(s, int(m[1]), int(m[2])) if m else s)
        return out

    def submit(self, req):
        return self.submit_many([req])[0]

    def load(self, **kw):
        return self._e.load(**kw).replace(**GAUGES)

    def server_info(self):
        return {**self._e.server_info(), "prefix_cache": dict(PREFIX_CACHE_INFO)}


@pytest.fixture(scope="module")
def servers(tokenizer_factory):
    """(device tier only, hierarchical cache on) on one engine."""
    from trnrt.serve import ServeSettings, get_state
    from trnrt.serve.server import stop_in_thread

    engine = make_scripted_engine(tokenizer_factory)
    fake = CachingEngine(engine)
    device = start_server(fake, tokenizer_factory, ServeSettings(served_model_name=MODEL))
    hicache = start_server(fake, tokenizer_factory, ServeSettings(served_model_name=MODEL,
                                                                  enable_hierarchical_cache=True))
    yield device, hicache
    engine.shutdown(0.0)
    for s in (device, hicache):
        get_state(s.app).wait_idle(5.0)
        stop_in_thread(s.srv, s.thread)


def sse(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


PROMPT = "SCRIPT:plain one two three four five six seven eight nine ten"


# --- /generate -----------------------------------------------------------------------------------
def test_generate_meta_info_cached_tokens(servers):
    device, hicache = servers
    b = {"text": PROMPT, "sampling_params": {"max_new_tokens": 3}}
    _, d, _ = device.raw("POST", GEN, {**b, "rid": "c8h2-gen"})
    assert d["meta_info"]["cached_tokens"] == 8 and "cached_tokens_details" not in d["meta_info"]
    _, d, _ = hicache.raw("POST", GEN, {**b, "rid": "c8h2-gen"})
    assert d["meta_info"]["cached_tokens"] == 8
    assert d["meta_info"]["cached_tokens_details"] == {"device": 6, "host": 2}
    _, d, _ = hicache.raw("POST", GEN, b)  # nothing cached
    assert d["meta_info"]["cached_tokens"] == 0 and d["meta_info"]["cached_tokens_details"] == {"device": 0, "host": 0}


def test_generate_stream_and_batch(servers):
    _, hicache = servers
    status, text, _ = hicache.raw("POST", GEN, {"text": PROMPT, "sampling_params": {"max_new_tokens": 3},
                                                "rid": "c4h0-gs", "stream": True})
    chunks = sse(text)
    assert status == 200 and chunks
    for c in chunks:
        assert c["meta_info"]["cached_tokens"] == 4 and c["meta_info"]["cached_tokens_details"] == {"device": 4, "host": 0}
    _, d, _ = hicache.raw("POST", GEN, {"text": [PROMPT, PROMPT], "rid": ["c3h3-b0", "c5h1-b1"],
                                        "sampling_params": {"max_new_tokens": 2}})
    assert [(x["meta_info"]["cached_tokens"], x["meta_info"]["cached_tokens_details"]) for x in d] == [
        (3, {"device": 0, "host": 3}), (5, {"device": 4, "host": 1})]


# --- OpenAI routes ------------------------------------------------------------------------------
def test_openai_usage_cached_tokens(servers):
    device, _ = servers
    _, d, _ = device.raw("POST", COMP, {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "rid": "c8h2-comp"})
    assert d["usage"]["prompt_tokens_details"] == {"cached_tokens": 8}
    _, d, _ = device.raw("POST", COMP, {"model": MODEL, "prompt": [PROMPT, PROMPT], "max_tokens": 3, "rid": "c8h0-n"})
    assert d["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}  # rid_0, rid_1: summed over prompts
    _, d, _ = device.raw("POST", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
                                        "max_tokens": 3, "rid": "c16h4-chat"})
    assert d["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}
    _, d, _ = device.raw("POST", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
                                        "max_tokens": 3})
    assert d["usage"]["prompt_tokens_details"] is None  # nothing cached: SGLang's null


@pytest.mark.parametrize("path", [COMP, CHAT])
def test_openai_stream_usage_cached_tokens(servers, path):
    device, _ = servers
    b = {"model": MODEL, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}, "rid": "c8h2-s"}
    b.update({"prompt": PROMPT} if path == COMP else {"messages": [{"role": "user", "content": PROMPT}]})
    status, text, _ = device.raw("POST", path, b)
    assert status == 200
    usage = sse(text)[-1]["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 8}


# --- /v1/loads, /server_info ----------------------------------------------------------------------
def test_loads_prefix_cache_section(servers):
    device, _ = servers
    _, d, _ = device.raw("GET", "/v1/loads")
    (e,) = d["loads"]
    page = e["prefix_cache"]["page_size"]
    assert page > 0
    assert e["cache_hit_rate"] == 0.4219
    assert e["prefix_cache"] == {
        "page_size": page, "num_cached_pages": 5, "num_evictable_pages": 3, "num_cached_tokens": 5 * page,
        "num_evictable_tokens": 3 * page, "num_used_checkpoints": 2, "num_total_checkpoints": 16,
        "num_host_used_pages": 4, "num_host_total_pages": 64, "num_host_used_checkpoints": 1,
        "num_host_total_checkpoints": 32, "cache_hit_rate": 0.4219}
    _, d, _ = device.raw("GET", "/v1/loads?include=cache")
    assert "prefix_cache" in d["loads"][0] and "memory" not in d["loads"][0]
    for include in ("core", "memory,queues"):
        assert "prefix_cache" not in device.raw("GET", f"/v1/loads?include={include}")[1]["loads"][0]
    status, text, _ = device.raw("GET", "/v1/loads?format=prometheus")
    assert status == 200
    assert 'sglang_prefix_cache_num_cached_pages{dp_rank="0"} 5\n' in text
    assert 'sglang_prefix_cache_num_host_total_pages{dp_rank="0"} 64\n' in text
    assert 'sglang_cache_hit_rate{dp_rank="0"} 0.4219\n' in text


def test_loads_without_a_prefix_cache_has_no_section():
    from trnrt.engine.core.client import EngineLoad
    from trnrt.serve.output.loads import load_entry, select

    entry = load_entry(EngineLoad(page_size=16, num_cached_pages=5).to_dict())
    assert "prefix_cache" not in entry
    assert "prefix_cache" not in select(entry, frozenset({"cache"}))  # asked for, but it does not apply
    entry = load_entry(EngineLoad(page_size=16, prefix_cache=True).to_dict())
    assert entry["prefix_cache"]["num_cached_pages"] == 0 and entry["prefix_cache"]["num_host_total_pages"] == 0


def test_server_info_passes_the_engines_prefix_cache_through(servers):
    device, _ = servers
    _, d, _ = device.raw("GET", "/server_info")
    assert d["prefix_cache"] == PREFIX_CACHE_INFO
    assert d["internal_states"][0]["prefix_cache"] == PREFIX_CACHE_INFO
    assert d["enable_hierarchical_cache"] is False and d["enable_priority_scheduling"] is False
