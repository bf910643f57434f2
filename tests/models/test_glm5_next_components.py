"""Component checks where an end-to-end comparison is blind (spec lessons 1, 2, 5, 6), and the
conditions that make the parity tests meaningful (clamp reached, indexer really sparse)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trnrt.models.glm5_next import hyper, indexer, kda, layers
from trnrt.models.glm5_next import moe as moe_mod
from glm5_helpers import Driver, tokens


def _hf_text(hf_model):
    return hf_model.model.language_model


# ----------------------------------------------------------------------------- meaningful
def test_swiglu_clamp_reached_in_every_mlp_kind(model, monkeypatch):
    seen: dict[str, list[bool]] = {"dense": [False, False], "shared": [False, False], "routed": [False, False]}
    orig = moe_mod.swiglu

    def probe(gate, up, limit, kind):
        seen[kind][0] |= bool((gate > limit).any())
        seen[kind][1] |= bool((up.abs() > limit).any())
        return orig(gate, up, limit, kind)

    monkeypatch.setattr(moe_mod, "swiglu", probe)
    drv = Driver(model)
    drv.new_seq("a")
    drv.step([("a", tokens(5, 40).tolist())])  # extend: dense experts form
    drv.step([("a", [3])])  # decode: gathered experts form
    assert model.config.swiglu_limit == 1.5
    for kind, (g, u) in seen.items():
        assert g and u, f"{kind} MLP never exceeded swiglu_limit (gate {g}, up {u})"


def test_indexer_selects_fewer_than_visible(model, monkeypatch):
    stats = []

    def probe(pool_mask, meta):
        sel = pool_mask.sum(-1)  # selected complete pools per query
        cand = meta.pool_cand.sum(-1)  # visible complete pools
        stats.append(((sel < cand) & meta.valid).sum().item())

    monkeypatch.setattr(indexer, "index_probe", probe)
    drv = Driver(model)
    drv.new_seq("a")
    drv.step([("a", tokens(6, 48).tolist())])
    drv.step([("a", [9])])
    assert len(stats) == 2 * len(model.config.full_indexer_layers)
    assert all(s > 0 for s in stats), stats  # every full layer, in extend and in decode


# ----------------------------------------------------------------------------- mHC
def _mhc_formula(streams, fn, base, scale, n, eps, norm_eps):
    """pre/post/comb written out from the spec (§1.4): 20 column and 19 row normalisations."""
    flat = streams.reshape(*streams.shape[:-2], -1).double()
    flat = flat / torch.sqrt((flat**2).mean(-1, keepdim=True) + norm_eps)
    mix = flat @ fn.double().T
    pre = torch.sigmoid(mix[..., :n] * scale[0] + base[:n]) + eps
    post = 2 * torch.sigmoid(mix[..., n: 2 * n] * scale[1] + base[n: 2 * n])
    comb = torch.softmax(mix[..., 2 * n:].reshape(*mix.shape[:-1], n, n) * scale[2] + base[2 * n:].reshape(n, n), -1)
    comb = comb + eps
    cols = rows = 0
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    cols += 1
    for _ in range(19):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        rows += 1
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
        cols += 1
    assert (cols, rows) == (20, 19)
    return pre, post, comb


def test_mhc_pre_post_comb_against_formula_and_hf(model, hf_model):
    torch.manual_seed(0)
    cfg = model.config
    hc = model.layers[1].ffn_hc
    streams = torch.randn(2, 3, cfg.hc_mult, cfg.hidden_size)
    pre, post, comb = hyper.hc_coefficients(streams, hc.fn, hc.base, hc.scale, cfg.hc_mult, cfg.hc_sinkhorn_iters,
                                            cfg.hc_eps, cfg.rms_norm_eps)
    fpre, fpost, fcomb = _mhc_formula(streams, hc.fn, hc.base.double(), hc.scale.double(), cfg.hc_mult,
                                      cfg.hc_eps, cfg.rms_norm_eps)
    assert torch.allclose(pre.double(), fpre, atol=1e-6)
    assert torch.allclose(post.double(), fpost, atol=1e-6)
    assert torch.allclose(comb.double(), fcomb, atol=1e-6)
    # truncated, not converged: rows of the final comb do not all sum to 1
    assert (comb.sum(-2) - 1).abs().max() < 1e-5  # ends on a column normalisation
    hf_hc = _hf_text(hf_model).layers[1].ffn_hc
    hpost, hcomb, hcollapsed = hf_hc(streams)
    _, _, collapsed = hc.collapse(streams)
    assert torch.allclose(post, hpost, atol=1e-6) and torch.allclose(comb, hcomb, atol=1e-6)
    assert torch.allclose(collapsed, hcollapsed, atol=1e-5)


def test_mhc_sinkhorn_truncation_is_exact():
    """With peaked comb logits Sinkhorn is far from converged after 20 column / 19 row steps, so
    the count of normalisations is visible (the checkpoint's own values converge too fast)."""
    torch.manual_seed(5)
    n, d = 4, 16
    fn = torch.randn((2 + n) * n, n * d) / (n * d) ** 0.5
    base = torch.randn((2 + n) * n)
    base[2 * n:] *= 6
    scale = torch.tensor([1.0, 1.0, 4.0])
    streams = torch.randn(3, 2, n, d)
    fpre, fpost, fcomb = _mhc_formula(streams, fn, base.double(), scale.double(), n, 1e-6, 1e-5)
    pre, post, comb = hyper.hc_coefficients(streams, fn, base, scale, n, 20, 1e-6, 1e-5)
    assert torch.allclose(comb.double(), fcomb, atol=1e-5)
    assert (comb.sum(-1) - 1).abs().max() > 1e-3  # rows not converged
    _, _, comb19 = hyper.hc_coefficients(streams, fn, base, scale, n, 19, 1e-6, 1e-5)
    _, _, comb21 = hyper.hc_coefficients(streams, fn, base, scale, n, 21, 1e-6, 1e-5)
    assert (comb19.double() - fcomb).abs().max() > 1e-4 and (comb21.double() - fcomb).abs().max() > 1e-4



def test_sinkhorn_graph_and_eager_spellings_agree(monkeypatch):
    """The eager (baddbmm) and traced (sum) spellings of the Sinkhorn are the same maths: both
    match the float64 formula, on peaked inputs far from converged, and each other to fp32 rounding."""
    torch.manual_seed(7)
    comb = torch.softmax(torch.randn(5, 3, 4, 4) * 6, dim=-1) + 1e-6  # [B, S, N, N]
    ref = comb.double()
    ref = ref / (ref.sum(-2, keepdim=True) + 1e-6)
    for _ in range(19):
        ref = ref / (ref.sum(-1, keepdim=True) + 1e-6)
        ref = ref / (ref.sum(-2, keepdim=True) + 1e-6)
    eager = hyper.sinkhorn(comb, 20, 1e-6)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    traced = hyper.sinkhorn(comb, 20, 1e-6)
    assert eager.shape == traced.shape == comb.shape
    assert (eager.sum(-1) - 1).abs().max() > 1e-3  # not converged: every step counts
    assert (eager.double() - ref).abs().max() < 1e-6 and (traced.double() - ref).abs().max() < 1e-6
    assert (eager - traced).abs().max() < 1e-6


def test_mhc_expand_formula():
    torch.manual_seed(1)
    post, comb = torch.rand(2, 3, 4), torch.rand(2, 3, 4, 4)
    out, res = torch.randn(2, 3, 16), torch.randn(2, 3, 4, 16)
    got = hyper.hc_expand(post, comb, out, res)
    want = torch.einsum("bsj,bsd->bsjd", post, out) + torch.einsum("bsij,bsid->bsjd", comb, res)
    assert torch.allclose(got, want, atol=1e-6)


# ----------------------------------------------------------------------------- KDA pieces
def test_output_gate_is_sigmoid(model, hf_model):
    torch.manual_seed(2)
    attn = model.layers[0].self_attn
    x, gate = torch.randn(2, 5, 4, 16), 3 * torch.randn(2, 5, 4, 16)
    w, eps = attn.o_norm.weight, attn.o_norm.eps
    got = kda.gated_rms_norm(x, gate, w, eps)
    normed = w * x / torch.sqrt((x**2).mean(-1, keepdim=True) + eps)
    assert torch.allclose(got, normed * torch.sigmoid(gate), atol=1e-5)
    assert not torch.allclose(got, normed * F.silu(gate), atol=1e-2)  # discriminates sigmoid vs silu
    hf_norm = _hf_text(hf_model).layers[0].self_attn.o_norm
    assert torch.allclose(got, hf_norm(x, gate), atol=1e-6)


def test_decay_is_per_channel(model, hf_model):
    torch.manual_seed(3)
    cfg = model.config
    attn = model.layers[0].self_attn
    x = torch.randn(2, 5, cfg.hidden_size)
    g = attn.forget_gate(attn.forget_gate.f_a_proj(x))  # [B,S,H,Dk]
    assert g.shape == (2, 5, cfg.linear_num_heads, cfg.linear_head_dim) and g.dtype == torch.float32
    assert (g.std(-1) > 1e-2).all()  # varies across the channels of each head (not a per-head scalar)
    assert (g < 0).all() and (g > cfg.linear_lower_bound).all()
    hf_g = _hf_text(hf_model).layers[0].self_attn.forget_gate(x)
    assert torch.allclose(g, hf_g, atol=1e-6)
    # formula: lower_bound * sigmoid(exp(A_log[h]) * (f_b(f_a(x)) + dt_bias))
    fg = attn.forget_gate
    f = (x @ fg.f_a_proj.weight.T @ fg.f_b_proj.weight.T + fg.dt_bias).view(2, 5, cfg.linear_num_heads, -1)
    want = cfg.linear_lower_bound * torch.sigmoid(fg.A_log.exp()[:, None] * f)
    assert torch.allclose(g, want, atol=1e-6)


def test_kda_chunked_equals_recurrence_and_padding_is_inert():
    torch.manual_seed(4)
    B, S, H, Dk, Dv = 2, 37, 3, 8, 6
    q = kda.l2norm(torch.randn(B, S, H, Dk)) * Dk**-0.5
    k = kda.l2norm(torch.randn(B, S, H, Dk))
    v, beta = torch.randn(B, S, H, Dv), torch.rand(B, S, H)
    g = -5 * torch.rand(B, S, H, Dk)
    s0 = torch.randn(B, H, Dk, Dv)
    s, outs = s0, []
    for t in range(S):
        o, s = kda.kda_recurrent_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], s)
        outs.append(o)
    ref = torch.stack(outs, 1)
    for chunk in (64, 8, 5):
        o, sc = kda.kda_chunked(q, k, v, g, beta, s0, chunk=chunk)
        assert torch.allclose(o, ref, atol=1e-4) and torch.allclose(sc, s, atol=1e-4), chunk
    o, su = kda.kda_unrolled(q, k, v, g, beta, s0)  # the short-extend form: the recurrence itself
    assert torch.equal(o, ref) and torch.equal(su, s)
    # tokens with decay 1 (g = 0) and beta = 0 leave the state untouched
    g2, b2 = g.clone(), beta.clone()
    g2[:, 20:], b2[:, 20:] = 0, 0
    _, s20 = kda.kda_chunked(q[:, :20], k[:, :20], v[:, :20], g[:, :20], beta[:, :20], s0)
    _, spad = kda.kda_chunked(q, k, v, g2, b2, s0, chunk=16)
    assert torch.allclose(s20, spad, atol=1e-5)


