"""Speculative decoding at the runner level (issue #18 part 2; trnrt.engine.spec), fp32 on the
random tiny model with its MTP layer.

* greedy speculative decoding equals plain greedy decoding (ModelRunner.execute: prefill, then
  one decode step per token) token for token, batched, with an oracle drafter forcing full,
  partial and zero acceptance at known positions (k = 2, 3), and with the real MTP drafter;
* after a partially accepted verify a slot's KDA state, conv window and indexer tail, and the
  latent / pooled-key pages of the accepted positions, equal plain decoding's within
  |a - b| <= 1e-6 * (1 + |b|) (torch.allclose with atol = rtol = 1e-6), not torch.equal: the
  verify and its re-run are extends (chunked KDA, dense attention), plain decoding is one decode
  step a token (the recurrent KDA step, the sparse selection), so the two round differently; the
  conv window holds raw projections of magnitude ~10, where one fp32 ulp is already 1e-6 (measured
  worst: 1.2e-6 absolute on the conv window, 8e-7 on the tail, 6e-7 on the KDA state). A missing
  rollback is off by ~1 (the negative control);
* the MTP layer's own cache ends consistent with the accepted tokens;
* the rejection rule keeps the target distribution (chi-square over seeded trials);
* no page, slot or checkpoint id leaks.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from glm5_helpers import tokens
from trnrt.config import EngineConfig
from trnrt.engine.cache.cache_manager import CacheManager, IdPool, cdiv
from trnrt.engine.runner.model_runner import ModelRunner
from trnrt.engine.output.outputs import RowInput
from trnrt.engine.request import SamplingParams
from trnrt.engine.sample.sampler import SamplingTensors, sample
from trnrt.engine.output.sequence import Sequence
from trnrt.engine.spec.decoder import SpecDecoder
from trnrt.engine.spec.drafter import Drafter, MTPDrafter
from trnrt.engine.spec.oracle import OracleDrafter
from trnrt.engine.spec.pages import ensure_lookahead
from trnrt.engine.spec.rejection import accept, accept_greedy, filtered_scores
from trnrt.engine.spec.rollback import SlotSnapshots

V = 4096
BS = 8  # block size: two pools of kpool 4 per page
STATE_TOL = 1e-6  # atol = rtol (see the module doc)


@pytest.fixture(scope="module")
def spec_model(tiny_dir, tmp_path_factory):
    from trnrt.models.glm5_next.weights import load_model
    from trnrt.models.tiny import add_mtp_layer

    d = tmp_path_factory.mktemp("mtp_spec") / "ckpt"
    shutil.copytree(tiny_dir, d)
    add_mtp_layer(d, seed=0)
    return load_model(d, load_mtp=True)


class Env:
    """One runner over a fresh state (with the MTP stack), its checkpoint pool, a CacheManager."""

    def __init__(self, model, num_ckpt: int = 4):
        self.cfg = EngineConfig(block_size=BS, max_model_len=128, decode_batch_buckets=(1, 2, 4),
                                prefill_token_buckets=(16, 32), num_blocks=64, num_slots=10, max_top_logprobs=1)
        state = model.allocate_state(self.cfg.num_blocks, BS, self.cfg.num_slots, mtp=True)
        self.runner = ModelRunner(model, state, self.cfg, V)
        self.runner.allocate_cache_tiers(num_ckpt, 0, 0)
        self.ckpts = IdPool(num_ckpt, "checkpoint")
        self.cm = CacheManager(self.cfg.num_blocks, BS, self.cfg.num_slots)
        self.seqs: dict[str, Sequence] = {}

    @property
    def state(self):
        return self.runner.state

    def new_seq(self, rid: str, prompt: list[int], temperature: float = 0.0, seed: int = 0) -> Sequence:
        sp = SamplingParams(temperature=temperature, seed=seed)
        seq = Sequence(request_id=rid, prompt_token_ids=list(prompt), sampling_params=sp)
        self.cm.allocate_blocks_for(seq, len(prompt))
        self.seqs[rid] = seq
        return seq

    @staticmethod
    def row(seq: Sequence, token_ids: list[int], start: int) -> RowInput:
        sp = seq.sampling_params
        return RowInput(token_ids=list(token_ids), start_pos=start, block_ids=list(seq.block_ids), slot_id=seq.slot_id,
                        temperature=sp.temperature, top_p=1.0, top_k=-1, min_p=0.0, seed=sp.seed, num_logprobs=None,
                        request_id=seq.request_id)

    def plain_greedy(self, prompts: dict[str, list[int]], n_tokens: int, suffix: str = "") -> dict[str, list[int]]:
        """ModelRunner.execute: each prompt's prefill, then batched decode steps (n_tokens in all)."""
        out = {}
        for rid, prompt in prompts.items():
            seq = self.new_seq(rid + suffix, prompt)
            out[rid] = [self.runner.execute([self.row(seq, prompt, 0)])[0].token_id]
            seq.num_computed_tokens = len(prompt)
        for _ in range(n_tokens - 1):
            rows = []
            for rid in prompts:
                seq = self.seqs[rid + suffix]
                self.cm.allocate_blocks_for(seq, seq.num_computed_tokens + 1)
                rows.append(self.row(seq, [out[rid][-1]], seq.num_computed_tokens))
            for rid, res in zip(prompts, self.runner.execute(rows)):
                out[rid].append(res.token_id)
                self.seqs[rid + suffix].num_computed_tokens += 1
        return out

    def spec_prefill(self, sd: SpecDecoder, prompts: dict[str, list[int]], suffix: str = "",
                     sampling: dict[str, tuple[float, int]] | None = None) -> dict[str, list[int]]:
        """sampling: request -> (temperature, seed); greedy when absent."""
        out = {}
        for rid, prompt in prompts.items():
            seq = self.new_seq(rid + suffix, prompt, *(sampling or {}).get(rid, (0.0, 0)))
            out[rid] = [sd.prefill(self.row(seq, prompt, 0))]
            seq.num_computed_tokens = len(prompt)
        return out

    def spec_steps(self, sd: SpecDecoder, out: dict[str, list[int]], min_tokens: int, suffix: str = "",
                   max_steps: int = 100) -> list[tuple[str, int, int]]:
        """Speculative steps over every sequence until each has min_tokens; returns the log of
        (request, start_pos, num_accepted)."""
        log = []
        for _ in range(max_steps):
            if all(len(v) >= min_tokens for v in out.values()):
                break
            rids = list(out)
            rows = []
            for rid in rids:
                seq = self.seqs[rid + suffix]
                ensure_lookahead(self.cm, seq, sd.k)
                assert len(seq.block_ids) == cdiv(seq.num_computed_tokens + sd.k + 1, BS)  # look-ahead only
                rows.append(self.row(seq, [out[rid][-1]], seq.num_computed_tokens))
            for rid, row, res in zip(rids, rows, sd.step(rows)):
                assert len(res.token_ids) == res.num_accepted + 1 and res.token_ids[: res.num_accepted] == \
                    res.drafts[: res.num_accepted]
                log.append((rid, row.start_pos, res.num_accepted))
                out[rid].extend(res.token_ids)
                self.seqs[rid + suffix].num_computed_tokens += res.num_accepted + 1
            assert self.ckpts.num_free == self.ckpts.size  # checkpoint ids only during a step
        return log

    def free_all(self) -> None:
        for seq in self.seqs.values():
            self.cm.free(seq)
        self.seqs.clear()


