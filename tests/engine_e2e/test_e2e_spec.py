"""Speculative decoding through the engine (eager): greedy output equals plain decoding token for
token, with the test-only oracle drafter forcing full, partial and zero acceptance at known
positions, batched, queued, preempted and with aborts mid-speculation; the MTP drafter of the
tiny checkpoint; requests the verify cannot serve run plain beside speculative ones; nothing leaks.

The oracle tests run on every `mtp-*` preset's own engine config (its k, its speculative mode and
minimum, its buckets) against the `default` preset's engine (whose greedy output is held to
transformers' here), both with the same small cache, so they queue and preempt (the speculative
engine's look-ahead pages make it preempt more). The cache size is not a graph-shaping difference
between the two (it is the same override on both), and the compiled verify / draft graphs of
mtp-always are held to these eager steps by tests/compile/test_compile_spec.py.
"""

from __future__ import annotations

import time

import pytest

from e2e_helpers import collect
from trnrt.engine.request import GenerateRequest, SamplingParams

K = 3
N_OUT = 24
V = 4096


def _mtp_presets() -> list[str]:
    from trnrt.config.presets import list_presets, load_preset

    return [p for p in list_presets() if load_preset(p).speculative_num_steps]


MTP_PRESETS = _mtp_presets()


def _configs():
    from trnrt.config import EngineConfig
    from trnrt.engine.sched.scheduler import SchedulerConfig

    ecfg = EngineConfig(max_model_len=256, block_size=16, num_blocks=256 // 16 + 1 + 4, num_slots=5,
                        decode_batch_buckets=(1, 2, 4), prefill_token_buckets=(16, 64))
    scfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, max_prefill_chunk_tokens=64)
    return ecfg, scfg


def _preset_configs(preset: str):
    """`preset`'s engine config with small_engine's cache (4 running sequences of up to 256 tokens
    in 20 usable pages: they preempt) and scheduler."""
    from trnrt.config.presets import load_preset

    ecfg, scfg = _configs()
    cfg = load_preset(preset).replace(max_model_len=ecfg.max_model_len, num_blocks=ecfg.num_blocks,
                                      num_slots=ecfg.num_slots)
    return cfg, scfg


def test_every_mtp_preset_is_tested():
    assert {"mtp-always", "mtp-dynamic"} <= set(MTP_PRESETS), MTP_PRESETS


@pytest.fixture(scope="module")
def reference(model_dir, hf_model, random_prompts):
    """rid -> prompt + greedy output (N_OUT tokens) of the `default` preset's engine, which equals
    transformers' greedy generate for every prompt."""
    from test_e2e_parity import hf_greedy

    from trnrt.engine.core.engine import Engine

    ecfg, scfg = _preset_configs("default")
    engine = Engine.from_model_dir(model_dir, engine_config=ecfg, scheduler_config=scfg)
    try:
        streams = [_submit(engine, f"r{i}", p, max_new_tokens=N_OUT) for i, p in enumerate(random_prompts)]
        outs = [collect(s, timeout=300) for s in streams]
    finally:
        engine.shutdown()
    ref = {}
    for i, (p, o) in enumerate(zip(random_prompts, outs)):
        assert o.error is None and len(o.output_ids) == N_OUT, o
        assert o.output_ids == hf_greedy(hf_model, p, N_OUT), f"default preset != transformers on prompt {i}"
        ref[f"r{i}"] = list(p) + o.output_ids
    return ref


@pytest.fixture(scope="module")
def oracle_engines(model_dir):
    """preset -> an engine on that mtp-* preset's config with the oracle drafter (made on first use,
    shut down at the end of the module)."""
    from trnrt.engine.core.engine import Engine
    from trnrt.engine.spec.oracle import OracleDrafter

    engines: dict = {}

    def get(preset: str):
        if preset not in engines:
            oracle = OracleDrafter({}, V)
            ecfg, scfg = _preset_configs(preset)
            engine = Engine.from_model_dir(model_dir, engine_config=ecfg, scheduler_config=scfg,
                                           drafter_factory=lambda runner: oracle)
            assert engine.speculative_config is not None, f"{preset} did not turn speculation on"
            _acceptance_only(engine)
            engine.oracle = oracle
            engines[preset] = engine
        return engines[preset]

    yield get
    for engine in engines.values():
        engine.shutdown()


