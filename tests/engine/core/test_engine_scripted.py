"""The real Engine with the scripted runner (no model, no torch): typed inbox messages, duplicate
request ids, abort by prefix / all, flush_cache, load(), server_info(), and the scripted runner's
replay under chunked prefill and preemption.

Every test ends with `assert_clean`: nothing queued or running, every page and slot free, the
scheduler's books balanced, and the runner holding no per-request record.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from trnrt.engine.core.client import (
    ABORT_WAITING_MESSAGE,
    FLUSH_BUSY_MESSAGE,
    FLUSH_IN_PROGRESS_MESSAGE,
    FLUSH_OK_MESSAGE,
    FLUSH_TIMEOUT_MESSAGE,
    EngineClient,
    EngineLoad,
    FlushResult,
)
from trnrt.engine.core.messages import AbortMatchingMsg, AbortMsg, FlushCacheMsg, LoadQueryMsg, Reply, SubmitMsg
from trnrt.engine.request import FinishReason, GenerateRequest, InvalidRequestError, SamplingParams

TIMEOUT_S = 20.0
LONG_TEXT = " ".join(f"word{i}" for i in range(300))


# -- fixtures and helpers ------------------------------------------------------------------------


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def long_script(tok):
    """Every prompt gets the same long answer (300 words, far more than any max_new_tokens here)."""
    out = enc(tok, LONG_TEXT)
    return lambda prompt: list(out)


def make_engine(tok, eos, script=None, **kw):
    from trnrt.engine.core.engine import Engine

    kw.setdefault("max_model_len", 1024)
    return Engine.scripted(tok, script or long_script(tok), eos_token_ids=(eos,), **kw)


@pytest.fixture
def engines(tok, eos):
    """make(**kw) -> a scripted Engine, shut down after the test."""
    made = []

    def make(script=None, **kw):
        e = make_engine(tok, eos, script, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.runner.paused.clear()
        e.shutdown(0.0)


def req(ids, rid=None, stream=True, **params) -> GenerateRequest:
    params.setdefault("ignore_eos", True)
    kw = {} if rid is None else {"request_id": rid}
    return GenerateRequest(prompt_token_ids=list(ids), sampling_params=SamplingParams(**params), stream=stream, **kw)


def collect(stream, timeout: float = TIMEOUT_S):
    """(output ids, text, outputs) of a stream up to its finished output."""
    outs = []
    deadline = time.monotonic() + timeout
    while not outs or not outs[-1].finished:
        o = stream.get(timeout=max(0.0, deadline - time.monotonic()))
        assert o is not None, f"{stream.request_id} stalled"
        outs.append(o)
    return [t for o in outs for t in o.new_token_ids], "".join(o.new_text for o in outs), outs


def wait_for(pred, what: str, timeout: float = TIMEOUT_S):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def assert_clean(engine) -> None:
    wait_for(engine.is_idle, "the engine to be idle")
    wait_for(lambda: engine.load().num_running_reqs == 0 and engine.load().num_used_pages == 0, "idle load")
    assert engine.thread.is_alive()
    assert engine.cache.num_used_blocks == 0 and engine.cache.num_used_slots == 0
    assert not engine.scheduler.has_unfinished_requests()
    engine.scheduler.check_integrity()
    assert engine._streams == {} and engine._detoks == {}
    assert engine.runner.num_records == 0, "the scripted runner kept records of finished requests"


# -- typed messages ------------------------------------------------------------------------------


def test_reply_claim_cancel_and_first_answer_wins():
    r = Reply()
    assert not r.done and r.claim() and not r.cancel()  # claimed: too late to withdraw
    assert r.set([1]) and not r.set([2]) and r.value == [1] and r.wait(0) and r.done
    r = Reply()
    assert r.cancel() and r.cancelled and not r.claim() and not r.set(3) and r.value is None and r.wait(0)
    r = Reply()
    assert not r.wait(0.01)
    threading.Timer(0.02, r.set, args=("late",)).start()
    assert r.wait(TIMEOUT_S) and r.value == "late"


def test_abort_matching_by_prefix_or_all():
    assert AbortMatchingMsg(prefix="job-").matches("job-1") and not AbortMatchingMsg(prefix="job-").matches("jo")
    assert not AbortMatchingMsg(prefix="").matches("anything")  # an empty prefix matches nothing...
    assert AbortMatchingMsg(abort_all=True).matches("anything")  # ...unless abort_all


def test_inbox_carries_typed_messages_only(tok, eos, engines):
    engine = engines()
    seen = []
    handle = engine._handle

    def spy(msg):
        seen.append(type(msg))
        handle(msg)

    engine._handle = spy  # the engine thread looks the method up per message
    collect(engine.submit(req(enc(tok, "hi"), max_new_tokens=2)))
    engine.abort("nobody")
    engine.abort_requests("nobody-")
    engine.flush_cache()
    engine.load(fresh=True)
    wait_for(lambda: len(seen) >= 5, "the messages")
    assert seen[:5] == [SubmitMsg, AbortMsg, AbortMatchingMsg, FlushCacheMsg, LoadQueryMsg]
    assert_clean(engine)


def test_pure_modules_and_the_scripted_engine_import_no_torch():
    code = ("import sys; import trnrt.engine.core.messages, trnrt.engine.runner.scripted_runner, trnrt.engine.core.engine, "
            "trnrt.engine.core.client; assert 'torch' not in sys.modules, 'torch'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_engine_satisfies_the_client_protocol(engines):
    assert isinstance(engines(), EngineClient)


def test_finish_reason_status_code_only_when_set():
    assert FinishReason("abort", message="x").to_dict() == {"type": "abort", "message": "x"}
    assert FinishReason("abort", message="x", status_code=503).to_dict() == {
        "type": "abort", "message": "x", "status_code": 503}
    assert FinishReason("stop", matched=7).to_dict() == {"type": "stop", "matched": 7}


# -- scripted replay -----------------------------------------------------------------------------


def test_script_replays_and_stops_on_eos_when_exhausted(tok, eos, engines):
    answer = enc(tok, "Hello world! How are you?")
    seen_prompts = []

    def script(prompt):
        seen_prompts.append(list(prompt))
        return answer

    engine = engines(script)
    prompt = enc(tok, "Say hello")
    ids, text, outs = collect(engine.submit(req(prompt, max_new_tokens=100, ignore_eos=False)))
    # the script's tokens, then the runner's EOS (exhausted script): a "stop" on the EOS id
    assert ids == answer + [eos] and text == "Hello world! How are you?"
    assert outs[-1].finish_reason == FinishReason("stop", matched=eos)
    assert outs[-1].num_output_tokens == len(answer) + 1 and outs[-1].num_prompt_tokens == len(prompt)
    assert seen_prompts == [prompt]
    # max_new_tokens still wins; ignore_eos keeps going with EOS (as a model that only says EOS)
    ids, _, outs = collect(engine.submit(req(prompt, max_new_tokens=3)))
    assert ids == answer[:3] and outs[-1].finish_reason.type == "length"
    ids, _, outs = collect(engine.submit(req(prompt, max_new_tokens=len(answer) + 3, ignore_eos=True)))
    assert ids == answer + [eos] * 3 and outs[-1].finish_reason.type == "length"
    assert engine.submitted[-1].sampling_params.max_new_tokens == len(answer) + 3
    assert_clean(engine)


def test_chunked_prefill_feeds_the_whole_prompt_to_the_script(tok, eos, engines):
    seen = {}
    answer = enc(tok, "fine thanks")

    def script(prompt):
        seen[len(prompt)] = list(prompt)
        return answer

    engine = engines(script)
    prompts = [enc(tok, LONG_TEXT)[:150 + i] for i in range(3)]  # > 64: chunked in several steps
    assert engine.scheduler_config.max_prefill_tokens < 150
    rows_seen = []
    inner = engine.runner.execute
    engine.runner.execute = lambda rows: (rows_seen.append([(r.request_id, len(r.token_ids), r.do_sample)
                                                            for r in rows]), inner(rows))[1]
    streams = engine.submit_many([req(p, max_new_tokens=len(answer) + 5, ignore_eos=False) for p in prompts])
    for s in streams:
        ids, text, _ = collect(s)
        assert ids == answer + [eos] and text == "fine thanks"
    assert sorted(seen) == [150, 151, 152] and all(seen[len(p)] == p for p in prompts)
    partial = [row for step in rows_seen for row in step if not row[2]]
    assert partial, "no partial prefill chunk ran: the test does not test chunking"
    del engine.runner.execute
    assert_clean(engine)


def test_preempted_requests_resume_with_their_first_prompt(tok, eos, engines):
    calls = []

    def script(prompt):
        calls.append(len(prompt))
        # a different answer per request, long enough for max_new_tokens
        return enc(tok, " ".join(f"p{len(prompt)}x{i}" for i in range(60)))

    # 6 usable pages of 16 tokens; three requests of 20 + 40 tokens need 4 pages each
    engine = engines(script, max_model_len=64, max_running_requests=3, num_blocks=7)
    prompts = [enc(tok, LONG_TEXT)[: 18 + i] for i in range(3)]
    streams = engine.submit_many([req(p, max_new_tokens=64 - len(p) - 2) for p in prompts])
    results = [collect(s) for s in streams]
    assert engine.scheduler.num_preemptions_total > 0, "no preemption: the test does not test resumption"
    for p, (ids, _, outs) in zip(prompts, results):
        n = 64 - len(p) - 2
        assert outs[-1].finish_reason.type == "length" and len(ids) == n
        assert ids == enc(tok, " ".join(f"p{len(p)}x{i}" for i in range(60)))[:n]
    assert sorted(calls) == sorted(len(p) for p in prompts)  # once per request, not per resume
    assert_clean(engine)


def test_a_failing_script_fails_its_request_only(tok, eos, engines):
    good = enc(tok, "ok")

    def script(prompt):
        if prompt == enc(tok, "fail please"):
            raise RuntimeError("scripted failure")
        return good

    engine = engines(script)
    bad, fine = engine.submit_many([req(enc(tok, "fail please"), max_new_tokens=4),
                                    req(enc(tok, "be fine"), max_new_tokens=4, ignore_eos=False)])
    _, _, outs = collect(bad)
    assert outs[-1].error and "scripted failure" in outs[-1].error and outs[-1].finish_reason.type == "abort"
    ids, _, outs = collect(fine)
    assert ids == good + [eos] and outs[-1].error is None
    assert engine.stats()["counters"]["errors"] == 1
    assert_clean(engine)


def test_fake_logprobs_rank_the_chosen_token_first(tok, eos, engines):
    engine = engines()
    _, _, outs = collect(engine.submit(req(enc(tok, "x"), max_new_tokens=4, logprobs=3)))
    lps = [lp for o in outs for lp in (o.new_logprobs or [])]
    assert len(lps) == 4
    for lp in lps:
        assert len(lp.top) == 3 and lp.top[0] == (lp.token_id, lp.logprob) and lp.logprob < 0
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
    _, _, outs = collect(engine.submit(req(enc(tok, "x"), max_new_tokens=2, logprobs=0)))
    assert all(lp.top == [] for o in outs for lp in o.new_logprobs)
    assert_clean(engine)


def test_runner_records_are_released_as_requests_finish(tok, eos, engines):
    engine = engines()
    peak = []
    inner = engine.runner.execute
    engine.runner.execute = lambda rows: (peak.append(engine.runner.num_records), inner(rows))[1]
    for round_ in range(3):
        streams = engine.submit_many([req(enc(tok, f"round {round_} request {i}"), max_new_tokens=3)
                                      for i in range(8)])
        for s in streams:
            collect(s)
        assert engine.runner.num_records == 0
    assert max(peak) == 8  # held only while live: never the 24 requests seen in total
    del engine.runner.execute
    assert_clean(engine)


def test_a_finished_output_comes_after_the_live_stats_drop_its_request(tok, eos, engines):
    """A client that reads a finish (length, stop string or abort) and then the stats sees the
    request gone and its pages free: the finish is delivered after the live stats are published.
    A slow `set_live` widens the window a finish delivered first would show."""
    engine = engines()
    inner = engine.stats_collector.set_live

    def slow_set_live(**kw):
        time.sleep(0.05)
        inner(**kw)

    engine.stats_collector.set_live = slow_set_live
    stop_text = LONG_TEXT.split()[3]
    cases = [dict(max_new_tokens=3), dict(max_new_tokens=40, stop=[stop_text])]
    for params in cases:
        (s,) = engine.submit_many([req(enc(tok, "finish then stats"), **params)])
        _, _, outs = collect(s)
        assert outs[-1].finish_reason.type in ("length", "stop"), outs[-1]
        live = engine.stats()["live"]
        assert live["running"] == 0 and live["pages_used"] == 0, (params, live)
    held = engine.submit_many([req(enc(tok, "aborted then stats"), max_new_tokens=1000)])[0]
    wait_for(lambda: engine.stats()["live"]["running"] == 1, "the request to run")
    engine.abort(held.request_id)
    _, _, outs = collect(held)
    assert outs[-1].finish_reason.type == "abort"
    assert engine.stats()["live"]["running"] == 0
    del engine.stats_collector.set_live
    assert_clean(engine)


# -- duplicate request ids -------------------------------------------------------------------------


def test_duplicate_request_id_is_refused_until_the_first_finished(tok, eos, engines):
    engine = engines(step_delay_s=0.005)
    prompt = enc(tok, "hello")
    first = engine.submit(req(prompt, rid="same", max_new_tokens=20))
    with pytest.raises(InvalidRequestError) as e:
        engine.submit(req(prompt, rid="same", max_new_tokens=2))
    assert str(e.value) == "Duplicate request ID detected: same" and e.value.field == "rid"
    ids, _, _ = collect(first)
    assert len(ids) == 20  # the refused duplicate did not touch the first one
    # finished: the id is free again, at once
    ids, _, outs = collect(engine.submit(req(prompt, rid="same", max_new_tokens=2)))
    assert len(ids) == 2 and outs[-1].finish_reason.type == "length"
    assert_clean(engine)


def test_duplicate_inside_a_batch_queues_nothing(tok, eos, engines):
    engine = engines()
    prompt = enc(tok, "hello")
    with pytest.raises(InvalidRequestError, match="Duplicate request ID detected: b"):
        engine.submit_many([req(prompt, rid="a"), req(prompt, rid="b"), req(prompt, rid="b")])
    assert engine.is_idle() and engine.submitted is not None and len(engine.submitted) == 0
    # none of them was taken: all three ids are free
    for s in engine.submit_many([req(prompt, rid=r, max_new_tokens=1) for r in "abc"]):
        collect(s)
    assert_clean(engine)


def test_ids_of_aborted_and_zero_token_requests_are_freed(tok, eos, engines):
    engine = engines(step_delay_s=0.005)
    prompt = enc(tok, "hello")
    s = engine.submit(req(prompt, rid="r", max_new_tokens=500))
    s.get(timeout=TIMEOUT_S)
    engine.abort("r")
    _, _, outs = collect(s)
    assert outs[-1].finish_reason.type == "abort"
    _, _, outs = collect(engine.submit(req(prompt, rid="r", max_new_tokens=0)))
    assert outs[-1].finish_reason.type == "length"
    collect(engine.submit(req(prompt, rid="r", max_new_tokens=1)))
    assert_clean(engine)


# -- abort_requests ------------------------------------------------------------------------------


def test_abort_requests_by_prefix_aborts_exactly_the_matching_ones(tok, eos, engines):
    engine = engines(step_delay_s=0.01, max_running_requests=3)
    script = enc(tok, LONG_TEXT)
    prompt = enc(tok, "tell me everything")
    specs = [("keep-1", True), ("job-1", True), ("job-2", False), ("job-3", True), ("keep-2", True)]
    streams = {rid: engine.submit(req(prompt, rid=rid, stream=stream, max_new_tokens=60 if rid.startswith("keep")
                                      else 500))
               for rid, stream in specs}  # 3 run (max_running_requests), job-3 and keep-2 wait
    early = {rid: [] for rid in streams}
    for rid in ("keep-1", "job-1"):  # running and streamed: tokens already delivered
        while not any(o.new_token_ids for o in early[rid]):
            early[rid].append(streams[rid].get(timeout=TIMEOUT_S))
    wait_for(lambda: engine.load().num_running_reqs == 3 and engine.load().num_waiting_reqs == 2, "3 running, 2 queued")
    aborted = engine.abort_requests("job-", message="stop them")
    assert sorted(aborted) == ["job-1", "job-2", "job-3"]
    results = {}
    for rid, s in streams.items():
        ids, text, outs = collect(s)
        results[rid] = (early[rid] + outs, ids, text)
    for rid in ("job-1", "job-2"):  # were running: the caller's message
        outs = results[rid][0]
        assert outs[-1].finish_reason == FinishReason("abort", message="stop them"), outs[-1]
        assert outs[-1].error is None
    outs = results["job-3"][0]  # was queued: SGLang's message, nothing generated
    assert outs[-1].finish_reason == FinishReason("abort", message=ABORT_WAITING_MESSAGE)
    assert [t for o in outs for t in o.new_token_ids] == [] and outs[-1].num_output_tokens == 0
    # what was sent stays sent: job-1's tokens are the script's prefix
    outs = results["job-1"][0]
    job1 = [t for o in outs for t in o.new_token_ids]
    assert job1 and job1 == script[: len(job1)] and outs[-1].num_output_tokens == len(job1)
    # the non-streamed one gets its text so far with the abort
    outs = results["job-2"][0]
    assert len(outs) == 1 and outs[0].num_output_tokens > 0
    assert outs[0].new_text == tok.decode(script[: outs[0].num_output_tokens], skip_special_tokens=True)
    for rid in ("keep-1", "keep-2"):  # not matched: finish normally
        outs = results[rid][0]
        assert outs[-1].finish_reason.type == "length" and outs[-1].num_output_tokens == 60
    assert engine.stats()["counters"]["aborts"] == 3
    assert_clean(engine)


def test_abort_all_and_empty_prefix(tok, eos, engines):
    engine = engines(step_delay_s=0.01, max_running_requests=2)
    prompt = enc(tok, "go")
    streams = [engine.submit(req(prompt, rid=f"r{i}", max_new_tokens=500)) for i in range(4)]
    wait_for(lambda: engine.load().num_running_reqs == 2, "two running")
    assert engine.abort_requests("") == []  # an empty prefix without abort_all: nothing
    assert engine.load(fresh=True).num_running_reqs == 2
    assert sorted(engine.abort_requests(abort_all=True)) == ["r0", "r1", "r2", "r3"]
    reasons = [collect(s)[2][-1].finish_reason for s in streams]
    assert all(r.type == "abort" and r.status_code is None for r in reasons)
    assert sorted(r.message for r in reasons) == sorted(["Aborted", "Aborted", ABORT_WAITING_MESSAGE,
                                                         ABORT_WAITING_MESSAGE])
    assert engine.abort_requests(abort_all=True) == []  # nothing left
    assert_clean(engine)


def test_abort_requests_that_time_out_abort_nothing(tok, eos, engines):
    engine = engines()
    engine.runner.paused.set()
    s = engine.submit(req(enc(tok, "held"), rid="held-1", max_new_tokens=3))
    assert engine.runner.paused.holding.wait(TIMEOUT_S)  # the engine thread is inside a step
    t0 = time.monotonic()
    assert engine.abort_requests("held-", timeout_s=0.2) == []
    assert time.monotonic() - t0 < 2.0
    engine.runner.paused.clear()
    ids, _, outs = collect(s)
    assert outs[-1].finish_reason.type == "length" and len(ids) == 3  # the withdrawn abort did nothing
    assert_clean(engine)


def test_shutdown_aborts_with_status_503(tok, eos):
    engine = make_engine(tok, eos, step_delay_s=0.01, max_running_requests=1)
    streams = [engine.submit(req(enc(tok, "go"), max_new_tokens=500)) for _ in range(2)]
    streams[0].get(timeout=TIMEOUT_S)
    engine.shutdown(0.0)
    assert not engine.thread.is_alive()
    for s in streams:
        r = collect(s)[2][-1].finish_reason
        assert r == FinishReason("abort", message="server shutting down", status_code=503)
    assert engine.cache.num_used_blocks == 0 and engine.runner.num_records == 0 and engine.is_idle()


# -- flush_cache -----------------------------------------------------------------------------------


def test_flush_cache_refused_while_busy_and_done_when_idle(tok, eos, engines):
    engine = engines(step_delay_s=0.01)
    assert engine.flush_cache() == FlushResult(True, FLUSH_OK_MESSAGE)
    s = engine.submit(req(enc(tok, "busy"), max_new_tokens=500))
    s.get(timeout=TIMEOUT_S)
    t0 = time.monotonic()
    assert engine.flush_cache() == FlushResult(False, FLUSH_BUSY_MESSAGE) == FlushResult(False, "Flush cache failed.\n")
    assert time.monotonic() - t0 < 1.0
    engine.abort_requests(abort_all=True)
    collect(s)
    assert_clean(engine)
    r = engine.flush_cache()
    assert r.ok and r.message.startswith("Cache flushed.\n")
    # the allocator starts over: the next request gets block 1 and slot 1 again
    got = []
    inner = engine.runner.execute
    engine.runner.execute = lambda rows: (got.append((rows[0].block_ids[0], rows[0].slot_id)), inner(rows))[1]
    collect(engine.submit(req(enc(tok, "again"), max_new_tokens=1)))
    del engine.runner.execute
    assert got[0] == (1, 1)
    assert_clean(engine)


def test_deferred_flush_waits_for_the_work_to_finish(tok, eos, engines):
    engine = engines(step_delay_s=0.01)
    s = engine.submit(req(enc(tok, "short job"), max_new_tokens=30))
    first = s.get(timeout=TIMEOUT_S)
    t0 = time.monotonic()
    result = engine.flush_cache(timeout_s=10.0)
    assert result == FlushResult(True, FLUSH_OK_MESSAGE)
    assert 0.05 < time.monotonic() - t0 < 8.0
    assert engine.is_idle()  # the flush ran only once the job had finished
    ids, _, outs = collect(s)
    assert outs[-1].finish_reason.type == "length" and len(first.new_token_ids + ids) == 30  # ...whole
    assert_clean(engine)


def test_deferred_flush_times_out_and_a_second_one_is_refused(tok, eos, engines):
    engine = engines(step_delay_s=0.01)
    s = engine.submit(req(enc(tok, "long job"), max_new_tokens=2000))
    s.get(timeout=TIMEOUT_S)
    t0 = time.monotonic()
    assert engine.flush_cache(timeout_s=0.2) == FlushResult(False, FLUSH_TIMEOUT_MESSAGE)
    assert 0.2 <= time.monotonic() - t0 < 2.0
    # one deferred flush at a time
    first: list = []
    t = threading.Thread(target=lambda: first.append(engine.flush_cache(timeout_s=10.0)))
    t.start()
    wait_for(lambda: engine._pending_flush is not None, "the first flush to be pending")
    assert engine.flush_cache(timeout_s=1.0) == FlushResult(False, FLUSH_IN_PROGRESS_MESSAGE)
    # a request submitted while the flush waits is admitted and runs (SGLang does not pause admission)
    ids, _, _ = collect(engine.submit(req(enc(tok, "late"), max_new_tokens=3)))
    assert len(ids) == 3 and not first
    engine.abort_requests(abort_all=True)
    t.join(TIMEOUT_S)
    assert first == [FlushResult(True, FLUSH_OK_MESSAGE)]
    collect(s)
    assert_clean(engine)


# -- load and server_info ------------------------------------------------------------------------


def test_load_while_running_and_at_idle(tok, eos, engines):
    engine = engines(max_running_requests=2)
    page = engine.cache.block_size
    prompts = [enc(tok, LONG_TEXT)[:n] for n in (10, 20, 30)]
    idle = engine.load()
    assert isinstance(idle, EngineLoad) and idle.num_running_reqs == idle.num_used_pages == idle.num_total_tokens == 0
    assert idle.max_total_num_tokens == engine.cache.num_usable_blocks * page and idle.page_size == page
    assert idle.max_running_requests == 2 and idle.num_total_slots == 2 and idle.cache_hit_rate == 0.0
    engine.runner.paused.set()  # hold the first step: two admitted (max_running_requests), one queued
    streams = engine.submit_many([req(p, max_new_tokens=5) for p in prompts])
    assert engine.runner.paused.holding.wait(TIMEOUT_S)
    t0 = time.monotonic()
    load = engine.load()
    assert time.monotonic() - t0 < 0.5  # answered while the engine thread is inside a step
    assert (load.num_running_reqs, load.num_waiting_reqs, load.num_pending_reqs) == (2, 1, 3)
    assert load.num_used_pages == 1 + 2 and load.num_used_tokens == 3 * page  # ceil(10/16) + ceil(20/16)
    assert load.num_used_slots == 2
    assert load.num_total_tokens == 10 + 20 + 30 and load.num_waiting_uncached_tokens == 30
    assert load.token_usage == pytest.approx(3 * page / load.max_total_num_tokens)
    assert json.loads(json.dumps(load.to_dict()))["num_running_reqs"] == 2
    fresh_t0 = time.monotonic()
    assert engine.load(fresh=True, timeout_s=0.1) == engine.load()  # the engine thread is held: published
    assert time.monotonic() - fresh_t0 < 1.0
    engine.runner.paused.clear()
    for s in streams:
        collect(s)
    assert_clean(engine)
    done = engine.load()
    assert (done.num_running_reqs, done.num_waiting_reqs, done.num_pending_reqs, done.num_used_pages,
            done.num_total_tokens, done.token_usage) == (0, 0, 0, 0, 0, 0.0)
    assert done.gen_throughput > 0  # 15 tokens in the last minute


def test_server_info_is_json_and_matches_the_config(tok, eos, engines):
    engine = engines(max_model_len=512, max_running_requests=4, stream_interval=2)
    info = engine.server_info()
    assert json.loads(json.dumps(info)) == info
    assert info["context_length"] == 512 and info["max_req_input_len"] == 511
    assert info["max_running_requests"] == 4 and info["page_size"] == engine.engine_config.block_size
    assert info["max_total_num_tokens"] == engine.load().max_total_num_tokens
    assert info["backend"] == "scripted" and info["stream_interval"] == 2 and info["startup_time"] >= 0
    assert info["engine_config"]["num_slots"] == 5 and info["scheduler_config"]["max_num_seqs"] == 4
    assert info["engine_config"]["decode_batch_buckets"] == list(engine.engine_config.decode_batch_buckets)
