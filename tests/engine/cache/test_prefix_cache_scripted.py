"""The radix prefix cache in the real Engine, with the scripted runner (no model, no torch).

The scripted runner simulates state exactly (a slot holds the tokens fed into it, a page the tokens
at its positions; CacheOps copy them), and a request resumed from the cache takes its prompt's head
from its restored slot. The script's output is a hash of the WHOLE prompt it reconstructs, so a
resume from a wrong checkpoint, a wrong shared page or a lost host copy changes the output or fails
the request with a "state mismatch": every test compares outputs with the cache off and asserts the
runner saw no mismatch, and that the mechanism under test actually happened (hits, evictions, host
loads, preemptions).
"""

from __future__ import annotations

import random
import time

import pytest

from trnrt.engine.cache.cache_config import PrefixCacheConfig
from trnrt.engine.request import GenerateRequest, SamplingParams
from trnrt.engine.sched.scheduler import SchedulerConfig

TIMEOUT_S = 30.0


def hash_script(vocab: int, eos: int, n: int = 24):
    """Output = n tokens that depend on every prompt token (never EOS)."""
    def script(prompt: list[int]) -> list[int]:
        h = 1469598103934665603
        for t in prompt:
            h = ((h ^ t) * 1099511628211) & ((1 << 64) - 1)
        rng = random.Random(h)
        out = []
        while len(out) < n:
            t = rng.randrange(vocab)
            if t != eos:
                out.append(t)
        return out
    return script