def _acceptance_only(engine):
    """Dynamic speculation judged on acceptance alone (against min_accept_length): the measured
    break-even (the runner's StepCosts) depends on this machine's speed, and these tests check
    which requests fall back at known acceptance. test_dynamic_line_follows_the_measured_costs
    covers the measured line."""
    engine.runner.step_costs.line = lambda num_plain, num_spec: None
    return engine


def _record_verifies(engine):
    """Wrap the runner's SpecDecoder.step: a list of (request id, start_pos, drafts, accepted)."""
    dec = engine.runner.decoder
    inner = dec.step
    log = []

    def step(rows, ks=None):
        outs = inner(rows, ks)
        log.extend((r.request_id, r.start_pos, len(o.drafts), o.num_accepted) for r, o in zip(rows, outs))
        return outs

    dec.step = step
    return log


def _assert_clean(engine):
    from e2e_helpers import assert_clean

    assert_clean(engine)
    pool = engine.runner.decoder.snapshots.pool
    assert pool.num_free == engine.runner._reserve, "a rollback checkpoint leaked"


def _submit(engine, rid, ids, **params):
    params.setdefault("ignore_eos", True)
    params.setdefault("temperature", 0.0)
    return engine.submit(GenerateRequest(prompt_token_ids=list(ids), sampling_params=SamplingParams(**params),
                                         request_id=rid))


@pytest.mark.parametrize("preset", MTP_PRESETS)
def test_greedy_equals_default_with_full_partial_and_zero_acceptance(preset, oracle_engines, reference,
                                                                     random_prompts):
    """16 prompts, batched behind max_num_seqs and preempted: every request's greedy output is the
    default preset's (transformers'), every verify accepted exactly the drafts the oracle's
    corruption allows, and all of full, partial and zero acceptance happened."""
    engine = oracle_engines(preset)
    oracle, spec = engine.oracle, engine.speculative_config
    K = spec.num_steps
    dynamic = spec.min_accept_length > 0
    fallbacks_before = engine.num_spec_fallbacks
    oracle.sequences = dict(reference)
    corrupt = {}
    for i, p in enumerate(random_prompts):
        rid, L = f"r{i}", len(p)
        if i % 4 == 1:  # zero acceptance: every draft wrong
            corrupt[rid] = set(range(L, L + N_OUT + K + 2))
        elif i % 4 == 2:  # partial: every third position wrong
            corrupt[rid] = set(range(L + 1, L + N_OUT + K + 2, 3))
        elif i % 4 == 3:  # a few wrong drafts
            corrupt[rid] = {L + 2, L + 9, L + 10}
    oracle.corrupt = corrupt
    log = _record_verifies(engine)
    before = engine.scheduler.num_preemptions_total
    try:
        streams = [_submit(engine, f"r{i}", p, max_new_tokens=N_OUT) for i, p in enumerate(random_prompts)]
        outs = {s.request_id: collect(s, timeout=300) for s in streams}
    finally:
        del engine.runner.decoder.step
    for i, p in enumerate(random_prompts):
        rid = f"r{i}"
        assert outs[rid].error is None, outs[rid]
        assert outs[rid].output_ids == reference[rid][len(p):], rid
    # every verify accepted exactly what the oracle's corruption allows
    assert log
    for rid, L, k, n in log:
        assert n == oracle.expected_accepted(rid, L, k), (rid, L, k, n)
    acc = {}
    for rid, _, k, n in log:
        if k:
            a = acc.setdefault(rid, [0, 0, 0])  # drafts, accepted, verifies
            a[0] += k
            a[1] += n
            a[2] += 1
    # full, partial and zero acceptance all happened (verify by verify)
    assert any(k and n == k == K for _, _, k, n in log), "no verify accepted every draft"
    assert any(k and 0 < n < k for _, _, k, n in log), "no verify accepted some drafts only"
    assert any(k and n == 0 for _, _, k, n in log), "no verify rejected every draft"
    full = [f"r{i}" for i in range(0, 16, 4)]
    zero = [f"r{i}" for i in range(1, 16, 4)]
    assert all(acc[r][1] == acc[r][0] for r in full if r in acc), acc  # nothing corrupted: all accepted
    assert all(acc[r][1] == 0 for r in zero if r in acc), acc
    assert any(0 < acc[f"r{i}"][1] < acc[f"r{i}"][0] for i in range(2, 16, 4) if f"r{i}" in acc), acc
    if not dynamic:  # always: every request speculated on every decode step
        assert set(acc) == set(reference), sorted(set(reference) - set(acc))
    else:
        # dynamic: a zero-acceptance request stops speculating after its probe verifies (it goes on
        # with plain steps), a fully accepted one keeps speculating past them
        assert any(r in acc for r in zero) and engine.num_spec_fallbacks > fallbacks_before
        assert all(acc[r][2] <= spec.probe_verifies for r in zero if r in acc), acc
        assert any(acc[r][2] > spec.probe_verifies for r in full if r in acc), acc
    assert engine.scheduler.num_preemptions_total > before, "no preemption happened: shrink the cache"
    _assert_clean(engine)


