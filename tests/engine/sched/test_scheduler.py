"""Scheduler: token budget, chunked prefill, continuous batching, preemption, aborts, stops.

Driven by fabricated RunnerOutputs. FakeRunner plays a deterministic "model": each slot's state is
the list of token ids fed so far, and the sampled token is a hash of that list. It asserts that
every chunk continues its slot's state exactly (start position == tokens already fed), so a
preempted sequence that re-fed the wrong tokens would produce different output.
"""

import random

import pytest

from trnrt.engine.cache.cache_manager import CacheManager, cdiv
from trnrt.engine.output.outputs import RunnerOutput, SchedulerOutput, TokenLogprob
from trnrt.engine.request import (
    FinishReason,
    GenerateRequest,
    InvalidRequestError,
    SamplingParams,
    check_context_length,
)
from trnrt.engine.sched.scheduler import Scheduler, SchedulerConfig
from trnrt.engine.output.sequence import Sequence, SequenceStatus

EOS = 999


def next_token(state: list[int]) -> int:
    h = 0
    for t in state:
        h = (h * 1_000_003 + t + 1) % 2_147_483_647
    return h % 900 + 10  # never a small id or EOS: the tests choose stop tokens explicitly


class FakeRunner:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self.state: dict[int, list[int]] = {}

    def __call__(self, so: SchedulerOutput) -> RunnerOutput:
        tokens = []
        slots, pages = set(), []
        for e in so.scheduled:
            assert e.slot_id != 0 and 0 not in e.block_table
            assert e.slot_id not in slots
            slots.add(e.slot_id)
            pages += e.block_table
            st = [] if e.num_computed_tokens == 0 else self.state[e.slot_id]
            assert len(st) == e.num_computed_tokens, (e.request_id, len(st), e.num_computed_tokens)
            st = st + e.token_ids
            self.state[e.slot_id] = st
            assert len(e.block_table) == cdiv(len(st), self.block_size)
            tokens.append(next_token(st) if e.do_sample else None)
        assert len(pages) == len(set(pages)), "a page is in two block tables"
        return RunnerOutput(sampled_token_ids=tokens)


def make(max_num_seqs=4, budget=64, max_model_len=128, num_blocks=64, block_size=4, num_slots=9, **kw):
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len, **kw)
    return Scheduler(cfg, CacheManager(num_blocks, block_size, num_slots), eos_token_ids=[EOS])


def req(rid, n=8, max_new_tokens=8, offset=0, **kw):
    return GenerateRequest(list(range(offset + 1, offset + n + 1)), SamplingParams(max_new_tokens=max_new_tokens, **kw), rid)


def run(sched, runner=None, max_steps=10_000, on_step=None):
    """Step until idle; return {request_id: (output ids, finish reason)} and the SchedulerOutputs."""
    runner = runner or FakeRunner(sched.cache.block_size)
    results, outs = {}, []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        outs.append(so)
        if on_step:
            on_step(so)
        for u in sched.update_from_output(so, runner(so)):
            if u.finished:
                results[u.request_id] = (list(u.seq.output_token_ids), u.finish_reason)
        sched.check_integrity()
    assert not sched.has_unfinished_requests()
    return results, outs


def assert_all_free(sched):
    cm = sched.cache
    cm.check_integrity([])
    assert cm.num_free_blocks == cm.num_usable_blocks and cm.num_free_slots == cm.num_usable_slots
    assert not sched.running and not sched.waiting and not sched.requests


# -- chunked prefill and budget ---------------------------------------------------------------


def test_chunk_boundaries_100_tokens_budget_32():
    s = make(budget=32, max_model_len=256, num_blocks=80)
    s.add_request(req("a", n=100, max_new_tokens=2))
    runner = FakeRunner(4)
    chunks = []
    for _ in range(4):
        so = s.schedule()
        (e,) = so.scheduled
        chunks.append((e.num_computed_tokens, e.num_new_tokens, e.do_sample, e.is_prefill))
        assert e.token_ids == list(range(1 + e.num_computed_tokens, 1 + e.num_computed_tokens + e.num_new_tokens))
        updates = s.update_from_output(so, runner(so))
        assert [u.new_token_ids for u in updates] == ([[next_token(list(range(1, 101)))]] if e.do_sample else [])
    assert chunks == [(0, 32, False, True), (32, 32, False, True), (64, 32, False, True), (96, 4, True, True)]
    so = s.schedule()  # then a decode of the sampled token at position 100
    (e,) = so.scheduled
    assert (e.num_computed_tokens, e.token_ids, e.is_prefill, e.do_sample) == (100, [next_token(list(range(1, 101)))], False, True)


