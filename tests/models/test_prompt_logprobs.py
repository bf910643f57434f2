"""Prompt logprobs (trnrt.engine.runner.prompt_logprobs) against transformers, fp32, tiny checkpoint.

Every prompt position's logprob of the next prompt token, and its top-N, equal transformers'
log-softmax of its own logits within 1e-4: in one prefill chunk and in two chunks (the first
chunk's last position predicts the second chunk's first token through `next_ids`), padded to a
bucket. The sampled first token equals the base prefill step's.
"""

from __future__ import annotations

import pytest
import torch

from glm5_helpers import Driver, hf_oneshot, tokens

from trnrt.engine.runner.prompt_logprobs import PromptLogprobsStepFunction
from trnrt.engine.runner.step import StepFunction

TOL = 1e-4
N_TOP = 5


def _inputs(drv, name, toks, next_ids, bucket):
    """The step inputs of one prefill chunk (row 0) padded to `bucket` tokens, plus a padding row."""
    s = drv.seqs[name]
    B = 2
    ids = torch.zeros(B, bucket, dtype=torch.long)
    ids[0, :len(toks)] = torch.tensor(toks)
    nxt = torch.zeros(B, bucket, dtype=torch.long)
    nxt[0, :len(next_ids)] = torch.tensor(next_ids)
    start = torch.tensor([s["pos"], 0])
    num = torch.tensor([len(toks), 0])
    bt = torch.zeros(B, drv.mb, dtype=torch.long)
    bt[0] = torch.tensor(s["blocks"])
    slots = torch.tensor([s["slot"], 0])
    f = torch.zeros(B)
    samp = (f, torch.ones(B), torch.full((B,), 4096, dtype=torch.long), f, torch.zeros(B, dtype=torch.long),
            start + num)
    s["pos"] += len(toks)
    return (ids, start, num, bt, slots, *samp, nxt)


def _ref(hf_model, ids):
    logp = torch.log_softmax(hf_oneshot(hf_model, ids), -1)  # [L, V]
    tok = logp[:-1].gather(-1, ids[1:, None]).squeeze(-1)  # [L-1]: position i predicts ids[i+1]
    return logp, tok


def test_one_chunk_equals_transformers(model, hf_model, report):
    L = 40
    ids = tokens(5, L)
    logp, ref_tok = _ref(hf_model, ids)
    drv = Driver(model)
    drv.new_seq("a")
    step = PromptLogprobsStepFunction(model, drv.state, N_TOP, sampling="greedy")
    out = step(*_inputs(drv, "a", ids.tolist(), ids[1:].tolist(), bucket=48))
    tok, top_ids, top_lp = out[4][0, :L], out[5][0, :L], out[6][0, :L]
    d = (tok[:L - 1] - ref_tok).abs().max().item()
    report["prompt logprobs one chunk vs HF"] = d
    assert d <= TOL
    ref_top, ref_ids = torch.topk(logp, N_TOP, -1)
    assert (top_lp - ref_top).abs().max().item() <= TOL
    assert (top_ids == ref_ids).float().mean().item() > 0.99  # near-ties may swap
    # the sampled token is the base prefill's (greedy): same state from a fresh driver
    drv2 = Driver(model)
    drv2.new_seq("a")
    base = StepFunction(model, drv2.state, N_TOP, sampling="greedy")(*_inputs(drv2, "a", ids.tolist(), [], 48)[:-1])
    assert torch.equal(out[0], base[0]) and torch.allclose(out[1], base[1], atol=1e-6)


def test_two_chunks_cover_every_position(model, hf_model, report):
    L, P = 40, 24
    ids = tokens(6, L)
    _, ref_tok = _ref(hf_model, ids)
    drv = Driver(model)
    drv.new_seq("a")
    step = PromptLogprobsStepFunction(model, drv.state, N_TOP)
    a = step(*_inputs(drv, "a", ids[:P].tolist(), ids[1:P + 1].tolist(), bucket=32))
    b = step(*_inputs(drv, "a", ids[P:].tolist(), ids[P + 1:].tolist(), bucket=32))
    got = torch.cat([a[4][0, :P], b[4][0, :L - P - 1]])
    d = (got - ref_tok).abs().max().item()
    report["prompt logprobs two chunks vs HF"] = d
    assert got.shape == ref_tok.shape and d <= TOL


