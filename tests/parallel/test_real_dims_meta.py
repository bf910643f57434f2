"""GLM-5.3-Flash's real dimensions at TP 64 on the meta device, one process, a fake world of 64.

The released dims are `Glm5NextConfig.from_dict({})` (the transformers defaults; glm5_next.md
§1.1, §5). For each layout (tp 64 with ep 1 and ep 8; ep 64 does not divide 288 experts and must be
refused by name) and a few ranks: every tensor of the rank model's skeleton has exactly the shape
`sharding` gives its shard, the decode state is the rank's (one KDA head), and one decode step
of the default preset runs end to end on meta through the real step function (the collectives
run on the fake group). The torch.export of that step on meta works too but takes ~30-50 s on a
2-core box: TRNRT_REAL_DIMS_EXPORT=1 runs it (test_real_dims_export_on_meta).
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch

from trnrt.models.glm5_next.config import ConfigError, Glm5NextConfig
from trnrt.parallel.context import ParallelContext
from trnrt.parallel.fake import destroy_world, init_fake_world

TP = 64
LAYOUTS = [(TP, 1), (TP, 8)]
RANKS = (0, 37, TP - 1)


@pytest.fixture(scope="module")
def real_cfg() -> Glm5NextConfig:
    cfg = Glm5NextConfig.from_dict({})
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.n_routed_experts) == (154880, 4096, 45, 288)
    return cfg


@pytest.fixture(scope="module")
def fake_world():
    init_fake_world(TP, rank=0)
    yield
    destroy_world()


def _ctx(tp, ep, rank):
    import torch.distributed as dist

    return ParallelContext(tp_size=tp, tp_rank=rank, ep_size=ep, group=dist.group.WORLD)


@pytest.mark.parametrize("tp,ep", LAYOUTS)
def test_real_dims_every_shard_shape(real_cfg, fake_world, tp, ep):
    from trnrt.models.glm5_next import rank_model
    from trnrt.models.glm5_next.rank_meta import full_shapes, rank_shapes

    full = full_shapes(real_cfg)
    for r in RANKS:
        ctx = _ctx(tp, ep, r)
        want = rank_shapes(real_cfg, ctx)
        got = {k: tuple(v.shape) for k, v in rank_model._skeleton(real_cfg, ctx, None, set(want)).state_dict().items()}
        assert set(got) == set(want) == set(full)
        bad = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
        assert not bad, f"rank {r}: {len(bad)} tensors disagree with sharding, e.g. {list(bad.items())[:3]}"
    # spot checks of the cut itself (t = 64)
    assert want["embed_tokens.weight"] == (154880 // tp, 4096)
    assert want["layers.0.self_attn.q_proj.weight"] == (128, 4096)  # 1 KDA head of 128
    assert want["layers.3.self_attn.q_b_proj.weight"] == (256, 1536)  # 1 MLA head of 256
    assert want["layers.3.mlp.experts.gate_up_proj"] == ((288 // ep), 2 * 2048 // (tp // ep), 4096)


def test_real_dims_ep64_refused(real_cfg, fake_world):
    from trnrt.models.glm5_next.rank_meta import rank_shapes

    with pytest.raises(ConfigError, match="n_routed_experts"):
        rank_shapes(real_cfg, _ctx(TP, TP, 0))


def _decode_setup(cfg, ctx):
    from trnrt.compile.catalogue import expand
    from trnrt.config.presets import read_preset
    from trnrt.models.glm5_next.rank_meta import meta_rank_model

    ec = read_preset("default").engine_config
    spec = next(s for s in expand(ec, []) if s.phase == "decode" and s.sampling == "full")
    model = meta_rank_model(cfg, ctx, getattr(torch, ec.dtype))
    state = model.allocate_state(ec.num_blocks, ec.block_size, ec.num_slots)
    return ec, spec, model, state


@pytest.mark.parametrize("tp,ep", LAYOUTS)
def test_real_dims_decode_on_meta(real_cfg, fake_world, tp, ep):
    from trnrt.compile.export import eager_callable, spec_inputs

    ec, spec, model, state = _decode_setup(real_cfg, _ctx(tp, ep, TP - 1))
    assert state.kda.shape[2] == real_cfg.linear_num_heads // tp  # [n_kda, NS, H/t, Dk, Dv]
    assert state.latent.shape[-1] == real_cfg.kv_lora_rank  # latents replicated
    ins = spec_inputs(spec, ec, real_cfg.vocab_size, device="meta")
    token_ids, logprobs, top_ids, top_lp = eager_callable(model, state, ec, spec)(*ins)[:4]
    B = spec.batch
    assert token_ids.device.type == "meta" and tuple(token_ids.shape) == (B,)
    assert tuple(top_ids.shape) == (B, ec.max_top_logprobs)
    # the gathered logits are the full vocabulary (the sampler saw [B, V])
    out = model(*_batch(spec, ec, real_cfg), state)
    assert tuple(out.logits.shape) == (B, real_cfg.vocab_size)


def _batch(spec, ec, cfg):
    from trnrt.models.glm5_next.batch import ForwardBatch

    B, S, mb = spec.batch, spec.tokens, ec.table_blocks(spec.context)
    z = lambda *s: torch.zeros(*s, dtype=torch.int64, device="meta")  # noqa: E731
    return (ForwardBatch(input_ids=z(B, S), start_pos=z(B), num_new=z(B) + 1, block_tables=z(B, mb),
                         slot_ids=z(B)),)


@pytest.mark.skipif(os.environ.get("TRNRT_REAL_DIMS_EXPORT") != "1", reason="~30-50 s: TRNRT_REAL_DIMS_EXPORT=1")
def test_real_dims_export_on_meta(real_cfg, fake_world):
    from trnrt.compile.export import export_spec

    ec, spec, model, state = _decode_setup(real_cfg, _ctx(TP, 8, 0))
    eg = export_spec(model, state, ec, spec, device="meta")
    ops = Counter(str(n.target) for n in eg.program.graph.nodes if n.op == "call_function")
    L = real_cfg.num_hidden_layers  # one all-reduce per block (attention, MLP) + the embedding; logits gathered
    assert ops["_c10d_functional.all_reduce.default"] == 2 * L + 1
    assert ops["_c10d_functional.all_gather_into_tensor.default"] == 1
    assert ops["_c10d_functional.wait_tensor.default"] == sum(v for k, v in ops.items() if "_c10d_functional" in k
                                                              and "wait" not in k)


def test_neuron_mapping_of_every_real_weight(real_cfg):
    """compile.neuron_tp classifies every real-dims weight (pure Python; the NxD layers are untested)."""
    from trnrt.compile.neuron_tp import COLUMN, EMBEDDING, GATHERED_HEAD, REPLICATED, ROW, nxd_kind
    from trnrt.models.glm5_next.rank_meta import full_shapes

    kinds = {k: nxd_kind(k, s, real_cfg) for k, s in full_shapes(real_cfg).items()}
    assert kinds["embed_tokens.weight"] == EMBEDDING and kinds["lm_head.weight"] == GATHERED_HEAD
    assert kinds["layers.0.self_attn.q_proj.weight"] == COLUMN and kinds["layers.0.self_attn.o_proj.weight"] == ROW
    assert kinds["layers.3.mlp.shared_experts.down_proj.weight"] == ROW
    assert kinds["layers.0.input_layernorm.weight"] == REPLICATED
    assert kinds["layers.0.self_attn.conv1d.weight"] is None and kinds["layers.3.mlp.experts.gate_up_proj"] is None
