"""The graph catalogue: expand() pinned per preset, deterministic, flags add variants only."""

from __future__ import annotations

import pytest

from trnrt.compile.catalogue import (
    UnknownVariantError, expand, register_variant, spec_from_id, unregister_variant,
)
from trnrt.config.presets import list_presets, load_preset
from trnrt.engine.runner.step import GraphSpec

# Pinned spec lists: a change here is a change of what every runner compiles and runs.
PINNED = {
    "default": [
        "decode-b1-t1-base", "decode-b1-t1-base-greedy", "decode-b8-t1-base", "decode-b8-t1-base-greedy",
        "decode-b32-t1-base", "decode-b32-t1-base-greedy",
        "prefill-b1-t16-c128-base", "prefill-b1-t16-base", "prefill-b1-t64-c128-base", "prefill-b1-t64-base",
    ],
    "batch8": ["decode-b8-t1-c128-base", "decode-b8-t1-c128-base-greedy", "decode-b8-t1-base", "decode-b8-t1-base-greedy",
               "prefill-b1-t32-base", "prefill-b1-t128-base"],
}
# The MTP presets: default's graphs, then per decode bucket the verify graphs (k + 1 = 4 tokens,
# both rules) and one draft graph, then per prefill spec a spec_prefill graph (every position's
# hidden state for the drafter).
_MTP = PINNED["default"] + [
    "verify-b1-t4-base", "verify-b1-t4-base-greedy", "verify-b8-t4-base", "verify-b8-t4-base-greedy",
    "verify-b32-t4-base", "verify-b32-t4-base-greedy",
    "draft-b1-t4-base-greedy", "draft-b8-t4-base-greedy", "draft-b32-t4-base-greedy",
    "spec_prefill-b1-t16-c128-base", "spec_prefill-b1-t16-base", "spec_prefill-b1-t64-c128-base",
    "spec_prefill-b1-t64-base",
]
PINNED["mtp-always"] = PINNED["mtp-dynamic"] = _MTP


@pytest.mark.parametrize("name", sorted(PINNED))
def test_expand_pinned(name):
    assert [s.graph_id for s in expand(load_preset(name))] == PINNED[name]


def test_every_shipped_preset_is_pinned():
    assert set(list_presets()) <= set(PINNED), "pin the spec list of every new preset here"


def test_expand_is_deterministic_and_sorted():
    cfg = load_preset("default")
    a, b = expand(cfg), expand(cfg)
    assert a == b and a is not b
    assert [s.graph_id for s in a] == PINNED["default"]
    assert all(spec_from_id(s.graph_id) == s for s in a)


def test_graph_ids_round_trip_and_bad_ids_are_refused():
    for s in expand(load_preset("default")):
        assert spec_from_id(s.graph_id) == s
    assert spec_from_id("decode-b8-t1-base-greedy").sampling == "greedy"
    assert spec_from_id("decode-b8-t1-base").sampling == "full"
    assert spec_from_id("decode-b8-t1-c128-base-greedy") == GraphSpec("decode", 8, 1, "base", "greedy", 128)
    for s in expand(load_preset("batch8")):
        assert spec_from_id(s.graph_id) == s
    for bad in ("decode-b8-t1", "decode-b8-t1-base-full", "decode-b8-t1-base-nucleus", "decode-8-t1-base",
                "decode-b8-t1-c0-base"):
        with pytest.raises(ValueError):
            spec_from_id(bad)


def test_penalties_variant_and_the_superset_of_both_flags():
    """--penalties: one variant per base spec (decode and prefill) taking logit_scale and
    logit_bias [B, V] fp32 (neutral 1 and 0); with --structured-outputs too, one superset variant
    (not one per flag) whose inputs are the penalties' then the bitmask (chain order). The base
    list never changes."""
    from trnrt.compile.catalogue import get_variant

    cfg = load_preset("batch8")
    base = expand(cfg)
    for flags, name in ((["penalties"], "penalties"),
                        (["structured_outputs", "penalties"], "penalties+structured_outputs")):
        specs = expand(cfg, flags)
        assert [s for s in specs if s.variant == "base"] == base
        variants = [s for s in specs if s.variant != "base"]
        assert {s.variant for s in variants} == {name} and len(variants) == len(base)
    vd = get_variant("penalties")
    assert vd.extra_input_names == ("logit_scale", "logit_bias") and vd.phases == ("decode", "prefill")
    spec = [s for s in expand(cfg, ["penalties"]) if s.variant == "penalties"][0]
    scale, bias = vd.example_extra_inputs(spec, cfg, 4096, "cpu")
    assert scale.shape == bias.shape == (spec.batch, 4096) and str(scale.dtype) == "torch.float32"
    assert bool((scale == 1).all()) and bool((bias == 0).all())
    assert get_variant("penalties+structured_outputs").extra_input_names == ("logit_scale", "logit_bias",
                                                                            "token_bitmask")