def test_max_prefill_chunk_tokens_caps_chunks():
    s = make(budget=64, max_model_len=256, num_blocks=80, max_prefill_chunk_tokens=16)
    s.add_request(req("a", n=40))
    _, outs = run(s)
    prefill = [e.num_new_tokens for so in outs for e in so.scheduled if e.is_prefill]
    assert prefill == [16, 16, 8]


def test_token_budget_and_max_num_seqs_respected_every_step():
    rng = random.Random(0)
    s = make(max_num_seqs=5, budget=48, max_model_len=200, num_blocks=400, num_slots=8)
    for i in range(30):
        s.add_request(req(f"r{i}", n=rng.randint(1, 120), max_new_tokens=rng.randint(1, 20), offset=i))
    hit_budget = hit_max_seqs = mixed = 0

    def check(so):
        nonlocal hit_budget, hit_max_seqs, mixed
        assert so.num_scheduled_tokens <= 48
        assert s.num_running <= 5
        hit_budget += so.num_scheduled_tokens == 48
        hit_max_seqs += s.num_running == 5
        mixed += bool(so.decodes) and bool(so.prefills)
        # decodes come first in the batch (decode_first)
        kinds = [e.is_prefill for e in so.scheduled]
        assert kinds == sorted(kinds)

    results, _ = run(s, on_step=check)
    assert len(results) == 30
    assert hit_budget and hit_max_seqs and mixed  # the limits were actually reached
    assert_all_free(s)


def test_decodes_mixed_with_prefill_chunks():
    s = make(budget=16, max_model_len=256, num_blocks=80)
    runner = FakeRunner(4)
    s.add_request(req("old", n=4, max_new_tokens=50))
    s.update_from_output(so := s.schedule(), runner(so))  # old is now decoding
    s.add_request(req("new", n=40, offset=100))
    so = s.schedule()
    assert [(e.request_id, e.num_new_tokens, e.is_prefill, e.do_sample) for e in so.scheduled] == [
        ("old", 1, False, True),
        ("new", 15, True, False),  # the prefill chunk takes what the decode left of the budget
    ]
    s.update_from_output(so, runner(so))
    so = s.schedule()
    assert [(e.request_id, e.num_computed_tokens, e.num_new_tokens) for e in so.scheduled] == [("old", 5, 1), ("new", 15, 15)]


def test_decode_first_false_puts_in_progress_prefills_first():
    s = make(budget=16, max_model_len=256, num_blocks=80, decode_first=False)
    runner = FakeRunner(4)
    s.add_request(req("old", n=4, max_new_tokens=50))
    s.update_from_output(so := s.schedule(), runner(so))
    s.add_request(req("new", n=40, offset=100))
    s.update_from_output(so := s.schedule(), runner(so))  # new: first chunk of 15 after old's decode
    so = s.schedule()
    assert [(e.request_id, e.num_new_tokens) for e in so.scheduled] == [("new", 16)]  # old's decode waits


def test_max_num_seqs_caps_running():
    s = make(max_num_seqs=2, budget=64)
    for i in range(5):
        s.add_request(req(f"r{i}", n=4))
    so = s.schedule()
    assert [e.request_id for e in so.scheduled] == ["r0", "r1"]
    assert (s.num_running, s.num_waiting) == (2, 3)
    run(s)
    assert_all_free(s)


def test_chunked_prefill_off_admits_whole_prompts_only():
    s = make(budget=128, max_model_len=128, chunked_prefill=False, num_blocks=80)
    s.add_request(req("a", n=100, max_new_tokens=4))
    s.add_request(req("b", n=50, offset=200))
    so = s.schedule()
    assert [(e.request_id, e.num_new_tokens) for e in so.scheduled] == [("a", 100)]  # b does not fit: it waits
    with pytest.raises(ValueError, match="chunked_prefill"):
        SchedulerConfig(max_num_batched_tokens=64, max_model_len=128, chunked_prefill=False)