@pytest.fixture
def engines(tok, eos):
    from trnrt.engine.core.engine import Engine

    made = []

    def make(cache: PrefixCacheConfig | None, **kw):
        kw.setdefault("max_model_len", 1024)
        e = Engine.scripted(tok, hash_script(tok.get_vocab_size(), eos), eos_token_ids=(eos,),
                            prefix_cache_config=cache, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.runner.paused.clear()
        e.shutdown(0.0)


def run(engine, prompts: list[list[int]], max_new: int = 24, rid: str = "r") -> list[tuple[list[int], int]]:
    """Submit all at once; (output ids, cached tokens) per prompt."""
    streams = engine.submit_many([
        GenerateRequest(prompt_token_ids=p, request_id=f"{rid}{i}", stream=False,
                        sampling_params=SamplingParams(max_new_tokens=max_new, ignore_eos=True))
        for i, p in enumerate(prompts)])
    out = []
    for s in streams:
        last = None
        deadline = time.monotonic() + TIMEOUT_S
        while last is None or not last.finished:
            o = s.get(timeout=max(0.0, deadline - time.monotonic()))
            assert o is not None, "stalled"
            last = o if last is None else o
            ids = getattr(s, "_ids", [])
            ids.extend(o.new_token_ids)
            s._ids = ids
        assert last.error is None, last.error
        out.append((list(s._ids), last.num_cached_tokens))
    return out


def wait_idle(engine) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not engine.is_idle() or engine.scheduler.has_unfinished_requests():
        assert time.monotonic() < deadline
        time.sleep(0.002)


def assert_books(engine) -> None:
    """Idle: every page, slot and checkpoint is free or owned by the cache; no mismatch seen."""
    wait_idle(engine)
    time.sleep(0.01)
    engine.scheduler.check_integrity()
    pc = engine.prefix_cache
    held = len(set(pc.device_page_refs())) if pc is not None else 0
    assert engine.cache.num_used_blocks == held
    assert engine.cache.num_used_slots == 0
    if pc is not None:
        assert pc.checkpoints.num_used == len(pc.checkpoint_ids())
        assert all(n.lock_ref == 0 for n in pc._nodes())
    assert engine.runner.num_state_mismatches == 0
    assert engine.runner.num_records == 0


def conversations(vocab: int, eos: int, n: int, seed: int, first_len: int = 70, turn_len: int = 20):
    rng = random.Random(seed)

    def toks(k):
        return [t for t in (rng.randrange(vocab) for _ in range(k * 2)) if t != eos][:k]

    return [toks(first_len) for _ in range(n)], lambda: toks(turn_len)


def multi_turn(engine, starts, next_turn, turns: int):
    """Run every conversation turn by turn (all conversations of a turn together)."""
    prompts = [list(p) for p in starts]
    results = []
    for t in range(turns):
        res = run(engine, prompts, rid=f"t{t}-")
        results.append(res)
        prompts = [p + out + next_turn() for p, (out, _) in zip(prompts, res)]
    return results


CACHE = PrefixCacheConfig(checkpoint_interval=32)


def test_multi_turn_equals_cache_off_and_hits(tok, eos, engines):
    vocab = tok.get_vocab_size()
    on = engines(CACHE)
    off = engines(None)
    starts, nxt = conversations(vocab, eos, 16, seed=1)
    r_on = multi_turn(on, starts, nxt, 4)
    starts, nxt = conversations(vocab, eos, 16, seed=1)
    r_off = multi_turn(off, starts, nxt, 4)
    assert [[o for o, _ in t] for t in r_on] == [[o for o, _ in t] for t in r_off]
    assert all(c == 0 for t in r_off for _, c in t)
    # turn 1 on resumes from the previous turns' checkpoints (a multiple of the interval)
    later = [c for t in r_on[1:] for _, c in t]
    assert all(c > 0 and c % 32 == 0 for c in later), later
    assert on.runner.num_cache_ops.get("load_slot", 0) >= 48
    assert on.scheduler.cache_hit_rate > 0.3
    assert_books(on)
    assert_books(off)


def test_shared_system_prompt(tok, eos, engines):
    vocab = tok.get_vocab_size()
    rng = random.Random(7)
    system = [t for t in (rng.randrange(vocab) for _ in range(300)) if t != eos][:200]
    users = [[t for t in (rng.randrange(vocab) for _ in range(40)) if t != eos][:30] for _ in range(8)]
    on, off = engines(CACHE), engines(None)
    first_on = run(on, [system + users[0]])
    rest_on = run(on, [system + u for u in users[1:]], rid="b")
    first_off = run(off, [system + users[0]])
    rest_off = run(off, [system + u for u in users[1:]], rid="b")
    assert [o for o, _ in first_on + rest_on] == [o for o, _ in first_off + rest_off]
    assert first_on[0][1] == 0
    assert all(c == 192 for _, c in rest_on), [c for _, c in rest_on]  # 200 shared -> 6 x 32
    assert_books(on)


def test_eviction_under_page_pressure(tok, eos, engines):
    """A pool too small to keep every conversation: the tree evicts, outputs stay equal."""
    vocab = tok.get_vocab_size()
    on = engines(CACHE, num_blocks=48, max_running_requests=4, max_model_len=512)
    off = engines(None, num_blocks=48, max_running_requests=4, max_model_len=512)
    starts, nxt = conversations(vocab, eos, 8, seed=3, first_len=60)
    r_on = multi_turn(on, starts, nxt, 3)
    starts, nxt = conversations(vocab, eos, 8, seed=3, first_len=60)
    r_off = multi_turn(off, starts, nxt, 3)
    assert [[o for o, _ in t] for t in r_on] == [[o for o, _ in t] for t in r_off]
    assert on.prefix_cache.num_evicted_pages > 0
    assert_books(on)


def test_host_tier_round_trip(tok, eos, engines):
    """Evicted pages and checkpoints go to host memory and come back on a hit."""
    vocab = tok.get_vocab_size()
    for policy in ("write_through", "write_back"):
        cfg = PrefixCacheConfig(checkpoint_interval=32, hierarchical=True, hicache_ratio=4.0, write_policy=policy)
        on = engines(cfg, num_blocks=48, max_running_requests=4, max_model_len=512)
        off = engines(None, num_blocks=48, max_running_requests=4, max_model_len=512)
        starts, nxt = conversations(vocab, eos, 8, seed=5, first_len=60)
        r_on = multi_turn(on, starts, nxt, 3)
        starts, nxt = conversations(vocab, eos, 8, seed=5, first_len=60)
        r_off = multi_turn(off, starts, nxt, 3)
        assert [[o for o, _ in t] for t in r_on] == [[o for o, _ in t] for t in r_off], policy
        pc = on.prefix_cache
        assert pc.num_evicted_pages > 0 and pc.num_host_loaded_pages > 0, policy
        assert on.scheduler.num_cached_tokens_host_total > 0, policy
        assert on.runner.num_cache_ops.get("pages_to_device", 0) > 0
        assert_books(on)


def test_preemption_resumes_through_the_cache(tok, eos, engines):
    """Long generations in a small pool: running requests are preempted and resume from their
    decode-time checkpoints (not from 0), with the same outputs."""
    vocab = tok.get_vocab_size()
    rng = random.Random(11)
    prompts = [[t for t in (rng.randrange(vocab) for _ in range(60)) if t != eos][:40] for _ in range(6)]
    on = engines(CACHE, num_blocks=40, max_running_requests=6, max_model_len=512)
    off = engines(None, num_blocks=40, max_running_requests=6, max_model_len=512)
    r_on = run(on, prompts, max_new=120)
    r_off = run(off, prompts, max_new=120)
    assert [o for o, _ in r_on] == [o for o, _ in r_off]
    assert on.scheduler.num_preemptions_total > 0
    assert on.runner.num_cache_ops.get("load_slot", 0) > 0
    assert_books(on)


def test_aborts_and_flush_leave_nothing(tok, eos, engines):
    vocab = tok.get_vocab_size()
    on = engines(CACHE)
    starts, nxt = conversations(vocab, eos, 6, seed=9)
    multi_turn(on, starts, nxt, 2)
    on.runner.step_delay_s = 0.002
    streams = on.submit_many([GenerateRequest(prompt_token_ids=p + nxt(), request_id=f"x{i}",
                                              sampling_params=SamplingParams(max_new_tokens=200, ignore_eos=True))
                              for i, p in enumerate(starts)])
    time.sleep(0.05)
    for s in streams[::2]:
        on.abort(s.request_id)
    for s in streams:
        while not (o := s.get(timeout=TIMEOUT_S)).finished:
            pass
    on.runner.step_delay_s = 0.0
    assert_books(on)
    assert on.prefix_cache.num_device_pages() > 0
    res = on.flush_cache(timeout_s=5.0)
    assert res.ok, res
    assert on.cache.num_used_blocks == 0 and on.prefix_cache.checkpoints.num_used == 0
    assert not on.prefix_cache.root.children
    assert_books(on)
    load = on.load()
    assert load.prefix_cache and load.num_cached_pages == 0


def test_one_token_difference_is_never_served_from_the_cache(tok, eos, engines):
    """Prompts equal but for one token (at a page start, mid-page, just before a checkpoint):
    the cache serves exactly the part before the difference, rounded down to a checkpoint."""
    vocab = tok.get_vocab_size()
    rng = random.Random(13)
    base = [t for t in (rng.randrange(vocab) for _ in range(200)) if t != eos][:130]
    on, off = engines(CACHE), engines(None)
    run(on, [base], rid="base")
    for pos in (0, 16, 31, 32, 48, 64, 70, 80, 95, 96, 112, 127):
        p = list(base)
        p[pos] = (p[pos] + 1) % vocab if (p[pos] + 1) % vocab != eos else (p[pos] + 2) % vocab
        (out_on, cached), = run(on, [p], rid=f"d{pos}-")
        (out_off, _), = run(off, [p], rid=f"d{pos}-")
        assert out_on == out_off, pos
        assert cached == (pos // 32) * 32, (pos, cached)
    assert_books(on)


# -- scheduling policies in the engine ------------------------------------------------------------


def _sub(engine, prompt, rid, max_new=24, priority=None):
    return engine.submit(GenerateRequest(prompt_token_ids=prompt, request_id=rid, priority=priority, stream=False,
                                         sampling_params=SamplingParams(max_new_tokens=max_new, ignore_eos=True)))


def _final(stream):
    ids = []
    while True:
        o = stream.get(timeout=TIMEOUT_S)
        assert o is not None
        ids += o.new_token_ids
        if o.finished:
            return ids, o


def test_priority_preemption_keeps_the_output(tok, eos, engines):
    """A high-priority arrival preempts the running low-priority request (max 1 running); the
    preempted one resumes (through the cache) and its output equals an undisturbed run."""
    vocab = tok.get_vocab_size()
    rng = random.Random(21)
    low_p = [t for t in (rng.randrange(vocab) for _ in range(80)) if t != eos][:50]
    high_p = [t for t in (rng.randrange(vocab) for _ in range(80)) if t != eos][:40]
    ref = engines(None, max_running_requests=1)
    ref_low, _ = _final(_sub(ref, low_p, "l", max_new=100))
    scfg = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=1024,
                           max_prefill_chunk_tokens=64, enable_priority_scheduling=True)
    e = engines(CACHE, max_running_requests=1, scheduler_config=scfg)
    e.runner.step_delay_s = 0.002
    low = _sub(e, low_p, "low", max_new=100, priority=0)
    deadline = time.monotonic() + TIMEOUT_S
    while e.scheduler.get_sequence("low") is None or e.scheduler.get_sequence("low").num_output_tokens < 40:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    high = _sub(e, high_p, "high", max_new=10, priority=20)  # better by 20 > threshold 10
    high_ids, high_out = _final(high)
    low_ids, low_out = _final(low)
    e.runner.step_delay_s = 0.0
    assert e.scheduler.num_priority_preemptions == 1
    assert low_ids == ref_low and low_out.finish_reason.type == "length"
    assert len(high_ids) == 10
    assert e.runner.num_cache_ops.get("load_slot", 0) >= 1  # resumed from its decode checkpoint
    assert_books(e)


def test_priority_within_threshold_does_not_preempt(tok, eos, engines):
    scfg = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=1024,
                           max_prefill_chunk_tokens=64, enable_priority_scheduling=True)
    e = engines(CACHE, max_running_requests=1, scheduler_config=scfg)
    e.runner.paused.set()
    low = _sub(e, [5] * 40, "low", max_new=30, priority=0)
    time.sleep(0.05)
    high = _sub(e, [6] * 40, "high", max_new=5, priority=10)  # better by exactly the threshold
    e.runner.paused.clear()
    _final(low), _final(high)
    assert e.scheduler.num_priority_preemptions == 0
    assert_books(e)


