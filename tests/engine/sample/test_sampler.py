"""Sampler: greedy == argmax, filters, per-row seeded determinism independent of the batch."""

import torch

from trnrt.engine.sample.sampler import SamplingTensors, sample, uniform_noise


def _st(b, temperature=1.0, top_p=1.0, top_k=10**9, min_p=0.0, seeds=None, positions=None):
    return SamplingTensors(
        temperature=torch.full((b,), float(temperature)),
        top_p=torch.full((b,), float(top_p)),
        top_k=torch.full((b,), int(top_k), dtype=torch.int64),
        min_p=torch.full((b,), float(min_p)),
        seeds=torch.arange(b, dtype=torch.int64) if seeds is None else seeds,
        positions=torch.zeros(b, dtype=torch.int64) if positions is None else positions,
    )


def test_greedy_is_argmax_and_logprobs_are_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(5, 300)
    ids, lp, top_ids, top_lp = sample(logits, _st(5, temperature=0.0), 4)
    assert torch.equal(ids, logits.argmax(-1))
    ref = torch.log_softmax(logits, -1)
    assert torch.allclose(lp, ref.gather(1, ids[:, None]).squeeze(1))
    assert top_ids.shape == (5, 4) and torch.equal(top_ids[:, 0], ids)
    assert torch.all(top_lp[:, :-1] >= top_lp[:, 1:])


def test_noise_is_uniform_and_keyed_by_seed_and_position():
    u = uniform_noise(torch.tensor([1, 1, 2, -7], dtype=torch.int64), torch.tensor([0, 1, 0, 5]), 50000)
    assert torch.all(u > 0) and torch.all(u < 1)
    assert abs(u.mean().item() - 0.5) < 0.01
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    again = uniform_noise(torch.tensor([1], dtype=torch.int64), torch.tensor([1]), 50000)
    assert torch.equal(again[0], u[1])


def test_noise_stays_inside_the_open_interval_at_its_extremes():
    """The top 24-bit cell once rounded to u = 1.0 (Gumbel +inf; NaN on a masked token, which
    argmax took: a grammar-masked token sampled in a CI run)."""
    from trnrt.engine.sample.sampler import unit_open

    u = unit_open(torch.tensor([0, 1, (1 << 23), (1 << 24) - 2, (1 << 24) - 1]))
    assert torch.all(u > 0) and torch.all(u < 1), u.tolist()
    assert torch.all(torch.isfinite(-torch.log(-torch.log(u))))
    assert torch.all(u[1:] >= u[:-1])


def test_a_masked_token_is_never_sampled_even_at_extreme_noise(monkeypatch):
    """Every token's noise at the top cell: the -inf (masked) tokens must still lose."""
    import trnrt.engine.sample.sampler as sampler

    monkeypatch.setattr(sampler, "uniform_noise", lambda seeds, positions, vocab: sampler.unit_open(
        torch.full((seeds.shape[0], vocab), (1 << 24) - 1, dtype=torch.int64)))
    logits = torch.full((3, 64), float("-inf"))
    allowed = [[5], [7, 40], [0, 63]]
    for i, ids in enumerate(allowed):
        logits[i, ids] = torch.tensor([0.3, -1.0][: len(ids)])
    ids, *_ = sample(logits, _st(3, temperature=1.0), 0)
    for i, tok in enumerate(ids.tolist()):
        assert tok in allowed[i], (i, tok)


def test_seeded_row_same_alone_and_batched():
    torch.manual_seed(1)
    logits = torch.randn(9, 1000)
    seeds = torch.tensor([123] + list(range(8)), dtype=torch.int64)
    pos = torch.tensor([17] + list(range(8)), dtype=torch.int64)
    batched, *_ = sample(logits, _st(9, temperature=0.9, top_p=0.95, seeds=seeds, positions=pos), 1)
    alone, *_ = sample(logits[:1], _st(1, temperature=0.9, top_p=0.95, seeds=seeds[:1], positions=pos[:1]), 1)
    assert batched[0] == alone[0]


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 1e-9]]))
    n = 4000
    st = _st(n, seeds=torch.arange(n, dtype=torch.int64))
    ids, *_ = sample(logits.expand(n, -1), st, 1)
    freq = torch.bincount(ids, minlength=4).float() / n
    assert torch.allclose(freq[:3], torch.tensor([0.5, 0.3, 0.2]), atol=0.03), freq
    assert freq[3] == 0


