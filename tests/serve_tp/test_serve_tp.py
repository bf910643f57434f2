"""`trnrt serve --tp-size 2`: the serve suite's OpenAI, /generate and `n` tests against one shared
two-rank server (the tests are tests/serve's, collected here with this directory's `any_server`),
a prefix-cache hit, /server_info and /v1/stats' `parallel` section, and the ranks' agreement on
every sampled token (checked after every step: TRNRT_TP_CHECK_EVERY=1)."""

from __future__ import annotations

from test_generate import (  # noqa: F401
    test_cumulative_stream_reassembles_to_the_answer,
    test_greedy_generate_equals_completions,
    test_single_shape,
)
from test_n_choices import test_completions_n_with_two_prompts, test_streamed_n_carries_indices_with_the_official_client  # noqa: F401
from test_openai_api import (  # noqa: F401
    test_chat_logprobs_shape,
    test_chat_non_stream_shape,
    test_chat_stream_shape,
    test_completion_shapes,
    test_concurrent_streams_then_idle,
    test_health_and_stats,
    test_models,
)

from serve_support import assert_idle

MODEL = "trnrt-tiny"


def test_chat_n_choices(any_server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story about a red fox " * 6}],
            "max_tokens": 8, "temperature": 1.0, "seed": 7}
    status, d = any_server.post("/v1/chat/completions", {**body, "n": 4})
    assert status == 200, d
    assert [c["index"] for c in d["choices"]] == list(range(4))
    _, single = any_server.post("/v1/chat/completions", body)
    assert d["usage"]["prompt_tokens"] == single["usage"]["prompt_tokens"]  # the prompt counted once
    assert d["choices"][0]["message"] == single["choices"][0]["message"]  # choice 0 is the n=1 answer
    assert len({c["message"]["content"] + (c["message"].get("reasoning_content") or "") for c in d["choices"]}) == 4
    assert_idle(any_server)


def test_prefix_cache_hit(any_server):
    prompt = "The history of the red fox in the northern forests is long and " * 12
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    status, first = any_server.post("/v1/completions", body)
    assert status == 200, first
    status, again = any_server.post("/v1/completions", body)
    assert status == 200, again
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, again["usage"]
    assert again["choices"][0]["text"] == first["choices"][0]["text"]  # the resumed state gives the same tokens


def test_server_info_and_parallel_stats(any_server):
    status, info, _ = any_server.raw("GET", "/server_info")
    assert status == 200
    assert (info["tp_size"], info["ep_size"], info["dp_size"]) == (2, 1, 1)
    (engine,) = any_server.stats()["engines"]
    par = engine["parallel"]
    assert (par["tp_size"], par["ep_size"]) == (2, 1)
    assert [r["rank"] for r in par["ranks"]] == [0, 1]
    assert all(r["rss_bytes"] > 0 for r in par["ranks"])
    # every rank sampled the same tokens at every step so far (checked after each step)
    ag = par["agreement"]
    assert ag["checks"] >= 10 and ag["mismatches"] == 0, ag
    assert par["ranks"][1]["digest"] == par["ranks"][0]["digest"] or par["ranks"][1]["steps"] < par["steps"]
