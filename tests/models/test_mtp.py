"""The MTP ("nextn") layer as a model component (issue #18 part 1): held to a plain-torch
reference of the spec's formula (§6) in fp32 within 1e-4, over a prefill, chunked extends and
decode steps through its own paged cache; both checkpoint namings; the tiny checkpoint's MTP layer
is deterministic and leaves the base weights byte-identical.

transformers does not implement MTP. The reference below writes the MTP parts (embedding with
position 0 zeroed, enorm/hnorm, eh_proj over [embedding, hidden], the plain pre-norm residuals,
shared_head.norm, the shared lm_head) in plain torch, and runs the block's MLA + indexer and MoE
with transformers' own glm5_next modules (a one-layer "indexed_attention"/"sparse" config), loaded
straight from the checkpoint's release-named tensors: nothing of trnrt's loader or model is used.
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
import torch.nn.functional as F

from glm5_helpers import BASE_TENSORS_SHA256, BLOCK, base_tensors_digest, save_single, tokens
from trnrt.models.glm5_next.config import ConfigError, Glm5NextMTPConfig
from trnrt.models.glm5_next.batch import ForwardBatch
from trnrt.models.glm5_next.weights import load_model
from trnrt.models.tiny import TINY_MTP_CONFIG, add_mtp_layer, tiny_text_config

N = 6  # tiny num_hidden_layers: the MTP layer is layers.6
PRE = f"model.language_model.layers.{N}."
TOL = 1e-4


@pytest.fixture(scope="module")
def mtp_dir(tiny_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("mtp") / "ckpt"
    shutil.copytree(tiny_dir, d)
    add_mtp_layer(d, seed=0)
    return d


@pytest.fixture(scope="module")
def mtp_model(mtp_dir):
    return load_model(mtp_dir, load_mtp=True)


# ----------------------------------------------------------------------------- the reference
def rms(x, w, eps=1e-5):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Reference:
    """The MTP forward of spec §6 for one sequence, no cache (causal over the whole sequence)."""

    def __init__(self, model_dir):
        from safetensors.torch import load_file
        from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
        from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextAttention, Glm5NextTextMoE

        raw = load_file(str(model_dir / "model.safetensors"))
        mine = {k[len(PRE):]: v for k, v in raw.items() if k.startswith(PRE)}
        self.embed = raw["model.language_model.embed_tokens.weight"]
        self.head = raw["lm_head.weight"]
        self.enorm, self.hnorm, self.eh_proj = mine["enorm.weight"], mine["hnorm.weight"], mine["eh_proj.weight"]
        self.in_ln, self.post_ln = mine["input_layernorm.weight"], mine["post_attention_layernorm.weight"]
        self.shared_norm = mine["shared_head.norm.weight"]
        # the block: one non-mHC indexed-attention + sparse layer, as transformers computes them
        cfg = Glm5NextTextConfig(**tiny_text_config(
            num_hidden_layers=1, layer_types=["indexed_attention"], indexer_types=["full"], mlp_layer_types=["sparse"]))
        cfg._attn_implementation = "eager"
        self.attn, self.moe = Glm5NextTextAttention(cfg, 0).eval(), Glm5NextTextMoE(cfg).eval()
        self.attn.load_state_dict({k[len("self_attn."):]: v for k, v in mine.items() if k.startswith("self_attn.")},
                                  strict=True)
        E, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
        moe = {k[len("mlp."):]: v for k, v in mine.items() if k.startswith("mlp.") and ".experts." not in k}
        moe["experts.gate_up_proj"] = torch.stack([
            torch.cat([mine[f"mlp.experts.{e}.gate_proj.weight"], mine[f"mlp.experts.{e}.up_proj.weight"]])
            for e in range(E)])
        moe["experts.down_proj"] = torch.stack([mine[f"mlp.experts.{e}.down_proj.weight"] for e in range(E)])
        assert moe["experts.gate_up_proj"].shape[1] == 2 * inter
        self.moe.load_state_dict(moe, strict=True)
        self.tensors = mine

    @torch.no_grad()
    def __call__(self, next_ids: torch.Tensor, h_prev: torch.Tensor):
        """next_ids [L] (row p: the token at p+1), h_prev [L, D] -> (logits [L, V], h_next [L, D])."""
        L = next_ids.shape[0]
        positions = torch.arange(L)
        e = self.embed[next_ids].clone()
        e[positions == 0] = 0
        x = F.linear(torch.cat([rms(e, self.enorm), rms(h_prev, self.hnorm)], -1), self.eh_proj)[None]  # [1,L,D]
        a = self.attn(rms(x, self.in_ln), attention_mask=torch.ones(1, L, dtype=torch.bool), past_key_values=None)[0]
        h = x + a
        out = h + self.moe(rms(h, self.post_ln))
        h_next = rms(out, self.shared_norm)[0]
        return F.linear(h_next, self.head), h_next


@pytest.fixture(scope="module")
def ref(mtp_dir):
    return Reference(mtp_dir)


def target_hidden(hf_model, ids: torch.Tensor) -> torch.Tensor:
    """The target's final hidden state after the final norm at every position [L, D] (h_prev)."""
    with torch.no_grad():
        return hf_model.model.language_model(input_ids=ids[None], use_cache=False).last_hidden_state[0].float()