def test_moe_forms_agree(model):
    """Decode (gathered), fp32 extend (dense) and bf16 extend (grouped GEMM) routed-expert forms."""
    torch.manual_seed(6)
    ex = model.layers[1].mlp.experts
    x = torch.randn(13, model.config.hidden_size)
    w, idx = model.layers[1].mlp.gate(x)
    a, b, c = ex.gathered(x, w, idx), ex.dense(x, w, idx), ex.grouped(x, w, idx)
    assert torch.allclose(a, b, atol=1e-5) and torch.allclose(a, c, atol=1e-5)
    # reference: explicit per-token loop over the chosen experts
    want = torch.zeros_like(x)
    I = model.config.moe_intermediate_size
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            h = ex.gate_up_proj[e] @ x[t]
            y = ex.down_proj[e] @ moe_mod.swiglu(h[:I], h[I:], model.config.swiglu_limit, "routed")
            want[t] += w[t, j] * y
    assert torch.allclose(a, want, atol=1e-5)


def test_short_extend_is_the_plain_extend_by_another_path(model, monkeypatch):
    """A verify-shaped extend (rows of k + 1 = 4 tokens, one partial, one padding row) with
    short_extend: the same logits, hidden states and state tensors as the plain extend, through
    the per-token KDA recurrence and the gathered experts (the chunked / dense forms not run)."""
    import copy

    from trnrt.models import kernels

    drivers = [Driver(model), Driver(model)]
    for d in drivers:
        for name, n in (("a", 13), ("b", 6)):
            d.new_seq(name)
            d.step([(name, tokens(len(name) + n, n).tolist())])
    calls = {"unrolled": 0, "gathered": 0, "chunked": 0, "dense": 0}

    def count(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(kda, "kda_unrolled", count("unrolled", kda.kda_unrolled))
    monkeypatch.setattr(kda, "kda_chunked", count("chunked", kda.kda_chunked))
    monkeypatch.setattr(kernels, "available", lambda: False)  # fused_kernels False: the graphs' ops, as compiled
    monkeypatch.setattr(moe_mod.Experts, "gathered", count("gathered", moe_mod.Experts.gathered))
    monkeypatch.setattr(moe_mod.Experts, "dense", count("dense", moe_mod.Experts.dense))
    items = [("a", [5, 9, 2, 7]), ("b", [3, 4])]
    with torch.inference_mode():
        plain = drivers[0].step(copy.deepcopy(items), bucket=4, pad_rows=1, all_logits=True)
        before = dict(calls)
        short = drivers[1].step(copy.deepcopy(items), bucket=4, pad_rows=1, all_logits=True, short_extend=True)
    assert before["chunked"] > 0 and before["dense"] > 0 and before["unrolled"] == 0
    assert calls["chunked"] == before["chunked"] and calls["dense"] == before["dense"]  # not run again
    assert calls["unrolled"] > 0 and calls["gathered"] > before["gathered"]
    valid = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    assert torch.allclose(short.logits[valid], plain.logits[valid], atol=1e-4)
    assert torch.allclose(short.hidden_all[valid], plain.hidden_all[valid], atol=1e-5)
    for name in ("latent", "pooled", "kda", "conv", "tail"):
        a, b = getattr(drivers[1].state, name), getattr(drivers[0].state, name)
        assert torch.allclose(a, b, atol=1e-5), name


def test_short_moe_takes_the_fused_decode_kernel_in_eager_fp32(model):
    """Eager fp32 on the CPU: a short extend's experts run in the decode kernel, same values."""
    if not layers.fused_kernels(torch.zeros(1)):
        pytest.skip("the C++ kernels are not built here")
    moe = model.layers[1].mlp
    x = torch.randn(3, 4, model.config.hidden_size)
    with torch.inference_mode():
        assert torch.allclose(moe(x, short=True), moe(x), atol=1e-5)


# ----------------------------------------------------------------------------- compiled selection
def test_select_topk_max_passes_equal_topk(monkeypatch):
    """Under export/compile, k <= 2 selections are max passes: the same values, and the same
    indices as torch.topk (ties: the lowest index), including rows with -inf entries."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 3, 8, generator=g)
    x[0, 0, 4:] = float("-inf")  # a masked expert group
    x[1, 1, [2, 6]] = 9.0  # a tie for the first place
    x[2, 2, [1, 5]] = -9.0  # a tie that is not selected
    for k in (1, 2):
        v, i = layers.select_topk(x, k)
        ref = torch.sort(x, dim=-1, descending=True, stable=True)  # ties: lowest index first
        assert torch.equal(v, ref.values[..., :k]) and torch.equal(i, ref.indices[..., :k]), k
        assert torch.equal(i[1, 1], torch.tensor([2, 6][:k]))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    v, i = layers.select_topk(x, 2)  # eager: torch.topk itself
    assert torch.equal(v, x.topk(2).values)


def test_exported_tiny_decode_step_has_no_topk_but_the_samplers(model, monkeypatch):
    from trnrt.models import kernels
    from trnrt.models.glm5_next.model import TensorForward

    monkeypatch.setattr(kernels, "available", lambda: False)
    B, MB = 3, 6
    st = model.allocate_state(24, 8, 5)
    ex_args = (torch.zeros(B, 1, dtype=torch.long), torch.zeros(B, dtype=torch.long), torch.ones(B, dtype=torch.long),
               torch.zeros(B, MB, dtype=torch.int32), torch.zeros(B, dtype=torch.long))
    ep = torch.export.export(TensorForward(model, block_size=8), ex_args + st.tensors(), strict=False)
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert not any("topk" in t for t in targets)  # router (4 sparse layers) and indexer: max passes
    assert sum("argmax" in t for t in targets) >= 4 * 3 + 2
