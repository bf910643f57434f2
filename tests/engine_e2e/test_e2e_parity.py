"""Greedy engine output == transformers' greedy generate, token for token, under queueing and
preemption, with prompts submitted at staggered steps."""

from __future__ import annotations

import torch

from e2e_helpers import N_NEW, Collector, assert_clean, hook_execute, submit


def hf_greedy(hf_model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy generate, batch 1 (no padding), EOS disabled, exactly n tokens."""
    x = torch.tensor([ids], dtype=torch.long)
    with torch.inference_mode():
        out = hf_model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                                min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    new = out[0, len(ids):].tolist()
    assert len(new) == n
    return new


def test_greedy_matches_transformers_staggered_queued_preempted(small_engine, hf_model, random_prompts):
    engine = small_engine
    prompts = random_prompts
    assert len(prompts) >= 16 and min(map(len, prompts)) == 1 and max(map(len, prompts)) == 200
    assert engine.scheduler_config.max_num_seqs < len(prompts)
    preempted_before = engine.scheduler.num_preemptions_total
    seen: list[tuple[int, int]] = []  # (running, waiting) at each step, read on the engine thread

    preempted_mid_decode: set[str] = set()  # preempted after they had generated tokens

    def before(rows):
        sch = engine.scheduler
        seen.append((sch.num_running, sch.num_waiting))
        preempted_mid_decode.update(s.request_id for s in sch.waiting if s.num_preemptions and s.output_token_ids)

    col = Collector()
    waves = [prompts[:6], prompts[6:11], prompts[11:]]
    with hook_execute(engine, before=before):
        for k, wave in enumerate(waves):
            for ids in wave:
                col.add(submit(engine, ids, max_new_tokens=N_NEW, temperature=0.0, ignore_eos=True))
            if k + 1 < len(waves):
                # let the engine emit a few tokens of what is in flight before submitting more
                target = col.num_tokens + 3
                col.wait(lambda c: c.num_tokens >= target)
        results = col.wait_all(timeout=120)

    expected = [hf_greedy(hf_model, ids, N_NEW) for ids in prompts]
    for i, (ids, r, exp) in enumerate(zip(prompts, results, expected)):
        assert r.error is None, (i, r.error)
        assert r.finish_reason.type == "length"
        assert r.output_ids == exp, f"prompt {i} ({len(ids)} tokens): trnrt {r.output_ids} != transformers {exp}"
    # The run was meaningful: requests queued behind max_num_seqs and some were preempted.
    assert engine.scheduler.num_preemptions_total > preempted_before, "no preemption happened: shrink the cache"
    assert preempted_mid_decode, "no sequence was preempted after generating: nothing resumed a decode"
    assert max(w for _, w in seen) > 0, "nothing ever queued"
    assert max(r for r, _ in seen) == engine.scheduler_config.max_num_seqs
    assert_clean(engine)


def test_seeded_sampling_survives_preemption(small_engine, eos_engine, random_prompts):
    """Seeded sampled outputs under queueing + preemption (small_engine) equal those of an engine
    with room for every request at once (eos_engine; ignore_eos makes its extra EOS id moot)."""
    params = [dict(max_new_tokens=N_NEW, temperature=0.8, top_p=0.9, top_k=50, seed=100 + i, ignore_eos=True)
              for i in range(len(random_prompts))]
    outputs = []
    for engine in (small_engine, eos_engine):
        before = engine.scheduler.num_preemptions_total
        col = Collector()
        for ids, p in zip(random_prompts, params):
            col.add(submit(engine, ids, **p))
        results = col.wait_all(timeout=120)
        assert all(r.error is None and len(r.output_ids) == N_NEW for r in results)
        outputs.append([r.output_ids for r in results])
        preempted = engine.scheduler.num_preemptions_total - before
        if engine is small_engine:
            assert preempted > 0, "no preemption happened"
        else:
            assert preempted == 0
        assert_clean(engine)
    assert outputs[0] == outputs[1]
