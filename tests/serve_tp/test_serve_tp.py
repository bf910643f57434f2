"""`trnrt serve --tp-size 2`: the serve suite's OpenAI, /generate and `n` tests against one shared
two-rank server (the tests are tests/serve's, collected here with this directory's `any_server`),
a prefix-cache hit, /server_info and /v1/stats' `parallel` section, and the ranks' agreement on
every sampled token (checked after every step: TRNRT_TP_CHECK_EVERY=1). The server speculates
(MTP, k = 2), serves penalties and structured outputs and schedules by priority
(tp_support.SERVER_FLAGS), so MTP, the variant graphs, aborts and priority preemption are proved
at TP 2 too (issue #31 item 2); a step that raises on every rank fails only its request; the last
test drains the server on SIGTERM. (A rank failing alone, or dying, ends a server: the two-node test
and tests/engine/core/test_tp_launch.py, test_tp_failure.py.)"""

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
    # logprobs: a plain (not speculative) request; speculative ones bypass the prefix cache, as at TP 1
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 1}
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


def _generate(server, text: str, max_new_tokens: int, **top):
    status, d = server.post("/generate", {"text": text, "sampling_params": {
        "temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True, **top.pop("sp", {})}, **top})
    assert status == 200, d
    return d


def _engine(server) -> dict:
    (engine,) = server.stats()["engines"]
    return engine


def test_mtp_speculation_gives_plain_greedy_tokens(any_server):
    """Speculative (MTP drafts verified at TP 2) greedy output equals the same request's plain
    steps (logprobs make a request plain), and only the speculative one verified drafts."""
    text = "A short note on the migration of arctic terns"
    spec0 = _engine(any_server)["speculative"]
    fast = _generate(any_server, text, 24)
    spec1 = _engine(any_server)["speculative"]
    plain = _generate(any_server, text, 24, return_logprob=True)
    spec2 = _engine(any_server)["speculative"]
    assert spec0["enabled"] and spec0["num_steps"] == 2, spec0
    assert fast["output_ids"] == plain["output_ids"] and len(fast["output_ids"]) == 24
    assert spec1["num_verifies"] > spec0["num_verifies"] and spec1["num_draft_tokens"] > spec0["num_draft_tokens"]
    assert spec2["num_verifies"] == spec1["num_verifies"], (spec1, spec2)  # the logprobs request ran plain
    assert _engine(any_server)["parallel"]["agreement"]["mismatches"] == 0


def test_variant_graphs_at_tp2(any_server, tokenizer):
    """Penalties (logit_bias, frequency_penalty) and a json_schema grammar run their variant
    graphs on both ranks: the bias forces its token, negative penalties make the greedy answer
    repeat itself, the schema's answer parses and matches; the ranks agree on every token."""
    import json

    text = "Once upon a time"
    base = _generate(any_server, text, 16)["output_ids"]
    forced = tokenizer.encode(" fox", add_special_tokens=False)[-1]
    biased = _generate(any_server, text, 6, sp={"logit_bias": {str(forced): 100.0}})["output_ids"]
    assert biased == [forced] * 6, (biased, forced)
    # negative penalties reward the tokens already generated: the greedy answer starts repeating
    penalized = _generate(any_server, text, 16, sp={"frequency_penalty": -2.0, "presence_penalty": -2.0})["output_ids"]
    assert len(penalized) == 16 and len(set(penalized)) < len(set(base)), (base, penalized)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    status, d = any_server.post("/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Answer in JSON."}], "max_tokens": 64,
        "temperature": 0, "chat_template_kwargs": {"enable_thinking": False},
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}})
    assert status == 200, d
    assert d["choices"][0]["finish_reason"] == "stop", d
    got = json.loads(d["choices"][0]["message"]["content"])
    assert set(got) == {"ok"} and isinstance(got["ok"], bool), got
    assert _engine(any_server)["parallel"]["agreement"]["mismatches"] == 0


