"""DynamicSpeculation (trnrt.engine.spec.policy) without a model: who speculates, who falls back."""

from __future__ import annotations

import pytest

from trnrt.engine.spec.policy import DynamicSpeculation, StepCosts


def _policy(**kw) -> DynamicSpeculation:
    return DynamicSpeculation(min_accept_length=2.0, probe_verifies=4, probe_every=3, **kw)


def test_a_lone_request_gets_its_probe_verifies_before_it_falls_back():
    p = _policy()
    assert p.admit()
    for i in range(3):
        p.record("a", 0)
        assert not p.should_fall_back("a"), i  # 1..3 verifies: neither its own nor the engine's evidence is enough
    p.record("a", 0)
    assert p.should_fall_back("a")


def test_requests_whose_drafts_pay_never_fall_back():
    p = _policy()
    for _ in range(20):
        p.record("a", 3)
        assert not p.should_fall_back("a")
    assert p.recent_accept_length == 4.0


def test_with_the_engine_below_the_line_a_failing_request_falls_back_after_one_verify():
    """A batch of requests all at 0 %: one verify step gives the engine 4 verifies below the line,
    so every one of them falls back at once instead of paying 4 verifies each."""
    p = _policy()
    batch = [f"r{i}" for i in range(4)]
    for rid in batch:
        p.record(rid, 0)
    assert all(p.should_fall_back(rid) for rid in batch)


def test_a_good_request_keeps_speculating_among_failing_ones():
    p = _policy()
    for rid in ("b1", "b2", "b3", "b4"):
        p.record(rid, 0)
    p.record("good", 3)  # 4 tokens from its first verify: above the line on its own
    assert not p.should_fall_back("good")
    assert p.should_fall_back("b1")


def test_mixed_evidence_above_the_line_leaves_the_per_request_rule():
    """Half the requests accept everything: the engine average is 2.5 tokens a verify, above the
    line, so the failing ones keep their probe_verifies verifies."""
    p = _policy()
    for _ in range(3):
        for rid, acc in (("g1", 3), ("g2", 3), ("b1", 0), ("b2", 0)):
            p.record(rid, acc)
        assert not p.should_fall_back("b1")
    p.record("b1", 0)
    assert p.should_fall_back("b1")


def test_the_gate_lets_one_new_request_in_probe_every_speculate():
    p = _policy()
    assert [p.admit() for _ in range(3)] == [True] * 3  # no evidence yet
    for i in range(4):
        p.record(f"r{i}", 0)
    assert [p.admit() for _ in range(6)] == [False, False, True, False, False, True]
    assert p.num_gated == 4


def test_the_window_forgets_old_verifies():
    """The gate opens again once the last `window` verifies pay (a traffic change)."""
    p = _policy(window=8)
    for i in range(8):
        p.record(f"old{i}", 0)
    assert p.admit() is False
    for i in range(8):
        p.record(f"new{i}", 3)
    assert p.recent_accept_length == 4.0
    assert p.admit() is True


def test_forget_drops_a_request():
    p = _policy()
    for _ in range(4):
        p.record("a", 0)
    p.forget("a")
    assert not p.should_fall_back("a")  # nothing recorded for it any more
    assert p._own == {}


def test_min_accept_length_must_be_positive():
    with pytest.raises(ValueError):
        DynamicSpeculation(0.0)


def test_a_measured_break_even_above_the_floor_is_the_line():
    """Drafts that give 4 tokens a verify pay against a floor of 2, not where a speculative step
    costs 6 plain ones."""
    p = _policy()
    for rid in ("a", "b", "c", "d"):
        p.record(rid, 3)
    assert not p.should_fall_back("a") and p.admit()
    p.break_even = 6.0
    assert p.line == 6.0
    assert p.should_fall_back("a")  # the engine's 4 verifies are below the line too: one verify is enough
    assert not p.admit()
    p.break_even = 1.2  # a memory-bound accelerator: the floor stands
    assert p.line == 2.0 and not p.should_fall_back("a")


def _costs(**kw) -> StepCosts:
    return StepCosts(lambda n: 1 if n <= 1 else 8 if n <= 8 else 32, 32, **kw)


def test_step_costs_skip_the_first_speculative_step_and_average():
    c = _costs(alpha=0.5)
    c.observe_spec(8, 1.0)  # the first call of the bucket: graph loading, not counted
    c.observe_plain(8, 0.002)
    assert c.break_even(8) is None and c.missing_plain(8) == [] and c.missing_plain(1, 8) == [1]
    c.observe_spec(8, 0.006)
    assert c.break_even(8) == pytest.approx(3.0)
    c.observe_spec(8, 0.010)  # averaged: 0.006 + 0.5 * (0.010 - 0.006)
    assert c.break_even(8) == pytest.approx(4.0) == c.snapshot()[8]["break_even"]
    assert c.snapshot()[8]["spec_s"] == pytest.approx(0.008)
    assert c.break_even(1) is None