def test_queue_full_and_displacement(tok, eos, engines):
    scfg = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=1024,
                           max_prefill_chunk_tokens=64, max_queued_requests=1)
    e = engines(CACHE, max_running_requests=1, scheduler_config=scfg)
    e.runner.paused.set()
    a = _sub(e, [5] * 20, "a")
    deadline = time.monotonic() + TIMEOUT_S
    while e.runner.paused.holding.is_set() is False:  # "a" is running, held in its step
        assert time.monotonic() < deadline
        time.sleep(0.001)
    b = _sub(e, [6] * 20, "b")  # waits (1 queued)
    c = _sub(e, [7] * 20, "c")  # the queue is full (both reach the engine together, after the step)
    e.runner.paused.clear()
    _, c_out = _final(c)
    assert c_out.finish_reason.message == "The request queue is full." and c_out.finish_reason.status_code == 503
    assert e.scheduler.num_queue_full == 1
    assert _final(a)[1].finish_reason.type == "length" and _final(b)[1].finish_reason.type == "length"
    assert_books(e)
    # with priority scheduling a better arrival displaces the worst waiting request
    scfg = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=1024,
                           max_prefill_chunk_tokens=64, max_queued_requests=1, enable_priority_scheduling=True,
                           disable_priority_preemption=True)
    e = engines(CACHE, max_running_requests=1, scheduler_config=scfg)
    e.runner.paused.set()
    a = _sub(e, [5] * 20, "a", priority=0)
    while e.runner.paused.holding.is_set() is False:
        time.sleep(0.001)
    b = _sub(e, [6] * 20, "b", priority=1)
    c = _sub(e, [7] * 20, "c", priority=5)
    d = _sub(e, [8] * 20, "d", priority=2)  # worse than c, which now waits: refused
    e.runner.paused.clear()
    _, b_out = _final(b)
    _, d_out = _final(d)
    assert b_out.finish_reason.message == "The request is aborted by a higher priority request."
    assert b_out.finish_reason.status_code == 503
    assert d_out.finish_reason.message == "The request queue is full."
    assert _final(c)[1].finish_reason.type == "length"
    _final(a)
    assert_books(e)


