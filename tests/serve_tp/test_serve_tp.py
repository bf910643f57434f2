"""`trnrt serve --tp-size 2`: the serve suite's OpenAI, /generate and `n` tests against one shared
two-rank server (the tests are tests/serve's, collected here with this directory's `any_server`),
a prefix-cache hit, /server_info and /v1/stats' `parallel` section, and the ranks' agreement on
every sampled token (checked after every step: TRNRT_TP_CHECK_EVERY=1)."""

from __future__ import annotations

import re

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
    status, d = any_server.post("/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 6,
                                                    "temperature": 0.9, "seed": 3, "ignore_eos": True})
    assert status == 200, d
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
    assert ag["checks"] >= 6 and ag["mismatches"] == 0, ag
    r0, r1 = par["ranks"]
    assert r1["steps"] == r0["steps"] == par["steps"] >= 6 and r1["digest"] == r0["digest"], par  # checked after the last step
    # the steps' collectives, timed on rank 0, and every rank's weights / state (rank 1's from its last check)
    assert par["collective_calls_per_step"] > 0 and 0 < par["collective_s_total"] and 0 < par["collective_share"] < 1 \
        and all(r["weight_bytes"] > 0 and r["state_bytes"] > 0 for r in par["ranks"]), par
    metrics = any_server.raw("GET", "/metrics")[1]
    assert re.search(r'^trnrt_tp_size\{[^}]*\} 2\.0$', metrics, re.M) and \
        re.search(r'^trnrt_tp_rank_memory_bytes\{(?=[^}]*rank="1")(?=[^}]*kind="weights")[^}]*\} [1-9]', metrics, re.M), metrics


def test_killing_a_rank_ends_the_server(tp_server, any_server):
    """Last in the module (it ends the shared server): SIGKILL worker rank 1 while a request
    streams; the request ends, nothing answers 200 afterwards, the server exits with code 3
    within 10 s and its log names the rank."""
    import http.client
    import json
    import os
    import signal
    import threading
    import time

    (pid,) = tp_server.rank_pids().values()
    ended = threading.Event()

    def stream():  # a long request in flight when the rank dies
        try:
            any_server.sse_events("/v1/completions", {"model": MODEL, "prompt": "Once", "max_tokens": 900,
                                                     "stream": True, "ignore_eos": True}, timeout=30)
        except Exception:
            pass
        ended.set()

    threading.Thread(target=stream, daemon=True).start()
    time.sleep(1.0)
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    statuses = []
    while tp_server.proc.poll() is None and time.monotonic() - t0 < 15:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", any_server.port, timeout=2)
            conn.request("POST", "/v1/completions", body=json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}),
                         headers={"Content-Type": "application/json"})
            statuses.append((time.monotonic() - t0, conn.getresponse().status))
            conn.close()
        except OSError:
            pass
        time.sleep(0.05)
    code = tp_server.wait(15)
    elapsed = time.monotonic() - t0
    assert code == 3, tp_server.output()[-3000:]
    assert elapsed < 10, elapsed
    assert ended.wait(5), "the streaming request did not end"
    late = [s for t, s in statuses if t > 0.5]  # past the watchdog's poll: the engine is gone
    assert late and all(s == 503 for s in late), statuses
    assert f"tensor-parallel rank 1 (pid {pid}) exited with code -9" in tp_server.output(), tp_server.output()[-4000:]