def test_known_flag_without_variant_is_refused(monkeypatch):
    from trnrt.engine.sample import logits_processors as lp

    monkeypatch.delitem(lp._PROCESSORS, "penalties")
    with pytest.raises(UnknownVariantError, match="no variant graph is defined for --penalties"):
        expand(load_preset("default"), ["penalties"])


def test_structured_outputs_variant_doubles_decode_and_prefill_only():
    """--structured-outputs: one variant per base spec (decode and prefill), the base list unchanged,
    each variant taking the packed [B, ceil(V/32)] int32 token bitmask after the base inputs."""
    from trnrt.compile.catalogue import get_variant

    cfg = load_preset("batch8")
    base = expand(cfg)
    specs = expand(cfg, ["structured_outputs"])
    assert [s for s in specs if s.variant == "base"] == base
    variants = [s for s in specs if s.variant != "base"]
    assert {s.variant for s in variants} == {"structured_outputs"}
    assert [(s.phase, s.batch, s.tokens, s.sampling, s.context) for s in variants] == \
        [(s.phase, s.batch, s.tokens, s.sampling, s.context) for s in base]
    vd = get_variant("structured_outputs")
    assert vd.extra_input_names == ("token_bitmask",) and vd.phases == ("decode", "prefill")
    (mask,) = vd.example_extra_inputs(variants[0], cfg, 4096, "cpu")
    assert mask.shape == (variants[0].batch, 128) and str(mask.dtype) == "torch.int32" and bool((mask == -1).all())


@pytest.fixture
def test_variant():
    """A test-only variant: decode graphs take an extra [B, V] logit bias input."""
    import torch

    from trnrt.compile.export import spec_inputs  # noqa: F401  (import check)
    from trnrt.engine.runner.step import StepFunction

    class BiasStep(StepFunction):
        def forward(self, *args):
            *base, bias = args
            return super().forward(*base)  # the bias is validated for shape only in this stub

    def extra(spec, cfg, vocab, device):
        return (torch.zeros(spec.batch, vocab, device=device),)

    vd = register_variant({"test_bias"}, ("decode",), lambda m, s, c: BiasStep(m, s, c.max_top_logprobs), extra,
                          ("logit_bias",))
    yield vd
    unregister_variant({"test_bias"})


def test_flags_add_variants_and_never_change_the_base(test_variant):
    cfg = load_preset("default")
    base = expand(cfg)
    with_flag = expand(cfg, ["test_bias"])
    assert [s for s in with_flag if s.variant == "base"] == base
    variants = [s.graph_id for s in with_flag if s.variant != "base"]
    assert variants == [f"decode-b{b}-t1-test_bias{g}" for b in (1, 8, 32) for g in ("", "-greedy")]
    # flags stored on the config are the default
    assert expand(cfg.replace(variants=("test_bias",))) == with_flag
    # sorted: each variant right after its base spec
    ids = [s.graph_id for s in with_flag]
    assert ids.index("decode-b1-t1-test_bias") == ids.index("decode-b1-t1-base") + 1
    assert ids.index("decode-b1-t1-test_bias-greedy") == ids.index("decode-b1-t1-base-greedy") + 1


def test_flag_sets_need_their_own_definition(test_variant):
    with pytest.raises(UnknownVariantError):
        expand(load_preset("default"), ["test_bias", "penalties"])


def test_mtp_presets_add_verify_and_draft_graphs_only():
    """The MTP presets hold the default preset's graphs unchanged (same specs, and the same
    graph-settings hash for the plain phases: their fingerprints are shared), plus verify / draft;
    flags add variants of the plain phases only; mtp-always refuses the processor flags."""
    from trnrt.compile.catalogue import SpeculativeFlagError
    from trnrt.config.presets import phase_settings_hash, preset_hash

    default = load_preset("default")
    for name in ("mtp-always", "mtp-dynamic"):
        cfg = load_preset(name)
        assert cfg.speculative_num_steps == 3
        plain = [s for s in expand(cfg) if s.phase in ("decode", "prefill")]
        assert plain == expand(default)
        assert preset_hash(cfg) != preset_hash(default)
        for phase in ("decode", "prefill"):
            assert phase_settings_hash(cfg, phase) == phase_settings_hash(default, phase)
        assert phase_settings_hash(cfg, "verify") == preset_hash(cfg)
        for s in expand(cfg):
            assert spec_from_id(s.graph_id) == s
    assert load_preset("mtp-always").speculative_mode == "always"
    dyn = load_preset("mtp-dynamic")
    assert dyn.speculative_mode == "dynamic" and dyn.speculative_min_accept_length > 1.0
    flagged = expand(dyn, ["penalties", "structured_outputs"])
    assert {s.phase for s in flagged if s.variant != "base"} == {"decode", "prefill"}
    assert [s for s in flagged if s.variant == "base"] == expand(dyn)
    for flag in ("penalties", "structured_outputs"):
        with pytest.raises(SpeculativeFlagError, match="--" + flag.replace("_", "-")):
            expand(load_preset("mtp-always"), [flag])
    assert expand(load_preset("mtp-always"), ["prompt_logprobs"])  # prefill-only: served