def _prompts():
    return {"a": tokens(41, 11).tolist(), "b": tokens(42, 19).tolist()}


def _same_prefix(spec: list[int], plain: list[int]) -> None:
    """The speculative tokens equal plain decoding's over at least N_SPEC tokens (a row that
    finishes first keeps stepping while the others catch up, possibly past the plain run)."""
    n = min(len(spec), len(plain))
    assert n >= N_SPEC and spec[:n] == plain[:n]


# corrupted draft positions, as offsets from the prompt's end (see test_oracle_patterns)
CORRUPT = {"a": (4, 5, 9, 13, 14, 16), "b": (2, 3, 7, 11, 12, 18)}
N_PLAIN, N_SPEC = 30, 20


# ----------------------------------------------------------------------------- (a) greedy = plain
@pytest.mark.parametrize("k", [2, 3])
def test_greedy_spec_with_oracle_equals_plain_decoding(spec_model, k):
    """Batched sequences of 11 and 19 prompt tokens; the oracle replays plain greedy decoding
    with chosen drafts corrupted: every step accepts exactly the predicted number of drafts, full,
    partial and zero acceptance all happen for each sequence, and the output equals plain greedy
    decoding token for token (>= 20 tokens)."""
    env = Env(spec_model)
    prompts = _prompts()
    plain = env.plain_greedy(prompts, N_PLAIN, suffix="-plain")
    recorded = {rid: prompts[rid] + plain[rid] for rid in prompts}
    corrupt = {rid: {len(prompts[rid]) + o for o in offs} for rid, offs in CORRUPT.items()}
    oracle = OracleDrafter(recorded, V, corrupt)
    sd = SpecDecoder(env.runner, oracle, k, env.ckpts)
    out = env.spec_prefill(sd, prompts)
    log = env.spec_steps(sd, out, N_SPEC)
    for rid in prompts:
        _same_prefix(out[rid], plain[rid])
        ns = [n for r, L, n in log if r == rid]
        assert [oracle.expected_accepted(rid, L, k) for r, L, n in log if r == rid] == ns
        assert 0 in ns and k in ns and any(0 < n < k for n in ns), (rid, ns)
    assert sd.num_rollbacks == sum(n < k for _, _, n in log) > 0


