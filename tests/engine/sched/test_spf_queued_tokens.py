"""--schedule-policy shortest-prefill-first (alias spf) and --max-queued-tokens: the pure policy
functions over fabricated Sequences, then the real Scheduler (with and without the prefix cache)
driven by test_scheduler_policies' fabricated runner."""

from __future__ import annotations

from dataclasses import replace

import pytest

from test_schedule_policy import BASE, PRIO, cfg, ids, matcher, seq
from test_scheduler_policies import P, CacheRunner, _queue_full, all_free, make, req, run, step, toks

from trnrt.engine.request import FinishReason
from trnrt.engine.sched import schedule_policy as policy
from trnrt.engine.sched.schedule_policy import (
    LPM_MAX_WAITING,
    PRIORITY_POLICY_MESSAGE,
    SCHEDULE_POLICIES,
    order_waiting,
    queue_admission,
    validate_policy,
)
from trnrt.engine.sched.scheduler import SchedulerConfig
from trnrt.engine.output.sequence import SequenceStatus

SPF = "shortest-prefill-first"


# -- the policy's name ------------------------------------------------------------------------------


def test_spf_is_an_alias_stored_as_sglangs_name():
    assert SPF in SCHEDULE_POLICIES and "spf" not in SCHEDULE_POLICIES
    c = SchedulerConfig(schedule_policy="spf")
    assert c.schedule_policy == SPF == replace(c).schedule_policy
    for cache in (True, False):  # not cache-aware in the fcfs-fallback sense: it runs either way
        assert validate_policy(c, cache_enabled=cache) == SPF
        assert validate_policy(cfg(schedule_policy=SPF), cache_enabled=cache) == SPF


@pytest.mark.parametrize("name", [SPF, "spf"])
def test_spf_with_priority_scheduling_is_sglangs_startup_error(name):
    with pytest.raises(ValueError) as e:
        validate_policy(cfg(schedule_policy=name, enable_priority_scheduling=True), cache_enabled=True)
    assert str(e.value) == PRIORITY_POLICY_MESSAGE


def test_the_cli_lists_the_engines_policies():
    from trnrt.cli import server_args

    assert server_args.SCHEDULE_POLICIES == policy.SCHEDULE_POLICIES
    assert server_args.SCHEDULE_POLICY_ALIASES == policy.SCHEDULE_POLICY_ALIASES


# -- order_waiting ----------------------------------------------------------------------------------


def test_spf_without_a_cache_is_shortest_prompt_then_arrival():
    w = [seq("n8_new", n=8), seq("n3", n=3), seq("n8_old", n=8), seq("n5", n=5)]
    w[2].arrival_index, w[0].arrival_index = w[0].arrival_index, w[2].arrival_index  # list order != arrival
    for name in (SPF, "spf"):
        assert ids(order_waiting(w, cfg(schedule_policy=name))) == ["n3", "n5", "n8_old", "n8_new"]
    assert ids(w) == ["n8_new", "n3", "n8_old", "n5"]  # input untouched


def test_spf_counts_what_a_preempted_request_re_prefills():
    long_prompt, short_prompt = seq("p6", n=6), seq("p4", n=4)
    short_prompt.output_token_ids.extend([7, 7, 7])  # preempted after 3 tokens: 7 to re-prefill
    assert ids(order_waiting([short_prompt, long_prompt], cfg(schedule_policy=SPF))) == ["p6", "p4"]


def test_spf_subtracts_the_cache_match_and_ties_by_arrival():
    w = [seq("n40_m32", n=40), seq("n20", n=20), seq("n60_m40", n=60), seq("n12", n=12), seq("n52_m32", n=52)]
    m = matcher({"n40_m32": (32, None), "n60_m40": (40, None), "n52_m32": (32, None)})
    # uncached: 8, 20, 20, 12, 20 (n20, n60_m40, n52_m32 tie: arrival order)
    assert ids(order_waiting(w, cfg(schedule_policy=SPF), match=m)) == ["n40_m32", "n12", "n20", "n60_m40", "n52_m32"]
    assert m.calls == ids(w)  # one lookup per waiting request, in queue order


def test_spf_defers_in_batch_duplicates_as_lpm_does():
    shared = list(range(100, 140))  # 40 tokens
    w = [seq("first", tokens=shared + [1, 2]), seq("other", n=50), seq("dup", tokens=shared + [3]),
         seq("short_dup", tokens=shared[:31]), seq("cached_dup", tokens=shared + [9])]
    m = matcher({"cached_dup": (40, None)})
    c = cfg(schedule_policy=SPF)
    # dup shares >= 32 tokens with "first": last, though shortest; short_dup shares only 31;
    # cached_dup (40 > 32 matched) is not checked (and has 1 uncached token)
    assert ids(order_waiting(w, c, match=m)) == ["cached_dup", "short_dup", "first", "other", "dup"]
    # without the cache there is no dedupe
    assert ids(order_waiting(w, c)) == ["short_dup", "dup", "cached_dup", "first", "other"]