def test_top_k_top_p_min_p_restrict_support():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]])).expand(2000, -1)
    seeds = torch.arange(2000, dtype=torch.int64)
    ids, *_ = sample(logits, _st(2000, top_k=2, seeds=seeds), 1)
    assert set(ids.tolist()) == {0, 1}
    ids, *_ = sample(logits, _st(2000, top_p=0.65, seeds=seeds), 1)  # 0.4 + 0.3 reaches 0.65
    assert set(ids.tolist()) == {0, 1}
    ids, *_ = sample(logits, _st(2000, min_p=0.6, seeds=seeds), 1)  # keeps p >= 0.24
    assert set(ids.tolist()) == {0, 1}
    ids, *_ = sample(logits, _st(2000, top_p=0.01, seeds=seeds), 1)  # always keeps the best token
    assert set(ids.tolist()) == {0}


def test_greedy_sampler_equals_full_sampler_on_greedy_rows():
    from trnrt.engine.sample.sampler import sample_greedy

    torch.manual_seed(3)
    logits = torch.randn(6, 500)
    full = sample(logits, _st(6, temperature=0.0, top_p=0.5, top_k=3), 5)
    greedy = sample_greedy(logits, 5)
    for a, b in zip(full, greedy):
        assert torch.equal(a, b)


def test_top_n_two_stage_equals_topk(monkeypatch):
    from trnrt.engine.sample import sampler

    calls = []
    real_topk = torch.topk
    monkeypatch.setattr(sampler.torch, "topk", lambda x, k, **kw: calls.append(x.shape[-1]) or real_topk(x, k, **kw))
    torch.manual_seed(3)
    x = torch.log_softmax(torch.randn(6, 4096) * 3, -1)
    # the hard cases: the top-20 packed into two chunks (chunks are strided: x[k::256]), the
    # top-20 in 20 different chunks, and a run of contiguous values
    W = 4096 // sampler._TOP_N_CHUNK
    x[1, 7::W] = torch.linspace(5, 6, 16)
    x[1, 9::W] = torch.linspace(4, 4.9, 16)
    x[2, ::200] = torch.linspace(3, 4, x[2, ::200].numel())
    x[3, 160:192] = torch.linspace(4, 5, 32)
    values, ids = sampler.top_n(x, 20)
    ref = real_topk(x, 20, dim=-1)
    assert torch.equal(values, ref.values) and torch.equal(ids, ref.indices)
    assert calls == [4096 // sampler._TOP_N_CHUNK, 20 * sampler._TOP_N_CHUNK]  # two small topks, no full one
    calls.clear()
    small = torch.randn(3, 300)  # too few chunks: plain topk
    v, i = sampler.top_n(small, 5)
    assert calls == [300] and torch.equal(i, real_topk(small, 5).indices)


def test_greedy_logprobs_are_log_softmax():
    from trnrt.engine.sample.sampler import sample_greedy

    torch.manual_seed(4)
    x = torch.randn(5, 4096) * 4
    ids, lp, top_ids, top_lp = sample_greedy(x, 20)
    ref = torch.log_softmax(x, -1)
    assert torch.equal(ids, x.argmax(-1))
    assert torch.allclose(lp, ref.gather(1, ids[:, None]).squeeze(1), atol=1e-5)
    assert torch.allclose(top_lp, ref.gather(1, top_ids), atol=1e-5)
    assert torch.allclose(top_lp, torch.topk(ref, 20).values, atol=1e-5)
