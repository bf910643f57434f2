"""The body of every rank of tests/parallel/test_tp_model.py: the rank model (rank_model.load_rank_model)
against the TP=1 model on the embedded tiny checkpoint, through the real runner step path.

Every rank loads the TP=1 model (load_rank_model at ParallelContext.single(), i.e. load_model)
and, per layout (tp = the world, ep), its rank model, and drives both through the same script
of engine steps on a `SpecModelRunner` (eager, the real ModelRunner / SpecDecoder / MTPDrafter
code and their state types):

  A  prefill chunk 0..15 (a partial chunk), the slot saved to a prefix-cache checkpoint at
     that page boundary (CacheOp save_slot), the chunk 16..39 (samples);
  B  shares A's first two pages, its slot restored from that checkpoint (load_slot), a prefill
     from 16 (the prefix-cache resume), then A and B decode 32 greedy steps as one batch;
  C  a speculative request: its prompt through the drafter's prefill, then speculative decode
     steps (MTP draft, target verify of k + 1 tokens, rollback / re-run where rejected);
  D  a prompt-logprobs prefill (`--prompt-logprobs`' graph: all-position logits, the next token
     sampled from the last hidden state through the head): its prompt logprobs and its token.

Every target and MTP forward's logits are recorded at their valid rows / tokens (hooks; padding
rows are left out), with the tokens each row emitted, every MoE router's top-k picks (a pre-hook
that runs the replicated router on the block's input) and every DSA indexer's selected pools
(`indexer.index_probe`, the test hook). Reported per layout: max |Δ logit| against TP=1, whether
the tokens and both selections equal TP=1's, digests of the selections (the test compares them
between ranks), and the collectives of one decode step. The planted bug: the 3*qkv conv cut as
one contiguous block (`rule=`), through the first prefill chunk.
"""

from __future__ import annotations

import hashlib
import time

import torch

K = 2  # drafts per speculative step
BS = 8  # block size (two pools of kpool 4)
DECODE_STEPS = 32
TOL = 1e-5
A_BLOCKS = list(range(1, 11))  # 80 tokens
B_BLOCKS = A_BLOCKS[:2] + list(range(11, 19))  # A's first two pages (positions 0..15), then its own
C_BLOCKS = list(range(19, 35))
D_BLOCKS = list(range(35, 38))


def _prompt(seed: int, n: int, vocab: int) -> list[int]:
    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Trace:
    """What one model did over the script (see the module doc)."""

    def __init__(self):
        self.logits: list[torch.Tensor] = []  # per forward: [rows or tokens, V] fp32
        self.tokens: list[int] = []
        self.drafts = self.accepted = 0  # speculative steps: drafts verified, drafts accepted
        self.router: list[torch.Tensor] = []  # per MoE call: [valid tokens, k]
        self.index: list[torch.Tensor] = []  # per indexer call: [valid tokens, P] bool
        self.valid: torch.Tensor | None = None  # [B, S] of the forward in flight

    def digest(self, which: str) -> str:
        h = hashlib.sha256()
        for t in getattr(self, which):
            h.update(t.contiguous().numpy().tobytes())
        return h.hexdigest()


def _hook(model, trace: Trace):
    """Record `trace` on every forward of the model, its MTP layer, their MoEs and indexers."""
    from trnrt.models.glm5_next import indexer
    from trnrt.models.glm5_next.moe import MoE

    def pre(mod, args, kwargs):
        b = args[0]  # ForwardBatch
        S = b.input_ids.shape[1]
        trace.valid = torch.arange(S)[None, :] < b.num_new[:, None]  # [B, S]

    def post(mod, args, kwargs, out):
        lg = out.logits
        if not trace.valid.any():
            return  # a step of padding rows only (the runner times one): nothing to compare
        trace.logits.append((lg[trace.valid] if lg.dim() == 3 else lg[trace.valid.any(1)]).clone())

    def router(mod, args):
        x = args[0]  # [B, S, D]
        idx = mod.gate(x.reshape(-1, x.shape[-1]))[1].view(*x.shape[:2], -1)  # [B, S, k]
        trace.router.append(idx[trace.valid].sort(-1).values)

    handles = []
    for m in (model, model.mtp):
        handles += [m.register_forward_pre_hook(pre, with_kwargs=True), m.register_forward_hook(post, with_kwargs=True)]
    handles += [m.register_forward_pre_hook(router) for m in model.modules() if isinstance(m, MoE)]
    indexer.index_probe = lambda pool_mask, meta: trace.index.append(pool_mask[meta.valid].clone())
    return handles