def test_prompt_logprobs_at_tp2(any_server):
    """An echo with logprobs runs the prompt-logprobs prefill graph on both ranks: its first
    sampled token comes from the last hidden state through the (vocab-parallel) head, so it must
    equal the plain prefill's, and the ranks agree on it (a rank-local head would sample an id of
    its own vocabulary slice: the two-node README run found that)."""
    prompt = "The capital of France is"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 1}
    status, echoed = any_server.post("/v1/completions", {**body, "echo": True})
    assert status == 200, echoed
    status, plain = any_server.post("/v1/completions", body)
    assert status == 200, plain
    lp = echoed["choices"][0]["logprobs"]
    n_prompt = echoed["usage"]["prompt_tokens"]
    assert echoed["choices"][0]["text"].startswith(prompt) and len(lp["token_logprobs"]) == n_prompt + 4, echoed
    assert lp["token_logprobs"][0] is None and all(isinstance(x, float) for x in lp["token_logprobs"][1:]), lp
    assert lp["tokens"][n_prompt:] == plain["choices"][0]["logprobs"]["tokens"], (echoed, plain)
    assert _engine(any_server)["parallel"]["agreement"]["mismatches"] == 0


def test_abort_and_disconnect_leave_every_rank_idle(any_server):
    """A streaming /generate aborted by rid (/abort_request) and one whose client hangs up, both
    speculative, mid-stream: both end, the engine is idle (no page or slot held), every rank's
    drafter forgot them (the release reached the workers), and greedy answers as before."""
    import json

    from serve_support import assert_idle, counters
    from test_concurrency import RawStream

    text = "The lighthouse keeper wrote in his log that night"
    ref = _generate(any_server, text, 12)["output_ids"]
    aborts0 = counters(any_server)["aborts"]

    def body(rid):
        return json.dumps({"text": text, "rid": rid, "stream": True,
                           "sampling_params": {"temperature": 0, "max_new_tokens": 600, "ignore_eos": True}}).encode()

    cut = RawStream(any_server.port, body("tp-abort-me"), path="/generate")
    assert len(cut.events(2)) == 2
    status, _, _ = any_server.raw("POST", "/abort_request", {"rid": "tp-abort-me"})
    assert status == 200
    rest = cut.events()
    cut.hang_up()
    assert rest and rest[-1] == "[DONE]", rest[-3:]
    assert rest[-2]["meta_info"]["finish_reason"]["type"] == "abort", rest[-2]["meta_info"]
    assert len(rest[-2]["output_ids"]) < 600

    gone = RawStream(any_server.port, body("tp-hang-up"), path="/generate")
    assert len(gone.events(2)) == 2
    gone.hang_up()
    assert_idle(any_server, timeout_s=15)
    assert counters(any_server)["aborts"] == aborts0 + 2
    assert _generate(any_server, text, 12)["output_ids"] == ref  # the same greedy answer
    _generate(any_server, text, 2, return_logprob=True)  # a plain request: its steps re-check every rank
    par = _engine(any_server)["parallel"]
    assert [r["spec_requests"] for r in par["ranks"]] == [0, 0], par["ranks"]
    assert par["agreement"]["mismatches"] == 0


def test_priority_preemption_keeps_greedy_outputs(any_server):
    """MAX_RUNNING greedy requests of priority 0 run; one of priority 20 arrives and preempts one
    of them (by recompute: pages and slot freed, re-prefilled later). Every output equals the
    request's unpreempted greedy answer, and /v1/stats counted the preemption."""
    import threading
    import time

    from serve_support import assert_idle, counters, live
    from tp_support import MAX_RUNNING

    low_text, high_text = "Notes on the tides of the northern sea", "An urgent message"
    low_ref = _generate(any_server, low_text, 40)["output_ids"]
    high_ref = _generate(any_server, high_text, 8)["output_ids"]
    pre0 = counters(any_server)["preemptions"]
    outs, errors = {}, []

    def low(i):
        try:
            outs[i] = _generate(any_server, low_text, 40, priority=0)["output_ids"]
        except Exception as e:  # reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=low, args=(i,)) for i in range(MAX_RUNNING)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while live(any_server)["running"] < MAX_RUNNING and time.monotonic() < deadline:
        time.sleep(0.02)
    assert live(any_server)["running"] == MAX_RUNNING, live(any_server)
    high = _generate(any_server, high_text, 8, priority=20)["output_ids"]
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert counters(any_server)["preemptions"] > pre0
    assert high == high_ref
    assert [outs.get(i) for i in range(MAX_RUNNING)] == [low_ref] * MAX_RUNNING
    assert_idle(any_server)
    assert _engine(any_server)["parallel"]["agreement"]["mismatches"] == 0


