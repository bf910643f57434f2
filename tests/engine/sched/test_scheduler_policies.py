"""Scheduler policies with the prefix cache, driven by fabricated runner outputs (no engine).

CacheRunner plays a deterministic "model" that also simulates the prefix cache's state copies:
a slot holds the tokens fed into it, a page the tokens at its positions, a checkpoint a copy of a
slot; CacheOps copy them. The sampled token is a hash of the slot's whole state, so a request
resumed from a wrong checkpoint or a wrong shared page samples a different token (every test
that runs to the end compares with the cache off).
"""

from __future__ import annotations

import random

import pytest

from trnrt.engine.sched import schedule_policy as policy
from trnrt.engine.cache.cache_manager import CacheManager, IdPool
from trnrt.engine.cache.eviction_policy import make_eviction_strategy
from trnrt.engine.output.outputs import CacheOp, RunnerOutput, SchedulerOutput
from trnrt.engine.cache.radix_cache import RadixCache
from trnrt.engine.request import FinishReason, GenerateRequest, SamplingParams
from trnrt.engine.sched.scheduler import Scheduler, SchedulerConfig
from trnrt.engine.output.sequence import SequenceStatus

EOS = 999
BS = 4
INTERVAL = 8


def next_token(state: list[int]) -> int:
    h = 0
    for t in state:
        h = (h * 1_000_003 + t + 1) % 2_147_483_647
    return h % 900 + 10  # never EOS