@pytest.mark.parametrize("preset", MTP_PRESETS)
def test_aborts_mid_speculation_free_everything(preset, oracle_engines, reference, random_prompts):
    engine = oracle_engines(preset)
    oracle = engine.oracle
    oracle.sequences = dict(reference)
    oracle.corrupt = {}
    oracle.check = False  # past the recorded run the drafts are token 0 (rejected): still correct
    log = _record_verifies(engine)
    try:
        streams = [_submit(engine, f"r{i}", random_prompts[i], max_new_tokens=60)
                   for i in (2, 4, 5, 7)]
        deadline = time.monotonic() + 60
        while len(log) < 6:
            assert time.monotonic() < deadline, "no speculative step ran"
            time.sleep(0.01)
        for s in streams[:2]:
            engine.abort(s.request_id)
        outs = [collect(s, timeout=300) for s in streams]
    finally:
        del engine.runner.decoder.step
        oracle.check = True
    for o in outs[:2]:
        assert o.finish_reason.type == "abort", o
    for o, i in zip(outs[2:], (5, 7)):
        assert o.error is None and o.output_ids[:N_OUT] == reference[f"r{i}"][len(random_prompts[i]):], o
    assert engine.runner.drafter.proposals  # the oracle drafted
    _assert_clean(engine)


def test_requests_the_verify_cannot_serve_run_plain_beside_it(oracle_engines, reference, random_prompts):
    engine = oracle_engines("mtp-always")
    oracle = engine.oracle
    oracle.sequences = dict(reference)
    oracle.corrupt = {}
    seen = []
    inner = engine.runner.execute

    def execute(rows):
        seen.extend((r.request_id, r.speculative) for r in rows)
        return inner(rows)

    engine.runner.execute = execute
    try:
        a = _submit(engine, "r3", random_prompts[3], max_new_tokens=N_OUT)
        b = _submit(engine, "r5", random_prompts[5], max_new_tokens=N_OUT, logprobs=2)
        ca, cb = collect(a, timeout=300), collect(b, timeout=300)
    finally:
        del engine.runner.execute
    assert ca.output_ids == reference["r3"][len(random_prompts[3]):]
    assert cb.output_ids == reference["r5"][len(random_prompts[5]):]
    assert {s for r, s in seen if r == "r3"} == {True} and {s for r, s in seen if r == "r5"} == {False}
    _assert_clean(engine)