def test_spf_has_no_128_request_fallback():
    w = [seq(f"r{i}", n=8) for i in range(LPM_MAX_WAITING + 1)] + [seq("short", n=2)]
    assert ids(order_waiting(w, cfg(schedule_policy=SPF), match=matcher({})))[0] == "short"


# -- the Scheduler ----------------------------------------------------------------------------------

# "long" has 48 tokens cached (P, warmed), 16 to compute; "short" 24; "tiny" 10
ORDER_SCENARIO = [("long", P + toks(9000, 16)), ("short", toks(3000, 24)), ("tiny", toks(4000, 10))]


@pytest.mark.parametrize("pol,cache,expected", [
    (SPF, True, ["tiny", "long", "short"]),
    ("spf", True, ["tiny", "long", "short"]),
    (SPF, False, ["tiny", "short", "long"]),
    ("lpm", True, ["long", "short", "tiny"]),
    ("fcfs", True, ["long", "short", "tiny"]),
])
def test_scheduler_admits_shortest_uncached_prefill_first(pol, cache, expected):
    s = make(pol, cache=cache)
    assert s.active_policy == (SPF if pol == "spf" else pol) and s.config.schedule_policy == s.active_policy
    runner = CacheRunner()
    s.add_request(req("warm", P, max_new=1))
    run(s, runner)
    seqs = {rid: s.add_request(req(rid, p, max_new=2)) for rid, p in ORDER_SCENARIO}
    results, _, admitted = run(s, runner)
    assert admitted == expected
    assert seqs["long"].num_cached_tokens == (48 if cache else 0)
    ref = make(cache=False)
    for rid, p in ORDER_SCENARIO:
        ref.add_request(req(rid, p, max_new=2))
    assert results == run(ref)[0]  # the order changed, the outputs did not
    all_free(s)


def test_scheduler_spf_lets_a_duplicate_wait_for_the_cache():
    """Two running seats: d1 and d2 share 40 uncached tokens. The dedupe admits the longer e
    beside d1, so d2 comes after d1 and resumes from d1's prefix; without the cache d2 runs beside d1."""
    shared = toks(6000, 40)
    burst = [("d1", shared + [1]), ("d2", shared + [2]), ("e", toks(7000, 50))]
    got = {}
    for cache in (True, False):
        s = make(SPF, cache=cache, max_num_seqs=2)
        seqs = {rid: s.add_request(req(rid, p, max_new=1)) for rid, p in burst}
        _, _, admitted = run(s)
        got[cache] = (admitted, seqs["d2"].num_cached_tokens)
        all_free(s)
    assert got == {True: (["d1", "e", "d2"], 40), False: (["d1", "d2", "e"], 0)}


# -- queue_admission: max_queued_tokens -------------------------------------------------------------


def test_validate_names_max_queued_tokens():
    for bad in (0, -1, True, 1.5, "8"):
        with pytest.raises(ValueError, match="max_queued_tokens"):
            validate_policy(cfg(max_queued_tokens=bad), True)
    assert validate_policy(cfg(max_queued_tokens=1), True) == "fcfs"


def test_token_limit_without_priority():
    c = cfg(max_queued_tokens=20)
    w = [seq("a", n=8), seq("b", n=4)]
    assert queue_admission(w, seq("c", n=8), c) == (True, [])  # 20 <= 20
    assert queue_admission(w, seq("c", n=9), c) == (False, [])
    assert queue_admission(w, seq("c", n=9), BASE) == (True, [])  # no limit
    w[1].output_token_ids.extend([5, 5])  # preempted: it re-prefills 6
    assert queue_admission(w, seq("c", n=7), c) == (False, [])


def test_token_limit_admits_any_prompt_at_an_empty_queue():
    c = cfg(max_queued_tokens=10)
    assert queue_admission([], seq("big", n=50), c) == (True, [])
    assert queue_admission([seq("one", n=1)], seq("big", n=50), c) == (False, [])
    # the request limit still holds at an empty queue
    assert queue_admission([], seq("big", n=50), cfg(max_queued_tokens=10, max_queued_requests=0)) == (False, [])


def test_both_limits_hold():
    w = [seq("a", n=4), seq("b", n=4)]
    assert queue_admission(w, seq("c", n=4), cfg(max_queued_tokens=100, max_queued_requests=2)) == (False, [])
    assert queue_admission(w, seq("c", n=4), cfg(max_queued_tokens=11, max_queued_requests=3)) == (False, [])
    assert queue_admission(w, seq("c", n=4), cfg(max_queued_tokens=12, max_queued_requests=3)) == (True, [])


def test_token_limit_displaces_one_or_several_least_preferred_first():
    c = replace(PRIO, max_queued_tokens=30)
    w = [seq("p1_old", priority=1, n=10), seq("p5", priority=5, n=10), seq("p1_new", priority=1, n=5),
         seq("p0", priority=0, n=5)]  # 30 waiting
    ok, displaced = queue_admission(w, seq("in", priority=3, n=5), c)
    assert ok and ids(displaced) == ["p0"]  # the least preferred frees enough
    ok, displaced = queue_admission(w, seq("in", priority=3, n=12), c)
    assert ok and ids(displaced) == ["p0", "p1_new", "p1_old"]  # 5 + 5 + 10 >= 12; p1 newest first
    lo = replace(c, schedule_low_priority_values_first=True)
    ok, displaced = queue_admission(w, seq("in", priority=2, n=10), lo)
    assert ok and ids(displaced) == ["p5"]