# -- preemption -------------------------------------------------------------------------------


def test_preemption_victim_is_newest_and_resume_refeeds_prompt_plus_output():
    # 8 usable pages of 4 tokens. Three 8-token prompts take 6 pages; decoding soon needs more.
    reqs = [req(f"r{i}", n=8, max_new_tokens=12, offset=10 * i) for i in range(3)]
    ref = make(num_blocks=64, max_model_len=32)
    for r in reqs:
        ref.add_request(r)
    expected, ref_outs = run(ref)
    assert not any(so.preempted_request_ids for so in ref_outs)

    s = make(num_blocks=9, max_model_len=32)
    for r in reqs:
        s.add_request(GenerateRequest(list(r.prompt_token_ids), r.sampling_params, r.request_id))
    preempted = []
    refeeds = {}

    def watch(so):
        for rid in so.preempted_request_ids:
            preempted.append(rid)
            seq = s.get_sequence(rid)
            assert seq.status is SequenceStatus.PREEMPTED and not seq.block_ids and seq.slot_id is None
            assert s.waiting[0].status is SequenceStatus.PREEMPTED
        for e in so.scheduled:
            seq = s.get_sequence(e.request_id)
            if seq.num_preemptions and e.num_computed_tokens == 0:
                refeeds[e.request_id] = (e.token_ids, list(seq.all_token_ids), seq.num_output_tokens)

    results, _ = run(s, on_step=watch)
    assert preempted, "the cache was meant to run out"
    assert preempted[0] == "r2"  # the most recently arrived running request goes first
    assert refeeds, "a preempted sequence was meant to resume"
    for rid, (fed, all_ids, num_out) in refeeds.items():
        assert num_out > 0 and fed == all_ids  # prompt + generated tokens, in one chunk here
    assert results == expected  # same tokens as without preemption
    assert s.num_preemptions_total == len(preempted)
    assert_all_free(s)


def test_preemption_order_newest_first_and_waiting_front_in_arrival_order():
    s = make(num_blocks=7, block_size=4, max_model_len=24, budget=64)  # 6 usable pages
    runner = FakeRunner(4)
    for i in range(3):
        s.add_request(req(f"r{i}", n=4, max_new_tokens=20, offset=10 * i))
    s.update_from_output(so := s.schedule(), runner(so))  # one full page each, all decoding now
    hog = Sequence("hog", [1], SamplingParams())
    s.cache.allocate_blocks_for(hog, 3 * 4)  # something else holds the other 3 pages
    assert s.cache.num_free_blocks == 0
    # Every decode at position 4 needs a 2nd page: r2 gives way to r0, then r1 (now the newest
    # running) gives way to itself.
    so = s.schedule()
    assert so.preempted_request_ids == ["r2", "r1"]
    assert [e.request_id for e in so.scheduled] == ["r0"]
    assert [q.request_id for q in s.waiting] == ["r1", "r2"]  # front of waiting, in arrival order
    s.update_from_output(so, runner(so))
    s.cache.check_integrity(list(s.requests.values()) + [hog])
    s.cache.free(hog)
    results, _ = run(s, runner)
    assert set(results) == {"r0", "r1", "r2"}
    assert_all_free(s)


def test_preemption_invariants_under_load():
    rng = random.Random(1)
    s = make(max_num_seqs=6, budget=32, max_model_len=64, num_blocks=20, block_size=4)  # 19 pages
    for i in range(16):
        s.add_request(req(f"r{i}", n=rng.randint(1, 40), max_new_tokens=rng.randint(5, 23), offset=i))
    events = 0

    def check(so):
        nonlocal events
        victims = [s.get_sequence(r) for r in so.preempted_request_ids]
        events += len(victims)
        for v in victims:  # a victim is always newer than every sequence left running
            assert all(v.arrival_index > r.arrival_index for r in s.running)
        preempted_front = [q.arrival_index for q in s.waiting if q.status is SequenceStatus.PREEMPTED]
        assert [q.arrival_index for q in list(s.waiting)[: len(preempted_front)]] == sorted(preempted_front)

    results, _ = run(s, on_step=check)
    assert events > 0 and len(results) == 16
    assert_all_free(s)


