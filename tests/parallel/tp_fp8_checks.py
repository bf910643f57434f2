"""The body of every rank of tests/parallel/test_tp_fp8.py: the FP8 rank model
(fp8/rank_load.py) against the FP8 TP=1 model (fp8/load.load_fp8_model) on an FP8 tiny checkpoint.

Per layout ([tp, ep, kv]: kv "fp8_e4m3" runs both models over the FP8 latent / key cache) both
models go through the same short script on a ModelRunner (eager, the real step path): prompt A's
prefill (a partial chunk then the rest), prompt B's prefill, then DECODE_STEPS greedy decode steps
of A and B as one batch. Every forward's logits are recorded at their valid rows (tp_model_checks'
Trace / _compare), with the tokens each step emitted. fp32 compute, one torch thread.
"""

from __future__ import annotations

import time

import torch
from tp_model_checks import BS, Trace, _compare, _prompt

DECODE_STEPS = 4


def _hook(model, trace: Trace):
    """Record the valid rows' logits of every target forward (padding rows left out)."""

    def pre(mod, args, kwargs):
        b = args[0]  # ForwardBatch
        trace.valid = torch.arange(b.input_ids.shape[1])[None, :] < b.num_new[:, None]  # [B, S]

    def post(mod, args, kwargs, out):
        lg = out.logits
        if trace.valid.any():
            trace.logits.append((lg[trace.valid] if lg.dim() == 3 else lg[trace.valid.any(1)]).clone())

    return [model.register_forward_pre_hook(pre, with_kwargs=True), model.register_forward_hook(post, with_kwargs=True)]


def drive(model, vocab: int, kv: str) -> Trace:
    """The script of the module doc over a fresh ModelRunner of `model`; its Trace."""
    from trnrt.config.engine_config import EngineConfig
    from trnrt.engine.output.outputs import RowInput
    from trnrt.engine.runner.model_runner import ModelRunner
    from trnrt.models.glm5_next.fp8.kv_cache import to_fp8_kv_state, use_fp8_kv_cache

    cfg = EngineConfig(block_size=BS, max_model_len=64, decode_batch_buckets=(1, 2), prefill_token_buckets=(16, 32),
                       num_blocks=16, num_slots=4)
    state = model.allocate_state(cfg.num_blocks, BS, cfg.num_slots)
    if kv == "fp8_e4m3":
        use_fp8_kv_cache(model)
        state = to_fp8_kv_state(state)
    runner = ModelRunner(model, state, cfg, vocab)
    trace = Trace()
    handles = _hook(model, trace)

    def row(ids, start, blocks, slot, **kw):
        return RowInput(token_ids=list(ids), start_pos=start, block_ids=blocks, slot_id=slot, temperature=0.0,
                        top_p=1.0, top_k=-1, min_p=0.0, seed=0, num_logprobs=None, **kw)

    def step(*rows):
        res = runner.execute(list(rows))
        trace.tokens += [r.token_id for r in res]
        return res

    try:
        a_blocks, b_blocks = list(range(1, 6)), list(range(6, 11))
        pa, pb = _prompt(11, 24, vocab), _prompt(12, 12, vocab)
        step(row(pa[:10], 0, a_blocks, 1, do_sample=False))  # a partial prefill chunk
        (ta,) = step(row(pa[10:], 10, a_blocks, 1))
        (tb,) = step(row(pb, 0, b_blocks, 2))
        last, pos = [ta.token_id, tb.token_id], [len(pa), len(pb)]
        for _ in range(DECODE_STEPS):
            ra, rb = step(row([last[0]], pos[0], a_blocks, 1), row([last[1]], pos[1], b_blocks, 2))
            last, pos = [ra.token_id, rb.token_id], [pos[0] + 1, pos[1] + 1]
    finally:
        for h in handles:
            h.remove()
    return trace


def run_fp8_checks(ctx, model_dir: str, layouts: list[list]) -> dict:
    """layouts: [tp, ep, kv] (tp == the world size, kv "auto" or "fp8_e4m3"); per layout the
    comparison with the FP8 TP=1 model over the same kv cache dtype, and the FP8 bytes of the rank."""
    from trnrt.models import kernels
    from trnrt.models.glm5_next.fp8.blocks import FP8_DTYPE
    from trnrt.models.glm5_next.fp8.rank_load import load_fp8_rank_model
    from trnrt.parallel.context import ParallelContext

    t0 = time.monotonic()
    kernels.load()
    f32 = torch.float32
    refs: dict[str, Trace] = {}
    out: dict = {"layouts": {}}
    for tp, ep, kv in layouts:
        if kv not in refs:  # the TP=1 FP8 model (load_fp8_model) over this cache dtype
            ref_model = load_fp8_rank_model(model_dir, f32, ParallelContext.single())
            out["ref_fp8_bytes"] = sum(p.nbytes for p in ref_model.parameters() if p.dtype == FP8_DTYPE)
            refs[kv] = drive(ref_model, ref_model.config.vocab_size, kv)
        c = ParallelContext(tp_size=tp, tp_rank=ctx.tp_rank, ep_size=ep, group=ctx.group)
        model = load_fp8_rank_model(model_dir, f32, c)
        row = _compare(refs[kv], drive(model, model.config.vocab_size, kv))
        row["ref_forwards"], row["ref_tokens"] = len(refs[kv].logits), len(refs[kv].tokens)
        row["fp8_bytes"] = sum(p.nbytes for p in model.parameters() if p.dtype == FP8_DTYPE)
        row["experts"] = type(model.layers[1].mlp.experts).__name__
        out["layouts"][f"tp{tp}_ep{ep}_{kv}"] = row
    out["seconds"] = time.monotonic() - t0
    return out
