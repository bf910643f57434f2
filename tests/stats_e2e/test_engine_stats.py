"""The real Engine's stats under preemption and aborts (no HTTP): every figure must match the
engine's own final outputs.

A page pool too small for the batch forces preemption by recompute; one request is aborted after
its first token (abort sent twice), one right after submit, and one is aborted after it finished.
"""

from __future__ import annotations

import time

import pytest

PROMPT = 100  # two prefill chunks of 64 tokens each: no token in a request's first step
OUT = 60


@pytest.fixture(scope="module")
def small_engine():
    from trnrt.config.presets import load_preset
    from trnrt.engine.core.engine import Engine
    from trnrt.models.tiny import default_model_dir

    # 23 usable pages of 16 tokens; four 160-token requests need 40: preemption is certain.
    cfg = load_preset("default").replace(num_blocks=24)
    engine = Engine.from_model_dir(default_model_dir(), engine_config=cfg, context_length=256)
    yield engine
    engine.shutdown(0.0)


def test_counts_under_preemption_and_aborts(small_engine):
    from trnrt.engine.request import GenerateRequest, SamplingParams

    engine = small_engine

    def submit(rid: str, offset: int, max_new: int = OUT):
        return engine.submit(GenerateRequest(
            request_id=rid, prompt_token_ids=[100 + offset + j for j in range(PROMPT)],
            sampling_params=SamplingParams(max_new_tokens=max_new, ignore_eos=True, temperature=0.0)))

    streams = {f"long{i}": submit(f"long{i}", 7 * i) for i in range(4)}
    # Aborted after its first token (twice: the second abort must not count again).
    streams["abort-late"] = s = submit("abort-late", 50, max_new=200)
    first = [s.get(timeout=30)]
    while not first[-1].new_token_ids and not first[-1].finished:
        first.append(s.get(timeout=30))
    engine.abort("abort-late")
    engine.abort("abort-late")
    # Aborted right away (normally before its first token: its prefill needs two steps).
    streams["abort-early"] = submit("abort-early", 60)
    engine.abort("abort-early")

    finals = {}
    for rid, stream in streams.items():
        outs = first if rid == "abort-late" else []
        for out in stream:
            outs.append(out)
        assert outs[-1].finished
        finals[rid] = outs[-1]
    engine.abort("long0")  # already finished: a no-op for the stats too

    deadline = time.monotonic() + 10
    while not engine._inbox.empty():  # let the engine thread take the late abort
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.1)

    assert [finals[f"long{i}"].finish_reason.type for i in range(4)] == ["length"] * 4
    assert finals["abort-late"].finish_reason.type == "abort" and finals["abort-early"].finish_reason.type == "abort"
    assert 1 <= finals["abort-late"].num_output_tokens < 200

    # The engine thread records finishes before it publishes idle gauges; wait for them.
    deadline = time.monotonic() + 10
    while (snap := engine.stats())["live"]["running"] or snap["counters"]["requests_finished_total"] < 6:
        assert time.monotonic() < deadline, snap
        time.sleep(0.01)
    c = snap["counters"]
    generated = sum(o.num_output_tokens for o in finals.values())
    with_tokens = sum(1 for o in finals.values() if o.num_output_tokens > 0)
    assert engine.scheduler.num_preemptions_total > 0
    assert c == {
        "requests_arrived": 6,
        "requests_finished": {"stop": 0, "length": 4, "abort": 2, "error": 0},
        "requests_finished_total": 6,
        "prompt_tokens": 6 * PROMPT,
        "finished_prompt_tokens": 6 * PROMPT,
        "cached_tokens": 0,
        "generation_tokens": generated,  # aborted requests' tokens included, recomputes not re-counted
        "errors": 0,
        "aborts": 2,
        "preemptions": engine.scheduler.num_preemptions_total,
    }
    assert generated == 4 * OUT + finals["abort-late"].num_output_tokens + finals["abort-early"].num_output_tokens
    lat = snap["latency"]
    assert lat["ttft_ms"]["total_count"] == with_tokens  # the aborted request's TTFT included
    assert lat["itl_ms"]["total_count"] == generated - with_tokens  # one step, one token, one sample
    assert lat["e2e_ms"]["total_count"] == 4  # stop/length only
    # Queue time once per request that was ever scheduled (not again after a preemption).
    assert with_tokens <= lat["queue_ms"]["total_count"] <= 6
    live = snap["live"]
    busy = ("running", "queued", "pages_used", "slots_used", "tokens_in_flight")
    assert {k: live[k] for k in busy} == dict.fromkeys(busy, 0)
