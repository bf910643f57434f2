"""Scheduling policies over fabricated Sequences and TreeNodes: every policy's order, the cache
fallbacks, priority direction and defaults, preemption's threshold edge, the queue limit."""

from __future__ import annotations

import random
import sys
import zlib
from dataclasses import replace

import pytest

from trnrt.engine.cache.radix_node import TreeNode
from trnrt.engine.request import SamplingParams
from trnrt.engine.sched.scheduler import SchedulerConfig
from trnrt.engine.sched.schedule_policy import (
    DISPLACED_MESSAGE,
    LPM_MAX_WAITING,
    PRIORITY_DISABLED_MESSAGE,
    QUEUE_FULL_MESSAGE,
    make_rng,
    order_waiting,
    preemption_victims,
    priority_of,
    priority_refusal,
    queue_admission,
    validate_policy,
)
from trnrt.engine.output.sequence import Sequence, SequenceStatus

BASE = SchedulerConfig()
PRIO = SchedulerConfig(enable_priority_scheduling=True)


def seq(rid, *, priority=None, max_new_tokens=16, tokens=None, n=8) -> Sequence:
    toks = list(tokens) if tokens is not None else [zlib.crc32(f"{rid}/{i}".encode()) % 1000 for i in range(n)]
    return Sequence(rid, toks, SamplingParams(max_new_tokens=max_new_tokens), priority=priority)


def ids(seqs) -> list[str]:
    return [s.request_id for s in seqs]


def cfg(**kw) -> SchedulerConfig:
    return replace(BASE, **kw)


# -- validate_policy --------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight", "random"])
def test_priority_scheduling_needs_fcfs_or_lof(policy):
    with pytest.raises(ValueError) as e:
        validate_policy(cfg(schedule_policy=policy, enable_priority_scheduling=True), cache_enabled=True)
    assert str(e.value) == "To use priority scheduling, schedule_policy must be 'fcfs' or 'lof'."
    assert validate_policy(cfg(schedule_policy="lof", enable_priority_scheduling=True), True) == "lof"
    assert validate_policy(cfg(schedule_policy="fcfs", enable_priority_scheduling=True), False) == "fcfs"


def test_unknown_and_unsupported_policies():
    for bad in ("priority", "LPM", "", "shortest"):
        with pytest.raises(ValueError, match=r"^Unknown schedule_policy: policy="):
            validate_policy(cfg(schedule_policy=bad), True)
    with pytest.raises(ValueError, match="'hrrn' is not supported"):
        validate_policy(cfg(schedule_policy="hrrn"), True)


def test_cache_aware_policies_are_fcfs_without_a_cache():
    assert validate_policy(cfg(schedule_policy="lpm"), cache_enabled=False) == "fcfs"
    assert validate_policy(cfg(schedule_policy="dfs-weight"), cache_enabled=False) == "fcfs"
    assert validate_policy(cfg(schedule_policy="lpm"), cache_enabled=True) == "lpm"
    assert validate_policy(cfg(schedule_policy="random"), cache_enabled=False) == "random"


@pytest.mark.parametrize("field,value", [("priority_preemption_threshold", 1.5), ("default_priority_value", "1"),
                                         ("max_queued_requests", -1), ("max_queued_requests", True),
                                         ("random_seed", 1.0)])
def test_validate_names_bad_fields(field, value):
    with pytest.raises(ValueError, match=field):
        validate_policy(cfg(**{field: value}), True)


# -- priorities -------------------------------------------------------------------------------------


def test_priority_value_defaults():
    assert priority_of(seq("a", priority=3), PRIO) == 3
    assert priority_of(seq("a"), PRIO) == -sys.maxsize - 1
    assert priority_of(seq("a"), replace(PRIO, schedule_low_priority_values_first=True)) == sys.maxsize
    assert priority_of(seq("a"), replace(PRIO, default_priority_value=0)) == 0  # 0 is a value, not "unset"
    assert priority_of(seq("a", priority=-2), replace(PRIO, default_priority_value=5)) == -2


def test_priority_refusal_only_when_disabled_and_asked():
    assert priority_refusal(1, cfg(abort_on_priority_when_disabled=True)) == PRIORITY_DISABLED_MESSAGE
    assert PRIORITY_DISABLED_MESSAGE == (
        "Using priority is disabled for this server. Please send a new request without a priority.")
    assert priority_refusal(0, cfg(abort_on_priority_when_disabled=True)) == PRIORITY_DISABLED_MESSAGE
    assert priority_refusal(None, cfg(abort_on_priority_when_disabled=True)) is None
    assert priority_refusal(1, BASE) is None
    assert priority_refusal(1, replace(PRIO, abort_on_priority_when_disabled=True)) is None


