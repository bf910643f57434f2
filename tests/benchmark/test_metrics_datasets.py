"""trnrt.benchmark without a server: metrics on fabricated results, the data sets, arrivals."""

from __future__ import annotations

import math

import numpy as np
import pytest

from trnrt.benchmark import datasets as ds
from trnrt.benchmark.client import RequestResult, Target, build_body
from trnrt.benchmark.metrics import peak_overlap, percentile, summarize
from trnrt.benchmark.runner import arrival_times, turn_payload


# -- metrics ----------------------------------------------------------------------------------

def test_percentile_matches_numpy_linear():
    assert percentile([], 50) == 0.0
    assert percentile([7.0], 99) == 7.0
    vals = [float(v) for v in range(1, 11)]
    assert percentile(vals, 50) == 5.5
    assert percentile(vals, 90) == pytest.approx(9.1)
    assert percentile(vals, 99) == pytest.approx(9.91)
    rng = np.random.default_rng(0)
    for n in (2, 3, 17, 100):
        xs = rng.random(n).tolist()
        for q in (0, 1, 50, 90, 95, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), abs=1e-12)


def _res(start, ttft, itl, out, prompt=10, ok=True, error=""):
    latency = ttft + sum(itl)
    return RequestResult(success=ok, error=error, start_time=start, latency=latency, ttft=ttft, itl=list(itl),
                         prompt_tokens=prompt, output_tokens=out, input_len=99, output_len=out)


def test_summary_of_fabricated_results():
    results = [
        _res(0.0, 0.100, [0.010, 0.020, 0.030], 4),
        _res(0.0, 0.200, [0.040], 2),
        _res(0.5, 0.300, [], 1),  # one token: no TPOT, no ITL
        _res(0.6, 0.0, [], 0, ok=False, error="HTTP 500: boom"),
    ]
    s = summarize(results, 2.0, {"backend": "x"})
    assert s["backend"] == "x" and list(s)[0] == "backend"  # config first, like SGLang's dict
    assert (s["completed"], s["failed"]) == (3, 1)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (30, 7)
    assert s["request_throughput"] == 1.5 and s["output_throughput"] == 3.5
    assert s["input_throughput"] == 15.0 and s["total_throughput"] == 18.5
    assert s["mean_ttft_ms"] == pytest.approx(200.0)
    assert s["median_ttft_ms"] == pytest.approx(200.0)
    assert s["p90_ttft_ms"] == pytest.approx(280.0)
    assert s["p99_ttft_ms"] == pytest.approx(298.0)
    # TPOT: (0.16 - 0.1) / 3 = 0.02 and (0.24 - 0.2) / 1 = 0.04
    assert s["mean_tpot_ms"] == pytest.approx(30.0) and s["median_tpot_ms"] == pytest.approx(30.0)
    assert s["p99_tpot_ms"] == pytest.approx(39.8)
    # ITL: 10, 20, 30, 40 ms
    assert s["mean_itl_ms"] == pytest.approx(25.0) and s["median_itl_ms"] == pytest.approx(25.0)
    assert s["p90_itl_ms"] == pytest.approx(37.0) and s["max_itl_ms"] == pytest.approx(40.0)
    assert s["std_itl_ms"] == pytest.approx(float(np.std([10, 20, 30, 40])))
    # E2E: 160, 240, 300 ms
    assert s["median_e2e_latency_ms"] == pytest.approx(240.0)
    assert s["concurrency"] == pytest.approx(0.7 / 2.0)
    assert s["max_concurrent_requests"] == 2  # the third starts after the first two ended
    assert s["max_output_tokens_per_s"] == 7.0  # every token within the first second
    assert s["errors"] == [{"error": "HTTP 500: boom", "count": 1}]
    assert s["input_tokens_reported"] and s["output_tokens_reported"]


def test_summary_falls_back_to_nominal_input_len_and_empty_is_zero():
    r = _res(0.0, 0.1, [], 1, prompt=None)
    s = summarize([r], 1.0)
    assert s["total_input_tokens"] == 99 and not s["input_tokens_reported"]
    s = summarize([], 1.0)
    assert s["completed"] == 0 and s["mean_ttft_ms"] == 0.0 and s["p99_itl_ms"] == 0.0


def test_peak_overlap():
    assert peak_overlap([]) == 0
    assert peak_overlap([(0, 1), (1, 2)]) == 1  # end before start at the same instant
    assert peak_overlap([(0, 3), (1, 2), (1.5, 4), (3.5, 5)]) == 3


# -- data sets --------------------------------------------------------------------------------