def test_the_line_of_a_mixed_step_counts_what_the_plain_call_would_have_carried():
    """7 plain rows and 1 speculative row: two calls (plain b8 2 ms + speculative b1 2 ms) for
    7 + a tokens against one plain b8 call (2 ms) for 8: the row must give 9 tokens a verify
    (8 * 4 / 2 - 7), not the 2 of a b1 step alone (2 ms / 1 ms)."""
    c = _costs()
    for b, plain, spec in ((1, 0.001, 0.002), (8, 0.002, 0.004)):
        c.observe_plain(b, plain)
        c.observe_spec(b, spec)
        c.observe_spec(b, spec)
    assert c.line(0, 1) == pytest.approx(2.0)
    assert c.line(7, 1) == pytest.approx(9.0)
    assert c.line(0, 8) == pytest.approx(2.0)
    # 1 plain row beside 7 speculative ones: (8 * (1 + 4) / 2 - 1) / 7
    assert c.line(1, 7) == pytest.approx(19 / 7)
    # past the largest bucket rows run in several calls
    assert c.buckets(40) == [32, 8] and c.missing_plain(40) == [32]
    assert c.line(0, 40) is None and c.line(0, 0) is None


def test_failed_probes_back_off_and_an_open_gate_resets_the_interval():
    p = DynamicSpeculation(min_accept_length=2.0, probe_verifies=4, probe_every=2, max_probe_every=8)
    for i in range(4):
        p.record(f"r{i}", 0)
    seen = []
    for n in range(40):
        rid = f"n{n}"
        if p.admit(rid):
            seen.append(n)
            p.record(rid, 0)
            assert p.should_fall_back(rid)
            p.fell_back(rid)
    assert seen == [1, 5, 13, 21, 29, 37], seen  # every 2nd, then 4th, then 8th (the cap)
    assert p.probe_interval == 8
    for i in range(100):  # the traffic changes: drafts pay again
        p.record(f"g{i}", 3)
    assert p.admit("x") and p.probe_interval == 2


def test_the_gate_judges_a_new_request_by_the_step_it_would_join():
    """Drafts give 4 tokens a verify: alone at batch 1 (break-even 1.4) a new request speculates;
    beside 7 plain rows (break-even 14) it starts plain; unknown costs: the latest step's line."""
    p = _policy()
    for i in range(4):
        p.record(f"r{i}", 3)
    assert p.admit("a", line=1.4)
    assert not p.admit("b", line=14.0)
    p.break_even = 5.0
    assert not p.admit("c") and p.admit("d", line=3.0)


def test_a_request_falls_back_once_its_probes_cannot_reach_the_line():
    """k = 3 (at most 4 tokens a verify), line 3, 4 probe verifies (12 tokens needed): after two
    verifies of 1 token, two more could bring at most 8: 10 < 12, so it falls back at the second
    (not the fourth); one whose drafts were accepted goes on."""
    p = DynamicSpeculation(min_accept_length=3.0, probe_verifies=4, probe_every=3, max_tokens_per_verify=4)
    p.record("a", 0)
    assert not p.should_fall_back("a")  # 1 + 3 * 4 = 13 >= 12: still possible
    p.record("a", 0)
    assert p.should_fall_back("a")
    p = DynamicSpeculation(min_accept_length=3.0, probe_verifies=4, probe_every=3, max_tokens_per_verify=4)
    p.record("b", 3)
    p.record("b", 0)
    assert not p.should_fall_back("b")  # 5 + 8 = 13 >= 12 (and its average 2.5 is under the line)
    # without the bound (the old rule): all four probes
    q = DynamicSpeculation(min_accept_length=3.0, probe_verifies=4, probe_every=3)
    for _ in range(3):
        q.record("a", 0)
        assert not q.should_fall_back("a")


def test_a_line_no_acceptance_reaches_falls_back_after_one_verify_and_closes_the_gate():
    """A measured break-even at k + 1 or more: not even every draft accepted pays."""
    p = DynamicSpeculation(min_accept_length=1.5, probe_verifies=4, probe_every=3, max_tokens_per_verify=4)
    assert p.admit("a")  # no measured line yet: the floor 1.5
    p.break_even = 4.5
    p.record("a", 3)  # even a full acceptance is under the line
    assert p.should_fall_back("a")
    p.fell_back("a")
    assert [p.admit(f"n{i}") for i in range(3)] == [False, False, True]  # the gate: probes only
    assert p.admit("m", line=2.0)  # a step whose line is lower (fewer rows beside) is judged by its own


def test_seeded_costs_stay_a_pair_until_a_speculative_call_is_measured():
    c = StepCosts(lambda n: 1 if n <= 1 else 8, max_batch=8)
    c.seed(1, spec_s=4.0, plain_s=1.0)
    assert c.line(0, 1) == 4.0
    c.observe_plain(1, 2.0)  # a measured plain call (with the step's Python work): not mixed in
    assert c.line(0, 1) == 4.0
    c.observe_spec(1, 9.0)  # the first speculative call of a bucket: not counted
    assert c.line(0, 1) == 4.0
    c.observe_spec(1, 3.0)  # the first measured one replaces the estimate; plain is measured again
    assert c.missing_plain(1) == [1] and c.line(0, 1) is None
    c.observe_plain(1, 1.5)
    assert c.line(0, 1) == 2.0
    c.seed(1, spec_s=10.0, plain_s=1.0)  # a bucket with measurements keeps them
    assert c.line(0, 1) == 2.0
