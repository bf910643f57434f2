"""Compiled variant graphs equal eager with live logits-processor inputs.

The session compiles the flags of compile_groups.FLAG_SETS together: the
`penalties+structured_outputs` superset variant (both processors in one graph: the dense
repetition scale and additive bias, then the packed token bitmask) and the prompt-logprobs
prefill variant carrying both processors, one graph of each kind of `batch8`. Each compiled graph
must give the eager step's tokens and logprobs (and every prompt position's logprob, top-N and
rank) on a batch with real masks, penalties and next ids, and the inputs must bind: every sampled
token is allowed by its row's mask, and the mask changes at least one row's token.
"""

from __future__ import annotations

import pytest
import torch

from trnrt.compile import load_compiled
from trnrt.compile.export import eager_callable, spec_inputs
from trnrt.compile.manifest import Manifest
from trnrt.config.presets import load_preset
from trnrt.compile.catalogue import get_variant

from compile_groups import MODE, PRESETS

FLAGS = ("penalties", "prompt_logprobs", "structured_outputs")
LOGPROB_TOL = 1e-4


# (an always-speculating preset takes no grammar / penalty flags: no variant graphs to check)
@pytest.fixture(params=[p for p in PRESETS if load_preset(p).speculative_mode != "always"])
def preset_and_dir(request, compiled):
    key = request.param + "+" + "+".join(sorted(FLAGS))
    if key not in compiled:
        pytest.skip(f"TRNRT_TEST_COMPILE={MODE} compiles no {key} graphs (TRNRT_TEST_COMPILE=variants: all)")
    return request.param, compiled[key]


def _live_inputs(spec, cfg, vocab: int, g: torch.Generator):
    """Step inputs with live rows (all but the last: padding), then real processor inputs."""
    inputs = list(spec_inputs(spec, cfg, vocab))
    names = get_variant(spec.variant).extra_input_names
    b, s = spec.batch, spec.tokens
    live = b - 1 if b > 1 else 1
    inputs[0][:live] = torch.randint(1, vocab, (live, s), generator=g)
    inputs[1][:live] = 0 if s > 1 else torch.arange(3, 3 + live)  # start_pos
    inputs[2][:live] = s  # num_new
    blocks = cfg.table_blocks(spec.context)
    inputs[3][:live, : min(blocks, 8)] = (torch.arange(1, min(blocks, 8) + 1)[None] + 8 * torch.arange(live)[:, None])
    inputs[4][:live] = torch.arange(1, live + 1)  # slots
    inputs[5][:live] = 0.8  # temperature (the greedy graphs ignore it)
    inputs[9][:live] = torch.arange(live) + 11  # seeds
    inputs[10][:live] = inputs[1][:live] + s
    extra = dict(zip(names, inputs[11:]))
    extra["logit_scale"][:live] = 1.0 + torch.rand(live, vocab, generator=g)  # repetition penalties in [1, 2)
    extra["logit_bias"][:live] = torch.randn(live, vocab, generator=g)
    words = extra["token_bitmask"].shape[1]
    bits = torch.randint(-(2 ** 31), 2 ** 31 - 1, (live, words), generator=g, dtype=torch.int64)
    extra["token_bitmask"][:live] = (bits & torch.randint(-(2 ** 31), 2 ** 31 - 1, (live, words), generator=g,
                                                          dtype=torch.int64)).to(torch.int32)  # ~1/4 allowed
    if "next_ids" in extra:  # the prompt shifted by one
        extra["next_ids"][:live, :-1] = inputs[0][:live, 1:]
        extra["next_ids"][:live, -1] = torch.randint(1, vocab, (live,), generator=g)
    return inputs, live, extra


def _allowed(mask: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    word = mask.gather(1, (ids // 32)[:, None]).squeeze(1).to(torch.int64) & 0xFFFFFFFF
    return ((word >> (ids % 32)) & 1) == 1


def test_compiled_variants_equal_eager_with_live_inputs(tiny_model, preset_and_dir):
    preset, variant_dir = preset_and_dir
    cfg = load_preset(preset).replace(variants=FLAGS)
    man = Manifest.read(variant_dir)
    ok = {e.id for e in man.graphs if e.status == "ok"}
    from trnrt.compile.catalogue import expand

    specs = [s for s in expand(cfg) if s.variant != "base" and s.graph_id in ok]
    assert specs, f"no compiled variant graph in {variant_dir}"
    vocab = int(tiny_model.config.vocab_size)
    changed = prompt_checked = 0
    for i, spec in enumerate(specs):
        g = torch.Generator().manual_seed(i)
        st_c = tiny_model.allocate_state(cfg.num_blocks, cfg.block_size, cfg.num_slots)
        st_e = tiny_model.allocate_state(cfg.num_blocks, cfg.block_size, cfg.num_slots)
        fn = load_compiled(variant_dir, tiny_model, st_c, cfg, specs=[spec], check_graphs=False)[spec]
        assert hasattr(fn, "runner"), "expected an AOTInductor callable"
        eager = eager_callable(tiny_model, st_e, cfg, spec)
        inputs, live, extra = _live_inputs(spec, cfg, vocab, g)
        mask = extra["token_bitmask"]
        with torch.inference_mode():
            c = fn(*[t.clone() for t in inputs])
            e = eager(*[t.clone() for t in inputs])
            neutral = [torch.full_like(t, -1) if t is mask else t for t in inputs]  # all tokens allowed
            st_n = tiny_model.allocate_state(cfg.num_blocks, cfg.block_size, cfg.num_slots)
            free = eager_callable(tiny_model, st_n, cfg, spec)(*neutral)
        assert torch.equal(c[0][:live], e[0][:live]), f"{spec.graph_id}: tokens {c[0].tolist()} vs {e[0].tolist()}"
        torch.testing.assert_close(c[1][:live], e[1][:live], atol=LOGPROB_TOL, rtol=0)
        torch.testing.assert_close(c[3][:live], e[3][:live], atol=LOGPROB_TOL, rtol=0)
        assert _allowed(mask[:live], c[0][:live]).all(), f"{spec.graph_id}: a sampled token is masked"
        if "next_ids" in extra:  # prompt logprobs: every position's logprob, top-N and rank
            assert len(c) == len(e) == 8
            n = spec.tokens
            torch.testing.assert_close(c[4][:live, :n], e[4][:live, :n], atol=LOGPROB_TOL, rtol=0)
            assert torch.equal(c[5][:live], e[5][:live]), f"{spec.graph_id}: prompt top ids differ"
            torch.testing.assert_close(c[6][:live], e[6][:live], atol=LOGPROB_TOL, rtol=0)
            assert torch.equal(c[7][:live], e[7][:live]), f"{spec.graph_id}: prompt ranks differ"
            prompt_checked += 1
        changed += int((free[0][:live] != e[0][:live]).any())
    assert changed, "the masks never changed a token: the test would not see a graph that ignores them"
    assert prompt_checked, "no compiled prompt-logprobs graph was checked"
    if MODE == "variants":  # every variant bucket of the preset was compiled and checked
        assert {s.graph_id for s in specs} == {s.graph_id for s in expand(cfg) if s.variant != "base"}