def test_preempted_victim_already_scheduled_in_the_step_is_taken_back():
    # 3 usable pages. a (older) is still prefilling in chunks of 4; b (newer) is decoding.
    s = make(num_blocks=4, block_size=4, max_model_len=12, budget=8, max_prefill_chunk_tokens=4)
    runner = FakeRunner(4)
    s.add_request(req("a", n=11, max_new_tokens=1))
    s.add_request(req("b", n=2, max_new_tokens=20, offset=20))
    s.update_from_output(so := s.schedule(), runner(so))  # a: 0..4 (page), b: whole prompt (page)
    s.update_from_output(so := s.schedule(), runner(so))  # b decodes; a: 4..8 takes the last page
    assert s.cache.num_free_blocks == 0
    so = s.schedule()  # b's decode is scheduled first, then a's chunk 8..11 needs a page: b goes
    assert so.preempted_request_ids == ["b"]
    assert [(e.request_id, e.num_computed_tokens, e.num_new_tokens) for e in so.scheduled] == [("a", 8, 3)]
    (u,) = s.update_from_output(so, runner(so))
    assert u.request_id == "a" and u.finished
    results, _ = run(s, runner)
    assert set(results) == {"b"} and s.get_sequence("b") is None
    assert_all_free(s)


# -- aborts, failures, finishing --------------------------------------------------------------


def test_abort_in_every_state_frees_everything():
    s = make(num_blocks=4, block_size=4, max_model_len=12, budget=64, max_num_seqs=2)
    runner = FakeRunner(4)
    s.add_request(req("a", n=4, max_new_tokens=20))
    s.add_request(req("b", n=4, max_new_tokens=20, offset=10))
    s.add_request(req("w", n=4, offset=20))
    s.update_from_output(so := s.schedule(), runner(so))
    s.update_from_output(so := s.schedule(), runner(so))
    b = s.get_sequence("b")
    assert b.status is SequenceStatus.PREEMPTED
    assert s.get_sequence("w").status is SequenceStatus.WAITING
    so = s.schedule()  # a is running and scheduled
    assert [e.request_id for e in so.scheduled] == ["a"]
    for rid in ("w", "b", "a"):
        seq = s.abort(rid, message="client left")
        assert seq.is_finished and seq.finish_reason == FinishReason("abort", message="client left")
        s.check_integrity()
    assert s.abort("a") is None and s.abort("nope") is None
    assert s.update_from_output(so, runner(so)) == []  # the aborted row's result is dropped
    assert sorted(s.schedule().finished_request_ids) == ["a", "b", "w"]
    assert_all_free(s)


def test_runner_failure_aborts_only_that_request():
    s = make()
    runner = FakeRunner(4)
    s.add_request(req("ok", n=4))
    s.add_request(req("bad", n=4, offset=10))
    so = s.schedule()
    out = runner(so)
    out.failed["bad"] = "NaN in logits"
    updates = {u.request_id: u for u in s.update_from_output(so, out)}
    assert updates["bad"].finish_reason.type == "abort" and updates["bad"].error == "NaN in logits"
    assert not updates["ok"].finished and len(updates["ok"].new_token_ids) == 1
    results, _ = run(s, runner)
    assert "ok" in results
    assert_all_free(s)


def test_stop_string_finish_via_finish_request_frees():
    s = make()
    runner = FakeRunner(4)
    s.add_request(req("a", n=4))
    s.update_from_output(so := s.schedule(), runner(so))
    seq = s.finish_request("a", FinishReason("stop", matched="\n\n"))
    assert seq.finish_reason.matched == "\n\n"
    assert_all_free(s)


def test_logprobs_are_recorded_per_output_token():
    s = make()
    s.add_request(req("a", n=4, max_new_tokens=2, logprobs=1))
    for _ in range(2):
        so = s.schedule()
        tok = 42
        lp = TokenLogprob(tok, -0.5, [(tok, -0.5)])
        (u,) = s.update_from_output(so, RunnerOutput([tok], logprobs=[lp]))
        assert u.new_logprobs == [lp]
    assert u.finished and u.seq.output_logprobs == [lp, lp]


# -- validation and stop conditions -----------------------------------------------------------