@pytest.mark.parametrize("name", ["fcfs", "lof", "random", "lpm", "dfs-weight"])
def test_every_policy_serves_everything(tok, eos, engines, name):
    """Each policy runs a mixed burst to completion with the same outputs (order may differ)."""
    vocab = tok.get_vocab_size()
    scfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=1024,
                           max_prefill_chunk_tokens=64, schedule_policy=name, random_seed=3)
    e = engines(CACHE, max_running_requests=2, scheduler_config=scfg)
    ref = engines(None, max_running_requests=2)
    starts, nxt = conversations(vocab, eos, 6, seed=17)
    prompts = [p + nxt() for p in starts] + [starts[0] + nxt(), starts[1] + nxt()]
    run(e, starts, rid="warm")
    assert [o for o, _ in run(e, prompts)] == [o for o, _ in run(ref, prompts)]
    assert e.scheduler.active_policy == name
    assert_books(e)


def test_errors_leave_nothing(tok, eos, engines):
    """A script failure mid-conversation and a failing state copy: the requests in question end
    with an error, the cache keeps balanced books, later requests are served exactly."""
    vocab = tok.get_vocab_size()
    on = engines(CACHE)
    starts, nxt = conversations(vocab, eos, 4, seed=23)
    res = run(on, starts)
    prompts = [p + o + nxt() for p, (o, _) in zip(starts, res)]
    inner = on.runner.script
    bad = tuple(prompts[1])
    on.runner.script = lambda prompt: (_ for _ in ()).throw(RuntimeError("boom")) if tuple(prompt) == bad else inner(prompt)
    streams = on.submit_many([GenerateRequest(prompt_token_ids=p, request_id=f"e{i}", stream=False,
                                              sampling_params=SamplingParams(max_new_tokens=24, ignore_eos=True))
                              for i, p in enumerate(prompts)])
    finals = [_final(s)[1] for s in streams]
    assert [f.error is not None for f in finals] == [False, True, False, False]
    assert_books(on)
    # a cache copy that fails: the step's requests fail, nothing leaks, the engine goes on
    on.runner.script = inner
    real = on.runner.apply_cache_ops
    calls = {"n": 0}

    def flaky(ops):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("copy failed")
        return real(ops)

    on.runner.apply_cache_ops = flaky
    (out, o), = [_final(s) for s in on.submit_many([GenerateRequest(
        prompt_token_ids=prompts[0], request_id="f0", stream=False,
        sampling_params=SamplingParams(max_new_tokens=24, ignore_eos=True))])]
    assert o.error is not None
    assert not on.prefix_cache.root.children  # whatever the failed copies touched is gone
    on.runner.apply_cache_ops = real
    again = run(on, [prompts[0]], rid="g")
    ref = engines(None)
    assert again[0][0] == run(ref, [prompts[0]], rid="g")[0][0]
    assert_books(on)