class MTPDriver:
    """Sequences with their own blocks and slot (never block 0 / slot 0), driving forward_mtp."""

    def __init__(self, model, max_blocks=6, num_blocks=40, num_slots=6):
        self.model, self.mb = model, max_blocks
        self.state = model.allocate_state(num_blocks, BLOCK, num_slots, mtp=True)
        self.seqs: dict[str, dict] = {}

    def new_seq(self, name: str) -> None:
        i = len(self.seqs)
        self.seqs[name] = dict(blocks=list(range(1 + i * self.mb, 1 + (i + 1) * self.mb)), slot=1 + i, pos=0)

    def step(self, items, bucket=None, pad_rows=0):
        """items: (name, next_ids [n], h_prev [n, D]); returns per item (logits [n, V], h_next [n, D])."""
        S = bucket or max(len(t) for _, t, _ in items)
        B = len(items) + pad_rows
        D = self.model.config.hidden_size
        ids = torch.full((B, S), 7, dtype=torch.long)  # pad token: must not matter
        hid = torch.randn(B, S, D, generator=torch.Generator().manual_seed(S))  # padding: must not matter
        start, num = torch.zeros(B, dtype=torch.long), torch.zeros(B, dtype=torch.long)
        bt, slots = torch.zeros(B, self.mb, dtype=torch.int32), torch.zeros(B, dtype=torch.long)
        for r, (name, toks, h) in enumerate(items):
            s = self.seqs[name]
            n = len(toks)
            ids[r, :n], hid[r, :n] = toks, h
            start[r], num[r], slots[r] = s["pos"], n, s["slot"]
            bt[r] = torch.tensor(s["blocks"], dtype=torch.int32)
        for r in range(len(items), B):
            start[r] = 3  # garbage start on padding rows
        out = self.model.forward_mtp(ForwardBatch(ids, start, num, bt, slots), hid, self.state, all_positions=True)
        res = []
        for r, (name, toks, _) in enumerate(items):
            self.seqs[name]["pos"] += len(toks)
            res.append((out.logits[r, : len(toks)], out.hidden[r, : len(toks)]))
        return res


def _close(a, b, what):
    err = (a - b).abs().max().item()
    assert err <= TOL, f"{what}: max |diff| {err:.2e} > {TOL}"
    return err


# ----------------------------------------------------------------------------- parity
def test_mtp_prefill_equals_reference(mtp_model, ref, hf_model, report):
    ids = tokens(70, 21)  # > 12 tokens: the indexer's selection is sparse (index_topk 8, kpool 4)
    h = target_hidden(hf_model, ids[:-1])  # h_p of the target at p = 0..19
    nxt = ids[1:]  # the MTP's row p reads token p+1
    want_logits, want_h = ref(nxt, h)
    drv = MTPDriver(mtp_model)
    drv.new_seq("a")
    (logits, hid), = drv.step([("a", nxt, h)])
    report["mtp prefill (20 tokens) vs reference"] = _close(logits, want_logits, "logits")
    _close(hid, want_h, "h_next")
    # the last-token form (all_positions=False): what a draft step reads
    B = ForwardBatch(nxt[None], torch.tensor([0]), torch.tensor([20]), torch.arange(1, 7, dtype=torch.int32)[None],
                     torch.tensor([2]))
    st = mtp_model.allocate_state(40, BLOCK, 6, mtp=True)
    out = mtp_model.forward_mtp(B, h[None], st)
    assert out.logits.shape == (1, 4096) and out.hidden.shape == (1, 64)
    _close(out.logits[0], want_logits[-1], "last-token logits")
    _close(out.hidden[0], want_h[-1], "last-token h_next")