def test_mtp_drafter_through_the_engine(model_dir, reference, random_prompts):
    """The tiny checkpoint's own MTP layer drafts (a random layer: few drafts accepted); the greedy
    output is still plain decoding's, seeded sampling is reproducible, and the drafter forgets
    every finished request."""
    from trnrt.engine.core.engine import Engine
    from trnrt.engine.spec.config import SpeculativeConfig

    ecfg, scfg = _configs()
    engine = Engine.from_model_dir(model_dir, engine_config=ecfg, scheduler_config=scfg,
                                   speculative=SpeculativeConfig(num_steps=2))
    try:
        idx = [0, 3, 8, 12]
        streams = [_submit(engine, f"r{i}", random_prompts[i], max_new_tokens=N_OUT) for i in idx]
        for s, i in zip(streams, idx):
            assert collect(s, timeout=300).output_ids == reference[f"r{i}"][len(random_prompts[i]):], i
        sampled = [collect(_submit(engine, f"s{j}", random_prompts[3], max_new_tokens=12, temperature=1.0,
                                   seed=7)).output_ids for j in range(2)]
        assert sampled[0] == sampled[1] and len(sampled[0]) == 12
        st = engine.stats()["speculative"]
        assert st["enabled"] and st["num_verifies"] > 0 and st["num_draft_tokens"] > 0, st
        _assert_clean(engine)
        assert engine.runner.drafter._computed == {} and engine.runner.drafter._pending == {}
    finally:
        engine.shutdown()


def test_dynamic_speculation_falls_back_where_drafts_fail(model_dir, reference, random_prompts):
    """min_accept_length 2: requests whose drafts are all wrong go on with plain steps once their
    probe verifies cannot reach the line (same output), those whose drafts are right keep
    speculating."""
    from trnrt.engine.core.engine import Engine
    from trnrt.engine.spec.config import SpeculativeConfig
    from trnrt.engine.spec.oracle import OracleDrafter

    idx = [0, 3, 8, 12]
    bad = {"r3", "r12"}
    corrupt = {f"r{i}": set(range(len(random_prompts[i]), 400)) for i in idx if f"r{i}" in bad}
    oracle = OracleDrafter(reference, V, corrupt)
    ecfg, scfg = _configs()
    engine = Engine.from_model_dir(model_dir, engine_config=ecfg, scheduler_config=scfg,
                                   speculative=SpeculativeConfig(num_steps=K, min_accept_length=2.0),
                                   drafter_factory=lambda runner: oracle)
    _acceptance_only(engine)
    try:
        log = _record_verifies(engine)
        streams = [_submit(engine, f"r{i}", random_prompts[i], max_new_tokens=N_OUT) for i in idx]
        for s, i in zip(streams, idx):
            assert collect(s, timeout=300).output_ids == reference[f"r{i}"][len(random_prompts[i]):], i
        verifies = {}
        for rid, _, k, _ in log:
            if k:
                verifies[rid] = verifies.get(rid, 0) + 1
        assert engine.num_spec_fallbacks == 2
        # each bad request: its probe verifies until the rest could not reach the line even
        # with every draft accepted (2 tokens a verify over 4 probes: 8; after 3 verifies of 1
        # token one more brings at most K + 1), i.e. before all of its probe verifies
        probes = engine.speculative_config.probe_verifies
        want = next(n for n in range(1, probes + 1) if n == probes or n + (probes - n) * (K + 1) < 2.0 * probes)
        assert want < probes and all(verifies[r] == want for r in bad), (want, verifies)
        assert all(r in verifies and r not in bad for r in verifies if r not in bad)
        _assert_clean(engine)
    finally:
        engine.shutdown()