# -- order_waiting: cache-agnostic ------------------------------------------------------------------


def test_fcfs_keeps_the_given_order_and_copies():
    w = [seq("b"), seq("a"), seq("c")]
    w[0].arrival_index, w[1].arrival_index = 10, 1  # the list order wins, not arrival_index
    out = order_waiting(w, BASE)
    assert ids(out) == ["b", "a", "c"] and out is not w


def test_fcfs_with_priority_larger_first_then_arrival():
    w = [seq("low", priority=1), seq("none"), seq("hi_old", priority=5), seq("mid", priority=3), seq("hi_new", priority=5)]
    assert ids(order_waiting(w, PRIO)) == ["hi_old", "hi_new", "mid", "low", "none"]


def test_fcfs_with_priority_low_values_first():
    c = replace(PRIO, schedule_low_priority_values_first=True)
    w = [seq("p5", priority=5), seq("none"), seq("p1_old", priority=1), seq("m3", priority=-3), seq("p1_new", priority=1)]
    assert ids(order_waiting(w, c)) == ["m3", "p1_old", "p1_new", "p5", "none"]


def test_fcfs_priority_uses_arrival_index_not_list_position():
    a, b = seq("a", priority=1), seq("b", priority=1)
    assert ids(order_waiting([b, a], PRIO)) == ["a", "b"]  # a arrived first


def test_default_priority_value_places_unset_requests():
    c = replace(PRIO, default_priority_value=3)
    w = [seq("none"), seq("p5", priority=5), seq("p1", priority=1)]
    assert ids(order_waiting(w, c)) == ["p5", "none", "p1"]


def test_lof_longest_output_first_stable():
    w = [seq("s", max_new_tokens=4), seq("l1", max_new_tokens=64), seq("m", max_new_tokens=16), seq("l2", max_new_tokens=64)]
    assert ids(order_waiting(w, cfg(schedule_policy="lof"))) == ["l1", "l2", "m", "s"]


def test_lof_with_priority_orders_by_priority_first():
    c = replace(PRIO, schedule_policy="lof")
    w = [seq("a", priority=1, max_new_tokens=100), seq("b", priority=2, max_new_tokens=4), seq("c", priority=2, max_new_tokens=50)]
    assert ids(order_waiting(w, c)) == ["c", "b", "a"]
    lo = replace(c, schedule_low_priority_values_first=True)
    assert ids(order_waiting(w, lo)) == ["a", "c", "b"]


def test_random_uses_the_given_rng():
    w = [seq(f"r{i}") for i in range(12)]
    c = cfg(schedule_policy="random", random_seed=7)
    got = ids(order_waiting(w, c, rng=make_rng(c)))
    ref = ids(w)
    random.Random(7).shuffle(ref)
    assert got == ref and got != ids(w)
    assert ids(w) == [f"r{i}" for i in range(12)]  # input untouched


# -- order_waiting: cache-aware ---------------------------------------------------------------------


def matcher(table: dict):
    """match(seq) from {rid: (matched tokens, node)}; records the calls."""
    calls = []

    def match(s):
        calls.append(s.request_id)
        return table.get(s.request_id, (0, None))

    match.calls = calls
    return match


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_cache_aware_is_fcfs_without_match(policy):
    w = [seq("a"), seq("b"), seq("c")]
    assert ids(order_waiting(w, cfg(schedule_policy=policy), match=None)) == ["a", "b", "c"]


def test_lpm_longest_match_first_stable():
    w = [seq("m0", n=40), seq("m64", n=80), seq("m40", n=60), seq("m64b", n=90), seq("m0b", n=10)]
    m = matcher({"m64": (64, None), "m40": (40, None), "m64b": (64, None)})
    assert ids(order_waiting(w, cfg(schedule_policy="lpm"), match=m)) == ["m64", "m64b", "m40", "m0", "m0b"]
    assert m.calls == ids(w)