def test_mtp_chunked_extend_and_decode_equal_reference(mtp_model, ref, hf_model, report):
    """Two sequences batched with a padding row: chunked extends (padded bucket), then decode
    steps through the paged latent / pooled-key / tail cache; then draft-style steps that recycle
    the MTP's own h_next as h_prev. Every row equals the one-shot reference at its positions."""
    ids_a, ids_b = tokens(71, 24), tokens(72, 19)
    h_a, h_b = target_hidden(hf_model, ids_a[:-1]), target_hidden(hf_model, ids_b[:-1])
    nxt_a, nxt_b = ids_a[1:], ids_b[1:]  # 23 and 18 MTP rows
    drv = MTPDriver(mtp_model)
    drv.new_seq("a")
    drv.new_seq("b")
    got = {"a": [[], []], "b": [[], []]}

    def keep(name, res):
        got[name][0].append(res[0])
        got[name][1].append(res[1])

    # extend: a 0..8 and b 0..5 in one bucket of 10 with a padding row; then a 9..14 and b 6..13
    for (a0, a1), (b0, b1) in (((0, 9), (0, 6)), ((9, 15), (6, 14))):
        ra, rb = drv.step([("a", nxt_a[a0:a1], h_a[a0:a1]), ("b", nxt_b[b0:b1], h_b[b0:b1])], bucket=10, pad_rows=1)
        keep("a", ra)
        keep("b", rb)
    # decode: one token a step for both rows (+ a padding row)
    for k in range(4):
        pa, pb = 15 + k, 14 + k
        ra, rb = drv.step([("a", nxt_a[pa:pa + 1], h_a[pa:pa + 1]), ("b", nxt_b[pb:pb + 1], h_b[pb:pb + 1])],
                          pad_rows=1)
        keep("a", ra)
        keep("b", rb)
    worst = 0.0
    for name, nxt, h in (("a", nxt_a[:19], h_a[:19]), ("b", nxt_b[:18], h_b[:18])):
        want_logits, want_h = ref(nxt, h)
        worst = max(worst, _close(torch.cat(got[name][0]), want_logits, f"{name} logits"))
        _close(torch.cat(got[name][1]), want_h, f"{name} h_next")

    # draft steps on "a": h_prev = the previous step's h_next, token = its argmax
    seq_ids, seq_h = list(nxt_a[:19]), list(h_a[:19])
    logits, h_last = got["a"][0][-1][-1], got["a"][1][-1][-1]
    for _ in range(3):
        tok = logits.argmax()
        seq_ids.append(tok)
        seq_h.append(h_last)
        (lg, hn), = drv.step([("a", tok.view(1), h_last.view(1, -1))])
        want_logits, want_h = ref(torch.stack(seq_ids), torch.stack(seq_h))
        worst = max(worst, _close(lg[0], want_logits[-1], "draft logits"))
        _close(hn[0], want_h[-1], "draft h_next")
        logits, h_last = lg[0], hn[0]
    report["mtp chunked extend + decode + drafts vs reference"] = worst


def test_position_zero_embedding_is_zeroed(mtp_model):
    """Row 0 (a fresh sequence) ignores its token: only h_prev decides it."""
    drv = MTPDriver(mtp_model)
    h = torch.randn(1, 64, generator=torch.Generator().manual_seed(3))
    outs = []
    for tok in (5, 900):
        drv.new_seq(str(tok))
        outs.append(drv.step([(str(tok), torch.tensor([tok]), h)])[0][0])
    assert torch.equal(outs[0], outs[1])