def test_random_is_deterministic_and_of_the_asked_lengths():
    a = ds.gen_random(20, 40, 8, 1.0, seed=3)
    assert a == ds.gen_random(20, 40, 8, 1.0, seed=3)
    assert a != ds.gen_random(20, 40, 8, 1.0, seed=4)
    for c in a:
        [t] = c.turns
        assert len(t.text.split()) == t.input_len == 40 and t.output_len == 8
        assert set(t.text.split()) <= set(ds.WORDS)
    ranged = ds.gen_random(200, 40, 8, 0.5, seed=3)
    ins = [c.turns[0].input_len for c in ranged]
    outs = [c.turns[0].output_len for c in ranged]
    assert min(ins) >= 20 and max(ins) <= 40 and len(set(ins)) > 5
    assert min(outs) >= 4 and max(outs) <= 8
    assert all(len(c.turns[0].text.split()) == c.turns[0].input_len for c in ranged)
    zero = ds.gen_random(200, 10, 3, 0.0, seed=1)  # ratio 0: [1, L]
    assert min(c.turns[0].input_len for c in zero) == 1


def test_random_ids_exact_lengths_from_the_pool():
    pool = [5, 9, 11, 42]
    a = ds.gen_random_ids(10, 33, 7, 1.0, seed=2, pool=pool)
    assert a == ds.gen_random_ids(10, 33, 7, 1.0, seed=2, pool=pool)
    for c in a:
        [t] = c.turns
        assert len(t.ids) == t.input_len == 33 and set(t.ids) <= set(pool) and t.text is None
    with pytest.raises(ValueError):
        ds.gen_random_ids(1, 3, 1, pool=[])


def test_shared_prefix_shares_its_prefix():
    convs = ds.gen_shared_prefix(3, 4, 50, 10, 6, seed=1)
    assert convs == ds.gen_shared_prefix(3, 4, 50, 10, 6, seed=1)
    assert len(convs) == 12
    turns = [c.turns[0] for c in convs]
    systems = {t.system for t in turns}
    assert len(systems) == 3
    for s in systems:
        group = [t for t in turns if t.system == s]
        assert len(group) == 4 and len({t.text for t in group}) == 4
        assert len(s.split()) == 52  # "Group N." + 50 words
    assert all(len(t.text.split()) == 10 and t.output_len == 6 for t in turns)
    # sent as a system message (chat) or as the text's first part (text routes)
    p = turn_payload("chat", [], turns[0])["messages"]
    assert p[0] == {"role": "system", "content": turns[0].system} and p[1]["content"] == turns[0].text
    assert turn_payload("completions", [], turns[0])["prompt"].startswith(turns[0].system)


def test_multi_turn_turns_grow():
    convs = ds.gen_multi_turn(2, 3, 12, 4, 1.0, seed=5)
    assert convs == ds.gen_multi_turn(2, 3, 12, 4, 1.0, seed=5)
    assert [len(c.turns) for c in convs] == [3, 3]
    conv = convs[0]
    history, sizes, prompts = [], [], []
    for k, turn in enumerate(conv.turns):
        msgs = turn_payload("chat", history, turn)["messages"]
        assert [m["role"] for m in msgs] == ["user", "assistant"] * k + ["user"]
        sizes.append(len(msgs))
        prompts.append(turn_payload("generate", history, turn)["prompt"])
        history.append((turn, f"answer {k}"))
    assert sizes == [1, 3, 5]
    assert prompts[1].startswith(prompts[0]) and prompts[2].startswith(prompts[1])
    assert len(prompts[0]) < len(prompts[1]) < len(prompts[2])
    assert "answer 0" in prompts[1] and "answer 1" in prompts[2]


def test_token_ids_are_refused_on_chat():
    [c] = ds.gen_random_ids(1, 3, 1, pool=[1, 2])
    with pytest.raises(ValueError):
        turn_payload("chat", [], c.turns[0])


# -- bodies and arrivals -----------------------------------------------------------------------

def test_request_bodies():
    t = Target("http://127.0.0.1:1", model="m")
    b = build_body("chat", t, messages=[{"role": "user", "content": "hi"}], max_tokens=7, ignore_eos=True,
                   temperature=0.0)
    assert b["stream"] and b["stream_options"] == {"include_usage": True} and b["ignore_eos"] and b["max_tokens"] == 7
    assert b["model"] == "m"
    b = build_body("generate", t, prompt=[1, 2], max_tokens=5, ignore_eos=True, temperature=0.0,
                   extra={"sampling_params": {"top_k": 3}, "rid": "x"})
    assert b["input_ids"] == [1, 2] and b["rid"] == "x" and b["stream"]
    assert b["sampling_params"] == {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True, "top_k": 3}
    b = build_body("completions", t, prompt="abc", max_tokens=5, ignore_eos=False, temperature=0.5)
    assert b["prompt"] == "abc" and "ignore_eos" not in b and b["temperature"] == 0.5


def test_arrivals():
    assert arrival_times(4, math.inf, 0) == [0.0] * 4
    a = arrival_times(4000, 100.0, 1)
    assert a == arrival_times(4000, 100.0, 1) and a[0] == 0.0 and a == sorted(a)
    assert a[-1] / 3999 == pytest.approx(0.01, rel=0.1)  # mean gap 1 / rate
    with pytest.raises(ValueError):
        arrival_times(3, 0.0, 0)