def test_lpm_defers_in_batch_duplicates():
    shared = list(range(100, 140))  # 40 tokens
    w = [seq("first", tokens=shared + [1, 2]), seq("other", n=50), seq("dup", tokens=shared + [3]),
         seq("short_dup", tokens=shared[:31]), seq("dup32", tokens=shared[:32]), seq("cached_dup", tokens=shared + [9])]
    m = matcher({"cached_dup": (33, None), "other": (8, None)})
    got = ids(order_waiting(w, cfg(schedule_policy="lpm"), match=m))
    # cached_dup (33 > 32 matched) is not checked; dup and dup32 share >= 32 tokens with "first";
    # short_dup shares only 31. Deprioritised ones go last, in queue order.
    assert got == ["cached_dup", "other", "first", "short_dup", "dup", "dup32"]


def test_lpm_dedupe_compares_against_earlier_waiting_only():
    shared = list(range(500, 540))
    w = [seq("a", tokens=shared), seq("b", tokens=shared + [1])]
    assert ids(order_waiting(w, cfg(schedule_policy="lpm"), match=matcher({"b": (10, None)}))) == ["a", "b"]
    w = [seq("b", tokens=shared + [1]), seq("a", tokens=shared)]
    assert ids(order_waiting(w, cfg(schedule_policy="lpm"), match=matcher({"b": (10, None)}))) == ["b", "a"]


def test_lpm_falls_back_to_fcfs_over_128_waiting():
    w = [seq(f"r{i}", n=4) for i in range(LPM_MAX_WAITING + 1)]
    m = matcher({"r128": (64, None)})
    assert ids(order_waiting(w, cfg(schedule_policy="lpm"), match=m)) == ids(w)
    assert ids(order_waiting(w[1:], cfg(schedule_policy="lpm"), match=m))[0] == "r128"


def tree():
    """root -> A -> {A1 -> A1x, A2}, root -> B (children in insertion order)."""
    root = TreeNode()

    def child(parent, tag, n=4):
        c = TreeNode(key=(tag,) * n, parent=parent, start_pos=parent.end_pos)
        parent.children[(tag,) * 4] = c
        return c

    A = child(root, 1)
    B = child(root, 2)
    A1 = child(A, 3)
    A2 = child(A, 4)
    A1x = child(A1, 5)
    return dict(root=root, A=A, B=B, A1=A1, A2=A2, A1x=A1x)


def test_dfs_weight_heaviest_subtree_first_post_order():
    t = tree()
    place = {"b1": t["B"], "b2": t["B"], "a": t["A"], "a1": t["A1"], "a1x": t["A1x"], "a2": t["A2"],
             "a2b": t["A2"], "none": None, "root": t["root"]}
    w = [seq(r) for r in ["b1", "a", "a1", "none", "b2", "a1x", "a2", "root", "a2b"]]
    m = matcher({r: (n.end_pos if n else 0, n) for r, n in place.items()})
    got = ids(order_waiting(w, cfg(schedule_policy="dfs-weight"), match=m))
    # weights: A = 5 (a, a1, a1x, a2, a2b), B = 2; under A: A1 = 2, A2 = 2 (tie: dict order A1 first)
    assert got == ["a1x", "a1", "a2", "a2b", "a", "b1", "b2", "root", "none"]


def test_dfs_weight_is_not_limited_to_128():
    t = tree()
    w = [seq("a1x")] + [seq(f"b{i}") for i in range(130)]  # fcfs would put a1x first
    m = matcher({**{f"b{i}": (4, t["B"]) for i in range(130)}, "a1x": (12, t["A1x"])})
    got = ids(order_waiting(w, cfg(schedule_policy="dfs-weight"), match=m))
    assert got[:130] == [f"b{i}" for i in range(130)] and got[-1] == "a1x"  # B's 130 outweigh A's 1


# -- preemption -------------------------------------------------------------------------------------


def running(*prios, tokens=8):
    out = [seq(f"run{i}_p{p}", priority=p) for i, p in enumerate(prios)]
    for s in out:
        s.status = SequenceStatus.RUNNING
    return out


def tok8(s):
    return 8


def test_threshold_edge_20_preempts_0_but_10_does_not():
    (r,) = running(0)
    assert preemption_victims([r], seq("new", priority=20), PRIO, 8, tok8) == [r]
    assert preemption_victims([r], seq("new", priority=10), PRIO, 8, tok8) == []
    assert preemption_victims([r], seq("new", priority=11), PRIO, 8, tok8) == [r]