# -- through the engine ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_dir(tiny_dir, tmp_path_factory):
    """The session's tiny checkpoint (transformers' reference weights) with the embedded tiny
    model's tokenizer files, as `trnrt serve --model` would load it."""
    import shutil

    from trnrt.models.tiny import default_model_dir

    d = tmp_path_factory.mktemp("engine_ckpt")
    for f in tiny_dir.iterdir():
        shutil.copy(f, d / f.name)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(default_model_dir() / name, d / name)
    return d


def _engine(tiny_dir, budget: int, **flags):
    import dataclasses

    from trnrt.config import EngineConfig
    from trnrt.engine.core.engine import Engine
    from trnrt.engine.core.engine_setup import resolve_configs
    from trnrt.engine.cache.cache_config import PrefixCacheConfig

    ecfg = EngineConfig(max_model_len=256, decode_batch_buckets=(1, 4), prefill_token_buckets=(16,), num_blocks=80,
                        num_slots=6, max_top_logprobs=N_TOP, block_size=8)
    ecfg, scfg = resolve_configs(ecfg)
    scfg = dataclasses.replace(scfg, max_num_batched_tokens=budget)
    return Engine.from_model_dir(tiny_dir, engine_config=ecfg, scheduler_config=scfg, prompt_logprobs=True,
                                 prefix_cache_config=PrefixCacheConfig(checkpoint_interval=8), **flags)


def _run(engine, ids, **sp):
    from trnrt.engine.request import GenerateRequest, SamplingParams

    outs = list(engine.submit(GenerateRequest(ids.tolist(), SamplingParams(temperature=0.0, **sp), stream=False)))
    assert len(outs) == 1 and outs[0].error is None, outs
    return outs[0]


def test_engine_prompt_logprobs_equal_transformers_chunked_and_cached(engine_dir, hf_model, report):
    """Through the engine (chunked prefill over a 16-token graph, the penalties processor
    compiled in alongside): every position's logprob and top-N equal transformers'; the prompt
    is in the prefix cache (a plain request resumed from it) and a prompt-logprobs request
    computes it again anyway; max_new_tokens 0 scores the prompt and generates nothing; the first
    generated token is transformers' argmax. A plain request runs no prompt-logprobs graph."""
    L = 37  # chunks cut at the 8-token checkpoints
    ids = tokens(11, L)
    logp, ref_tok = _ref(hf_model, ids)
    ref_top_lp, ref_top_ids = torch.topk(logp, 3, -1)
    engine = _engine(engine_dir, budget=17, penalties=True)
    try:
        _run(engine, ids, max_new_tokens=2)
        plain = _run(engine, ids, max_new_tokens=2)
        assert plain.num_cached_tokens > 0 and plain.prompt_logprobs is None
        assert not any("prompt_logprobs" in g for g in engine.runner.num_graph_calls)
        worst = 0.0
        for max_new in (2, 0):
            out = _run(engine, ids, max_new_tokens=max_new, prompt_logprobs=3)
            assert out.num_cached_tokens == 0, "a prompt-logprobs request must not resume from the cache"
            pl = out.prompt_logprobs
            assert pl is not None and len(pl) == L and pl[0] is None
            got = torch.tensor([e.logprob for e in pl[1:]])
            assert [e.token_id for e in pl[1:]] == ids[1:].tolist()
            worst = max(worst, (got - ref_tok).abs().max().item())
            ref_rank = (logp[:-1] > ref_tok[:, None]).sum(-1) + 1  # [L-1]
            assert [e.rank for e in pl[1:]] == ref_rank.tolist()
            for p in range(1, L):
                assert [t for t, _ in pl[p].top] == ref_top_ids[p - 1].tolist(), p
                torch.testing.assert_close(torch.tensor([v for _, v in pl[p].top]), ref_top_lp[p - 1], atol=TOL, rtol=0)
            if max_new == 0:
                assert out.new_token_ids == [] and out.finish_reason.type == "length"
            else:
                assert out.new_token_ids == plain.new_token_ids
                assert out.new_token_ids[0] == int(logp[-1].argmax())
        report["prompt logprobs through the engine vs HF"] = worst
        assert worst <= TOL
        assert any("prompt_logprobs" in g for g in engine.runner.num_graph_calls)
    finally:
        engine.shutdown()


