"""The MTP graphs compiled (AOTInductor, CPU) equal eager: mtp-always's `verify`, `draft` and
`spec_prefill` graphs.

The session compiles one verify graph (the full rule), one draft graph and one spec_prefill graph
of mtp-always (smallest bucket; compile_groups "kinds"). Each is run on live rows, compiled over
one state and eagerly over a copy, twice in a row (an extend from an empty slot, then one after
it): tokens, accept counts and drafts must be equal, hidden states, logprobs and every state
tensor the graph writes (the target's stacks for verify and spec_prefill, the MTP stack for draft)
equal to float rounding. Then an
engine on mtp-always with the compiled verify graph and the oracle drafter (full, partial and
zero acceptance) gives the plain engine's greedy tokens, and its verifies ran in the graph.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from trnrt.compile import expand, load_compiled
from trnrt.compile.export import eager_callable, spec_inputs, state_tensors
from trnrt.compile.manifest import Manifest
from trnrt.config.presets import load_preset

from compile_groups import MODE

sys.path.insert(0, str(Path(__file__).parents[1] / "engine_e2e"))  # e2e_helpers

TOL = 1e-4  # fp32; Inductor fuses and reorders reductions


@pytest.fixture(scope="module")
def mtp_art(compiled):
    if "mtp-always" not in compiled:
        pytest.skip(f"TRNRT_TEST_COMPILE={MODE}: mtp-always's graphs are not compiled")
    return compiled["mtp-always"]


@pytest.fixture(scope="module")
def mtp_model(tiny_dir):
    from trnrt.models.glm5_next.weights import load_model

    return load_model(tiny_dir, torch.float32, load_mtp=True)


def _specs(art, cfg, phase):
    ok = {g.id for g in Manifest.read(art).graphs if g.status == "ok" and not g.reused}
    return [s for s in expand(cfg) if s.graph_id in ok and s.phase == phase]


def _live(spec, cfg, model, g, start: int, num: int):
    """Inputs of `spec` for live rows (all but the last when B > 1) at `start`, `num` tokens each."""
    inputs = list(spec_inputs(spec, cfg, model.config.vocab_size, hidden_size=model.config.hidden_size))
    b, s = spec.batch, spec.tokens
    live = b - 1 if b > 1 else 1
    inputs[0][:live] = torch.randint(1, model.config.vocab_size, (live, s), generator=g)
    inputs[1][:live] = start
    inputs[2][:live] = num
    blocks = cfg.table_blocks(spec.context)
    inputs[3][:live, :4] = torch.arange(1, 5)[None] + 4 * torch.arange(live)[:, None]
    inputs[4][:live] = torch.arange(1, live + 1)
    if spec.phase == "draft":
        inputs[5][:live] = torch.randn(live, s, model.config.hidden_size, generator=g)
    else:
        inputs[5][:live] = 0.8  # temperature: the full rule's rejection sampling
        inputs[9][:live] = torch.arange(live) + 7  # seeds
    assert blocks >= 4
    return inputs, live


N_OUT = {"verify": 3, "draft": 1, "spec_prefill": 5}


@pytest.mark.parametrize("phase", ["verify", "draft", "spec_prefill"])
def test_compiled_mtp_graphs_equal_eager(mtp_art, mtp_model, phase):
    cfg = load_preset("mtp-always")
    specs = _specs(mtp_art, cfg, phase)
    assert specs, f"no compiled {phase} graph"
    for spec in specs:
        st_c = mtp_model.allocate_state(cfg.num_blocks, cfg.block_size, cfg.num_slots, mtp=True)
        st_e = copy.deepcopy(st_c)
        fn = load_compiled(mtp_art, mtp_model, st_c, cfg, specs=[spec], check_graphs=False)[spec]
        assert hasattr(fn, "runner"), "expected an AOTInductor callable"
        eager = eager_callable(mtp_model, st_e, cfg, spec)
        g = torch.Generator().manual_seed(0)
        for start, num in ((0, spec.tokens), (spec.tokens, spec.tokens - 1)):
            inputs, live = _live(spec, cfg, mtp_model, g, start, num)
            out_c, out_e = fn(*inputs), eager(*[t.clone() for t in inputs])
            assert len(out_c) == len(out_e) == N_OUT[phase]
            assert torch.equal(out_c[0][:live], out_e[0][:live]), (spec.graph_id, out_c[0], out_e[0])
            if phase == "verify":
                assert torch.equal(out_c[1][:live], out_e[1][:live])
                torch.testing.assert_close(out_c[2][:live], out_e[2][:live], atol=TOL, rtol=TOL)
            if phase == "spec_prefill":  # the sampled token's logprobs, then every position's hidden state
                for j in (1, 3, 4):
                    torch.testing.assert_close(out_c[j][:live], out_e[j][:live], atol=TOL, rtol=TOL)
                assert torch.equal(out_c[2][:live], out_e[2][:live])
                assert out_c[4].shape == (1, spec.tokens, mtp_model.config.hidden_size)
        target = st_c.mtp if phase == "draft" else st_c
        ref = st_e.mtp if phase == "draft" else st_e
        for (name, a), (_, b) in zip(state_tensors(target), state_tensors(ref)):
            if name == "kda" and phase == "draft":
                continue
            written = a[:, 1:].abs().sum() > 0
            if phase == "draft" and name == "tail":
                # the draft puts its tail back as after the catch-up: written by the extend
                assert written, f"{spec.graph_id}: the catch-up never wrote the MTP tail"
            else:
                assert written, f"{spec.graph_id} never wrote {name}"
            torch.testing.assert_close(a[:, 1:], b[:, 1:], atol=TOL, rtol=TOL, msg=f"{spec.graph_id}: state {name}")
        # the MTP graph leaves the target's stacks alone, and verify the MTP's
        untouched = st_c if phase == "draft" else st_c.mtp
        for name, t in state_tensors(untouched):
            assert t[:, 1:].abs().sum() == 0, f"{spec.graph_id} wrote {name} of the other stack"


def test_engine_on_mtp_always_runs_the_compiled_verify_graph(mtp_art, tiny_dir):
    """Greedy tokens of an mtp-always engine (its compiled verify graph of batch 1 and spec_prefill
    graph of 16 tokens, the oracle drafter at full, partial and zero acceptance) equal the plain
    default engine's; its verifies and prompt chunks ran in the compiled graphs; nothing leaks."""
    from e2e_helpers import assert_clean, collect, greedy

    from trnrt.engine.request import GenerateRequest, SamplingParams

    from trnrt.engine.core.engine import Engine
    from trnrt.engine.spec.oracle import OracleDrafter

    cfg = load_preset("mtp-always")
    specs = _specs(mtp_art, cfg, "verify")
    assert any(s.batch == 1 for s in specs)
    prefills = _specs(mtp_art, cfg, "spec_prefill")  # the prompts' chunks (<= 16 tokens) run in it
    assert [s.graph_id for s in prefills] == ["spec_prefill-b1-t16-c128-base"]
    prompts = [[5 + i, 17, 33 + 2 * i, 101, 7 * i + 3, 250, 9][: 4 + i % 4] for i in range(3)]
    n_out = 12
    plain = Engine.from_model_dir(tiny_dir, preset="default")
    try:
        reference = {f"c{i}": p + greedy(plain, p, n_out) for i, p in enumerate(prompts)}
        vocab = plain.model_info.vocab_size
    finally:
        plain.shutdown()
    # c0: every draft right; c1: every draft wrong; c2: every third position wrong
    corrupt = {"c1": set(range(0, 200)), "c2": set(range(len(prompts[2]) + 1, 200, 3))}
    oracle = OracleDrafter(reference, vocab, corrupt)
    engine = Engine.from_model_dir(
        tiny_dir, preset="mtp-always", drafter_factory=lambda runner: oracle,
        compiled_loader=lambda m, s, e: load_compiled(mtp_art, m, s, e, specs=specs + prefills, check_graphs=False))
    try:
        assert engine.speculative_config is not None and engine.speculative_config.num_steps == 3
        for i, p in enumerate(prompts):  # one at a time: decode batches of 1, the compiled bucket
            c = collect(engine.submit(GenerateRequest(
                prompt_token_ids=list(p), request_id=f"c{i}",
                sampling_params=SamplingParams(max_new_tokens=n_out, temperature=0.0, ignore_eos=True))))
            assert c.error is None and c.output_ids == reference[f"c{i}"][len(p):], f"c{i}"
        dec = engine.runner.decoder
        assert dec.num_graph_verifies > 0, "no verify ran in the compiled graph"
        assert engine.runner.num_graph_calls.get(prefills[0].graph_id, 0) == len(prompts), "spec prefill ran eager"
        assert dec.num_rollbacks > 0, "no partial acceptance was exercised"
        stats = engine.stats_collector.spec_summary()
        assert 0.0 < stats["accept_rate"] < 1.0, stats
        assert_clean(engine)
        assert engine.runner.decoder.snapshots.pool.num_free == engine.runner._reserve
    finally:
        engine.shutdown()