def test_dynamic_speculation_gates_new_requests_while_drafts_do_not_pay(model_dir, reference, random_prompts):
    """Every draft wrong: the first request probes and falls back; the next ones start plain
    (no drafter work at all) except one in probe_every, which measures again and falls back
    after one verify."""
    from trnrt.engine.core.engine import Engine
    from trnrt.engine.spec.config import SpeculativeConfig
    from trnrt.engine.spec.oracle import OracleDrafter

    oracle = OracleDrafter(reference, V, {rid: set(range(0, 400)) for rid in reference})
    ecfg, scfg = _configs()
    cfg = SpeculativeConfig(num_steps=K, min_accept_length=2.0, probe_every=3)
    engine = Engine.from_model_dir(model_dir, engine_config=ecfg, scheduler_config=scfg, speculative=cfg,
                                   drafter_factory=lambda runner: oracle)
    _acceptance_only(engine)
    try:
        log = _record_verifies(engine)
        order = [0, 3, 8, 12, 5, 7]
        for i in order:  # one at a time: each admission sees the verifies before it
            out = collect(_submit(engine, f"r{i}", random_prompts[i], max_new_tokens=12), timeout=300)
            assert out.output_ids == reference[f"r{i}"][len(random_prompts[i]):12 + len(random_prompts[i])], i
        probed = [f"r{i}" for i in order if any(rid == f"r{i}" and k for rid, _, k, _ in log)]
        verifies = {r: sum(1 for rid, _, k, _ in log if rid == r and k) for r in probed}
        # r0 probes alone: 3 verifies (then a 4th of K + 1 tokens could not lift 3 + 4 to the
        # line's 2 x 4). The engine holds 3 verifies, fewer than probe_verifies: r3 speculates
        # too and falls back after one (now the engine's last 4 verifies are below the line). Then
        # the gate lets every third new request through (r8, r12 plain, r5 probes, r7 plain); the
        # probe falls back after one verify (the engine's evidence counts).
        assert probed == ["r0", "r3", "r5"], probed
        assert verifies == {"r0": cfg.probe_verifies - 1, "r3": 1, "r5": 1}, verifies
        assert engine.num_spec_fallbacks == 3 and engine.spec_policy.num_gated == 3
        _assert_clean(engine)
    finally:
        engine.shutdown()


def test_dynamic_line_follows_the_measured_costs(model_dir, reference, random_prompts):
    """Every draft right (4 tokens a verify, above the configured floor of 1): the runner times
    its speculative and plain decode steps per batch bucket and the policy's line is their ratio.
    Where that ratio is above what the drafts give (pinned at 10 here), new requests start plain."""
    from trnrt.engine.core.engine import Engine
    from trnrt.engine.spec.config import SpeculativeConfig
    from trnrt.engine.spec.oracle import OracleDrafter

    oracle = OracleDrafter(reference, V)
    ecfg, scfg = _configs()
    engine = Engine.from_model_dir(model_dir, engine_config=ecfg, scheduler_config=scfg,
                                   speculative=SpeculativeConfig(num_steps=K, min_accept_length=1.0),
                                   drafter_factory=lambda runner: oracle)
    try:
        idx = [0, 3, 8, 12]
        streams = [_submit(engine, f"r{i}", random_prompts[i], max_new_tokens=16) for i in idx]
        for s, i in zip(streams, idx):
            assert collect(s, timeout=300).output_ids == reference[f"r{i}"][len(random_prompts[i]):][:16], i
        costs, policy = engine.runner.step_costs, engine.spec_policy
        measured = {b: c for b, c in costs.snapshot().items() if c["break_even"] is not None}
        # a speculative bucket got its plain comparison (timed on padding rows if no plain step ran)
        assert measured and all(c["spec_s"] > 0 and c["plain_s"] > 0 for c in measured.values()), costs.snapshot()
        assert policy.break_even is not None and policy.break_even > 0, policy.break_even  # a step's line
        assert policy.line == max(1.0, policy.break_even)
        engine.runner.step_costs.line = lambda num_plain, num_spec: 10.0  # speculation "costs" 10 plain steps
        policy.break_even = 10.0
        gated = policy.num_gated
        streams = [_submit(engine, f"r{i}", random_prompts[i], max_new_tokens=8) for i in (5, 7)]
        for s, i in zip(streams, (5, 7)):
            assert collect(s, timeout=300).output_ids == reference[f"r{i}"][len(random_prompts[i]):][:8], i
        # the last verifies gave at most 4 tokens each, below the line of 10: both new requests ran plain
        assert policy.recent_accept_length <= K + 1 and policy.num_gated == gated + 2
        # /v1/stats shows it (the engine entry's speculative_dynamic section)
        import json

        sec = json.loads(json.dumps(engine.stats()["engines"][0]["speculative_dynamic"]))
        assert sec["line"] == 10.0 and sec["min_accept_length"] == 1.0 and sec["num_started_plain"] == policy.num_gated
        assert sec["num_fallbacks"] == engine.num_spec_fallbacks
        assert {int(b) for b in sec["by_batch_bucket"]} == set(costs.snapshot())
        _assert_clean(engine)
    finally:
        engine.shutdown()