# -- n > 1: choices fork from one computed prompt ---------------------------------------------------


def _group(engine, prompt, n, group, max_new=24, stream=False):
    return engine.submit_many([
        GenerateRequest(prompt_token_ids=list(prompt), request_id=f"{group}-{i}", prefix_group=group, stream=stream,
                        sampling_params=SamplingParams(max_new_tokens=max_new, ignore_eos=True, seed=100 + i))
        for i in range(n)])


@pytest.mark.parametrize("plen", [75, 80, 81])  # partial last page, page-aligned fork, aligned + 1
def test_n_choices_compute_the_prompt_once(tok, eos, engines, plen):
    vocab = tok.get_vocab_size()
    rng = random.Random(plen)
    prompt = [t for t in (rng.randrange(vocab) for _ in range(plen * 2)) if t != eos][:plen]
    on, off = engines(CACHE), engines(None)
    finals = [_final(s) for s in _group(on, prompt, 8, "g")]
    ref = [_final(s) for s in _group(off, prompt, 8, "g")]
    assert [f[0] for f in finals] == [r[0] for r in ref]
    assert on.scheduler.num_forked == 7
    # the prompt's first plen - 1 tokens were fed once, in prefill chunks; every choice then feeds
    # the last prompt token as a one-token row and samples its own first token
    assert on.scheduler.num_prefill_tokens_computed == plen - 1
    assert off.scheduler.num_prefill_tokens_computed >= 8 * (plen - 1)
    assert [f[1].num_cached_tokens for f in finals] == [0] + [plen - 1] * 7
    assert_books(on)


def test_n_leader_aborted_before_the_fork(tok, eos, engines):
    """The leader goes before its prompt is computed: the others are served as ordinary requests;
    a held choice aborted leaves the group; nothing leaks."""
    vocab = tok.get_vocab_size()
    rng = random.Random(3)
    prompt = [t for t in (rng.randrange(vocab) for _ in range(300)) if t != eos][:200]
    e = engines(CACHE)
    e.runner.paused.set()
    streams = _group(e, prompt, 4, "h")
    deadline = time.monotonic() + TIMEOUT_S
    while not e.runner.paused.holding.is_set():
        assert time.monotonic() < deadline
        time.sleep(0.001)
    e.abort("h-0")  # the leader, mid-prefill (200 tokens in chunks of 64)
    e.abort("h-2")  # a held choice
    e.runner.paused.clear()
    outs = [_final(s) for s in streams]
    assert outs[0][1].finish_reason.type == "abort" and outs[2][1].finish_reason.type == "abort"
    assert outs[1][0] == outs[3][0] and len(outs[1][0]) == 24
    assert not e.scheduler._groups
    assert_books(e)


def test_n_when_the_prompt_is_already_cached(tok, eos, engines):
    """The whole prompt but its last token is cached: no fork is needed, every choice resumes
    from the cache."""
    vocab = tok.get_vocab_size()
    rng = random.Random(31)
    prompt = [t for t in (rng.randrange(vocab) for _ in range(200)) if t != eos][:97]  # 96 = 3 x 32
    on = engines(CACHE)
    run(on, [prompt], rid="warm")
    finals = [_final(s) for s in _group(on, prompt, 4, "c")]
    assert [f[1].num_cached_tokens for f in finals] == [96] * 4
    assert on.scheduler.num_forked == 0 and not on.scheduler._groups
    assert_books(on)