class CacheRunner:
    def __init__(self, block_size: int = BS):
        self.bs = block_size
        self.slot: dict[int, list[int]] = {}
        self.page: dict[int, dict[int, int]] = {}  # page -> {offset: token}
        self.ckpt: dict[int, list[int]] = {}
        self.host_page: dict[int, dict[int, int]] = {}
        self.host_ckpt: dict[int, list[int]] = {}

    def apply(self, ops: list[CacheOp]) -> None:
        for op in ops:
            for s, d in zip(op.src, op.dst):
                if op.kind == "save_slot":
                    self.ckpt[d] = list(self.slot[s])
                elif op.kind == "load_slot":
                    self.slot[d] = list(self.ckpt[s])
                elif op.kind == "load_slot_host":
                    self.slot[d] = list(self.host_ckpt[s])
                elif op.kind == "pages_to_host":
                    self.host_page[d] = dict(self.page[s])
                elif op.kind == "pages_to_device":
                    self.page[d] = dict(self.host_page[s])
                elif op.kind == "ckpt_to_host":
                    self.host_ckpt[d] = list(self.ckpt[s])
                else:
                    raise AssertionError(op)

    def __call__(self, so: SchedulerOutput) -> RunnerOutput:
        self.apply(so.cache_ops)
        tokens = []
        for e in so.scheduled:
            st = [] if e.num_computed_tokens == 0 else self.slot[e.slot_id]
            assert len(st) == e.num_computed_tokens, (e.request_id, len(st), e.num_computed_tokens)
            full = st + e.token_ids
            for pos in range(e.num_computed_tokens):  # shared / loaded pages hold the prefix
                assert self.page[e.block_table[pos // self.bs]].get(pos % self.bs) == full[pos], (e.request_id, pos)
            for pos in range(e.num_computed_tokens, len(full)):
                self.page.setdefault(e.block_table[pos // self.bs], {})[pos % self.bs] = full[pos]
            self.slot[e.slot_id] = full
            tokens.append(next_token(full) if e.do_sample else None)
        out = RunnerOutput(sampled_token_ids=tokens)
        self.apply(so.snapshot_ops)  # after the step
        return out


def make(schedule_policy="fcfs", *, cache=True, num_blocks=128, num_slots=6, n_ckpt=64, host=None,
         eviction="lru", write_policy="write_through", interval=INTERVAL, **kw):
    kw.setdefault("max_num_seqs", 1)
    kw.setdefault("max_num_batched_tokens", 64)
    kw.setdefault("max_model_len", 128)
    cm = CacheManager(num_blocks, BS, num_slots)
    pc = None
    if cache:  # as Engine._build_prefix_cache builds it
        hp = IdPool(host, "host page") if host else None
        hc = IdPool(2 * n_ckpt, "host checkpoint") if host else None  # hicache_ratio 2
        pc = RadixCache(cm, IdPool(n_ckpt, "checkpoint"), host_pages=hp, host_checkpoints=hc,
                        strategy=make_eviction_strategy(eviction, {}), write_policy=write_policy)
    cfg = SchedulerConfig(schedule_policy=schedule_policy, **kw)
    return Scheduler(cfg, cm, eos_token_ids=[EOS], prefix_cache=pc, checkpoint_interval=interval if cache else 0)


def req(rid, prompt, max_new=2, priority=None):
    return GenerateRequest(list(prompt), SamplingParams(max_new_tokens=max_new), rid, priority=priority)


def toks(base, n):
    return list(range(base, base + n))


def step(s: Scheduler, runner: CacheRunner):
    so = s.schedule()
    ups = s.update_from_output(so, runner(so))
    s.check_integrity()
    return so, ups


def run(s: Scheduler, runner: CacheRunner | None = None, max_steps=2000, on_step=None):
    """Step until idle; ({rid: output ids}, [SchedulerOutput], admission order)."""
    runner = runner or CacheRunner()
    results, outs, admitted = {}, [], []
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            break
        so, ups = step(s, runner)
        outs.append(so)
        for e in so.scheduled:
            if e.request_id not in admitted:
                admitted.append(e.request_id)
        if on_step:
            on_step(so)
        for u in ups:
            if u.finished:
                results[u.request_id] = list(u.seq.output_token_ids)
    assert not s.has_unfinished_requests()
    return results, outs, admitted


def all_free(s: Scheduler):
    cm, pc = s.cache, s.prefix_cache
    s.check_integrity()
    assert cm.num_used_slots == 0 and not s.running and not s.waiting
    if pc is not None:
        assert cm.num_used_blocks == len(set(pc.device_page_refs()))
        assert all(n.lock_ref == 0 for n in pc._nodes())
        s.flush_prefix_cache()
    assert cm.num_free_blocks == cm.num_usable_blocks


# -- policy order --------------------------------------------------------------------------------

P = toks(1000, 48)
Q = toks(2000, 48)
BURST = [  # (rid, prompt, max_new): cache matches a 0, b1 16 (P), c 40 (Q), b2 8 (P)
    ("a", toks(5000, 40), 3),
    ("b1", P[:16] + toks(6000, 24), 2),
    ("c", Q[:40] + toks(7000, 8), 1),
    ("b2", P[:8] + toks(8000, 32), 4),
]
EXPECTED_ADMISSION = {
    "fcfs": ["a", "b1", "c", "b2"],
    "lof": ["b2", "a", "b1", "c"],          # max_new 4, 3, 2, 1
    "lpm": ["c", "b1", "b2", "a"],          # matched 40, 16, 8, 0
    # P's subtree holds two waiting requests (b1 deeper first, post-order), Q's one; after b1
    # the branches tie and the root's children order (Q was cached first) decides
    "dfs-weight": ["b1", "c", "b2", "a"],
    "shortest-prefill-first": ["c", "b1", "b2", "a"],  # uncached 8, 24, 32, 40
}
EXPECTED_CACHED = {"a": 0, "b1": 16, "c": 40, "b2": 8}


def warm(s: Scheduler, runner: CacheRunner):
    for rid, p in (("wq", Q), ("wp", P)):  # one at a time: Q is the root's first child
        s.add_request(req(rid, p, max_new=1))
        run(s, runner)


def burst(s: Scheduler):
    seqs = {}
    for rid, p, n in BURST:
        seqs[rid] = s.add_request(req(rid, p, max_new=n))
    return seqs


@pytest.fixture(scope="module")
def reference():
    s = make(cache=False)
    r = CacheRunner()
    for rid, p in (("wq", Q), ("wp", P)):
        s.add_request(req(rid, p, max_new=1))
    for rid, p, n in BURST:
        s.add_request(req(rid, p, max_new=n))
    results, _, admitted = run(s, r)
    assert admitted == ["wq", "wp", "a", "b1", "c", "b2"]
    return results


@pytest.mark.parametrize("pol", sorted(EXPECTED_ADMISSION))
def test_admission_order_follows_the_policy(pol, reference):
    s = make(pol)
    assert s.active_policy == pol
    runner = CacheRunner()
    warm(s, runner)
    seqs = burst(s)
    results, outs, admitted = run(s, runner)
    assert admitted == EXPECTED_ADMISSION[pol]
    assert results == {rid: reference[rid] for rid in results}
    assert {rid: sq.num_cached_tokens for rid, sq in seqs.items()} == EXPECTED_CACHED
    assert all(n % INTERVAL == 0 for n in EXPECTED_CACHED.values())
    all_free(s)


@pytest.mark.parametrize("pol", ["lpm", "dfs-weight"])
def test_cache_aware_policies_are_fcfs_without_the_cache(pol):
    s = make(pol, cache=False)
    assert s.active_policy == "fcfs"
    for rid, p in (("wq", Q), ("wp", P)):
        s.add_request(req(rid, p, max_new=1))
    burst(s)
    _, _, admitted = run(s)
    assert admitted == ["wq", "wp", "a", "b1", "c", "b2"]


class RecordingRandom(random.Random):
    def __init__(self, seed):
        super().__init__(seed)
        self.shuffles: list[list[str]] = []

    def shuffle(self, x):
        super().shuffle(x)
        self.shuffles.append([q.request_id for q in x])


def test_random_policy_is_seeded_and_admits_the_head_of_each_shuffle(reference):
    orders = {}
    for seed in range(6):
        s = make("random", random_seed=seed)
        runner = CacheRunner()
        warm(s, runner)
        rec = RecordingRandom(seed)
        s._rng = rec
        burst(s)
        admitted, results = [], {}
        while s.has_unfinished_requests():
            n_before = len(rec.shuffles)
            so, ups = step(s, runner)
            new = [e.request_id for e in so.scheduled if e.request_id not in admitted]
            if new:
                (rid,) = new
                # the head of this step's shuffle (none when only one was waiting)
                if len(rec.shuffles) > n_before:
                    assert rec.shuffles[-1][0] == rid
                else:
                    assert s.num_waiting == 0
                admitted.append(rid)
            results.update({u.request_id: list(u.seq.output_token_ids) for u in ups if u.finished})
        assert sorted(admitted) == sorted(r for r, _, _ in BURST)
        assert results == {rid: reference[rid] for rid in results}
        # same seed, same order
        s2 = make("random", random_seed=seed)
        r2 = CacheRunner()
        warm(s2, r2)
        burst(s2)
        assert run(s2, r2)[2] == admitted
        orders[seed] = tuple(admitted)
        all_free(s)
    assert len(set(orders.values())) > 1 and any(o != tuple(EXPECTED_ADMISSION["fcfs"]) for o in orders.values())


# -- priority ------------------------------------------------------------------------------------


@pytest.mark.parametrize("low_first, expected", [
    (False, ["p5", "p5b", "p3", "p1", "none"]),
    (True, ["p1", "p3", "p5", "p5b", "none"]),
])
@pytest.mark.parametrize("pol", ["fcfs", "lof"])
def test_admission_order_by_priority(low_first, expected, pol):
    s = make(pol, enable_priority_scheduling=True, schedule_low_priority_values_first=low_first)
    for rid, pr in (("p1", 1), ("p5", 5), ("none", None), ("p3", 3), ("p5b", 5)):
        s.add_request(req(rid, toks(100 * len(rid) + (pr or 0) * 1000, 12), max_new=2, priority=pr))
    _, _, admitted = run(s)
    assert admitted == expected
    assert s.num_priority_preemptions == 0  # no difference exceeds the threshold (10)
    all_free(s)


def _run_steps(s, runner, n):
    for _ in range(n):
        step(s, runner)


@pytest.mark.parametrize("low_first", [False, True])
def test_priority_preemption_only_past_the_threshold(low_first):
    sign = -1 if low_first else 1
    s = make(enable_priority_scheduling=True, schedule_low_priority_values_first=low_first, max_num_seqs=2)
    runner = CacheRunner()
    s.add_request(req("r0", toks(100, 20), max_new=30, priority=0))
    s.add_request(req("r5", toks(200, 20), max_new=30, priority=5 * sign))
    _run_steps(s, runner, 4)
    assert {q.request_id for q in s.running} == {"r0", "r5"}
    # better than r0 by exactly the threshold: waits
    s.add_request(req("r10", toks(300, 12), max_new=2, priority=10 * sign))
    so, _ = step(s, runner)
    assert s.num_priority_preemptions == 0 and [q.request_id for q in s.waiting] == ["r10"]
    assert {e.request_id for e in so.scheduled} == {"r0", "r5"}
    s.abort("r10")
    # past it: the least preferred running request (r0) is preempted, r5 (also past) is not needed
    s.add_request(req("r11", toks(400, 12), max_new=2, priority=11 * sign))
    so, _ = step(s, runner)
    r0 = s.get_sequence("r0")
    assert s.num_priority_preemptions == 1 and r0.status is SequenceStatus.PREEMPTED
    assert [q.request_id for q in s.running] == ["r5", "r11"]
    assert {e.request_id for e in so.scheduled} == {"r5", "r11"}  # r0's decode was taken back
    assert [q.request_id for q in s.waiting] == ["r0"]
    run(s, runner)
    all_free(s)


def test_priority_preemption_victims_are_reported():
    s = make(enable_priority_scheduling=True)
    runner = CacheRunner()
    s.add_request(req("low", toks(100, 20), max_new=30, priority=0))
    _run_steps(s, runner, 3)
    s.add_request(req("high", toks(200, 12), max_new=2, priority=50))
    so, _ = step(s, runner)
    assert s.get_sequence("low").status is SequenceStatus.PREEMPTED
    assert so.preempted_request_ids == ["low"]


@pytest.mark.parametrize("cache", [True, False])
def test_priority_preempted_request_resumes_from_its_checkpoint(cache):
    s = make(enable_priority_scheduling=True, cache=cache)
    runner = CacheRunner()
    low = s.add_request(req("low", toks(100, 20), max_new=12, priority=0))
    _run_steps(s, runner, 6 if cache else 4)  # chunks 8, 8, 4 (or 20) then 3 decodes: 23 computed
    computed = low.num_computed_tokens
    assert computed == 23 and low.num_output_tokens == 4
    s.add_request(req("high", toks(200, 12), max_new=2, priority=50))
    so, _ = step(s, runner)
    assert low.status is SequenceStatus.PREEMPTED and low.num_computed_tokens == 0
    assert [e.request_id for e in so.scheduled] == ["high"]
    while s.get_sequence("high") is not None:
        so, _ = step(s, runner)
        assert "low" not in {e.request_id for e in so.scheduled}
    # resume
    pc = s.prefix_cache
    expect = computed // INTERVAL * INTERVAL if cache else 0
    if cache:
        m = pc.match(low.token_slice(0, low.num_tokens - 1), touch=False)
        assert m.num_tokens == expect == 16
        ckpt = m.node.checkpoint
    so, _ = step(s, runner)
    (e,) = so.scheduled
    assert e.request_id == "low" and e.num_computed_tokens == expect and e.is_prefill
    if cache:
        assert CacheOp("load_slot", (ckpt,), (e.slot_id,)) in so.cache_ops
        assert low.num_cached_tokens == 0  # only a first admission reports cached tokens
    else:
        assert not so.cache_ops
    results, _, _ = run(s, runner)
    ref = make(cache=False)
    ref.add_request(req("low", toks(100, 20), max_new=12, priority=0))
    ref_results, _, _ = run(ref)
    assert results["low"] == ref_results["low"]
    all_free(s)


# -- queue limit ---------------------------------------------------------------------------------


def _queue_full(seq):
    return (seq.status is SequenceStatus.FINISHED and seq.finish_reason ==
            FinishReason("abort", message=policy.QUEUE_FULL_MESSAGE, status_code=503))


def test_queue_limit_len_plus_one_rule_and_refusal():
    s = make(max_queued_requests=2)
    runner = CacheRunner()
    a = s.add_request(req("a", toks(100, 12)))
    b = s.add_request(req("b", toks(200, 12)))
    c = s.add_request(req("c", toks(300, 12)))
    assert not _queue_full(a) and not _queue_full(b) and _queue_full(c)
    assert s.num_queue_full == 1 and "c" not in s.requests and s.num_waiting == 2
    s.check_integrity()
    step(s, runner)  # a runs: one waiting, so one more fits (1 + 1 <= 2), the running one does not count
    assert s.num_waiting == 1
    d = s.add_request(req("d", toks(400, 12)))
    e = s.add_request(req("e", toks(500, 12)))
    assert not _queue_full(d) and _queue_full(e) and s.num_queue_full == 2
    c2 = s.add_request(req("c", toks(300, 12)))  # a refused id is not live: it may come again later
    assert _queue_full(c2)
    s.check_integrity()
    results, _, admitted = run(s, runner)
    assert admitted == ["a", "b", "d"] and set(results) == {"a", "b", "d"}
    all_free(s)


def test_queue_limit_zero_refuses_everything():
    s = make(max_queued_requests=0, enable_priority_scheduling=True)
    assert _queue_full(s.add_request(req("a", toks(100, 12), priority=100)))
    assert not s.requests and s.num_queue_full == 1


def test_queue_full_displaces_the_least_preferred_newest_waiting():
    s = make(max_queued_requests=2, enable_priority_scheduling=True)
    runner = CacheRunner()
    x = s.add_request(req("x", toks(100, 12), priority=1))
    y = s.add_request(req("y", toks(200, 12), priority=1))
    # equal to the worst: refused
    z = s.add_request(req("z", toks(300, 12), priority=1))
    assert _queue_full(z) and s.take_finished() == []
    # better: the newest of the worst (y) is displaced
    w = s.add_request(req("w", toks(400, 12), priority=3))
    assert not _queue_full(w)
    assert s.take_finished() == [y] and s.take_finished() == []
    assert y.status is SequenceStatus.FINISHED and y.finish_reason == FinishReason(
        "abort", message=policy.DISPLACED_MESSAGE, status_code=503)
    assert [q.request_id for q in s.waiting] == ["x", "w"] and "y" not in s.requests
    s.check_integrity()
    so, _ = step(s, runner)
    assert "y" in so.finished_request_ids
    assert [e.request_id for e in so.scheduled] == ["w"]
    results, _, _ = run(s, runner)
    assert set(results) == {"x", "w"}
    all_free(s)


def test_queue_full_without_priority_never_displaces():
    s = make(max_queued_requests=1)
    s.add_request(req("x", toks(100, 12), priority=1))
    assert _queue_full(s.add_request(req("y", toks(200, 12), priority=100)))
    assert s.take_finished() == []


# -- prefix cache: chunks, snapshots, cached tokens ----------------------------------------------


def _saves(so):
    return [op for op in so.snapshot_ops if op.kind == "save_slot"]


def test_chunks_cut_at_checkpoints_and_snapshots_planned_exactly_there():
    s = make(max_num_batched_tokens=64)
    runner = CacheRunner()
    pc = s.prefix_cache
    a = s.add_request(req("a", toks(100, 30), max_new=1))
    lens, snaps = [], []
    while s.has_unfinished_requests():
        so, _ = step(s, runner)
        (e,) = so.scheduled
        lens.append(e.num_new_tokens)
        end = e.num_computed_tokens + e.num_new_tokens
        saves = _saves(so)
        if end in (8, 16, 24):
            assert saves == [CacheOp("save_slot", (e.slot_id,), saves[0].dst)]
        else:
            assert saves == []
        snaps += [end] * len(saves)
    assert lens == [8, 8, 8, 6] and snaps == [8, 16, 24]
    assert all(pc.has_checkpoint_at(toks(100, n)) for n in (8, 16, 24))
    assert not pc.has_checkpoint_at(toks(100, 30)) and a.num_cached_tokens == 0

    # resumed at 16 (its own tokens diverge after it): the chunk ends at 24, which the tree lacks
    b = s.add_request(req("b", toks(100, 16) + toks(500, 14), max_new=1))
    so, _ = step(s, runner)
    (e,) = so.scheduled
    ck16 = pc.match(toks(100, 16), touch=False).node.checkpoint
    assert e.num_computed_tokens == 16 and e.num_new_tokens == 8 and b.num_cached_tokens == 16
    assert so.cache_ops == [CacheOp("load_slot", (ck16,), (e.slot_id,))]
    assert len(_saves(so)) == 1
    so, _ = step(s, runner)
    assert [x.num_new_tokens for x in so.scheduled] == [6] and _saves(so) == []
    assert not s.has_unfinished_requests()

    # a 16-token prompt resumes at 8 (the last token is always computed); its chunk ends at 16,
    # where the tree already has a checkpoint: no snapshot
    c = s.add_request(req("c", toks(100, 16), max_new=3))
    so, _ = step(s, runner)
    (e,) = so.scheduled
    assert (e.num_computed_tokens, e.num_new_tokens, c.num_cached_tokens) == (8, 8, 8)
    assert _saves(so) == []
    run(s, runner)
    all_free(s)


def test_small_budget_chunks_still_stop_at_checkpoints():
    s = make(max_num_batched_tokens=5)
    runner = CacheRunner()
    s.add_request(req("a", toks(100, 30), max_new=1))
    lens, snaps = [], []
    while s.has_unfinished_requests():
        so, _ = step(s, runner)
        (e,) = so.scheduled
        lens.append(e.num_new_tokens)
        snaps += [e.num_computed_tokens + e.num_new_tokens] * len(_saves(so))
    assert lens == [5, 3, 5, 3, 5, 3, 5, 1] and snaps == [8, 16, 24]
    all_free(s)


def test_decode_snapshots_at_checkpoint_positions():
    s = make()
    runner = CacheRunner()
    s.add_request(req("a", toks(100, 14), max_new=12))
    snaps = []
    while s.has_unfinished_requests():
        so, _ = step(s, runner)
        for e in so.scheduled:
            snaps += [e.num_computed_tokens + e.num_new_tokens] * len(_saves(so))
    assert snaps == [8, 16, 24]  # 14 + 12 = 26 tokens; the last one is never fed
    all_free(s)


@pytest.mark.parametrize("host, eviction, num_blocks, n_ckpt", [
    (None, "lru", 48, 12), (None, "lfu", 36, 40), (96, "slru", 48, 12), (96, "tlru", 48, 12),
    (96, "priority", 36, 40)])
def test_burst_with_shared_prefixes_and_eviction_matches_cache_off(host, eviction, num_blocks, n_ckpt):
    """Many requests over a few shared prefixes, a small page pool (eviction, host round trips):
    outputs as without the cache, cached tokens always multiples of the interval."""
    rng = random.Random(7)
    heads = [[rng.randrange(10, 900) for _ in range(40)] for _ in range(3)]
    reqs = []
    for i in range(24):
        h = rng.choice(heads)
        n = rng.randrange(4, 40)
        reqs.append((f"r{i}", h[:n] + [rng.randrange(10, 900) for _ in range(rng.randrange(1, 10))],
                     rng.randrange(1, 8)))
    ref = make(cache=False, max_num_seqs=3)
    for rid, p, n in reqs:
        ref.add_request(req(rid, p, max_new=n))
    ref_results, _, _ = run(ref)

    s = make(max_num_seqs=3, num_blocks=num_blocks, num_slots=4, n_ckpt=n_ckpt, host=host, eviction=eviction,
             write_policy="write_back" if eviction == "tlru" else "write_through")
    seqs = [s.add_request(req(rid, p, max_new=n)) for rid, p, n in reqs]
    results, outs, _ = run(s)
    assert results == ref_results
    assert all(q.num_cached_tokens % INTERVAL == 0 and q.num_cached_tokens < q.num_prompt_tokens for q in seqs)
    assert s.num_prefix_hits > 0 and s.prefix_cache.num_evicted_pages > 0
    if host:
        assert s.prefix_cache.num_host_loaded_pages > 0
    for so in outs:  # every chunk ends at a checkpoint position or at the end of the known tokens
        for e in so.scheduled:
            end = e.num_computed_tokens + e.num_new_tokens
            assert end % INTERVAL == 0 or e.do_sample
            assert e.num_computed_tokens // INTERVAL == (end - 1) // INTERVAL
    all_free(s)