def test_token_limit_displaces_nothing_when_worse_ones_cannot_make_room():
    c = replace(PRIO, max_queued_tokens=30)
    w = [seq("p5", priority=5, n=20), seq("p1", priority=1, n=6), seq("p0", priority=0, n=4)]
    assert queue_admission(w, seq("in", priority=3, n=11), c) == (False, [])  # p1 + p0 free 10 < 11
    assert queue_admission(w, seq("in", priority=0, n=1), c) == (False, [])  # equal is not better
    assert queue_admission(w, seq("in", priority=3, n=11), replace(c, enable_priority_scheduling=False)) == (False, [])
    ok, displaced = queue_admission(w, seq("in", priority=3, n=10), c)
    assert ok and ids(displaced) == ["p0", "p1"]


def test_token_limit_displacing_every_worse_one_may_empty_the_queue():
    c = replace(PRIO, max_queued_tokens=10)
    w = [seq("p0", priority=0, n=4), seq("p1", priority=1, n=4)]
    ok, displaced = queue_admission(w, seq("big", priority=9, n=50), c)
    assert ok and ids(displaced) == ["p0", "p1"]  # it waits alone: the empty-queue rule
    assert queue_admission(w, seq("big", priority=1, n=50), c) == (False, [])  # p1 stays: no room


def test_both_limits_with_priority_displace_for_the_stricter():
    c = replace(PRIO, max_queued_tokens=20, max_queued_requests=3)
    w = [seq("p0", priority=0, n=6), seq("p1", priority=1, n=6), seq("p2", priority=2, n=6)]
    ok, displaced = queue_admission(w, seq("in", priority=5, n=2), c)
    assert ok and ids(displaced) == ["p0"]  # the request limit wants one out, the tokens none
    ok, displaced = queue_admission(w, seq("in", priority=5, n=9), c)
    assert ok and ids(displaced) == ["p0", "p1"]  # the tokens want two


# -- the Scheduler's queue ---------------------------------------------------------------------------


def test_scheduler_refuses_past_the_token_limit_and_queues_at_an_empty_queue():
    s = make(cache=False, max_queued_tokens=20)
    runner = CacheRunner()
    a = s.add_request(req("a", toks(100, 12)))
    b = s.add_request(req("b", toks(200, 8)))  # 20 waiting
    c = s.add_request(req("c", toks(300, 1)))
    assert not _queue_full(a) and not _queue_full(b) and _queue_full(c)
    assert s.num_queue_full == 1 and "c" not in s.requests
    step(s, runner)  # a runs: 8 waiting
    step(s, runner)
    d = s.add_request(req("d", toks(400, 12)))
    assert not _queue_full(d) and [q.request_id for q in s.waiting] == ["b", "d"]
    results, _, admitted = run(s, runner)
    assert admitted == ["b", "d"] and set(results) == {"b", "d"}  # (a ended in the steps above)
    # nothing waiting: a prompt over the limit is queued (and runs); one more is refused
    s.add_request(req("x", toks(500, 8)))
    step(s, runner)  # x runs, the waiting queue is empty
    big = s.add_request(req("big", toks(600, 40)))
    assert not _queue_full(big) and s.num_waiting == 1
    assert _queue_full(s.add_request(req("late", toks(700, 1))))
    results, _, admitted = run(s, runner)
    assert set(results) == {"x", "big"} and s.num_queue_full == 2
    all_free(s)


def test_scheduler_token_limit_displaces_several_and_ends_them():
    s = make(max_queued_tokens=24, enable_priority_scheduling=True)
    runner = CacheRunner()
    lo = [s.add_request(req(f"lo{i}", toks(100 * (i + 1), 8), priority=0)) for i in range(3)]  # 24 waiting
    hi = s.add_request(req("hi", toks(900, 14), priority=5))
    assert not _queue_full(hi)
    ended = s.take_finished()
    assert ended == [lo[2], lo[1]]  # newest first, until 8 + 14 <= 24
    for q in ended:
        assert q.status is SequenceStatus.FINISHED and q.finish_reason == FinishReason(
            "abort", message=policy.DISPLACED_MESSAGE, status_code=503)
    assert [q.request_id for q in s.waiting] == ["lo0", "hi"] and s.num_queue_full == 0
    # worse than everything waiting, and no room: refused, nothing displaced
    assert _queue_full(s.add_request(req("worst", toks(950, 4), priority=-1)))
    assert s.take_finished() == []
    so, _ = step(s, runner)
    assert {"lo1", "lo2"} <= set(so.finished_request_ids)
    results, _, admitted = run(s, runner)
    assert admitted == ["hi", "lo0"] and set(results) == {"hi", "lo0"}
    all_free(s)