def drive(model, vocab: int, first_chunk_only: bool = False) -> Trace:
    """The script of the module doc over a fresh SpecModelRunner of `model`; its Trace."""
    trace = Trace()
    handles = _hook(model, trace)
    try:
        _script(model, vocab, trace, first_chunk_only)
    finally:
        for h in handles:
            h.remove()
    return trace


def _script(model, vocab: int, trace: Trace, first_chunk_only: bool) -> None:
    from trnrt.config.engine_config import EngineConfig
    from trnrt.engine.output.outputs import CacheOp, RowInput
    from trnrt.engine.sample.logits_processors import PROMPT_LOGPROBS
    from trnrt.engine.spec.runner import SpecModelRunner

    cfg = EngineConfig(block_size=BS, max_model_len=128, decode_batch_buckets=(1, 2, 4),
                       prefill_token_buckets=(16, 32), num_blocks=40, num_slots=6, max_top_logprobs=2,
                       variants=(PROMPT_LOGPROBS,))
    state = model.allocate_state(cfg.num_blocks, BS, cfg.num_slots, mtp=True)
    runner = SpecModelRunner(model, state, cfg, vocab, num_steps=K)
    runner.allocate_cache_tiers(2, 0, 0)

    def row(ids, start, blocks, slot, rid, **kw):
        return RowInput(token_ids=list(ids), start_pos=start, block_ids=blocks, slot_id=slot, temperature=0.0,
                        top_p=1.0, top_k=-1, min_p=0.0, seed=0, num_logprobs=None, request_id=rid, **kw)

    def step(*rows):
        res = runner.execute(list(rows))
        for r in res:
            trace.tokens += [r.token_id, *r.extra_token_ids]
            trace.drafts += r.num_drafts
            trace.accepted += r.num_accepted
        return res

    pa = _prompt(1, 40, vocab)
    step(row(pa[:16], 0, A_BLOCKS, 1, "a", do_sample=False))  # partial chunk
    if first_chunk_only:
        return
    runner.apply_cache_ops([CacheOp("save_slot", (1,), (0,))])  # the prefix-cache checkpoint at 16
    (ta,) = step(row(pa[16:], 16, A_BLOCKS, 1, "a"))
    pb = pa[:16] + _prompt(2, 12, vocab)
    runner.apply_cache_ops([CacheOp("load_slot", (0,), (2,))])  # B resumes from A's checkpoint
    (tb,) = step(row(pb[16:], 16, B_BLOCKS, 2, "b"))
    last, pos = [ta.token_id, tb.token_id], [len(pa), len(pb)]
    for _ in range(DECODE_STEPS):
        ra, rb = step(row([last[0]], pos[0], A_BLOCKS, 1, "a"), row([last[1]], pos[1], B_BLOCKS, 2, "b"))
        last, pos = [ra.token_id, rb.token_id], [pos[0] + 1, pos[1] + 1]
    pc = _prompt(3, 20, vocab)
    (tc,) = step(row(pc, 0, C_BLOCKS, 3, "c", speculative=True))
    t, n = tc.token_id, len(pc)
    for _ in range(3):  # speculative decode steps: draft, verify, rollback where rejected
        (rc,) = step(row([t], n, C_BLOCKS, 3, "c", speculative=True, spec_decode=True, num_lookahead=K))
        emitted = [rc.token_id, *rc.extra_token_ids]
        t, n = emitted[-1], n + len(emitted)
    pd = _prompt(4, 20, vocab)
    (td,) = step(row(pd, 0, D_BLOCKS, 4, "d", prompt_next_ids=pd[1:] + [0], num_prompt_logprobs=2))
    assert td.prompt_logprobs is not None and len(td.prompt_logprobs) == len(pd)  # the prompt variant ran
    trace.tokens += [t for p in td.prompt_logprobs[:-1] for t, _ in p.top]  # the prompt's top-2 ids


