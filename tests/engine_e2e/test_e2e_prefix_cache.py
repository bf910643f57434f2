"""The prefix cache on the real tiny model: greedy tokens and logprobs with the cache on equal the
cache off (and hence transformers, which test_e2e_parity holds the cache-off engine to), for
multi-turn conversations and shared-system-prompt batches, with eviction, host-tier round trips
and preemption asserted to have happened. Seeded sampling is equal too.

The engines here are small (chunks of 64 tokens, checkpoints every 32), so every mechanism fires
within a few hundred tokens; they are module-scoped and shut down at the end.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from e2e_helpers import TIMEOUT_S  # noqa: E402

from trnrt.engine.cache.cache_config import PrefixCacheConfig
from trnrt.engine.request import GenerateRequest, SamplingParams

N_NEW = 10


def _engine(model_dir, cache, num_blocks=64, slots=5, **sched):
    from trnrt.config import EngineConfig
    from trnrt.engine.core.engine import Engine
    from trnrt.engine.sched.scheduler import SchedulerConfig

    ecfg = EngineConfig(max_model_len=512, block_size=16, num_blocks=num_blocks, num_slots=slots,
                        decode_batch_buckets=(1, 2, 4), prefill_token_buckets=(16, 64))
    scfg = SchedulerConfig(max_num_seqs=slots - 1, max_num_batched_tokens=64, max_model_len=512,
                           max_prefill_chunk_tokens=64, **sched)
    return Engine.from_model_dir(model_dir, engine_config=ecfg, scheduler_config=scfg, prefix_cache_config=cache)


@pytest.fixture(scope="module")
def engines(model_dir):
    made = {}

    def get(name):
        if name not in made:
            cache = {
                "off": None,
                "on": PrefixCacheConfig(checkpoint_interval=32, num_checkpoints=64),
                # a pool too small for the conversations (evictions), a host tier 4x the device
                "host": PrefixCacheConfig(checkpoint_interval=32, hierarchical=True, hicache_ratio=4.0),
                "prio": None,
            }[name]
            if name == "prio":  # one running request at a time, priority scheduling
                made[name] = _engine(model_dir, PrefixCacheConfig(checkpoint_interval=32), slots=2,
                                     enable_priority_scheduling=True)
            else:
                made[name] = _engine(model_dir, cache, num_blocks=34 if name == "host" else 64)
        return made[name]

    yield get
    for e in made.values():
        e.shutdown()


class _Out:
    def __init__(self):
        self.token_ids, self.logprobs, self.num_cached_tokens = [], [], 0


def collect(stream) -> _Out:
    c = _Out()
    while True:
        o = stream.get(timeout=TIMEOUT_S)
        assert o is not None, "stalled"
        c.token_ids += o.new_token_ids
        c.logprobs += o.new_logprobs or []
        if o.finished:
            assert o.error is None, o.error
            c.num_cached_tokens = o.num_cached_tokens
            return c


def _run(engine, prompts, rid, *, temperature=0.0, seed=None, logprobs=2, max_new=N_NEW):
    streams = engine.submit_many([
        GenerateRequest(prompt_token_ids=p, request_id=f"{rid}{i}", stream=False,
                        sampling_params=SamplingParams(max_new_tokens=max_new, ignore_eos=True, temperature=temperature,
                                                       seed=seed, logprobs=logprobs))
        for i, p in enumerate(prompts)])
    return [collect(s) for s in streams]


def _key(c):
    return c.token_ids, [lp.logprob for lp in c.logprobs]


def _conversations(special_ids, n, seed, first=40, turn=12):
    rng = random.Random(seed)
    allowed = [i for i in range(4096) if i not in special_ids]
    return [[rng.choice(allowed) for _ in range(first)] for _ in range(n)], lambda: [rng.choice(allowed) for _ in range(turn)]


def _multi_turn(engine, special_ids, turns, n, seed, first=40, **kw):
    prompts, nxt = _conversations(special_ids, n, seed, first=first)
    results = []
    for t in range(turns):
        res = _run(engine, prompts, f"mt{seed}-{t}-", **kw)
        results.append(res)
        prompts = [p + c.token_ids + nxt() for p, c in zip(prompts, res)]
    return results


def _logprob_close(a, b):
    (ta, la), (tb, lb) = a, b
    return ta == tb and all(abs(x - y) <= 1e-4 for x, y in zip(la, lb))


def test_multi_turn_and_shared_prompts_equal_cache_off(engines, special_ids):
    on, off = engines("on"), engines("off")
    # 8 conversations x 3 turns (+ 8 more in the host-tier test); 8 shared-system-prompt requests below
    r_on = _multi_turn(on, special_ids, 3, 8, seed=1)
    r_off = _multi_turn(off, special_ids, 3, 8, seed=1)
    for t, (a, b) in enumerate(zip(r_on, r_off)):
        for i, (x, y) in enumerate(zip(a, b)):
            assert _logprob_close(_key(x), _key(y)), (t, i)
    hits = [c.num_cached_tokens for t in r_on[1:] for c in t]
    assert all(h > 0 for h in hits), hits

    rng = random.Random(5)
    allowed = [i for i in range(4096) if i not in special_ids]
    system = [rng.choice(allowed) for _ in range(100)]
    users = [[rng.choice(allowed) for _ in range(20)] for _ in range(8)]
    a = _run(on, [system + users[0]], "sys0-") + _run(on, [system + u for u in users[1:]], "sys-")
    b = _run(off, [system + users[0]], "sys0-") + _run(off, [system + u for u in users[1:]], "sys-")
    for x, y in zip(a, b):
        assert _logprob_close(_key(x), _key(y))
    assert [c.num_cached_tokens for c in a[1:]] == [96] * 7
    on.scheduler.check_integrity()


def test_resumed_turns_equal_transformers(engines, special_ids, hf_model):
    """Two conversations' later turns, served from the cache, equal transformers' greedy generate
    on the whole prompt (the cache-off engine is held to transformers in test_e2e_parity)."""
    import torch

    on = engines("on")
    prompts, nxt = _conversations(special_ids, 2, seed=8)
    for t in range(3):
        res = _run(on, prompts, f"hf{t}-", logprobs=None)
        for p, c in zip(prompts, res):
            x = torch.tensor([p], dtype=torch.long)
            with torch.inference_mode():
                ref = hf_model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=N_NEW,
                                        min_new_tokens=N_NEW, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
            assert c.token_ids == ref, t
            if t:
                assert c.num_cached_tokens > 0
        prompts = [p + c.token_ids + nxt() for p, c in zip(prompts, res)]


def test_seeded_sampling_equal_cache_off(engines, special_ids):
    on, off = engines("on"), engines("off")
    prompts, nxt = _conversations(special_ids, 4, seed=3)
    for t in range(3):
        a = _run(on, prompts, f"s{t}-", temperature=0.9, seed=1234)
        b = _run(off, prompts, f"s{t}-", temperature=0.9, seed=1234)
        assert [x.token_ids for x in a] == [y.token_ids for y in b], t
        prompts = [p + c.token_ids + nxt() for p, c in zip(prompts, a)]
    assert on.scheduler.num_prefix_hits > 0


def test_eviction_host_tier_and_preemption(engines, special_ids):
    """A 33-page pool: conversations evict to the host tier and come back; long generations are
    preempted and resume through the cache. Outputs equal the cache-off engine's."""
    host, off = engines("host"), engines("off")
    r_h = _multi_turn(host, special_ids, 3, 8, seed=4, first=60)
    r_off = _multi_turn(off, special_ids, 3, 8, seed=4, first=60)
    for a, b in zip(r_h, r_off):
        for x, y in zip(a, b):
            assert _logprob_close(_key(x), _key(y))
    pc = host.prefix_cache
    assert pc.num_evicted_pages > 0 and pc.num_host_loaded_pages > 0
    assert host.scheduler.num_cached_tokens_host_total > 0
    # preemption: 4 long generations in 33 pages
    prompts, _ = _conversations(special_ids, 4, seed=6, first=60)
    before = host.scheduler.num_preemptions_total
    a = _run(host, prompts, "long-", max_new=80, logprobs=None)
    b = _run(off, prompts, "long-", max_new=80, logprobs=None)
    assert [x.token_ids for x in a] == [y.token_ids for y in b]
    assert host.scheduler.num_preemptions_total > before
    host.scheduler.check_integrity()


def test_priority_preemption_keeps_the_output(engines, special_ids):
    """One running request at a time: a request better by more than the threshold preempts the
    running one, which resumes through the cache with exactly the tokens of an undisturbed run."""
    import time

    prio, off = engines("prio"), engines("off")
    prompts, _ = _conversations(special_ids, 2, seed=12, first=50)
    ref = _run(off, [prompts[0]], "ref-", max_new=60, logprobs=None)[0].token_ids
    low = prio.submit(GenerateRequest(prompt_token_ids=prompts[0], request_id="low", stream=False, priority=0,
                                      sampling_params=SamplingParams(max_new_tokens=60, ignore_eos=True, temperature=0.0)))
    deadline = time.monotonic() + 60
    while (s := prio.scheduler.get_sequence("low")) is None or s.num_output_tokens < 20:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    high = prio.submit(GenerateRequest(prompt_token_ids=prompts[1], request_id="high", stream=False, priority=50,
                                       sampling_params=SamplingParams(max_new_tokens=5, ignore_eos=True, temperature=0.0)))
    assert len(collect(high).token_ids) == 5
    assert collect(low).token_ids == ref
    assert prio.scheduler.num_priority_preemptions == 1
    prio.scheduler.check_integrity()
