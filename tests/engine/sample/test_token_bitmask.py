"""The structured_outputs logits processor and variant step on fabricated logits and the tiny model.

- unpack/apply against a reference (bit j of word w allows token 32w + j; sign bit included);
- the variant step with neutral masks gives the base step's tokens and logprobs, and a mask
  forces the sampled token into the allowed set (greedy and full sampler);
- with the flag off an engine runs exactly the graph keys (and tokens) it ran before; with the
  flag on and no grammar in a batch it still runs the base graphs only.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trnrt.engine.sample.logits_processors import TokenBitmaskProcessor, bitmask_width, unpack_bitmask


def _pack(allowed: np.ndarray) -> torch.Tensor:
    """Reference packer: allowed [B, V] bool -> [B, ceil(V/32)] int32 (xgrammar's layout)."""
    b, v = allowed.shape
    w = bitmask_width(v)
    out = np.zeros((b, w), np.uint32)
    for i in range(b):
        for t in np.flatnonzero(allowed[i]):
            out[i, t // 32] |= np.uint32(1) << np.uint32(t % 32)
    return torch.from_numpy(out.view(np.int32))


@pytest.mark.parametrize("vocab", [64, 100, 4096])
def test_unpack_and_apply_match_a_reference(vocab):
    rng = np.random.default_rng(vocab)
    allowed = rng.random((5, vocab)) < 0.3
    allowed[0] = True  # neutral row
    allowed[1, :] = False
    allowed[1, 31] = True  # the sign bit of word 0
    allowed[2, :] = False
    allowed[2, vocab - 1] = True  # the last token (a partial last word)
    mask = _pack(allowed)
    assert mask.dtype == torch.int32 and mask.shape == (5, bitmask_width(vocab))
    assert torch.equal(unpack_bitmask(mask, vocab), torch.from_numpy(allowed))
    logits = torch.randn(5, vocab)
    out = TokenBitmaskProcessor().apply(logits, mask)
    ref = torch.where(torch.from_numpy(allowed), logits, torch.tensor(float("-inf")))
    assert torch.equal(out, ref)
    assert torch.isneginf(out[1]).sum() == vocab - 1 and out[1, 31] == logits[1, 31]
    # a packed row from xgrammar itself (all bits set = neutral)
    (neutral,) = TokenBitmaskProcessor().example_inputs(2, vocab, "cpu")
    assert torch.equal(TokenBitmaskProcessor().apply(logits[:2], neutral), logits[:2])


def test_xgrammar_masks_unpack_to_its_own_allowed_set():
    xgr = pytest.importorskip("xgrammar")
    vocab = 100
    bm = xgr.allocate_token_bitmask(1, vocab)
    bm.zero_()
    for t in (0, 5, 31, 32, 99):
        bm[0, t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)
    logits = torch.zeros(1, vocab)
    ref = logits.clone()
    xgr.apply_token_bitmask_inplace(ref, bm)
    assert torch.equal(TokenBitmaskProcessor().apply(logits, bm), ref)


def _step_inputs(cfg, vocab, sampling_temp):
    from trnrt.engine.runner.step import GraphSpec, example_inputs

    x = list(example_inputs(GraphSpec("prefill", 2, 16), cfg.max_blocks_per_seq, vocab))
    x[0] = torch.randint(0, vocab, (2, 16))
    x[2] = torch.tensor([16, 9])  # num_new
    x[3][:, :1] = torch.tensor([[1], [2]])  # block tables
    x[4] = torch.tensor([1, 2])  # slots
    x[5] = torch.full((2,), sampling_temp)
    x[9] = torch.tensor([11, 12])
    x[10] = torch.tensor([16, 9])
    return tuple(x)


@pytest.mark.parametrize("sampling,temp", [("greedy", 0.0), ("full", 0.8)])
def test_variant_step_neutral_equals_base_and_mask_constrains(tiny, sampling, temp):
    from trnrt.engine.runner.step import StepFunction
    from trnrt.engine.runner.variant_step import VariantStepFunction

    model, cfg = tiny
    vocab = model.config.vocab_size
    inputs = _step_inputs(cfg, vocab, temp)

    def fresh_state():
        return model.allocate_state(cfg.num_blocks, cfg.block_size, cfg.num_slots)

    with torch.inference_mode():
        base = StepFunction(model, fresh_state(), 4, sampling)(*inputs)
        (neutral,) = TokenBitmaskProcessor().example_inputs(2, vocab, "cpu")
        var = VariantStepFunction(model, fresh_state(), 4, ["structured_outputs"], sampling)(*inputs, neutral)
        for a, b in zip(base, var):
            assert torch.equal(a, b)
        # allow only 3 tokens per row, none of them the base choice: the sampled token moves there
        allowed = np.zeros((2, vocab), bool)
        picks = [[7, 300, 4001], [12, 13, 2048]]
        for i, p in enumerate(picks):
            assert int(base[0][i]) not in p
            allowed[i, p] = True
        out = VariantStepFunction(model, fresh_state(), 4, ["structured_outputs"], sampling)(*inputs, _pack(allowed))
        assert [int(t) in p for t, p in zip(out[0], picks)] == [True, True]


def test_flag_off_engine_runs_the_same_graphs(tiny):
    """Same graph keys and tokens with the flag off as an engine that has no variants at all; with
    the flag on and no grammar in any batch: the base graphs still, the same tokens."""
    from trnrt.engine.runner.model_runner import ModelRunner
    from trnrt.engine.output.outputs import RowInput

    model, cfg = tiny
    vocab = model.config.vocab_size

    def run(ecfg, with_mask=False):
        state = model.allocate_state(ecfg.num_blocks, ecfg.block_size, ecfg.num_slots)
        r = ModelRunner(model, state, ecfg, vocab)
        rows = [RowInput(token_ids=list(range(5 + i, 17 + i)), start_pos=0, block_ids=[1 + i], slot_id=1 + i,
                         temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, seed=0, num_logprobs=None) for i in range(2)]
        toks = [x.token_id for x in r.execute(rows)]
        for step in range(3):
            rows = [RowInput(token_ids=[toks[-2 + i]], start_pos=12 + step, block_ids=[1 + i], slot_id=1 + i,
                             temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, seed=0, num_logprobs=None,
                             token_bitmask=(torch.full((bitmask_width(vocab),), -1, dtype=torch.int32)
                                            if with_mask and i == 0 else None)) for i in range(2)]
            toks += [x.token_id for x in r.execute(rows)]
        return toks, dict(r.num_graph_calls)

    with torch.inference_mode():
        toks0, keys0 = run(cfg)
        toks1, keys1 = run(cfg.replace(variants=("structured_outputs",)))
        toks2, keys2 = run(cfg.replace(variants=("structured_outputs",)), with_mask=True)
    assert toks1 == toks0 and keys1 == keys0 and all(k.endswith(("-base", "-base-greedy")) for k in keys0)
    # a (neutral) mask on one row moves that batch's decodes into the variant graph, same tokens
    assert toks2 == toks0
    assert keys2 == {"prefill-b1-t16-base": 2, "decode-b4-t1-structured_outputs-greedy": 3}