def test_spec_prefill_is_the_runners_prefill(spec_model):
    """The speculative prefill (all positions' hidden states kept) samples the runner's token
    and leaves the same slot state and pages, bit for bit."""
    env = Env(spec_model)
    prompt = tokens(43, 21).tolist()
    plain = env.plain_greedy({"p": prompt}, 1)
    sd = SpecDecoder(env.runner, OracleDrafter({}, V), 2, env.ckpts)
    first = env.spec_prefill(sd, {"p": prompt}, suffix="-spec")
    assert first["p"] == plain["p"]
    a, b = env.seqs["p"], env.seqs["p-spec"]
    st = env.state
    for name in ("kda", "conv", "tail"):
        assert torch.equal(getattr(st, name)[:, a.slot_id], getattr(st, name)[:, b.slot_id]), name
    for name in ("latent", "pooled"):
        t = getattr(st, name)
        assert torch.equal(t[:, a.block_ids], t[:, b.block_ids]), name


def test_mixed_greedy_and_sampled_batch(spec_model):
    """A greedy and a seeded sampled row in one batch run the full rule (rejection sampling for
    the sampled row): the greedy row is still plain greedy decoding token for token; the sampled
    row's run is reproducible (same seed, same tokens), accepts oracle drafts while it follows the
    greedy run and leaves it (temperature 0.1: the random model's distributions are flat)."""
    prompts = _prompts()
    sampling = {"b": (0.1, 1234)}
    runs, logs = [], []
    for _ in range(2):
        env = Env(spec_model)
        plain = env.plain_greedy(prompts, N_PLAIN, suffix="-plain")
        recorded = {rid: prompts[rid] + plain[rid] for rid in prompts}
        sd = SpecDecoder(env.runner, OracleDrafter(recorded, V, {"a": {len(prompts["a"]) + 5}}, check=False), 3,
                         env.ckpts)
        out = env.spec_prefill(sd, prompts, sampling=sampling)
        logs.append(env.spec_steps(sd, out, N_SPEC))
        _same_prefix(out["a"], plain["a"])
        runs.append(out)
    assert runs[0] == runs[1] and logs[0] == logs[1]
    assert runs[0]["b"] != plain["b"][: len(runs[0]["b"])]  # it samples
    assert any(n > 0 for r, _, n in logs[0] if r == "b")


# ----------------------------------------------------------------------------- (b) state after rollback
def _slot_state(st, slot):
    return {n: getattr(st, n)[:, slot].clone() for n in ("kda", "conv", "tail")}