def test_threshold_edge_low_values_first():
    c = replace(PRIO, schedule_low_priority_values_first=True)
    (r,) = running(20)
    assert preemption_victims([r], seq("new", priority=0), c, 8, tok8) == [r]
    assert preemption_victims([r], seq("new", priority=10), c, 8, tok8) == []
    assert preemption_victims([r], seq("new", priority=40), c, 8, tok8) == []


def test_preemption_takes_least_preferred_newest_first_until_enough():
    rs = running(0, 0, 5, 0)  # arrival order = list order
    inc = seq("new", priority=50)
    assert ids(preemption_victims(rs, inc, PRIO, 8, tok8)) == ["run3_p0"]
    assert ids(preemption_victims(rs, inc, PRIO, 9, tok8)) == ["run3_p0", "run1_p0"]
    assert ids(preemption_victims(rs, inc, PRIO, 25, tok8)) == ["run3_p0", "run1_p0", "run0_p0", "run2_p5"]
    assert preemption_victims(rs, inc, PRIO, 33, tok8) == []  # cannot free enough: nothing


def test_preemption_stops_at_the_first_protected_request():
    rs = running(0, 30)
    inc = seq("new", priority=35)  # beats 0 by 35, but 30 only by 5
    assert preemption_victims(rs, inc, PRIO, 16, tok8) == []
    assert ids(preemption_victims(rs, inc, PRIO, 8, tok8)) == ["run0_p0"]


def test_preemption_uses_tokens_of():
    rs = running(0, 0)
    sizes = {rs[0].request_id: 100, rs[1].request_id: 3}
    assert ids(preemption_victims(rs, seq("new", priority=50), PRIO, 50, lambda s: sizes[s.request_id])) == \
        ["run1_p0", "run0_p0"]


def test_preemption_off():
    (r,) = running(0)
    inc = seq("new", priority=100)
    assert preemption_victims([r], inc, BASE, 8, tok8) == []
    assert preemption_victims([r], inc, replace(PRIO, disable_priority_preemption=True), 8, tok8) == []
    assert preemption_victims([r], inc, replace(PRIO, priority_preemption_threshold=100), 8, tok8) == []
    assert preemption_victims([r], inc, replace(PRIO, priority_preemption_threshold=99), 8, tok8) == [r]


def test_preemption_default_priority_for_unset():
    (r,) = running(None)  # least preferred by default
    assert preemption_victims([r], seq("new", priority=0), PRIO, 8, tok8) == [r]
    c = replace(PRIO, default_priority_value=0)
    assert preemption_victims([r], seq("new", priority=10), c, 8, tok8) == []
    assert preemption_victims([r], seq("new", priority=11), c, 8, tok8) == [r]


# -- queue limit ------------------------------------------------------------------------------------


def test_message_constants():
    assert QUEUE_FULL_MESSAGE == "The request queue is full."
    assert DISPLACED_MESSAGE == "The request is aborted by a higher priority request."


def test_queue_limit_without_priority():
    w = [seq("a"), seq("b")]
    assert queue_admission(w, seq("c"), BASE) == (True, [])  # no limit
    assert queue_admission(w, seq("c"), cfg(max_queued_requests=3)) == (True, [])
    assert queue_admission(w, seq("c"), cfg(max_queued_requests=2)) == (False, [])
    assert queue_admission([], seq("c"), cfg(max_queued_requests=1)) == (True, [])
    assert queue_admission([], seq("c"), cfg(max_queued_requests=0)) == (False, [])


def test_queue_full_with_priority_displaces_least_preferred_newest():
    c = replace(PRIO, max_queued_requests=3)
    w = [seq("p1_old", priority=1), seq("p5", priority=5), seq("p1_new", priority=1)]
    ok, displaced = queue_admission(w, seq("p2", priority=2), c)
    assert ok and displaced == [w[2]]
    assert queue_admission(w, seq("p1", priority=1), c) == (False, [])  # equal is not better
    assert queue_admission(w, seq("p0", priority=0), c) == (False, [])
    assert queue_admission(w, seq("none"), c) == (False, [])
    lo = replace(c, schedule_low_priority_values_first=True)
    ok, displaced = queue_admission(w, seq("p4", priority=4), lo)
    assert ok and displaced == [w[1]]


def test_queue_full_displaces_unset_priority_first():
    c = replace(PRIO, max_queued_requests=2)
    w = [seq("none_old"), seq("p0", priority=0)]
    ok, displaced = queue_admission(w, seq("p_neg", priority=-5), c)
    assert ok and displaced == [w[0]]
