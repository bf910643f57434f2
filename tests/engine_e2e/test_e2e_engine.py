"""Engine end to end on the tiny model: seeded sampling, stop strings, multi-byte text, EOS and
stop tokens, length limits, aborts in prefill and decode, a failing step. Every test ends with no
page or slot in use and consistent scheduler books."""

from __future__ import annotations

import threading

import pytest
from e2e_helpers import (
    N_NEW, Collected, Collector, assert_clean, collect, greedy, hook_execute, run, slot_of, submit, submit_together,
    wait_idle,
)

from trnrt.engine.request import GenerateRequest, SamplingParams

CJK_PROMPT = "東京の天気は"


def _first_fresh(out: list[int], start: int = 1) -> int:
    """Index of the first token (at or after `start`) that does not occur earlier in `out`."""
    for k in range(start, len(out)):
        if out[k] not in out[:k]:
            return k
    raise AssertionError(f"no fresh token in {out}")


# -- sampling --------------------------------------------------------------------------------


def test_seeded_sampling_same_alone_and_batched(eos_engine, tokenizer):
    engine = eos_engine
    target = tokenizer.encode("Once upon a time", add_special_tokens=False)
    params = dict(max_new_tokens=10, temperature=0.8, top_p=0.9, seed=1234, ignore_eos=True)
    alone = run(engine, target, **params)

    others = [tokenizer.encode(t, add_special_tokens=False) for t in (
        "Hello", "The quick brown fox", "A", "Lorem ipsum dolor sit amet", "1 2 3", "def f(x):",
        "Paris is", "東京")]
    decode_rows: list[int] = []  # decode rows per step
    with hook_execute(engine, before=lambda rows: decode_rows.append(sum(len(r.token_ids) == 1 for r in rows))):
        items = [(ids, dict(max_new_tokens=10, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True))
                 for i, ids in enumerate(others[:4])]
        items.append((target, params))
        items += [(ids, dict(max_new_tokens=10, temperature=1.0, seed=100 + i, ignore_eos=True))
                  for i, ids in enumerate(others[4:])]
        col = Collector()
        for stream in submit_together(engine, items):
            col.add(stream)
        batched = col.wait_all()[4]
    assert max(decode_rows) == 9, f"the 9 requests never decoded in one batch: {decode_rows}"
    assert batched.output_ids == alone.output_ids
    assert batched.text == alone.text
    # the comparison is not vacuous: the sampling is random (not greedy) and the seed matters
    assert alone.output_ids != greedy(engine, target, 10)
    assert run(engine, target, **{**params, "seed": 4321}).output_ids != alone.output_ids
    assert_clean(engine)


# -- stops -----------------------------------------------------------------------------------


def test_stop_string_across_token_boundary(small_engine, tokenizer):
    engine = small_engine
    ids = tokenizer.encode("The quick brown fox", add_special_tokens=False)
    out = greedy(engine, ids, 24)
    full = tokenizer.decode(out, skip_special_tokens=True)
    choice = None
    for i in range(len(out) - 1):
        a = tokenizer.decode(out[: i + 1], skip_special_tokens=True)
        b = tokenizer.decode(out[: i + 2], skip_special_tokens=True)
        if not (a and len(b) > len(a) and full.startswith(b)) or "\ufffd" in b:
            continue
        stop = full[len(a) - 1 : len(a) + 1]  # last char of token i + first char of token i+1
        if stop.strip() and full.find(stop) == len(a) - 1:
            choice = (i, a, stop)
            break
    assert choice is not None, f"no usable token boundary in {full!r}"
    i, a, stop = choice
    r = run(engine, ids, max_new_tokens=24, temperature=0.0, stop=[stop], ignore_eos=True)
    assert r.finish_reason.type == "stop" and r.finish_reason.matched == stop
    assert r.text == full[: len(a) - 1], (r.text, full, stop)
    assert stop not in r.text
    assert r.output_ids == out[: i + 2]  # stopped on the token that completed the string
    assert_clean(engine)