def _fake_graphs(cfg, calls, seconds, fail=False):
    """compiled_loader -> {spec: callable} for batch bucket 4's greedy decode, verify and draft at
    the smallest context: each records its inputs and sleeps `seconds[phase]` (or raises)."""
    from trnrt.engine.runner.step import GraphSpec

    ctx = cfg.context_bucket(1)
    specs = [GraphSpec("decode", 4, 1, "base", "greedy", ctx), GraphSpec("verify", 4, K + 1, "base", "greedy", ctx),
             GraphSpec("draft", 4, K + 1, "base", "greedy", ctx)]

    def make(spec):
        def fn(*inputs):
            calls.append((spec.graph_id, [t.clone() for t in inputs]))
            if fail:
                raise RuntimeError("a graph that cannot run")
            time.sleep(seconds[spec.phase])
        return fn

    return lambda model, state, ecfg: {s: make(s) for s in specs}


def test_warm_up_calls_every_compiled_graph_on_padding_rows_and_seeds_the_line(model_dir, reference, random_prompts):
    """A compiled engine calls each of its graphs before it is returned, on padding rows only
    (num_new 0, slot 0: the requests' state is untouched, so output stays plain decoding's), not
    counted as requests' graph calls; a dynamic engine's line starts from those call times: a
    speculative step that accepts nothing (draft + verify + the plain re-run: 7x decode here, above
    k + 1, so no acceptance pays and new requests start plain)."""
    from trnrt.engine.core.engine import Engine
    from trnrt.engine.spec.config import SpeculativeConfig

    ecfg, scfg = _configs()
    calls: list = []
    loader = _fake_graphs(ecfg, calls, {"decode": 0.002, "verify": 0.008, "draft": 0.004})
    engine = Engine.from_model_dir(model_dir, engine_config=ecfg, scheduler_config=scfg, compiled_loader=loader,
                                   speculative=SpeculativeConfig(num_steps=K, min_accept_length=1.5))
    try:
        ids = [gid for gid, _ in calls]
        # twice each (the warm-up), then 5 timed calls of each graph the line's seed reads
        assert len(set(ids)) == 3 and all(ids.count(g) == 2 + 5 for g in ids), ids
        for gid, inputs in calls:
            num_new, slot_ids = (inputs[2], inputs[4])
            assert not num_new.any() and not slot_ids.any(), gid  # padding rows only
        assert engine.warmup_s > 0 and engine.runner.num_graph_calls == {}
        costs = engine.runner.step_costs.snapshot()
        assert set(costs) == {4}  # the bucket with all three graphs
        assert costs[4]["break_even"] == pytest.approx(7.0, rel=0.4)
        assert engine.runner.step_costs.line(0, 4) >= K + 1
        # batch-4 rows would take the fakes: run requests one at a time (bucket 1, eager)
        out = collect(_submit(engine, "r0", random_prompts[0], max_new_tokens=N_OUT), timeout=300)
        assert out.output_ids == reference["r0"][len(random_prompts[0]):]
    finally:
        engine.shutdown()


def test_a_failing_warm_up_is_logged_and_the_engine_serves(model_dir, reference, random_prompts, caplog):
    from trnrt.engine.core.engine import Engine

    ecfg, scfg = _configs()
    calls: list = []
    with caplog.at_level("WARNING", logger="trnrt.engine.core.engine"):
        engine = Engine.from_model_dir(model_dir, engine_config=ecfg, scheduler_config=scfg,
                                       compiled_loader=_fake_graphs(ecfg, calls, {}, fail=True))
    try:
        assert len(calls) == 1 and "warm-up of the compiled graphs failed" in caplog.text
        out = collect(_submit(engine, "r0", random_prompts[0], max_new_tokens=N_OUT), timeout=300)
        assert out.output_ids == reference["r0"][len(random_prompts[0]):]
    finally:
        engine.shutdown()