def test_a_failure_every_rank_shares_fails_only_its_request(any_server):
    """A step that raises on every rank before any collective (the injected fault for
    SHARED_FAULT_SEED, on ranks 0 and 1: as a bad input would): its request fails, the server and
    both ranks go on, and they still agree."""
    from tp_support import SHARED_FAULT_SEED

    status, d = any_server.post("/v1/completions", {"model": MODEL, "prompt": "A shared fault", "max_tokens": 4,
                                                    "temperature": 1.0, "seed": SHARED_FAULT_SEED})
    assert status == 500 and "InjectedFault: injected test fault on rank 0" in d["error"]["message"], (status, d)
    status, d = any_server.post("/v1/completions", {"model": MODEL, "prompt": "And then", "max_tokens": 4,
                                                    "temperature": 1.0, "seed": 11})
    assert status == 200 and d["usage"]["completion_tokens"] == 4, d
    assert_idle(any_server)
    par = _engine(any_server)["parallel"]
    r0, r1 = par["ranks"]
    assert par["agreement"]["mismatches"] == 0 and r0["steps"] == r1["steps"] and r0["digest"] == r1["digest"], par


def test_drain_on_sigterm_finishes_the_stream_and_stops_every_rank(tp_server, any_server):
    """Last in the module (it ends the shared server): SIGTERM while a speculative stream is in
    flight, as at TP 1 (tests/serve/test_cli.py): a new request gets 503 service_unavailable at
    once, the stream finishes with every token it asked for, the server exits 0, the ranks'
    agreement was checked at close and agreed (its log line), and no rank or engine process is left."""
    import json
    import signal
    import time

    from test_cli import _children
    from test_concurrency import RawStream
    from tp_support import pid_alive

    max_tokens = 40
    (worker,) = tp_server.rank_pids().values()
    kids = _children(tp_server.proc.pid)  # the engine process (rank 0) and multiprocessing's helpers
    stream = RawStream(any_server.port, json.dumps({
        "model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0, "stream": True,
        "ignore_eos": True, "stream_options": {"include_usage": True}}).encode(), path="/v1/completions")
    first = stream.events(1)
    assert first and first[0]["choices"][0]["text"] is not None, first
    tp_server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    status, late, _ = any_server.raw("POST", "/v1/completions", {"model": MODEL, "prompt": "late", "max_tokens": 2},
                                     timeout=10)
    assert status == 503 and late["error"]["type"] == "service_unavailable", (status, late)
    rest = stream.events()
    assert rest and rest[-1] == "[DONE]", rest[-3:]
    usage = [e["usage"] for e in rest[:-1] if e.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == max_tokens, rest[-3:]
    assert any(c["finish_reason"] == "length" for e in rest[:-1] for c in e["choices"]), rest[-3:]
    assert tp_server.wait(30) == 0, tp_server.output()[-3000:]
    log = tp_server.output()
    closing = re.search(r"tensor-parallel ranks at close: agree after (\d+) steps .*; (\d+) checks, 0 mismatches\)",
                        log)
    assert closing and "DISAGREE" not in log, log[-3000:]
    steps, checks = map(int, closing.groups())
    assert steps >= max_tokens // 3 and checks == steps + 1, closing.group(0)  # each step's check, and the close's
    assert "rank 1: stopped by rank 0" in log, log[-3000:]
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in (worker, *kids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in (worker, *kids) if pid_alive(p)], "a rank or engine process outlived the server"