def test_mtp_decode_step_exports_and_equals_eager(mtp_model, monkeypatch):
    """Same static-shape style as the base layers: the MTP decode step traces with torch.export
    (tensors only, its state mutated in place) and the exported program equals eager bit for bit
    on the plain PyTorch path. (A test-only wrapper: no trnrt graph includes the MTP layer.)"""
    from trnrt.models import kernels
    from trnrt.models.glm5_next.state import MTPState

    monkeypatch.setattr(kernels, "available", lambda: False)
    m = mtp_model

    class Wrap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mtp = m.mtp

        def forward(self, ids, start, num, bt, slots, h, latent, pooled, tail):
            st = MTPState(latent, pooled, tail, BLOCK, 4)
            out = self.mtp(ForwardBatch(ids, start, num, bt, slots), h, st, m.embed_tokens.weight, m.head_weight())
            return out.logits, out.hidden

    B, MB = 3, 6
    w = Wrap()
    st0 = MTPState.allocate(m.config, 24, BLOCK, 5)
    ex = (torch.zeros(B, 1, dtype=torch.long), torch.zeros(B, dtype=torch.long), torch.ones(B, dtype=torch.long),
          torch.zeros(B, MB, dtype=torch.int32), torch.zeros(B, dtype=torch.long), torch.zeros(B, 1, 64))
    ep = torch.export.export(w, ex + st0.tensors(), strict=False)
    s_eager, s_export = (MTPState.allocate(m.config, 24, BLOCK, 5) for _ in range(2))
    for s in (s_eager, s_export):
        for t in s.tensors():
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(t.numel())))
    g = torch.Generator().manual_seed(1)
    args = (torch.randint(0, 4096, (B, 1), generator=g), torch.tensor([11, 20, 0]), torch.tensor([1, 1, 0]),
            torch.tensor([[1, 2, 3, 0, 0, 0], [4, 5, 6, 7, 0, 0], [0] * 6], dtype=torch.int32), torch.tensor([1, 2, 0]),
            torch.randn(B, 1, 64, generator=g))
    le, he = w(*args, *s_eager.tensors())
    lx, hx = ep.module()(*args, *s_export.tensors())
    assert torch.equal(le[:2], lx[:2]) and torch.equal(he[:2], hx[:2])  # live rows (see test_glm5_next_export)
    assert all(torch.equal(a[:, 1:], b[:, 1:]) for a, b in zip(s_eager.tensors(), s_export.tensors()))


# ----------------------------------------------------------------------------- loading
def _sglang(sd: dict[str, torch.Tensor], specials_in_decoder: bool) -> dict[str, torch.Tensor]:
    """SGLang's naming: `model.layers.{N}` -> `model.decoder`; its NextN module keeps enorm,
    hnorm, eh_proj and shared_head outside the decoder (or, specials_in_decoder, a plain rename)."""
    out = {}
    for k, v in sd.items():
        if k.startswith(PRE):
            rest = k[len(PRE):]
            top = rest.split(".", 1)[0] in ("enorm", "hnorm", "eh_proj", "shared_head")
            k = f"model.{rest}" if top and not specials_in_decoder else f"model.decoder.{rest}"
        out[k] = v
    return out