def test_stop_token_ids(small_engine, tokenizer):
    engine = small_engine
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    out = greedy(engine, ids, N_NEW)
    k = _first_fresh(out, 2)
    r = run(engine, ids, max_new_tokens=N_NEW, temperature=0.0, stop_token_ids=[out[k]])
    assert r.finish_reason.type == "stop" and r.finish_reason.matched == out[k]
    assert r.output_ids == out[: k + 1]
    assert r.text == tokenizer.decode(out[:k], skip_special_tokens=True)  # the stop token's text is not output
    # ignore_eos does not ignore explicit stop_token_ids
    r2 = run(engine, ids, max_new_tokens=N_NEW, temperature=0.0, stop_token_ids=[out[k]], ignore_eos=True)
    assert r2.output_ids == out[: k + 1]
    assert_clean(engine)


def test_model_eos_from_generation_config_and_ignore_eos(eos_engine, eos_ref, tokenizer):
    engine = eos_engine
    ids, out, k, eos = eos_ref
    r = run(engine, ids, max_new_tokens=N_NEW, temperature=0.0)
    assert r.finish_reason.type == "stop" and r.finish_reason.matched == eos
    assert r.output_ids == out[: k + 1]
    assert r.text == tokenizer.decode(out[:k], skip_special_tokens=True)
    r2 = run(engine, ids, max_new_tokens=N_NEW, temperature=0.0, ignore_eos=True)
    assert r2.finish_reason.type == "length"
    assert r2.output_ids == out and eos in r2.output_ids
    assert_clean(engine)


def test_max_new_tokens(small_engine, tokenizer):
    engine = small_engine
    ids = tokenizer.encode("Count with me", add_special_tokens=False)
    out = greedy(engine, ids, 7)
    for n in (1, 3):
        r = run(engine, ids, max_new_tokens=n, temperature=0.0, ignore_eos=True)
        assert r.finish_reason.type == "length" and r.output_ids == out[:n]
    r0 = run(engine, ids, max_new_tokens=0)
    assert r0.finish_reason.type == "length" and r0.output_ids == [] and r0.text == ""
    assert_clean(engine)


# -- text ------------------------------------------------------------------------------------