def _compare(ref: Trace, got: Trace) -> dict:
    same_shape = len(ref.logits) == len(got.logits) and all(
        a.shape == b.shape for a, b in zip(ref.logits, got.logits))
    delta = max(float((a - b).abs().max()) for a, b in zip(ref.logits, got.logits)) if same_shape else float("inf")

    def equal(which):
        x, y = getattr(ref, which), getattr(got, which)
        return len(x) == len(y) and all(torch.equal(a, b) for a, b in zip(x, y))

    return {"delta": delta, "forwards": len(got.logits), "tokens_equal": ref.tokens == got.tokens,
            "router_equal_tp1": equal("router"), "index_equal_tp1": equal("index"),
            "router_digest": got.digest("router"), "index_digest": got.digest("index"),
            "num_router": len(got.router), "num_index": len(got.index), "num_tokens": len(got.tokens),
            "drafts": got.drafts, "accepted": got.accepted}


def _decode_collectives(model, ctx) -> dict:
    """The collectives of one batch-2 decode forward (counted on the context), outside the script."""
    from trnrt.models.glm5_next.batch import ForwardBatch

    st = model.allocate_state(8, BS, 4, mtp=True)
    b = ForwardBatch(torch.tensor([[5], [7]]), torch.tensor([3, 4]), torch.tensor([1, 1]),
                     torch.tensor([[1], [2]]), torch.tensor([1, 2]))
    ctx.stats.reset()
    with torch.inference_mode():
        model(b, st)
    return ctx.stats.snapshot()["calls"]


def run_model_checks(ctx, layouts: list[list[int]], planted: list[int]) -> dict:
    """layouts: [tp, ep] pairs (tp == the world size); planted: the [tp, ep] to plant the bug in."""
    from trnrt.models import kernels
    from trnrt.models.glm5_next.config import Glm5NextConfig, Glm5NextMTPConfig
    from trnrt.models.glm5_next.rank_model import build_rank_model, load_rank_model, read_full_then_shard
    from trnrt.models.glm5_next.sharding import rule_for, shard_state_dict
    from trnrt.models.glm5_next.weights import read_safetensors, to_serving_names
    from trnrt.models.tiny import default_model_dir
    from trnrt.parallel.context import ParallelContext
    from trnrt.parallel.shard import Split

    t0 = time.monotonic()
    kernels.load()
    d = default_model_dir()
    f32 = torch.float32
    ref_model = load_rank_model(d, f32, ParallelContext.single(), load_mtp=True)
    V = ref_model.config.vocab_size
    ref = drive(ref_model, V)
    out = {"layouts": {}, "fused": kernels.load(), "ref_forwards": len(ref.logits), "ref_tokens": len(ref.tokens)}
    for tp, ep in layouts:
        c = ParallelContext(tp_size=tp, tp_rank=ctx.tp_rank, ep_size=ep, group=ctx.group)
        model = load_rank_model(d, f32, c, load_mtp=True, read=read_full_then_shard)
        row = _compare(ref, drive(model, V))
        row["decode_collectives"] = _decode_collectives(model, c)
        row["kda_heads"] = model.allocate_state(2, BS, 2).kda.shape[2]
        out["layouts"][f"tp{tp}_ep{ep}"] = row
    tp, ep = planted
    c = ParallelContext(tp_size=tp, tp_rank=ctx.tp_rank, ep_size=ep, group=ctx.group)
    cfg = Glm5NextConfig.from_pretrained(d)

    def contiguous_conv(name, cf):  # the planted bug: 3*qkv cut as one block, not per third
        return (Split(0),) if name.endswith("self_attn.conv1d.weight") else rule_for(name, cf)

    full = to_serving_names(read_safetensors(d), cfg, load_mtp=True)
    wrong = build_rank_model(cfg, shard_state_dict(full, cfg, c, rule=contiguous_conv), c,
                             Glm5NextMTPConfig.from_pretrained(d), dtype=f32)
    ref_first = drive(ref_model, V, first_chunk_only=True)
    out["planted"] = _compare(ref_first, drive(wrong, V, first_chunk_only=True))
    out["seconds"] = time.monotonic() - t0
    return out
