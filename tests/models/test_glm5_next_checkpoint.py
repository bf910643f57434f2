"""Checkpoint namings (transformers / release, single / sharded), skipped vision + MTP tensors,
dtype handling, and clear errors for bad checkpoints and unsupported configs."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from glm5_helpers import Driver, save_sharded, save_single, to_release_naming, tokens
from trnrt.models.glm5_next.config import ConfigError, Glm5NextConfig
from trnrt.models.glm5_next.weights import CheckpointError, load_model


@pytest.fixture(scope="module")
def namings(tiny_dir, hf_model, tmp_path_factory):
    """(transformers-named single file, release-named sharded + fake MTP) directories."""
    root = tmp_path_factory.mktemp("namings")
    sd = hf_model.state_dict()
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in sd)
    assert any(".forget_gate." in k for k in sd) and any(".attn_hc." in k for k in sd)
    assert any(k.startswith("model.visual.") for k in sd)  # vision keys present, must be skipped
    tf_dir = root / "transformers"
    save_single(sd, tf_dir, tiny_dir)
    cfg = Glm5NextConfig.from_pretrained(tiny_dir)
    rel = to_release_naming(sd, cfg)
    n = cfg.num_hidden_layers
    # a fake MTP layer (layers.{n}.*, shared_head) with the release naming
    rel[f"model.language_model.layers.{n}.eh_proj.weight"] = torch.randn(64, 128)
    rel[f"model.language_model.layers.{n}.enorm.weight"] = torch.ones(64)
    rel[f"model.language_model.layers.{n}.mlp.experts.0.gate_proj.weight"] = torch.randn(32, 64)
    rel[f"model.language_model.layers.{n}.self_attn.q_a_proj.weight"] = torch.randn(32, 64)
    rel[f"model.language_model.layers.{n}.shared_head.norm.weight"] = torch.ones(64)
    rel["model.visual.extra_fake.weight"] = torch.randn(3)
    assert any(".hc_attn_fn" in k for k in rel) and any(".q_conv1d." in k for k in rel)
    assert any(".experts.7.down_proj.weight" in k for k in rel)
    rel_dir = root / "release"
    save_sharded(rel, rel_dir, tiny_dir, shards=3)
    return tf_dir, rel_dir


def _logits(model, ids):
    drv = Driver(model)
    drv.new_seq("a")
    return drv.step([("a", ids.tolist())], all_logits=True).logits[0]


def test_both_namings_give_identical_logits(namings, model, caplog):
    tf_dir, rel_dir = namings
    assert (rel_dir / "model.safetensors.index.json").exists()
    with caplog.at_level(logging.DEBUG, logger="trnrt.models.glm5_next"):  # vision: a debug line
        m_rel = load_model(rel_dir)
    assert "MTP" in caplog.text and "vision" in caplog.text
    m_tf = load_model(tf_dir)
    ids = tokens(40, 33)
    a, b, c = _logits(m_tf, ids), _logits(m_rel, ids), _logits(model, ids)
    assert torch.equal(a, b)
    assert torch.equal(a, c)  # save_pretrained output (release-like naming, single file)
    sa, sb = m_tf.state_dict(), m_rel.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_bf16_keeps_fp32_params(tiny_dir):
    m = load_model(tiny_dir, dtype=torch.bfloat16)
    sd = m.state_dict()
    fp32 = {k for k, v in sd.items() if v.dtype == torch.float32}
    for k in sd:
        keep = any(p in k for p in ("e_score_correction_bias", "conv1d", "dt_bias", "A_log",
                                    "attn_hc.base", "attn_hc.scale", "ffn_hc.base", "ffn_hc.scale"))
        assert (k in fp32) == keep, k
    assert sd["layers.0.attn_hc.fn"].dtype == torch.bfloat16
    st = m.allocate_state(8, 8, 3)
    assert st.kda.dtype == torch.float32 and st.latent.dtype == torch.bfloat16


# ----------------------------------------------------------------------------- bad checkpoints
def _copy_ckpt(src, dst, mutate=None, cfg_mutate=None):
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    if cfg_mutate:
        cfg_mutate(cfg["text_config"])
    (dst / "config.json").write_text(json.dumps(cfg))
    sd = load_file(str(src / "model.safetensors"))
    if mutate:
        mutate(sd)
    save_file(sd, str(dst / "model.safetensors"))
    return dst


def test_missing_tensor_is_named(tiny_dir, tmp_path):
    key = "model.language_model.layers.1.self_attn.kv_b_proj.weight"
    d = _copy_ckpt(tiny_dir, tmp_path / "c", mutate=lambda sd: sd.pop(key))
    with pytest.raises(CheckpointError, match=r"layers\.1\.self_attn\.kv_b_proj\.weight.*missing") as e:
        load_model(d)
    assert e.value.tensor == "layers.1.self_attn.kv_b_proj.weight"


def test_missing_expert_is_named(tiny_dir, tmp_path):
    key = "model.language_model.layers.4.mlp.experts.5.up_proj.weight"
    d = _copy_ckpt(tiny_dir, tmp_path / "c", mutate=lambda sd: sd.pop(key))
    with pytest.raises(CheckpointError, match=r"layers\.4\.mlp\.experts\.5\.up_proj\.weight"):
        load_model(d)


def test_wrong_shape_is_named(tiny_dir, tmp_path):
    key = "model.language_model.layers.3.self_attn.o_proj.weight"

    def mutate(sd):
        sd[key] = torch.zeros(64, 60)

    d = _copy_ckpt(tiny_dir, tmp_path / "c", mutate=mutate)
    with pytest.raises(CheckpointError, match=r"layers\.3\.self_attn\.o_proj\.weight.*\(64, 60\).*\(64, 64\)"):
        load_model(d)


def test_unexpected_tensor_is_named(tiny_dir, tmp_path):
    def mutate(sd):
        sd["model.language_model.layers.2.self_attn.mystery.weight"] = torch.zeros(3)

    d = _copy_ckpt(tiny_dir, tmp_path / "c", mutate=mutate)
    with pytest.raises(CheckpointError, match=r"layers\.2\.self_attn\.mystery\.weight"):
        load_model(d)


@pytest.mark.parametrize(
    "field,mutate",
    [
        ("qk_rope_head_dim", lambda c: c.update(qk_rope_head_dim=64)),
        ("layer_types", lambda c: c["layer_types"].__setitem__(3, "sliding_attention")),
        ("layer_types", lambda c: c.update(layer_types=c["layer_types"][:5])),
        ("mlp_layer_types", lambda c: c["mlp_layer_types"].__setitem__(0, "moe")),
        # shared indexer layer 4 directly after a KDA layer (3)
        ("indexer_types", lambda c: c["indexer_types"].__setitem__(4, "shared")),
        # shared after shared
        ("indexer_types", lambda c: (c["layer_types"].__setitem__(3, "indexed_attention"),
                                     c["indexer_types"].__setitem__(3, "shared"))),
        ("index_topk", lambda c: c.update(index_topk=10)),
        ("num_key_value_heads", lambda c: c.update(num_key_value_heads=2)),
        ("hidden_act", lambda c: c.update(hidden_act="gelu")),
        ("q_lora_rank", lambda c: c.update(q_lora_rank=None)),
        ("index_kpool_always_select_tail", lambda c: c.update(index_kpool_always_select_tail=False)),
    ],
)
def test_unsupported_config_is_named(tiny_dir, tmp_path, field, mutate):
    d = _copy_ckpt(tiny_dir, tmp_path / "c", cfg_mutate=mutate)
    with pytest.raises(ConfigError) as e:
        load_model(d)
    assert e.value.field == field and field in str(e.value)


def test_config_flat_and_nested_agree(tiny_dir):
    raw = json.loads((tiny_dir / "config.json").read_text())
    nested = Glm5NextConfig.from_dict(raw)
    flat = Glm5NextConfig.from_dict(raw["text_config"])
    assert nested == flat
    assert nested.kda_layers == (0, 3, 5) and nested.mla_layers == (1, 2, 4)
    assert nested.full_indexer_layers == (1, 4)
    # release-style fields: linear_attn_config, first_k_dense_replace, legacy layer type names
    rel = dict(raw["text_config"])
    for k in ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim", "linear_lower_bound",
              "mlp_layer_types"):
        rel.pop(k)
    rel["linear_attn_config"] = {"num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4,
                                 "gate_lower_bound": -5.0}
    rel["first_k_dense_replace"] = 1
    rel["layer_types"] = ["linear_attention", "full_attention", "deepseek_sparse_attention",
                          "linear_attention", "indexed_attention", "linear_attention"]
    c = Glm5NextConfig.from_dict(rel)
    assert c.linear_num_heads == 4 and c.linear_lower_bound == -5.0
    assert c.mlp_layer_types == ("dense",) + ("sparse",) * 5
    assert c.layer_types == nested.layer_types
    # transformers' defaults when schedules are absent: KDA unless i % 4 == 3, 3 dense, all full
    d = Glm5NextConfig.from_dict({"num_hidden_layers": 8})
    assert d.mla_layers == (3, 7) and d.mlp_layer_types[:4] == ("dense", "dense", "dense", "sparse")
    assert set(d.indexer_types) == {"full"}