def _byte_token_ids(tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte of `text` (the byte-level BPE has a token for each of the 256 bytes)."""
    # GPT-2's byte -> printable character map, which tokenizers' ByteLevel uses
    b2u = {}
    n = 0
    for b in range(256):
        if ord("!") <= b <= ord("~") or ord("¡") <= b <= ord("¬") or ord("®") <= b <= ord("ÿ"):
            b2u[b] = chr(b)
        else:
            b2u[b] = chr(256 + n)
            n += 1
    ids = tokenizer.convert_tokens_to_ids([b2u[b] for b in text.encode("utf-8")])
    assert None not in ids and tokenizer.unk_token_id not in ids
    return ids


FORCED_TEXT = "Tokyo 東京の天気は晴れ, 서울 🙂 ok"


def test_multibyte_text_split_across_tokens_streams_whole_characters(small_engine, tokenizer):
    """The sampled ids are forced (a hook overwrites the runner's results) to the UTF-8 bytes of a
    CJK / Hangul / emoji text, one byte per token, so every multi-byte character is split across
    2-4 tokens: no chunk may carry a U+FFFD or half a character, the streamed text must equal
    tokenizer.decode of all output ids, and a stop string made of CJK characters must match."""
    engine = small_engine
    forced = _byte_token_ids(tokenizer, FORCED_TEXT)
    assert tokenizer.decode(forced) == FORCED_TEXT
    assert "\ufffd" in tokenizer.decode(forced[:7])  # the first CJK character really is split
    prompt = tokenizer.encode("東京", add_special_tokens=False)

    def run_forced(**params) -> Collected:
        req = GenerateRequest(prompt_token_ids=prompt, sampling_params=SamplingParams(**params))
        count = [0]

        def after(rows, results):
            slot = slot_of(engine, req.request_id)
            for row, res in zip(rows, results):
                if row.slot_id == slot:
                    res.token_id = forced[min(count[0], len(forced) - 1)]
                    count[0] += 1

        with hook_execute(engine, after=after):
            return collect(engine.submit(req))

    r = run_forced(max_new_tokens=len(forced), temperature=0.0, ignore_eos=True)
    assert r.output_ids == forced and r.finish_reason.type == "length"
    assert r.text == tokenizer.decode(r.output_ids, skip_special_tokens=True) == FORCED_TEXT
    assert not any("\ufffd" in c for c in r.chunks), r.chunks
    assert len([c for c in r.chunks if c]) > 5  # it really streamed in pieces
    # a stop string of multi-byte characters, completed by the last byte of its last character
    r = run_forced(max_new_tokens=len(forced), temperature=0.0, ignore_eos=True, stop=["天気"])
    assert r.finish_reason.type == "stop" and r.finish_reason.matched == "天気"
    assert r.text == "Tokyo 東京の"
    assert r.output_ids == forced[: len("Tokyo 東京の天気".encode())]
    # stopped mid-character by max_new_tokens: the incomplete tail is flushed as decode gives it
    n = len("Tokyo 東".encode()) + 1
    r = run_forced(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    assert r.text == tokenizer.decode(forced[:n], skip_special_tokens=True)
    assert_clean(engine)


def test_sampled_text_streamed_equals_full_decode(eos_engine, tokenizer):
    """Random sampling (16 seeds) from a CJK prompt: whatever bytes come out, the streamed text
    equals tokenizer.decode of all output ids."""
    engine = eos_engine
    ids = tokenizer.encode(CJK_PROMPT, add_special_tokens=False)
    col = Collector()
    for seed in range(16):
        col.add(submit(engine, ids, max_new_tokens=24, temperature=1.0, seed=seed, ignore_eos=True))
    for r in col.wait_all():
        assert r.error is None and len(r.output_ids) == 24
        assert r.text == tokenizer.decode(r.output_ids, skip_special_tokens=True), (r.output_ids, r.chunks)
    assert_clean(engine)


# -- aborts and failures ---------------------------------------------------------------------


def test_abort_during_prefill(small_engine, random_prompts):
    engine = small_engine
    ids = random_prompts[1]  # 200 tokens: 4 prefill chunks of <= 64
    assert len(ids) == 200
    req = GenerateRequest(prompt_token_ids=list(ids), sampling_params=SamplingParams(max_new_tokens=8, ignore_eos=True))
    chunks: list[int] = []

    def after(rows, results):
        slot = slot_of(engine, req.request_id)
        mine = [r for r in rows if r.slot_id == slot]
        if mine:
            chunks.append(len(mine[0].token_ids))
            if len(chunks) == 1:
                engine.abort(req.request_id)  # handled before the next step

    with hook_execute(engine, after=after):
        r = collect(engine.submit(req))
    assert chunks == [64], chunks  # exactly one prefill chunk ran
    assert r.finish_reason.type == "abort" and r.output_ids == [] and r.error is None
    assert_clean(engine)
    # the engine serves the same prompt normally afterwards
    assert len(greedy(engine, ids, 2)) == 2
    assert_clean(engine)


def _abort_after_two_decodes(engine, tokenizer, stream: bool):
    """Greedy-decode a prompt, then run it again and abort it after its second decode step.
    Returns (the uninterrupted output ids, what the aborted request collected)."""
    ids = tokenizer.encode("Tell me a long story", add_special_tokens=False)
    out = greedy(engine, ids, N_NEW)
    req = GenerateRequest(prompt_token_ids=ids, sampling_params=SamplingParams(max_new_tokens=N_NEW, temperature=0.0,
                                                                               ignore_eos=True), stream=stream)
    decodes = []

    def after(rows, results):
        slot = slot_of(engine, req.request_id)
        if any(r.slot_id == slot and len(r.token_ids) == 1 for r in rows):
            decodes.append(1)
            if len(decodes) == 2:
                engine.abort(req.request_id)

    with hook_execute(engine, after=after):
        return out, collect(engine.submit(req))


def test_abort_during_decode(small_engine, tokenizer):
    out, r = _abort_after_two_decodes(small_engine, tokenizer, stream=True)
    assert r.finish_reason.type == "abort"
    assert r.output_ids == out[:3]  # the prefill's token and two decodes
    assert_clean(small_engine)


def test_failing_step_fails_its_requests_and_engine_keeps_serving(small_engine, tokenizer):
    engine = small_engine
    a = tokenizer.encode("First request", add_special_tokens=False)
    b = tokenizer.encode("Second request", add_special_tokens=False)
    c = tokenizer.encode("Third request", add_special_tokens=False)
    expected_c = greedy(engine, c, 6)
    raised = threading.Event()

    def before(rows):
        if not raised.is_set():
            raised.set()
            raise RuntimeError("injected device failure")

    with hook_execute(engine, before=before) as steps:
        s1 = submit(engine, a, max_new_tokens=6, ignore_eos=True)
        s2 = submit(engine, b, max_new_tokens=6, ignore_eos=True)
        r1, r2 = collect(s1), collect(s2)
        failed = [r for r in (r1, r2) if r.error is not None]
        assert failed, "the injected failure hit no request"
        for r in failed:
            assert r.finish_reason.type == "abort"
            assert "injected device failure" in r.error
        assert len(steps[0]) == len(failed)  # exactly the requests of the failing step failed
        r3 = run(engine, c, max_new_tokens=6, temperature=0.0, ignore_eos=True)
    assert raised.is_set()
    assert r3.error is None and r3.finish_reason.type == "length" and r3.output_ids == expected_c
    assert engine.thread.is_alive()
    assert_clean(engine)


def test_context_limit_and_abort_while_queued(small_engine, random_prompts, tokenizer):
    """A prompt near max_model_len stops with "length" when the context is full; a request aborted
    while it waits behind max_num_seqs never runs; the others are unaffected."""
    engine = small_engine
    max_len = engine.scheduler_config.max_model_len
    long_ids = (random_prompts[1] * 2)[: max_len - 5]
    short = [tokenizer.encode(t, add_special_tokens=False) for t in ("one", "two", "three")]
    expected = [greedy(engine, ids, 8) for ids in short]
    queued = GenerateRequest(prompt_token_ids=short[0], sampling_params=SamplingParams(max_new_tokens=8))
    waiting_seen: list[int] = []

    def before(rows):
        seq = engine.scheduler.get_sequence(queued.request_id)
        if seq is not None and not waiting_seen:
            waiting_seen.append(engine.scheduler.num_waiting)
            assert seq in engine.scheduler.waiting  # still queued: 4 requests hold max_num_seqs
            engine.abort(queued.request_id)

    with hook_execute(engine, before=before):
        col = Collector()
        col.add(submit(engine, long_ids, max_new_tokens=50, temperature=0.0, ignore_eos=True))
        for ids in short:
            col.add(submit(engine, ids, max_new_tokens=8, temperature=0.0, ignore_eos=True))
        col.add(engine.submit(queued))
        results = col.wait_all()
    assert waiting_seen, "the queued request was never seen waiting"
    r_long, *r_short, r_queued = results
    assert r_long.finish_reason.type == "length" and len(r_long.output_ids) == 5  # prompt + output == max_model_len
    assert [r.output_ids for r in r_short] == expected
    assert r_queued.finish_reason.type == "abort" and r_queued.output_ids == []
    assert_clean(engine)


def test_shutdown_aborts_in_flight_requests(model_dir, tokenizer):
    from trnrt.config import EngineConfig
    from trnrt.engine.core.client import EngineDeadError
    from trnrt.engine.core.engine import Engine

    engine = Engine.from_model_dir(model_dir, engine_config=EngineConfig(
        max_model_len=128, num_blocks=33, num_slots=3, decode_batch_buckets=(1, 2), prefill_token_buckets=(16, 64)))
    ids = tokenizer.encode("Keep talking", add_special_tokens=False)
    col = Collector()
    for _ in range(3):  # two run, one waits
        col.add(submit(engine, ids, max_new_tokens=100, ignore_eos=True))
    col.wait(lambda c: c.num_tokens >= 2)
    engine.shutdown()
    assert not engine.thread.is_alive()
    results = col.wait_all(timeout=10)
    assert all(r.finish_reason.type == "abort" for r in results)
    assert engine.cache.num_used_blocks == 0 and engine.cache.num_used_slots == 0
    engine.scheduler.check_integrity()
    try:
        submit(engine, ids, max_new_tokens=1)
    except EngineDeadError:
        pass
    else:
        raise AssertionError("a shut-down engine accepted a request")


def test_random_aborts_under_preemption_leave_nothing_behind(small_engine, random_prompts):
    """Client-thread aborts at random moments (queued, prefilling, decoding, preempted, finished)
    while the small cache preempts: every stream ends, the survivors are unaffected (greedy output
    equal to a run without aborts), and no page or slot leaks."""
    import random
    import time

    engine = small_engine
    rng = random.Random(7)
    prompts = random_prompts * 2
    reference = {}
    for i in range(0, len(prompts), 5):  # survivors to check against (computed without aborts)
        reference[i] = greedy(engine, prompts[i], 8)
    preempted_before = engine.scheduler.num_preemptions_total
    col = Collector()
    reqs = []
    for i, ids in enumerate(prompts):
        req = GenerateRequest(prompt_token_ids=list(ids), sampling_params=SamplingParams(
            max_new_tokens=8, temperature=0.0, ignore_eos=True))
        reqs.append(req)
        col.add(engine.submit(req))
    victims = [r for i, r in enumerate(reqs) if i not in reference and rng.random() < 0.7]
    for r in victims:
        time.sleep(rng.random() * 0.02)
        engine.abort(r.request_id)
    results = col.wait_all(timeout=120)
    assert engine.scheduler.num_preemptions_total > preempted_before
    victim_ids = {r.request_id for r in victims}
    for i, (req, res) in enumerate(zip(reqs, results)):
        assert res.error is None
        if req.request_id in victim_ids:
            assert res.finish_reason.type in ("abort", "length")
        else:
            assert res.finish_reason.type == "length" and len(res.output_ids) == 8
            if i in reference:
                assert res.output_ids == reference[i]
    assert any(results[i].finish_reason.type == "abort" for i, r in enumerate(reqs) if r.request_id in victim_ids)
    assert_clean(engine)


def test_llm_generate_invalid_prompt_leaves_no_orphan_requests(small_engine):
    from trnrt.engine.core.llm import LLM
    from trnrt.engine.request import InvalidRequestError

    engine = small_engine
    llm = LLM.__new__(LLM)  # an LLM over the shared engine (LLM() would load another one)
    llm.engine, llm.tokenizer = engine, engine.tokenizer
    try:
        with pytest.raises(InvalidRequestError):
            llm.generate([[1, 2, 3], [1, 99999]], SamplingParams(max_new_tokens=240, ignore_eos=True))
        wait_idle(engine, timeout=0.5)  # the valid first prompt must not keep running
    finally:
        for rid in list(engine._streams):
            engine.abort(rid)
        assert_clean(engine)


def test_all_greedy_batches_run_the_greedy_graph_and_mixed_ones_the_full_sampler(small_engine, tokenizer):
    """The runner picks the greedy-sampler decode graph only when every row is greedy; a greedy
    request gives the same tokens either way."""
    engine = small_engine
    ids = tokenizer.encode("The quick brown fox", add_special_tokens=False)
    calls = engine.runner.num_graph_calls
    before = dict(calls)
    alone = greedy(engine, ids, 8)
    delta = {k: v - before.get(k, 0) for k, v in calls.items() if v != before.get(k, 0)}
    assert any(k.startswith("decode-") and k.endswith("-greedy") for k in delta), delta
    assert not any(k.startswith("decode-") and not k.endswith("-greedy") for k in delta), delta

    before = dict(calls)
    col = Collector()
    for stream in submit_together(engine, [(ids, dict(max_new_tokens=8, temperature=0.0, seed=1, ignore_eos=True)),
                                           (ids, dict(max_new_tokens=8, temperature=0.9, seed=7, ignore_eos=True))]):
        col.add(stream)
    mixed = col.wait_all()
    delta = {k: v - before.get(k, 0) for k, v in calls.items() if v != before.get(k, 0)}
    assert any(k.startswith("decode-") and not k.endswith("-greedy") for k in delta), delta
    assert mixed[0].output_ids == alone
    assert_clean(engine)


def test_decode_context_buckets_cut_the_block_table_and_keep_greedy_tokens(model_dir, small_engine, tokenizer):
    """A decode batch whose rows all fit in a context bucket runs the short-table graph; once a row
    outgrows it, the full table. Tokens equal those of an engine without context buckets."""
    from trnrt.config import EngineConfig
    from trnrt.engine.core.engine import Engine
    from trnrt.engine.sched.scheduler import SchedulerConfig

    ecfg = EngineConfig(max_model_len=256, block_size=16, num_blocks=256 // 16 + 1 + 4, num_slots=5,
                        decode_batch_buckets=(1, 2, 4), prefill_token_buckets=(16, 64), decode_context_buckets=(32,))
    scfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, max_prefill_chunk_tokens=64)
    engine = Engine.from_model_dir(model_dir, engine_config=ecfg, scheduler_config=scfg)
    try:
        ids = tokenizer.encode("The quick brown fox", add_special_tokens=False)
        n = 40 - len(ids)  # crosses the 32-token bucket
        got = greedy(engine, ids, n)
        calls = engine.runner.num_graph_calls
        short = sum(v for k, v in calls.items() if k.startswith("decode-") and "-c32-" in k)
        full = sum(v for k, v in calls.items() if k.startswith("decode-") and "-c32-" not in k)
        assert short == 32 - len(ids) and full == n - 1 - short, calls
        assert got == greedy(small_engine, ids, n)
        assert_clean(engine)
    finally:
        engine.shutdown()


def test_prefill_context_buckets_cut_the_block_table_and_keep_greedy_tokens(model_dir, small_engine, tokenizer):
    """A prefill chunk whose sequence ends within a prefill context bucket runs the short-table
    graph (also for a later chunk of the same prompt); a prompt past it runs the full table.
    Tokens equal those of an engine without prefill context buckets."""
    from trnrt.config import EngineConfig
    from trnrt.engine.core.engine import Engine
    from trnrt.engine.sched.scheduler import SchedulerConfig

    ecfg = EngineConfig(max_model_len=256, block_size=16, num_blocks=256 // 16 + 1 + 4, num_slots=5,
                        decode_batch_buckets=(1, 2, 4), prefill_token_buckets=(16, 64), prefill_context_buckets=(32, 64))
    scfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, max_prefill_chunk_tokens=16)
    engine = Engine.from_model_dir(model_dir, engine_config=ecfg, scheduler_config=scfg)
    try:
        words = "the quick brown fox jumps over a lazy dog and runs far away " * 8
        ids = tokenizer.encode(words, add_special_tokens=False)
        for n_prompt, want in ((20, {"c32"}), (50, {"c32", "c64"}), (90, {"c32", "c64", "full"})):
            before = dict(engine.runner.num_graph_calls)
            got = greedy(engine, ids[:n_prompt], 3)
            delta = {k for k, v in engine.runner.num_graph_calls.items()
                     if k.startswith("prefill-") and v > before.get(k, 0)}
            # 16-token chunks: the chunk ending at token t runs in the smallest context >= t
            assert {k.split("-")[3] if "-c" in k else "full" for k in delta} == want, delta
            assert got == greedy(small_engine, ids[:n_prompt], 3)
        assert_clean(engine)
    finally:
        engine.shutdown()


# -- delivery ----------------------------------------------------------------------------------


def test_non_streamed_and_interval_requests_get_the_same_result_in_fewer_outputs(eos_engine, tokenizer, monkeypatch):
    """stream=False: one output, at the end, equal to the streamed request's concatenation (tokens,
    text, logprobs, finish reason), with a stop string and with seeded sampling; a stream interval
    of 3 delivers ceil(n / 3) outputs of the same content."""
    from trnrt.engine.core import intake as intake_mod  # Engine._add makes the detokenizers

    made = []  # (deferred, has stop strings) of each detokenizer the engine creates

    class Recording(intake_mod.IncrementalDetokenizer):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append((self.deferred, bool(self.stop)))

    monkeypatch.setattr(intake_mod, "IncrementalDetokenizer", Recording)
    engine = eos_engine
    ids = tokenizer.encode(CJK_PROMPT, add_special_tokens=False)
    streamed_ref = run(engine, ids, max_new_tokens=10, temperature=0.0, ignore_eos=True)
    stop = streamed_ref.text[-3:]  # a stop string the greedy output reaches
    cases = [dict(max_new_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2),
             dict(max_new_tokens=10, temperature=0.0, ignore_eos=True, stop=[stop]),
             dict(max_new_tokens=10, temperature=1.0, seed=7, ignore_eos=True, logprobs=0)]
    for params in cases:
        results = {}
        for mode in ("stream", "final", "interval"):
            req = GenerateRequest(prompt_token_ids=list(ids), sampling_params=SamplingParams(**params),
                                  stream=mode != "final")
            engine.stream_interval = 3 if mode == "interval" else 1
            try:
                stream = engine.submit(req)
            finally:
                engine.stream_interval = 1
            got, lps = Collected(req.request_id), []
            while not got.finished:
                out = stream.get(timeout=60)
                assert out is not None
                got.add(out)
                lps.extend(out.new_logprobs or [])
            results[mode] = (got, lps)
        ref, ref_lps = results["stream"]
        assert ref.num_outputs >= 4  # so both other modes really merged outputs
        if params.get("stop"):
            assert ref.finish_reason.type == "stop" and ref.finish_reason.matched == stop
        for mode in ("final", "interval"):
            got, lps = results[mode]
            assert (got.output_ids, got.text, got.finish_reason, got.error) == \
                (ref.output_ids, ref.text, ref.finish_reason, ref.error), (mode, params)
            assert [(lp.token_id, lp.logprob, lp.top) for lp in lps] == \
                [(lp.token_id, lp.logprob, lp.top) for lp in ref_lps]
        assert results["final"][0].num_outputs == 1
        assert results["interval"][0].num_outputs == -(-ref.num_outputs // 3)
    # per case: stream, final, interval; only the non-streamed request without a stop string defers
    assert [d for d, _ in made[1:]] == [False, True, False, False, False, False, False, True, False]
    assert_clean(engine)


def test_non_streamed_request_aborted_mid_decode_gets_its_tokens_in_one_output(small_engine, tokenizer):
    engine = small_engine
    out, r = _abort_after_two_decodes(engine, tokenizer, stream=False)
    assert r.finish_reason.type == "abort" and r.num_outputs == 1
    assert r.output_ids == out[:3]  # the prefill's token and two decodes
    # its text was never decoded before the abort, and comes with it
    assert r.text == tokenizer.decode(out[:3], skip_special_tokens=True) and r.text
    assert_clean(engine)
