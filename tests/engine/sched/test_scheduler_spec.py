"""Scheduler with speculative decode steps, driven by a fake runner (no model): look-ahead pages
and budget, multi-token updates, stops inside the accepted tokens, the max_new_tokens and
max_model_len limits, preemption, the prefix cache left alone, dynamic fallback."""

from __future__ import annotations

import random

from trnrt.engine.cache.cache_manager import CacheManager, cdiv
from trnrt.engine.output.outputs import RunnerOutput, SchedulerOutput
from trnrt.engine.request import GenerateRequest, SamplingParams
from trnrt.engine.sched.scheduler import Scheduler, SchedulerConfig

from test_scheduler import EOS, next_token


class SpecFakeRunner:
    """Each slot's state is the token list fed so far; the target's next token is next_token(state).
    A speculative decode row drafts the true continuation, except that a draft is wrong with
    probability `wrong` (seeded): it accepts up to the first wrong draft and emits the target's
    token there (or the bonus), and its state advances by exactly the accepted tokens + 1."""

    def __init__(self, block_size: int, wrong: float = 0.3, seed: int = 0, max_model_len: int = 128):
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.state: dict[int, list[int]] = {}
        self.wrong = wrong
        self.rng = random.Random(seed)
        self.verifies: list[tuple[str, int, int]] = []  # (request, drafts, accepted)

    def __call__(self, so: SchedulerOutput) -> RunnerOutput:
        tokens, extras = [], []
        for e in so.scheduled:
            st = [] if e.num_computed_tokens == 0 else self.state[e.slot_id]
            assert len(st) == e.num_computed_tokens, (e.request_id, len(st), e.num_computed_tokens)
            k = e.num_lookahead
            if k:
                assert e.speculative and not e.is_prefill and len(e.token_ids) == 1
                # never a draft whose token could not be kept: k + 1 emitted tokens fit both limits
                assert e.num_output_tokens + k + 1 <= e.sampling_params.max_new_tokens, e
                assert e.num_computed_tokens + 1 + k + 1 <= self.max_model_len, e
            # the block table covers every position the verify writes
            assert len(e.block_table) >= cdiv(len(st) + len(e.token_ids) + k, self.block_size), e
            st = st + e.token_ids
            emitted = []
            if e.do_sample:
                for _ in range(k):
                    t = next_token(st)
                    if self.rng.random() < self.wrong:
                        break  # draft rejected: the target's token below is the correction
                    emitted.append(t)
                    st = st + [t]
                if k:
                    self.verifies.append((e.request_id, k, len(emitted)))
                emitted.append(next_token(st))  # correction / bonus (not fed yet)
            self.state[e.slot_id] = st
            tokens.append(emitted[0] if emitted else None)
            extras.append(emitted[1:])
        return RunnerOutput(sampled_token_ids=tokens, extra_token_ids=extras)


def make(k=3, budget=64, max_model_len=128, num_blocks=64, block_size=4, num_slots=9, max_num_seqs=4, **kw):
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
                          num_speculative_tokens=k, **kw)
    return Scheduler(cfg, CacheManager(num_blocks, block_size, num_slots), eos_token_ids=[EOS])


def run(sched, runner, reqs, speculative=True, max_steps=2000, cached_pages_ok=False):
    for r in reqs:
        sched.add_request(r, speculative=speculative)
    outs = {r.request_id: [] for r in reqs}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        budget = sum(e.num_new_tokens + e.num_lookahead for e in so.scheduled)
        assert budget <= sched.config.max_num_batched_tokens
        for u in sched.update_from_output(so, runner(so)):
            outs[u.request_id].extend(u.new_token_ids)
        sched.check_integrity()
    assert not sched.has_unfinished_requests()
    assert sched.cache.num_used_slots == 0
    assert cached_pages_ok or sched.cache.num_used_blocks == 0
    return outs


def reqs(n=6, max_new=20, seed=1, **sp):
    rng = random.Random(seed)
    return [GenerateRequest(prompt_token_ids=[rng.randrange(10, 900) for _ in range(rng.randrange(1, 30))],
                            sampling_params=SamplingParams(max_new_tokens=max_new, ignore_eos=True, **sp),
                            request_id=f"q{i}") for i in range(n)]


def test_speculative_output_equals_plain_decoding():
    plain = run(make(k=0), SpecFakeRunner(4), reqs(), speculative=False)
    runner = SpecFakeRunner(4, wrong=0.3)
    spec = run(make(k=3), runner, reqs())
    assert spec == plain
    assert all(len(v) == 20 for v in spec.values())  # max_new_tokens exactly, never past it
    assert any(n == 3 for _, _, n in runner.verifies) and any(n == 0 for _, _, n in runner.verifies)
    assert len(runner.verifies) < sum(len(v) for v in spec.values())  # fewer steps than tokens


