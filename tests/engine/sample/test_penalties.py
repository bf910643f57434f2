"""The penalties logits processor on fabricated logits and on the tiny model.

- PenaltyState + PenaltiesProcessor (host fill, only-touched reset, device apply) equal a plain
  per-token reference of the formulas (repetition over prompt+output, frequency/presence over
  output, logit_bias, the min_new_tokens stop ban), over several steps with rows coming and going;
- the variant step with neutral inputs gives the base step's tokens and logprobs exactly;
- end to end on the tiny model (greedy): a large logit_bias forces its token; repetition and
  frequency penalties change the output exactly as a reference greedy loop over the model's own
  logits predicts; with the flag off, or on with no penalty in a batch, only base graphs run.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trnrt.engine.sample.logits_processors import PenaltiesProcessor
from trnrt.engine.sample.penalties import PenaltyState, reference_logits


class _Row:
    def __init__(self, state):
        self.penalties = state


def test_processor_matches_the_reference_over_steps():
    rng = np.random.default_rng(0)
    B, V = 4, 97
    proc = PenaltiesProcessor()
    scale, bias = proc.host_buffers(B, V)
    prompts = [list(rng.integers(0, V, 12)) for _ in range(B)]
    rep, freq, pres = [1.7, 1.0, 0.6, 1.3], [0.0, 0.8, -0.5, 1.1], [0.0, 0.4, 1.5, -0.3]
    lbias = [{}, {3: 5.0, 90: -100.0}, {}, {7: 2.5}]
    mins, stops = [0, 0, 4, 6], [5, 96]
    states = [PenaltyState(repetition_penalty=rep[b], frequency_penalty=freq[b], presence_penalty=pres[b],
                           logit_bias=lbias[b], min_new_tokens=mins[b], stop_ids=stops, prompt_token_ids=prompts[b])
              for b in range(B)]
    outputs = [[] for _ in range(B)]
    for step in range(8):
        # row 0 leaves the batch at step 5 (neutral from then on): its old entries must be reset
        active = [b != 0 or step < 5 for b in range(B)]
        proc.pack((scale, bias), [_Row(s).penalties if a else None for s, a in zip(states, active)])
        logits = rng.standard_normal((B, V)).astype(np.float32) * 3
        got = proc.apply(torch.from_numpy(logits), torch.from_numpy(scale), torch.from_numpy(bias)).numpy()
        ref = reference_logits(logits, prompts, outputs, repetition_penalty=[r if a else 1.0 for r, a in zip(rep, active)],
                               frequency_penalty=[f if a else 0.0 for f, a in zip(freq, active)],
                               presence_penalty=[p if a else 0.0 for p, a in zip(pres, active)],
                               logit_bias=[lb if a else {} for lb, a in zip(lbias, active)],
                               min_new_tokens=[m if a else 0 for m, a in zip(mins, active)], stop_ids=stops)
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-5)
        assert np.array_equal(np.isneginf(got), np.isneginf(ref))
        if not active[0]:
            assert np.array_equal(got[0], logits[0])  # exactly neutral once it left
        if step < 4:
            assert np.isneginf(got[2, stops]).all()  # min_new_tokens 4 not reached
        for b in range(B):  # each row "samples" a token, often a repeat
            t = int(rng.choice(prompts[b] + outputs[b][-3:] + [int(rng.integers(0, V))]))
            outputs[b].append(t)
            states[b].add([t])
    assert not np.isneginf(got[2]).any()  # the ban lifts after min_new_tokens


def test_neutral_inputs_are_the_identity_and_inactive_states_are_neutral():
    proc = PenaltiesProcessor()
    logits = torch.randn(3, 50) * 4
    logits[0, 0] = float("-inf")
    scale, bias = proc.example_inputs(3, 50, "cpu")
    assert torch.equal(proc.apply(logits, scale, bias), logits)
    st = PenaltyState(min_new_tokens=2, stop_ids=[1])
    assert proc.row_value(_Row(st)) is st
    st.add([4, 4])
    assert proc.row_value(_Row(st)) is None  # min reached, nothing else: the row may run in the base graph


@pytest.mark.parametrize("sampling,temp", [("greedy", 0.0), ("full", 0.8)])
def test_variant_step_neutral_equals_base(tiny, sampling, temp):
    from trnrt.engine.runner.step import GraphSpec, StepFunction, example_inputs
    from trnrt.engine.runner.variant_step import VariantStepFunction

    model, cfg = tiny
    vocab = model.config.vocab_size
    x = list(example_inputs(GraphSpec("prefill", 2, 16), cfg.max_blocks_per_seq, vocab))
    x[0] = torch.randint(0, vocab, (2, 16))
    x[2], x[4], x[5] = torch.tensor([16, 9]), torch.tensor([1, 2]), torch.full((2,), temp)
    x[3][:, :1] = torch.tensor([[1], [2]])
    x[9], x[10] = torch.tensor([11, 12]), torch.tensor([16, 9])
    with torch.inference_mode():
        base = StepFunction(model, model.allocate_state(cfg.num_blocks, cfg.block_size, cfg.num_slots), 4, sampling)(*x)
        neutral = PenaltiesProcessor().example_inputs(2, vocab, "cpu")
        for flags in (["penalties"], ["penalties", "structured_outputs"]):
            extra = neutral if flags == ["penalties"] else neutral + (torch.full((2, -(-vocab // 32)), -1, dtype=torch.int32),)
            state = model.allocate_state(cfg.num_blocks, cfg.block_size, cfg.num_slots)
            var = VariantStepFunction(model, state, 4, flags, sampling)(*x, *extra)
            for a, b in zip(base, var):
                assert torch.equal(a, b)


def _reference_greedy(model, cfg, prompt, n, **pen):
    """Greedy decode by full recomputation: the model's logits of the whole sequence each step
    (a fresh state, one prefill), the reference penalty formulas, argmax."""
    from trnrt.engine.runner.step import StepFunction

    vocab = model.config.vocab_size
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(n):
            seq = prompt + out
            state = model.allocate_state(cfg.num_blocks, cfg.block_size, cfg.num_slots)
            nb = cfg.max_blocks_per_seq
            tables = torch.zeros((1, nb), dtype=torch.int64)
            tables[0, : -(-len(seq) // cfg.block_size)] = torch.arange(1, 1 + -(-len(seq) // cfg.block_size))
            logits = StepFunction(model, state, 4).logits(torch.tensor([seq]), torch.tensor([0]),
                                                          torch.tensor([len(seq)]), tables, torch.tensor([1]))
            ref = reference_logits(logits.float().numpy(), [prompt], [out],
                                   **{k: v if k == "logit_bias" else [v] for k, v in pen.items()})
            out.append(int(np.argmax(ref[0])))
    assert vocab == logits.shape[-1]
    return out


@pytest.fixture(scope="module")
def engine():
    from trnrt.engine.core.engine import Engine

    eng = Engine.from_model_dir(None, max_running_requests=4, context_length=128, penalties=True)
    yield eng
    eng.shutdown()


def _gen(eng, prompt, n, **sp):
    from trnrt.engine.request import GenerateRequest, SamplingParams

    stream = eng.submit(GenerateRequest(list(prompt), SamplingParams(max_new_tokens=n, temperature=0.0,
                                                                      ignore_eos=True, **sp)))
    ids = []
    for o in stream:
        ids += o.new_token_ids
    return ids


def test_engine_penalties_change_greedy_output_as_predicted(engine, tiny):
    model, cfg = tiny
    prompt = [11, 12, 13, 14, 11, 12, 13, 14, 11, 12]
    n = 8
    neutral = dict(repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0)
    base = _gen(engine, prompt, n)
    # a huge bias forces its token at every step
    target = next(t for t in range(100, 200) if t not in base)
    assert _gen(engine, prompt, 5, logit_bias={target: 100.0}) == [target] * 5
    # a moderate bias on a prompt token makes the greedy output repeat it (the random tiny model
    # never repeats by itself); repetition / frequency+presence penalties then break the loop,
    # exactly as the reference predicts from the model's own logits
    lb = {11: 5.0}
    looping = _gen(engine, prompt, n, logit_bias=lb)
    assert looping == [11] * n and looping == _reference_greedy(model, cfg, prompt, n, logit_bias=[lb], **neutral)
    for pen in (dict(repetition_penalty=2.0), dict(frequency_penalty=1.0, presence_penalty=0.5)):
        got = _gen(engine, prompt, n, logit_bias=lb, **pen)
        assert got == _reference_greedy(model, cfg, prompt, n, logit_bias=[lb], **(neutral | pen)), pen
        assert got != looping, pen  # the penalty really changed the output


def test_flag_off_and_unused_flag_run_base_graphs_same_tokens(tiny):
    from trnrt.engine.runner.model_runner import ModelRunner
    from trnrt.engine.output.outputs import RowInput

    model, cfg = tiny
    vocab = model.config.vocab_size

    def run(ecfg, with_pen=False):
        state = model.allocate_state(ecfg.num_blocks, ecfg.block_size, ecfg.num_slots)
        r = ModelRunner(model, state, ecfg, vocab)
        rows = [RowInput(token_ids=list(range(5 + i, 17 + i)), start_pos=0, block_ids=[1 + i], slot_id=1 + i,
                         temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, seed=0, num_logprobs=2) for i in range(2)]
        res = r.execute(rows)
        for step in range(3):
            pen = PenaltyState(logit_bias={3: 0.0}) if with_pen else None  # a neutral-valued but active state
            rows = [RowInput(token_ids=[res[i].token_id], start_pos=12 + step, block_ids=[1 + i], slot_id=1 + i,
                             temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, seed=0, num_logprobs=2,
                             penalties=pen if i == 0 else None) for i in range(2)]
            res += r.execute(rows)
        return [(x.token_id, x.logprob.logprob, x.logprob.top) for x in res], dict(r.num_graph_calls)

    with torch.inference_mode():
        toks0, keys0 = run(cfg)
        toks1, keys1 = run(cfg.replace(variants=("penalties",)))
        toks2, keys2 = run(cfg.replace(variants=("penalties",)), with_pen=True)
    assert toks1 == toks0 and keys1 == keys0 and all(k.endswith(("-base", "-base-greedy")) for k in keys0)
    assert toks2 == toks0
    assert keys2 == {"prefill-b1-t16-base": 2, "decode-b4-t1-penalties-greedy": 3}
