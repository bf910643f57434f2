"""trnrt's fused C++ mHC kernels (trnrt/models/kernels) against the plain PyTorch path.

The kernels must build on a CI-like machine (g++ and ninja, the tools AOTInductor needs too):
a failed build would silently put every eager step back on the slow path, so it fails here.
"""

from __future__ import annotations

import pytest
import torch

from trnrt.models.glm5_next import hyper, indexer, kda, layers
from trnrt.models.glm5_next import moe as moe_mod
from trnrt.models import kernels
from glm5_helpers import Driver, tokens


@pytest.fixture(scope="module")
def ops():
    assert kernels.load(), f"fused kernels did not build: {kernels.error()}"
    return torch.ops.trnrt


def _plain(monkeypatch):
    monkeypatch.setattr(kernels, "available", lambda: False)


def _hc_inputs(shape, n, d, seed, peaked=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    fn = torch.randn((2 + n) * n, n * d, generator=g) / (n * d) ** 0.5
    base = torch.randn((2 + n) * n, generator=g)
    scale = torch.tensor([1.0, 1.0, 4.0 if peaked else 0.5])
    if peaked:
        base[2 * n:] *= 6
    streams = (torch.randn(*shape, n, d, generator=g) * 3).to(dtype)
    return streams, fn, base, scale


def _plain_collapse(streams, fn, base, scale, n, iters):
    pre, post, comb = hyper.hc_coefficients(streams, fn, base, scale, n, iters, 1e-6, 1e-5)
    return post, comb, (pre.unsqueeze(-1) * streams).sum(-2).to(streams.dtype)


@pytest.mark.parametrize("shape,n,d,iters,peaked", [
    ((8, 1), 4, 64, 20, False),  # a decode batch
    ((1, 37), 4, 64, 20, True),  # a prefill chunk, Sinkhorn far from converged
    ((3, 2), 4, 16, 3, True),  # few iterations: every normalisation counts
    ((2, 5), 2, 8, 20, False),  # another stream count
])
def test_hc_collapse_matches_plain_path(ops, monkeypatch, shape, n, d, iters, peaked):
    streams, fn, base, scale = _hc_inputs(shape, n, d, seed=sum(shape) + iters, peaked=peaked)
    _plain(monkeypatch)
    post_p, comb_p, col_p = _plain_collapse(streams, fn, base, scale, n, iters)
    post_k, comb_k, col_k = ops.hc_collapse(streams, fn, base, scale, iters, 1e-6, 1e-5)
    assert post_k.shape == post_p.shape and comb_k.shape == comb_p.shape and col_k.shape == col_p.shape
    assert comb_k.dtype == torch.float32 and col_k.dtype == streams.dtype
    if peaked:
        assert (comb_p.sum(-1) - 1).abs().max() > 1e-3  # not converged: the iteration count shows
    torch.testing.assert_close(post_k, post_p, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(comb_k, comb_p, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(col_k, col_p, atol=1e-5, rtol=1e-5)
    if peaked:  # one Sinkhorn step fewer is far outside that tolerance
        _, comb_short, _ = ops.hc_collapse(streams, fn, base, scale, iters - 1, 1e-6, 1e-5)
        assert (comb_short - comb_p).abs().max() > 1e-4


def test_hc_collapse_bf16_streams(ops, monkeypatch):
    streams, fn, base, scale = _hc_inputs((4, 3), 4, 32, seed=3, dtype=torch.bfloat16)
    _plain(monkeypatch)
    post_p, comb_p, col_p = _plain_collapse(streams, fn, base, scale, 4, 20)
    post_k, comb_k, col_k = ops.hc_collapse(streams, fn, base, scale, 20, 1e-6, 1e-5)
    assert col_k.dtype == torch.bfloat16
    torch.testing.assert_close(comb_k, comb_p, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(col_k.float(), col_p.float(), atol=0, rtol=1e-2)  # at most a bf16 rounding step


def test_hc_expand_matches_plain_path(ops, monkeypatch):
    torch.manual_seed(1)
    post, comb = torch.rand(2, 3, 4), torch.rand(2, 3, 4, 4)
    out, res = torch.randn(2, 3, 16), torch.randn(2, 3, 4, 16)
    _plain(monkeypatch)
    want = hyper.hc_expand(post, comb, out, res)
    got = ops.hc_expand(post, comb, out, res)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    ref = post.unsqueeze(-1) * out.unsqueeze(-2) + torch.einsum("bsij,bsid->bsjd", comb, res)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_model_uses_kernels_and_matches_plain(ops, model, monkeypatch):
    """The serving model calls the fused ops in eager steps (counted per op), and its logits and
    state equal the plain PyTorch path's to fp32 rounding through a prefill and decodes (the
    decodes cross a KDA conv window and complete indexer pools)."""
    calls: dict[str, int] = {}
    real = torch.ops.trnrt

    class Counting:
        def __getattr__(self, name):
            fn = getattr(real, name)

            def counted(*a):
                calls[name] = calls.get(name, 0) + 1
                return fn(*a)

            return counted

    def run():
        drv = Driver(model)
        drv.new_seq("a")
        drv.new_seq("b")
        out = [drv.step([("a", tokens(9, 23).tolist()), ("b", tokens(4, 23).tolist())]).logits]
        for t in (5, 7, 11, 13, 17):
            out.append(drv.step([("a", [t]), ("b", [t + 1])], pad_rows=1).logits)
        return out, drv.state

    selected = []

    def probe(pool_mask, meta):
        if meta.S == 1:
            selected.append((int(pool_mask.sum(-1).max()), int((meta.pos[:, 0] + 1).max()) // kp))

    kp = model.config.index_kpool
    monkeypatch.setattr(indexer, "index_probe", probe)
    monkeypatch.setattr(torch.ops, "trnrt", Counting())
    fused, st_f = run()
    cfg = model.config
    n_layers, n_kda = cfg.num_hidden_layers, cfg.layer_types.count("linear_attention")
    n_mla = n_layers - n_kda
    n_full = sum(1 for t, i in zip(cfg.layer_types, cfg.indexer_types) if t != "linear_attention" and i == "full")
    n_sparse = cfg.mlp_layer_types.count("sparse")
    steps, decodes = 6, 5
    assert calls["hc_collapse"] == calls["hc_expand"] == 2 * n_layers * steps
    assert calls["kda_decode"] == n_kda * decodes
    assert calls["kda_chunk_pairs"] == n_kda  # the prefill: one chunk (23 tokens) per KDA layer
    assert calls["gated_rms_norm"] == n_kda * steps
    assert calls["rms_norm"] >= 2 * n_layers * steps
    assert calls["indexer_decode"] == n_full * decodes and calls["mla_decode_attn"] == n_mla * decodes
    assert calls["moe_routed"] == n_sparse * decodes
    # the decodes really ran sparse: fewer pools selected than complete ones
    assert selected and all(sel == cfg.index_topk // kp < complete for sel, complete in selected)
    seen = dict(calls)
    monkeypatch.setattr(indexer, "index_probe", lambda pool_mask, meta: None)
    _plain(monkeypatch)
    plain, st_p = run()
    assert calls == seen  # the plain path made no further calls
    for f, p in zip(fused, plain):
        torch.testing.assert_close(f, p, atol=1e-5, rtol=1e-5)
    for a, b in zip(st_f.tensors(), st_p.tensors()):
        # scratch slot / block 0 take the padding row's writes in either order: skip them
        torch.testing.assert_close(a[:, 1:], b[:, 1:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("S,chunk", [(23, 64), (64, 16), (40, 16)])
def test_kda_chunked_pairs_match_plain_path(ops, monkeypatch, S, chunk):
    """kda_chunked with the fused pairwise kernel equals the plain path (outputs and final state),
    over several chunks, a padded last chunk and padded (g = 0, beta = 0) rows."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(S + chunk)
    B, H, Dk, Dv = 2, 3, 16, 8
    q = F.normalize(torch.randn(B, S, H, Dk, generator=g), dim=-1) * Dk ** -0.5
    k = F.normalize(torch.randn(B, S, H, Dk, generator=g), dim=-1)
    v = torch.randn(B, S, H, Dv, generator=g)
    gate = -torch.rand(B, S, H, Dk, generator=g) * 2  # log-decays <= 0
    beta = torch.rand(B, S, H, generator=g)
    gate[1, S - 5:], beta[1, S - 5:] = 0.0, 0.0  # row 1 ends in padding
    s0 = torch.randn(B, H, Dk, Dv, generator=g)
    o_f, s_f = kda.kda_chunked(q, k, v, gate, beta, s0, chunk=chunk)
    _plain(monkeypatch)
    o_p, s_p = kda.kda_chunked(q, k, v, gate, beta, s0, chunk=chunk)
    torch.testing.assert_close(o_f, o_p, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_f, s_p, atol=1e-5, rtol=1e-5)
    A, Mm = ops.kda_chunk_pairs(q[0, :chunk].transpose(0, 1).contiguous(), k[0, :chunk].transpose(0, 1).contiguous(),
                                gate[0, :chunk].transpose(0, 1).cumsum(1).contiguous())
    assert (A.triu() == 0).all() and (Mm.triu(1) == 0).all() and (Mm.diagonal(dim1=1, dim2=2) != 0).all()


def test_kda_decode_restart_and_padding(ops, model, monkeypatch):
    """A slot reused by a new sequence (start_pos 0 in a decode step) starts from zero state, and a
    padding row leaves every real slot alone, in the fused op as in the plain path."""
    def run():
        drv = Driver(model)
        drv.new_seq("a")
        drv.step([("a", tokens(2, 12).tolist())])
        drv.new_seq("b", slot=drv.seqs["a"]["slot"])  # same slot, fresh sequence
        out = drv.step([("b", [9])], pad_rows=2).logits
        return out, drv.state

    fused, st_f = run()
    _plain(monkeypatch)
    plain, st_p = run()
    torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)
    for a, b in zip(st_f.tensors(), st_p.tensors()):
        torch.testing.assert_close(a[:, 1:], b[:, 1:], atol=1e-5, rtol=1e-5)


def test_moe_routed_matches_plain_path_with_clamp_reached(ops, model, monkeypatch):
    """Router + gathered experts against the plain path, on inputs that reach the SwiGLU clamp."""
    moe = next(layer.mlp for layer in model.layers if hasattr(layer.mlp, "gate"))
    x = torch.randn(16, model.config.hidden_size, generator=torch.Generator().manual_seed(4)) * 8
    seen = []
    orig = moe_mod.swiglu

    def probe(gate, up, limit, kind):
        seen.append(bool((gate > limit).any()) and bool((up.abs() > limit).any()))
        return orig(gate, up, limit, kind)

    monkeypatch.setattr(moe_mod, "swiglu", probe)
    _plain(monkeypatch)
    w, idx = moe.gate(x)
    want = moe.experts.gathered(x, w, idx)
    assert seen and all(seen), "the inputs must reach the clamp"
    got = moe._decode_fused(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_rms_norms_match_plain_path(ops, monkeypatch):
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(3, 5, 64, generator=g) * 4, torch.randn(64, generator=g)
    gate = torch.randn(3, 5, 64, generator=g)
    _plain(monkeypatch)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), layers.rms_norm(x, w, 1e-5), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ops.gated_rms_norm(x, gate, w, 1e-5), kda.gated_rms_norm(x, gate, w, 1e-5),
                               atol=1e-6, rtol=1e-6)
    xb, wb = x.bfloat16(), w.bfloat16()
    got, want = ops.rms_norm(xb, wb, 1e-5), layers.rms_norm(xb, wb, 1e-5)
    assert got.dtype == torch.bfloat16
    assert (got.float() - want.float()).abs().max() <= 0.02 * want.float().abs().max()  # one bf16 rounding step


def test_export_never_traces_the_kernels(ops, monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not layers.fused_kernels(torch.zeros(1))


def test_env_switch_turns_kernels_off(monkeypatch):
    monkeypatch.setenv("TRNRT_KERNELS", "0")
    assert not kernels.enabled_by_env()