def test_max_model_len_refusal_names_the_field():
    s = make(max_model_len=16)
    for n in (16, 17):
        with pytest.raises(InvalidRequestError, match="context length") as ei:
            s.add_request(req("x", n=n))
        assert ei.value.field == "prompt_token_ids"
    with pytest.raises(InvalidRequestError) as ei:
        s.add_request(GenerateRequest([], SamplingParams(), "e"))
    assert ei.value.field == "prompt_token_ids"
    with pytest.raises(InvalidRequestError) as ei:
        s.add_request(GenerateRequest([1, -2], SamplingParams(), "neg"))
    assert ei.value.field == "prompt_token_ids"
    with pytest.raises(InvalidRequestError) as ei:
        s.add_request(req("t", n=4, temperature=-1.0))
    assert ei.value.field == "temperature"
    s.add_request(req("dup", n=4))
    with pytest.raises(InvalidRequestError) as ei:
        s.add_request(req("dup", n=4))
    assert ei.value.field == "request_id"
    # strict mode (client set max_tokens): prompt + max_new_tokens over the context is refused
    check_context_length(10, 6, 16, strict_max_new_tokens=True)
    with pytest.raises(InvalidRequestError) as ei:
        check_context_length(10, 7, 16, strict_max_new_tokens=True)
    assert ei.value.field == "max_new_tokens"


def test_prompt_plus_max_new_tokens_over_context_is_capped_at_max_model_len():
    s = make(max_model_len=16)
    s.add_request(req("a", n=10, max_new_tokens=100))
    s.add_request(req("b", n=15, max_new_tokens=100, offset=50))  # room for exactly one token
    results, _ = run(s)
    assert len(results["a"][0]) == 6 and results["a"][1] == FinishReason("length")
    assert len(results["b"][0]) == 1 and results["b"][1] == FinishReason("length")


def test_scheduler_requires_cache_for_one_full_context():
    with pytest.raises(ValueError, match="max_model_len"):
        make(num_blocks=4, block_size=4, max_model_len=13)  # 3 usable pages = 12 tokens


def scripted(s, rid, tokens):
    """Feed `tokens` as the sampled ids of request `rid` (alone in the scheduler); return the last update."""
    u = None
    for t in tokens:
        so = s.schedule()
        (e,) = so.scheduled
        assert e.request_id == rid
        (u,) = s.update_from_output(so, RunnerOutput([t]))
        if u.finished:
            break
    return u


def test_eos_stop_token_ids_ignore_eos_and_max_new_tokens():
    s = make()
    s.add_request(req("eos", max_new_tokens=10))
    u = scripted(s, "eos", [5, 6, EOS, 7])
    assert u.finish_reason == FinishReason("stop", matched=EOS) and u.seq.output_token_ids == [5, 6, EOS]

    s.add_request(req("ign", max_new_tokens=4, ignore_eos=True))
    u = scripted(s, "ign", [EOS, EOS, 5, 6])
    assert u.finish_reason == FinishReason("length") and u.seq.output_token_ids == [EOS, EOS, 5, 6]

    s.add_request(req("ids", max_new_tokens=10, stop_token_ids=[77]))
    u = scripted(s, "ids", [5, 77])
    assert u.finish_reason == FinishReason("stop", matched=77)

    # ignore_eos ignores the model's EOS only: explicit stop_token_ids still stop
    s.add_request(req("ign-ids", max_new_tokens=10, ignore_eos=True, stop_token_ids=[77]))
    u = scripted(s, "ign-ids", [EOS, 77])
    assert u.finish_reason == FinishReason("stop", matched=77) and u.seq.output_token_ids == [EOS, 77]

    # length is checked first (as SGLang / vLLM): EOS as the last allowed token is a "length" finish
    s.add_request(req("len", max_new_tokens=2))
    u = scripted(s, "len", [5, EOS])
    assert u.finish_reason == FinishReason("length")
    assert_all_free(s)


def test_max_new_tokens_zero_finishes_without_running():
    s = make()
    seq = s.add_request(req("z", max_new_tokens=0))
    assert seq.is_finished and seq.finish_reason == FinishReason("length")
    assert not s.has_unfinished_requests() and s.schedule().is_empty