def _pages(st, seq, upto: int):
    """latents of positions < upto, pooled keys of the pools complete before upto."""
    lat = st.latent[:, seq.block_ids].flatten(1, 2)[:, :upto]
    pooled = st.pooled[:, seq.block_ids].flatten(1, 2)[:, : upto // st.kpool]
    return {"latent": lat.clone(), "pooled": pooled.clone()}


def _max_diff(x: dict, y: dict) -> dict:
    """max |a - b| / (1 + |b|) per tensor (<= STATE_TOL is torch.allclose(atol=rtol=STATE_TOL))."""
    return {n: ((x[n] - y[n]).abs() / (1 + y[n].abs())).max().item() for n in x}


def _partial_then_compare(env, k=3):
    """Three rows (prompts 12, 21 and 14 tokens): one verify each with one / two / no drafts
    accepted (the first rejects a draft that completes a pool, the second one on a new page, the
    third re-runs as a plain decode step), against plain decoding of the accepted tokens in other
    slots. Returns per row the max |diff| of each tensor."""
    prompts = {"a": tokens(44, 12).tolist(), "b": tokens(45, 21).tolist(), "c": tokens(46, 14).tolist()}
    accepted = {"a": 1, "b": 2, "c": 0}
    plain = env.plain_greedy(prompts, 4, suffix="-plain")  # feeds t_P .. t_P+2: state at P + 3
    recorded = {rid: prompts[rid] + plain[rid] for rid in prompts}
    corrupt = {rid: {len(prompts[rid]) + accepted[rid] + 1} for rid in prompts}
    oracle = OracleDrafter(recorded, V, corrupt)
    sd = SpecDecoder(env.runner, oracle, k, env.ckpts)
    out = env.spec_prefill(sd, prompts)
    rows = []
    for rid in prompts:
        seq = env.seqs[rid]
        ensure_lookahead(env.cm, seq, k)
        rows.append(env.row(seq, out[rid], len(prompts[rid])))
    res = sd.step(rows)
    assert sd.num_rollbacks == 3 and sd.num_plain_reruns == 1  # "c" re-ran through the decode step
    diffs = {}
    for rid, r in zip(prompts, res):
        n = accepted[rid]
        assert r.num_accepted == n and r.token_ids == plain[rid][1: n + 2]
        # plain decoding of the same accepted tokens t_P .. t_P+n: a fresh copy, prefill + n+1 decodes
        ref = env.plain_greedy({rid: prompts[rid]}, n + 2, suffix="-ref")[rid]
        assert ref == plain[rid][: n + 2]
        spec, pl = env.seqs[rid], env.seqs[rid + "-ref"]
        upto = len(prompts[rid]) + n + 1
        d = _max_diff(_slot_state(env.state, spec.slot_id), _slot_state(env.state, pl.slot_id))
        d.update(_max_diff(_pages(env.state, spec, upto), _pages(env.state, pl, upto)))
        diffs[rid] = d
    return diffs


def test_state_after_partial_acceptance_equals_plain_decoding(spec_model):
    diffs = _partial_then_compare(Env(spec_model))
    for rid, d in diffs.items():
        assert all(v <= STATE_TOL for v in d.values()), (rid, d)


def test_missing_rollback_is_caught(spec_model, monkeypatch):
    """Negative control: without the slot restore the same comparison fails by far."""
    monkeypatch.setattr(SlotSnapshots, "restore", lambda self, ids, slots: None)
    diffs = _partial_then_compare(Env(spec_model))
    for rid, d in diffs.items():
        assert d["kda"] > 1e3 * STATE_TOL and d["conv"] > 1e3 * STATE_TOL, (rid, d)


# ----------------------------------------------------------------------------- (c) the MTP drafter
@pytest.mark.parametrize("k", [2, 3])
def test_greedy_spec_with_mtp_drafter_equals_plain_decoding(spec_model, k, report):
    env = Env(spec_model)
    prompts = _prompts()
    plain = env.plain_greedy(prompts, N_PLAIN, suffix="-plain")
    drafter = MTPDrafter(env.runner)
    sd = SpecDecoder(env.runner, drafter, k, env.ckpts)
    out = env.spec_prefill(sd, prompts)
    log = env.spec_steps(sd, out, N_SPEC)
    for rid in prompts:
        _same_prefix(out[rid], plain[rid])
    rate = sum(n for *_, n in log) / (k * len(log))
    report[f"MTP drafter k={k} acceptance rate (random tiny model)"] = rate
    _check_mtp_cache(env, drafter, prompts, out)


class _MTPRunsOracleDrafts(Drafter):
    """Runs the MTP drafter every step (its cache bookkeeping under test) but proposes the
    oracle's drafts, so the MTP cache sees full, partial and zero acceptance (the random MTP
    layer's own drafts are never accepted)."""

    def __init__(self, mtp: MTPDrafter, oracle: OracleDrafter):
        self.mtp, self.oracle = mtp, oracle

    def propose(self, rows, k):
        self.mtp.propose(rows, k)
        return self.oracle.propose(rows, k)

    def observe(self, *args):
        self.mtp.observe(*args)


def test_mtp_cache_follows_the_accepted_tokens(spec_model):
    """Under full, partial and zero acceptance (oracle drafts, k = 3) the MTP cache ends equal to
    an MTP prefill over the accepted tokens, and the output is still plain greedy decoding's."""
    env = Env(spec_model)
    prompts = _prompts()
    plain = env.plain_greedy(prompts, N_PLAIN, suffix="-plain")
    recorded = {rid: prompts[rid] + plain[rid] for rid in prompts}
    oracle = OracleDrafter(recorded, V, {rid: {len(prompts[rid]) + o for o in offs} for rid, offs in CORRUPT.items()})
    mtp = MTPDrafter(env.runner)
    sd = SpecDecoder(env.runner, _MTPRunsOracleDrafts(mtp, oracle), 3, env.ckpts)
    out = env.spec_prefill(sd, prompts)
    log = env.spec_steps(sd, out, N_SPEC)
    assert {n for *_, n in log} == {0, 1, 3}
    for rid in prompts:
        _same_prefix(out[rid], plain[rid])
    _check_mtp_cache(env, mtp, prompts, out)


def _check_mtp_cache(env, drafter, prompts, out):
    """The MTP cache of each sequence (latents of positions < M, its indexer tail at M) equals an
    MTP prefill over the accepted tokens with the target's hidden states of a plain forward."""
    from trnrt.models.glm5_next.batch import ForwardBatch

    model, st = env.runner.model, env.state
    for rid, prompt in prompts.items():
        seq = env.seqs[rid]
        M = drafter._computed[rid]  # fed up to the last step's start; its verified tokens are pending
        assert M + len(drafter._pending[rid][0]) == seq.num_computed_tokens
        full = prompt + out[rid]
        ref = env.new_seq(rid + "-mtpref", full[:M])
        tables = torch.tensor([ref.block_ids], dtype=torch.long)
        fb = ForwardBatch(torch.tensor([full[:M]]), torch.tensor([0]), torch.tensor([M]), tables,
                          torch.tensor([ref.slot_id]))
        with torch.inference_mode():
            h = model(fb, st, all_logits=True).hidden_all  # [1, M, D]
            nb = ForwardBatch(torch.tensor([full[1: M + 1]]), torch.tensor([0]), torch.tensor([M]), tables,
                              torch.tensor([ref.slot_id]))
            model.forward_mtp(nb, h, st)
        got = st.mtp.latent[0, seq.block_ids].flatten(0, 1)[:M]
        want = st.mtp.latent[0, ref.block_ids].flatten(0, 1)[:M]
        assert (got - want).abs().max().item() <= 1e-4, rid
        assert (st.mtp.tail[0, seq.slot_id] - st.mtp.tail[0, ref.slot_id]).abs().max().item() <= 1e-4, rid
        pools = M // st.kpool
        gp = st.mtp.pooled[0, seq.block_ids].flatten(0, 1)[:pools]
        wp = st.mtp.pooled[0, ref.block_ids].flatten(0, 1)[:pools]
        assert (gp - wp).abs().max().item() <= 1e-4, rid


# ----------------------------------------------------------------------------- (e) no leaks
def test_no_page_slot_or_checkpoint_leak(spec_model, monkeypatch):
    env = Env(spec_model)
    cm = env.cm
    before = (cm.num_free_blocks, cm.num_free_slots, env.ckpts.num_free)
    prompts = _prompts()
    drafter = MTPDrafter(env.runner)
    sd = SpecDecoder(env.runner, drafter, 3, env.ckpts)
    out = env.spec_prefill(sd, prompts)
    env.spec_steps(sd, out, 12)
    cm.check_integrity(live_seqs=list(env.seqs.values()))
    # a step that fails in the verify still gives its checkpoint ids back
    rows = []
    for rid in prompts:
        seq = env.seqs[rid]
        ensure_lookahead(cm, seq, 3)
        rows.append(env.row(seq, [out[rid][-1]], seq.num_computed_tokens))

    def boom(*a, **kw):
        raise RuntimeError("verify failed")

    for fn in sd.verify_fns.values():
        monkeypatch.setattr(fn, "forward", boom)
    with pytest.raises(RuntimeError, match="verify failed"):
        sd.step(rows)
    assert env.ckpts.num_free == env.ckpts.size
    drafter.release(list(prompts))
    env.free_all()
    cm.check_integrity(live_seqs=[])
    assert (cm.num_free_blocks, cm.num_free_slots, env.ckpts.num_free) == before
    assert not drafter._pending and not drafter._computed


def test_step_refuses_a_short_block_table_and_the_end_of_the_context(spec_model):
    env = Env(spec_model)
    prompt = tokens(46, 15).tolist()  # 15 tokens: 2 pages; a verify of k=2 at 15 needs 18 tokens: 3 pages
    sd = SpecDecoder(env.runner, OracleDrafter({"s": prompt}, V), 2, env.ckpts)
    out = env.spec_prefill(sd, {"s": prompt})
    seq = env.seqs["s"]
    with pytest.raises(ValueError, match="block table"):
        sd.step([env.row(seq, out["s"], 15)])
    near_end = env.row(seq, out["s"], env.cfg.max_model_len - 2)  # a verify would pass max_model_len
    with pytest.raises(ValueError, match="max_model_len"):
        sd.step([near_end])
    assert env.ckpts.num_free == env.ckpts.size


# ----------------------------------------------------------------------------- (d) the rejection rule
def _st(B, temperature=0.0, top_p=1.0, top_k=V, min_p=0.0):
    f = lambda v: torch.full((B,), v, dtype=torch.float32)
    return dict(temperature=f(temperature), top_p=f(top_p), top_k=torch.full((B,), top_k, dtype=torch.long),
                min_p=f(min_p))


def test_greedy_rule():
    logits = torch.full((3, 4, 6), -1.0)
    argmax = torch.tensor([[2, 3, 1, 5], [4, 4, 0, 1], [0, 1, 2, 3]])
    logits.scatter_(-1, argmax[..., None], 5.0)
    drafts = torch.tensor([[2, 3, 1], [4, 0, 0], [1, 1, 2]])  # full, partial (1), zero
    tok, n = accept_greedy(logits, drafts)
    assert n.tolist() == [3, 1, 0]
    assert tok.tolist() == [[2, 3, 1, 5], [4, 4, -1, -1], [0, -1, -1, -1]]
    tok2, n2 = accept_greedy(logits, drafts, num_drafts=torch.tensor([2, 3, 3]))  # row 0 has 2 drafts
    assert n2.tolist() == [2, 1, 0] and tok2[0].tolist() == [2, 3, 1, -1]
    # the full rule gives the same for greedy rows
    B = 3
    tok3, n3 = accept(logits, drafts, **_st(B), seeds=torch.arange(B), positions=torch.full((B,), 9))
    assert torch.equal(tok3, tok) and torch.equal(n3, n)


def _chi2(counts: torch.Tensor, p: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of counts against p over p's support; (statistic, degrees of freedom)."""
    sup = p > 0
    assert counts[~sup].sum() == 0, "a token outside the target's support was emitted"
    exp = counts.sum() * p[sup]
    return (((counts[sup] - exp) ** 2) / exp).sum().item(), int(sup.sum()) - 1


# chi-square critical values at p = 1e-4 by degrees of freedom (the seeds are fixed: a pass is a pass)
CHI2_1E4 = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74}
N_TRIALS = 40000


def _trials(draft_mode: str):
    """N_TRIALS rows of fabricated logits (the same per position for every row, filtered by
    temperature 0.8 and top_k 4), k = 3 drafts each, distinct seeds. draft_mode: "onehot"
    (fixed drafts, q one-hot), "q" (drafts drawn from q, q passed), "lie" (drawn from q, a
    uniform q claimed: the negative control)."""
    K, Vs = 3, 5
    base = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0], [0.3, 0.2, 0.1, 0.0, -0.1], [1.5, -0.5, 0.7, 0.2, 0.0],
                         [0.0, 0.4, -0.3, 0.9, 0.1]])  # [K+1, V]
    N = N_TRIALS
    logits = base.expand(N, K + 1, Vs).contiguous()
    st = _st(N, temperature=0.8, top_k=4)
    seeds = torch.arange(N, dtype=torch.long) * 7919 + 12345
    positions = 100 + torch.arange(N) % 13
    q = torch.softmax(torch.tensor([[1.0, 1.5, 0.0, 0.2, -2.0], [0.0, 0.5, 1.0, 0.0, 0.0],
                                    [0.8, 0.0, 0.3, 0.0, 1.0]]), -1)  # [K, V]
    draft_probs = None
    if draft_mode == "onehot":
        drafts = torch.tensor([0, 1, 0]).expand(N, K).contiguous()
    else:
        g = torch.Generator().manual_seed(0)
        drafts = torch.stack([torch.multinomial(q[j], N, replacement=True, generator=g) for j in range(K)], 1)
        draft_probs = (q if draft_mode == "q" else torch.full_like(q, 1 / Vs)).expand(N, K, Vs)
    tok, n = accept(logits, drafts, **st, seeds=seeds, positions=positions, draft_probs=draft_probs)
    p = torch.softmax(filtered_scores(base, *(v[: K + 1] for v in st.values())), -1)  # [K+1, V]
    return tok, n, p