def test_runner_one_token_prompt_chunk_runs_the_prompt_graph(engine_dir, hf_model):
    """A one-token chunk inside a prompt (a step budget can leave one token) still scores its
    position: the runner sends it to the prefill graph, not the decode graph."""
    from trnrt.config import EngineConfig
    from trnrt.engine.runner.model_runner import ModelRunner
    from trnrt.engine.output.outputs import RowInput
    from trnrt.models.glm5_next.weights import load_model

    ids = tokens(13, 24)
    _, ref_tok = _ref(hf_model, ids)
    cfg = EngineConfig(max_model_len=64, decode_batch_buckets=(1,), prefill_token_buckets=(16,), num_blocks=12,
                       num_slots=2, max_top_logprobs=N_TOP, block_size=8, variants=("prompt_logprobs",))
    model = load_model(engine_dir)
    runner = ModelRunner(model, model.allocate_state(cfg.num_blocks, cfg.block_size, cfg.num_slots), cfg,
                         int(model.config.vocab_size))
    got = []
    for lo, hi in ((0, 10), (10, 11), (11, 24)):
        row = RowInput(token_ids=ids[lo:hi].tolist(), start_pos=lo, block_ids=[1, 2, 3, 4], slot_id=1,
                       temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, seed=0, num_logprobs=None,
                       prompt_next_ids=[int(ids[q + 1]) if q + 1 < 24 else 0 for q in range(lo, hi)],
                       num_prompt_logprobs=0)
        (res,) = runner.execute([row])
        got += [e.logprob for e in res.prompt_logprobs]
    assert runner.num_graph_calls.get("prefill-b1-t16-prompt_logprobs") == 3, runner.num_graph_calls
    assert not any(g.startswith("decode") for g in runner.num_graph_calls)
    assert (torch.tensor(got[:23]) - ref_tok).abs().max().item() <= TOL


def test_engine_prompt_logprobs_start_and_flag_off(engine_dir):
    from trnrt.engine.core.engine import Engine
    from trnrt.engine.request import GenerateRequest, InvalidRequestError, SamplingParams

    ids = tokens(12, 20)
    engine = _engine(engine_dir, budget=64)
    try:
        full = _run(engine, ids, max_new_tokens=1, prompt_logprobs=0).prompt_logprobs
        part = _run(engine, ids, max_new_tokens=1, prompt_logprobs=0, prompt_logprobs_start=7).prompt_logprobs
        assert len(part) == 13 and all(e.top == [] for e in part)
        assert [e.logprob for e in part] == [e.logprob for e in full[7:]]
        with pytest.raises(InvalidRequestError) as e:
            engine.submit(GenerateRequest(ids.tolist(), SamplingParams(prompt_logprobs=0, prompt_logprobs_start=20)))
        assert e.value.field == "prompt_logprobs_start"
    finally:
        engine.shutdown()
    off = Engine.from_model_dir(engine_dir, max_running_requests=2, context_length=128)
    try:
        with pytest.raises(InvalidRequestError, match="--prompt-logprobs") as e:
            off.submit(GenerateRequest(ids.tolist(), SamplingParams(prompt_logprobs=1)))
        assert e.value.field == "prompt_logprobs"
    finally:
        off.shutdown()