def _merged(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers-style merged experts for the MTP layer too."""
    out = {k: v for k, v in sd.items() if not (k.startswith(PRE) and ".experts." in k)}
    E = 8
    out[PRE + "mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([sd[f"{PRE}mlp.experts.{e}.gate_proj.weight"], sd[f"{PRE}mlp.experts.{e}.up_proj.weight"]])
         for e in range(E)])
    out[PRE + "mlp.experts.down_proj"] = torch.stack([sd[f"{PRE}mlp.experts.{e}.down_proj.weight"] for e in range(E)])
    return out


@pytest.mark.parametrize("naming", ["sglang", "sglang-plain-rename", "merged-experts"])
def test_both_namings_load_identical_tensors(mtp_dir, mtp_model, tmp_path, naming):
    from safetensors.torch import load_file

    sd = load_file(str(mtp_dir / "model.safetensors"))
    alt = {"sglang": lambda s: _sglang(s, False), "sglang-plain-rename": lambda s: _sglang(s, True),
           "merged-experts": _merged}[naming](sd)
    assert not any(k.startswith(PRE) for k in alt) or naming == "merged-experts"
    save_single(alt, tmp_path / "alt", mtp_dir)
    m = load_model(tmp_path / "alt", load_mtp=True)
    a, b = mtp_model.state_dict(), m.state_dict()
    assert a.keys() == b.keys() and any(k.startswith("mtp.") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert m.mtp.embed_tokens is None and m.mtp.shared_head.head is None  # shared with the target


def test_mtp_tensors_land_where_named(mtp_model, ref):
    mtp = mtp_model.mtp
    t = ref.tensors
    assert torch.equal(mtp.enorm.weight, t["enorm.weight"]) and torch.equal(mtp.hnorm.weight, t["hnorm.weight"])
    assert torch.equal(mtp.eh_proj.weight, t["eh_proj.weight"])
    assert torch.equal(mtp.shared_head.norm.weight, t["shared_head.norm.weight"])
    assert torch.equal(mtp.self_attn.indexer.wk.weight, t["self_attn.indexer.wk.weight"])
    assert torch.equal(mtp.mlp.experts.down_proj[3], t["mlp.experts.3.down_proj.weight"])
    assert mtp.index_share is True and mtp.layer_idx == N


def test_mtp_off_is_the_base_model(mtp_dir, model, caplog):
    with caplog.at_level(logging.INFO, logger="trnrt.models.glm5_next"):
        m = load_model(mtp_dir)
    assert m.mtp is None
    assert "skipped 49 MTP-layer tensors" in caplog.text
    a, b = model.state_dict(), m.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    st = m.allocate_state(8, BLOCK, 3)
    assert st.mtp is None and len(st.tensors()) == 5
    with pytest.raises(ValueError, match="MTP layer"):
        m.allocate_state(8, BLOCK, 3, mtp=True)
    with pytest.raises(ValueError, match="MTP layer"):
        m.forward_mtp(None, None, st)


def test_load_mtp_needs_an_mtp_layer(tiny_dir):
    assert Glm5NextMTPConfig.from_pretrained(tiny_dir).num_nextn_predict_layers == 0  # absent -> 0
    with pytest.raises(ConfigError) as e:
        load_model(tiny_dir, load_mtp=True)
    assert e.value.field == "num_nextn_predict_layers"


def test_own_embed_and_head_are_used(mtp_dir, mtp_model, tmp_path):
    from safetensors.torch import load_file

    sd = load_file(str(mtp_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(5)
    sd[PRE + "embed_tokens.weight"] = torch.randn(4096, 64, generator=g)
    sd[PRE + "shared_head.head.weight"] = torch.randn(4096, 64, generator=g) / 8
    save_single(sd, tmp_path / "own", mtp_dir)
    m = load_model(tmp_path / "own", load_mtp=True)
    assert torch.equal(m.mtp.embed_tokens.weight, sd[PRE + "embed_tokens.weight"])
    batch = ForwardBatch(torch.tensor([[9, 10, 11]]), torch.tensor([4]), torch.tensor([3]),
                         torch.tensor([[1, 2]], dtype=torch.int32), torch.tensor([1]))
    h = torch.randn(1, 3, 64, generator=g)
    own = m.forward_mtp(batch, h, m.allocate_state(4, BLOCK, 2, mtp=True), all_positions=True)
    shared = mtp_model.forward_mtp(batch, h, mtp_model.allocate_state(4, BLOCK, 2, mtp=True), all_positions=True)
    assert torch.allclose(own.logits, F.linear(own.hidden, sd[PRE + "shared_head.head.weight"]), atol=1e-5)
    assert not torch.allclose(own.hidden, shared.hidden)  # its own embedding changed the rows (positions 4..6)


# ----------------------------------------------------------------------------- the tiny checkpoint
def test_tiny_mtp_layer_is_deterministic_and_base_weights_unchanged(tiny_dir, mtp_dir, tmp_path):
    from safetensors.torch import load_file

    again, seed1 = tmp_path / "again", tmp_path / "seed1"
    for d, seed in ((again, 0), (seed1, 1)):
        shutil.copytree(tiny_dir, d)
        add_mtp_layer(d, seed=seed)
    for f in ("model.safetensors", "config.json"):
        assert (again / f).read_bytes() == (mtp_dir / f).read_bytes(), f
    base, with_mtp, other = (load_file(str(d / "model.safetensors")) for d in (tiny_dir, mtp_dir, seed1))
    assert base_tensors_digest(base) == BASE_TENSORS_SHA256  # the checkpoint without MTP, as before
    new = sorted(set(with_mtp) - set(base))
    assert len(new) == 49 and all(k.startswith(PRE) for k in new)
    assert all(torch.equal(with_mtp[k], base[k]) for k in base)  # base tensors untouched
    assert base_tensors_digest({k: with_mtp[k] for k in base}) == BASE_TENSORS_SHA256
    assert not torch.equal(other[PRE + "eh_proj.weight"], with_mtp[PRE + "eh_proj.weight"])  # the seed matters
    text = json.loads((mtp_dir / "config.json").read_text())["text_config"]
    assert {k: text[k] for k in TINY_MTP_CONFIG} == TINY_MTP_CONFIG
    with pytest.raises(ValueError, match="already has MTP"):
        add_mtp_layer(again, seed=0)


def test_transformers_loads_the_mtp_checkpoint(mtp_dir, hf_model):
    """transformers ignores the MTP tensors (reported UNEXPECTED in its load report, not an
    error) and computes the same logits as without them."""
    import warnings

    from transformers import Glm5NextForConditionalGeneration

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = Glm5NextForConditionalGeneration.from_pretrained(mtp_dir, dtype=torch.float32).eval()
    assert m.config.text_config.num_nextn_predict_layers == 1
    ids = tokens(73, 9)[None]
    with torch.no_grad():
        assert torch.equal(m(input_ids=ids, use_cache=False).logits, hf_model(input_ids=ids, use_cache=False).logits)
