"""The sharding rules of glm5_next and the parallel primitives in ONE process (no collectives):
every weight of the tiny model (and its MTP layer) has a rule, an unknown name fails loudly,
shard -> unshard round-trips, each shard has the shape of the rank-local block that loads it,
a lazy getter is asked for the rank's slices only, and TP=1 is the unsharded model exactly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trnrt.models.glm5_next.config import ConfigError, Glm5NextConfig
from trnrt.models.glm5_next.model import Glm5NextForServing
from trnrt.models.glm5_next.moe import DenseMLP, MoE
from trnrt.models.glm5_next.mtp import Glm5NextMTP
from trnrt.models.glm5_next.parallel_blocks import ParallelDenseMLP, ParallelKDA, ParallelMLA, ParallelMoE
from trnrt.models.glm5_next.sharding import (
    check_layout, iter_shards, local_config, rule_for, shard_state_dict, state_rule,
)
from trnrt.models.glm5_next.state import ModelState
from trnrt.models.tiny import tiny_text_config
from trnrt.parallel.collectives import all_gather, all_reduce
from trnrt.parallel.context import ParallelContext
from trnrt.parallel.layers import ParallelLMHead, VocabParallelEmbedding, vocab_parallel_embedding
from trnrt.parallel.shard import ShardingError, Split, shard_shape, shard_tensor, unshard

LAYOUTS = [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4)]  # (tp_size, ep_size)


@pytest.fixture(scope="module")
def cfg() -> Glm5NextConfig:
    return Glm5NextConfig.from_dict(tiny_text_config())


def _model(cfg, ctx: ParallelContext | None = None) -> torch.nn.Module:
    """The tiny model with its MTP layer (own embedding and head) on meta; with ctx, every
    sharded block replaced by its rank-local version (same names: the subclasses keep them)."""
    with torch.device("meta"):
        m = Glm5NextForServing(cfg)
        m.mtp = Glm5NextMTP(cfg, own_embed=True, own_head=True)
        if ctx is None:
            return m
        V, D = cfg.vocab_size, cfg.hidden_size
        m.embed_tokens, m.lm_head = VocabParallelEmbedding(V, D, ctx), ParallelLMHead(V, D, ctx)
        m.mtp.embed_tokens, m.mtp.shared_head.head = VocabParallelEmbedding(V, D, ctx), ParallelLMHead(V, D, ctx)
        for i, layer in enumerate([*m.layers, m.mtp]):
            a = layer.self_attn
            if hasattr(a, "kda_idx"):
                layer.self_attn = ParallelKDA(cfg, a.layer_idx, a.kda_idx, ctx)
            else:
                full = a.indexer.full_idx if a.indexer is not None else None
                layer.self_attn = ParallelMLA(cfg, a.layer_idx, a.mla_idx, full, ctx)
            if isinstance(layer.mlp, MoE):
                layer.mlp = ParallelMoE(cfg, ctx)
            else:
                layer.mlp = ParallelDenseMLP(cfg, cfg.intermediate_size, "dense", ctx)
    return m


def _full_sd(cfg) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {k: torch.randn(v.shape, generator=gen) for k, v in _model(cfg).state_dict().items()}


def test_every_weight_of_the_tiny_model_has_a_rule(cfg):
    names = list(_model(cfg).state_dict())
    assert any(n.startswith("mtp.") for n in names) and "mtp.shared_head.head.weight" in names
    rules = {n: rule_for(n, cfg) for n in names}
    assert rules["layers.0.self_attn.conv1d.weight"] == (Split(0, parts=3, unit=cfg.linear_head_dim),)
    assert rules["layers.1.mlp.experts.gate_up_proj"] == (Split(0, "ep"), Split(1, "moe_tp", parts=2))
    assert rules["layers.0.self_attn.forget_gate.f_a_proj.weight"] == ()  # f_a, g_a stay whole
    assert rules["layers.1.self_attn.indexer.wq_b.weight"] == ()  # the indexer is replicated
    assert sum(1 for r in rules.values() if r) > 0 and sum(1 for r in rules.values() if not r) > 0


@pytest.mark.parametrize("name", [
    "layers.0.self_attn.q_b_proj.weight",  # an MLA weight in a KDA layer
    "layers.2.self_attn.indexer.wk.weight",  # layer 2 shares layer 1's indexer: it has none
    "layers.0.mlp.experts.gate_up_proj",  # layer 0 is dense
    "layers.6.input_layernorm.weight",  # past the decoder (the MTP layer is `mtp.*`)
    "mtp.attn_hc.fn",  # the MTP layer has no mHC
    "lm_head.bias", "visual.blocks.0.attn.qkv.weight",
])
def test_an_unknown_weight_name_fails_loudly(cfg, name):
    with pytest.raises(ShardingError) as e:
        rule_for(name, cfg)
    assert e.value.tensor == name and name in str(e.value)
    with pytest.raises(ShardingError):
        shard_state_dict({name: torch.zeros(4, 4)}, cfg, ParallelContext.for_rank(2, 0))


@pytest.mark.parametrize("tp,ep", LAYOUTS)
def test_shard_then_unshard_round_trips(cfg, tp, ep):
    full = _full_sd(cfg)
    ctxs = [ParallelContext.for_rank(tp, r, ep) for r in range(tp)]
    shards = [shard_state_dict(full, cfg, c) for c in ctxs]
    for name, t in full.items():
        back = unshard([(c, s[name]) for c, s in zip(ctxs, shards)], rule_for(name, cfg), t.shape, name)
        assert torch.equal(back, t), name
    # each shard has exactly the shape of the rank-local block that loads it (strict names)
    for c, s in zip(ctxs, shards):
        local = _model(cfg, c).state_dict()
        assert set(local) == set(s)
        bad = {n: (tuple(s[n].shape), tuple(v.shape)) for n, v in local.items() if s[n].shape != v.shape}
        assert not bad, bad
        state = ModelState.allocate(local_config(cfg, c), 2, 4, 2)
        for field in ("latent", "pooled", "kda", "conv", "tail"):  # the rank's state = its shard of the full
            full_shape = getattr(ModelState.allocate(cfg, 2, 4, 2), field).shape
            assert shard_shape(state_rule(field, cfg), full_shape, c, field) == tuple(getattr(state, field).shape)


def test_conv_thirds_and_gate_up_halves_are_cut_per_part(cfg):
    """Rank r's conv channels are q, k and v of its own heads, in that order (not a contiguous block)."""
    C = cfg.conv_channels
    w = torch.arange(C, dtype=torch.float32).view(C, 1, 1).expand(C, 1, cfg.linear_conv_kernel_dim)
    third, half = C // 3, C // 6
    got = shard_tensor(w, rule_for("layers.0.self_attn.conv1d.weight", cfg), ParallelContext.for_rank(2, 1))
    want = torch.cat([torch.arange(p * third + half, (p + 1) * third) for p in range(3)]).float()
    assert torch.equal(got[:, 0, 0], want)
    I = cfg.moe_intermediate_size
    gu = torch.arange(2 * I, dtype=torch.float32).view(1, 2 * I, 1).expand(cfg.n_routed_experts, 2 * I, 1)
    got = shard_tensor(gu, rule_for("layers.1.mlp.experts.gate_up_proj", cfg), ParallelContext.for_rank(2, 0))
    assert torch.equal(got[0, :, 0], torch.cat([torch.arange(0, I // 2), torch.arange(I, I + I // 2)]).float())


def test_a_lazy_getter_is_asked_for_the_ranks_slices_only(cfg):
    full = _full_sd(cfg)
    asked: dict[str, int] = {}

    def get(name, index):
        block = full[name][index]
        asked[name] = asked.get(name, 0) + block.numel()
        return block

    ctx = ParallelContext.for_rank(4, 3, 2)
    shapes = {k: tuple(v.shape) for k, v in full.items()}
    for name, shard in iter_shards(shapes, get, cfg, ctx):
        assert asked[name] == shard.numel(), name  # never the whole tensor of a split weight
        assert torch.equal(shard, shard_tensor(full[name], rule_for(name, cfg), ctx))
    # tp 4, ep 2: half the experts, half of each one's I: a quarter, as in every layout at tp 4
    assert asked["layers.1.mlp.experts.gate_up_proj"] * 4 == full["layers.1.mlp.experts.gate_up_proj"].numel()


def test_tp1_is_the_unsharded_model(cfg):
    """TP=1: the same config, the same tensors, no collective (the input object comes back), and
    a rank-local block exports to the graph of its base block with no collective node in it."""
    one = ParallelContext.single()
    assert local_config(cfg, one) is cfg
    full = _full_sd(cfg)
    assert all(torch.equal(v, full[k]) for k, v in shard_state_dict(full, cfg, one).items())
    x = torch.randn(2, 3, cfg.hidden_size)
    assert all_reduce(x, one) is x and all_gather(x, one, -1) is x
    w = torch.randn(16, cfg.hidden_size)
    ids = torch.randint(0, 16, (2, 3))
    assert torch.equal(vocab_parallel_embedding(ids, w, torch.tensor(0), one), F.embedding(ids, w))

    torch.manual_seed(0)
    base = DenseMLP(cfg, cfg.intermediate_size, "dense").requires_grad_(False)
    par = ParallelDenseMLP(cfg, cfg.intermediate_size, "dense", one).requires_grad_(False)
    par.load_state_dict(base.state_dict())
    g_base = torch.export.export(base, (x,)).graph_module.code
    g_par = torch.export.export(par, (x,)).graph_module.code
    assert g_par == g_base
    assert "c10d" not in g_par and "all_reduce" not in g_par
    head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, one)
    assert "c10d" not in torch.export.export(head, (x,)).graph_module.code


def test_a_layout_that_cannot_split_is_refused(cfg):
    with pytest.raises(ConfigError) as e:
        check_layout(cfg, ParallelContext.for_rank(3, 0))
    assert e.value.field == "vocab_size"
    with pytest.raises(ConfigError) as e:
        local_config(cfg, ParallelContext.for_rank(8, 0))
    assert e.value.field == "num_attention_heads"  # 4 heads over 8 ranks
    with pytest.raises(ValueError, match="ep_size"):
        ParallelContext.for_rank(2, 0, ep_size=4)
    with pytest.raises(ValueError, match="tp_rank"):
        ParallelContext.for_rank(2, 2)
    with pytest.raises(ShardingError, match="units of 16"):  # a head's 16 rows cannot be cut
        shard_tensor(torch.zeros(24, 4), (Split(0, unit=16),), ParallelContext.for_rank(2, 0), "w")


def test_mixed_rank_layouts_name_their_moe_ranks():
    ranks = [ParallelContext.for_rank(4, r, 2) for r in range(4)]
    assert [(c.ep_rank, c.moe_tp_rank, c.moe_tp_size) for c in ranks] == [(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)]


def test_a_collective_without_a_process_group_refuses():
    with pytest.raises(RuntimeError, match="process group"):
        all_reduce(torch.ones(2), ParallelContext.for_rank(2, 0))


def test_unshard_finds_a_rank_missing():
    ctx = [ParallelContext.for_rank(2, r) for r in range(2)]
    t = torch.randn(4, 2)
    with pytest.raises(ShardingError, match="on no rank"):
        unshard([(ctx[0], shard_tensor(t, (Split(0),), ctx[0]))], (Split(0),), t.shape, "w")