@pytest.mark.parametrize("draft_mode", ["onehot", "q"])
def test_rejection_sampling_keeps_the_target_distribution(draft_mode):
    """Every emitted position's token (among the trials that reach it) follows the target's
    filtered distribution p: Pearson's chi-square below its 1e-4 critical value, total variation
    below 0.02, at each of the k + 1 positions."""
    tok, n, p = _trials(draft_mode)
    for j in range(4):
        reach = n >= j
        assert reach.sum() > 2000, j  # enough trials reach position j for the test to mean something
        counts = torch.bincount(tok[reach, j], minlength=5).double()
        stat, df = _chi2(counts, p[j].double())
        tv = 0.5 * (counts / counts.sum() - p[j].double()).abs().sum().item()
        assert stat < CHI2_1E4[df] and tv < 0.02, (j, stat, df, tv)


def test_rejection_test_has_power():
    """Negative control: drafts drawn from q but q misreported as uniform break the distribution;
    the same statistic rejects it."""
    tok, n, p = _trials("lie")
    stats = []
    for j in range(3):
        reach = n >= j
        stat, df = _chi2(torch.bincount(tok[reach, j], minlength=5).double(), p[j].double())
        stats.append(stat / CHI2_1E4[df])
    assert max(stats) > 10, stats


def test_sampled_rule_is_seeded_per_row_and_its_bonus_is_the_samplers_token():
    """A row's outcome depends on its own (seed, position) only (alone = batched), and after a
    full acceptance the bonus token is the one trnrt.engine.sample.sampler.sample picks from the same
    logits, seed and position."""
    g = torch.Generator().manual_seed(3)
    B, K, Vs = 16, 3, 64
    logits = torch.randn(B, K + 1, Vs, generator=g) * 2
    drafts = torch.randint(0, Vs, (B, K), generator=g)
    temp = torch.rand(B, generator=g) + 0.3
    top_p = torch.where(torch.arange(B) % 2 == 0, torch.tensor(0.9), torch.tensor(1.0))
    top_k = torch.where(torch.arange(B) % 3 == 0, torch.tensor(5), torch.tensor(Vs))
    min_p = torch.where(torch.arange(B) % 4 == 1, torch.tensor(0.05), torch.tensor(0.0))
    seeds, pos = torch.randint(0, 2 ** 40, (B,), generator=g), torch.randint(0, 500, (B,), generator=g)
    args = (temp, top_p, top_k, min_p, seeds, pos)
    tok, n = accept(logits, drafts, *args)
    for b in (0, 5, 11):
        tb, nb = accept(logits[b: b + 1], drafts[b: b + 1], *(a[b: b + 1] for a in args))
        assert torch.equal(tb[0], tok[b]) and nb.item() == n[b].item()
    # drafts = the tokens the rule itself emits at each position: with a one-hot q they are
    # accepted only by chance, so force acceptance with num_drafts 0 (the bonus at row 0) ...
    t0, n0 = accept(logits, drafts, *args, num_drafts=torch.zeros(B, dtype=torch.long))
    want = sample(logits[:, 0], SamplingTensors(temp, top_p, top_k, min_p, seeds, pos), 1)[0]
    assert n0.eq(0).all() and torch.equal(t0[:, 0], want)
    # ... and at row K after a full acceptance: drafts in the support (each row's argmax) with a
    # claimed q(x) of 1e-9 are accepted (u * q(x) < p(x)); the bonus is drawn at position pos + K
    top_drafts = logits[:, :K].argmax(-1)
    tiny_q = torch.full((B, K, Vs), 1e-9)
    tk, nk = accept(logits, top_drafts, *args, draft_probs=tiny_q)
    want_k = sample(logits[:, K], SamplingTensors(temp, top_p, top_k, min_p, seeds, pos + K), 1)[0]
    assert nk.eq(K).all() and torch.equal(tk[:, K], want_k)