def test_drafts_are_cut_at_max_new_tokens_max_model_len_and_the_budget():
    runner = SpecFakeRunner(4, wrong=0.0, max_model_len=40)
    sched = make(k=4, max_model_len=40)
    r = GenerateRequest(prompt_token_ids=list(range(10, 30)), request_id="a",
                        sampling_params=SamplingParams(max_new_tokens=100, ignore_eos=True))
    out = run(sched, runner, [r])
    assert len(out["a"]) == 40 - 20  # stopped at max_model_len, never past it
    ks = [k for _, k, _ in runner.verifies]
    assert max(ks) == 4 and ks[-1] < 4  # the last verify was cut to what the context leaves
    # the budget: 3 decoding sequences in a 6-token budget cannot all verify 4 drafts
    sched = make(k=4, budget=6)
    runner = SpecFakeRunner(4, wrong=0.0)
    run(sched, runner, reqs(n=3, max_new=12))
    assert runner.verifies


def test_a_stop_inside_the_accepted_tokens_drops_the_rest():
    runner = SpecFakeRunner(4, wrong=0.0)
    ref = run(make(k=0), SpecFakeRunner(4), reqs(n=1, max_new=30), speculative=False)["q0"]
    stop = ref[7]
    runner = SpecFakeRunner(4, wrong=0.0)
    r = reqs(n=1, max_new=30)[0]
    r.sampling_params = SamplingParams(max_new_tokens=30, stop_token_ids=[stop])
    out = run(make(k=3), runner, [r])["q0"]
    assert out == ref[: ref.index(stop) + 1]


def test_preemption_under_speculation_keeps_the_output():
    small = dict(num_blocks=14, num_slots=5, max_model_len=48)
    plain = run(make(k=0, **small), SpecFakeRunner(4), reqs(n=6, max_new=16), speculative=False)
    sched = make(k=3, **small)
    spec = run(sched, SpecFakeRunner(4, wrong=0.2, max_model_len=48), reqs(n=6, max_new=16))
    assert spec == plain
    assert sched.num_preemptions_total > 0, "no preemption: shrink the cache"


def test_plain_requests_beside_speculative_ones_and_the_fallback():
    sched = make(k=3)
    runner = SpecFakeRunner(4, wrong=0.3)
    rs = reqs(n=4)
    sched.add_request(rs[0], speculative=False)
    for r in rs[1:]:
        sched.add_request(r, speculative=True)
    so = sched.schedule()
    while any(e.is_prefill for e in so.scheduled):
        sched.update_from_output(so, runner(so))
        so = sched.schedule()
    assert {e.request_id: e.num_lookahead > 0 for e in so.scheduled} == {"q0": False, "q1": True, "q2": True,
                                                                         "q3": True}
    sched.update_from_output(so, runner(so))
    assert sched.stop_speculating("q1") and not sched.stop_speculating("q0")
    so = sched.schedule()
    assert {e.request_id for e in so.scheduled if e.num_lookahead} == {"q2", "q3"}


def test_speculative_requests_bypass_the_prefix_cache():
    from trnrt.engine.cache.cache_manager import IdPool
    from trnrt.engine.cache.radix_cache import RadixCache

    cm = CacheManager(64, 4, 9)
    pc = RadixCache(cm, IdPool(8, "checkpoint"))
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, num_speculative_tokens=3)
    sched = Scheduler(cfg, cm, eos_token_ids=[EOS], prefix_cache=pc, checkpoint_interval=8)
    runner = SpecFakeRunner(4, wrong=0.3)
    prompt = list(range(10, 40))
    first = GenerateRequest(prompt_token_ids=prompt, request_id="a",
                            sampling_params=SamplingParams(max_new_tokens=8, ignore_eos=True))
    run(sched, runner, [first], speculative=False, cached_pages_ok=True)  # caches the prompt's checkpoints
    assert pc.checkpoints.num_used > 0
    again = GenerateRequest(prompt_token_ids=prompt, request_id="b",
                            sampling_params=SamplingParams(max_new_tokens=8, ignore_eos=True))
    sched.add_request(again, speculative=True)
    so = sched.schedule()
    assert so.scheduled[0].num_computed_tokens == 0  # no resume from the cache
    saved = [op for op in so.snapshot_ops]
    while sched.has_unfinished_requests():
        for e in so.scheduled:
            if not e.is_prefill:
                assert e.request_id not in sched._pending_snapshots  # no snapshot while decoding
        sched.update_from_output(so, runner(so))
        so = sched.schedule()
        saved += so.snapshot_ops
    sched.check_integrity()
