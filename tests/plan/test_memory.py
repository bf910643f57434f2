"""trnrt.plan: weight / state bytes per rank against the real shards and tensor_parallel.md §6,
the refusal of a layout that cannot fit, and the CLI table. No real weights: meta device only."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from trnrt.config.engine_config import EngineConfig
from trnrt.models.glm5_next import sharding
from trnrt.models.glm5_next.config import Glm5NextConfig, Glm5NextMTPConfig
from trnrt.models.glm5_next.model import Glm5NextForServing
from trnrt.models.glm5_next.mtp import Glm5NextMTP
from trnrt.models.glm5_next.state import ModelState
from trnrt.models.glm5_next.weights import is_fp32_param
from trnrt.models.tiny import tiny_text_config
from trnrt.parallel.context import ParallelContext
from trnrt.parallel.shard import REPLICATE, shard_tensor
from trnrt.plan.fit import PlanError, check_fits, real_config
from trnrt.plan.memory import state_bytes, weight_bytes

GB = 1e9


@pytest.fixture(scope="module")
def tiny() -> Glm5NextConfig:
    return Glm5NextConfig.from_dict(tiny_text_config())


@pytest.fixture(scope="module")
def tiny_sd(tiny):
    """The tiny model's full serving state dict (with the MTP layer), bf16 with fp32-kept params."""
    torch.manual_seed(0)
    model = Glm5NextForServing(tiny)
    sd = dict(model.state_dict())
    sd.update({"mtp." + k: v for k, v in Glm5NextMTP(tiny, Glm5NextMTPConfig(1)).state_dict().items()})
    return {k: v.to(torch.float32 if is_fp32_param(k) else torch.bfloat16) for k, v in sd.items()}


def _real_bytes(sd, cfg, tp, ep):
    shards = sharding.shard_state_dict(sd, cfg, ParallelContext.for_rank(tp, 0, ep))
    return sum(t.numel() * t.element_size() for t in shards.values())


@pytest.mark.parametrize("tp,ep", [(2, 1), (4, 1), (2, 2), (4, 2)])
def test_tiny_weight_bytes_equal_the_real_shards(tiny, tiny_sd, tp, ep):
    assert weight_bytes(tiny, tp, ep, "bfloat16", mtp=True).total == _real_bytes(tiny_sd, tiny, tp, ep)


def test_planted_bug_a_replicated_tensor_counted_as_split_is_caught(tiny, tiny_sd):
    def wrong(name, cfg):  # q_a_proj is replicated; this counts it as split by rows
        r = sharding.rule_for(name, cfg)
        return (sharding.VOCAB[0],) if name.endswith("q_a_proj.weight") and r == REPLICATE else r

    assert weight_bytes(tiny, 2, 1, "bfloat16", mtp=True, rule=wrong).total != _real_bytes(tiny_sd, tiny, 2, 1)


@pytest.mark.parametrize("kv", [None, "fp8_e4m3"])
def test_tiny_state_bytes_equal_the_sharded_state(tiny, kv):
    from trnrt.models.glm5_next.fp8.kv_cache import to_fp8_kv_state

    ctx = ParallelContext.for_rank(2, 0, 1)
    st = ModelState.allocate(tiny, num_blocks=3, block_size=8, num_slots=5, dtype=torch.bfloat16)
    st = to_fp8_kv_state(st) if kv else st
    total = 0
    for field in ("latent", "pooled", "kda", "conv", "tail"):
        t = shard_tensor(getattr(st, field), sharding.state_rule(field, tiny), ctx, field)
        total += t.numel() * t.element_size()
    s = state_bytes(tiny, 2, 1, 8, "bfloat16", kv_cache_dtype=kv)
    assert 3 * s.block + 5 * s.slot == total


def test_real_dims_tp8_match_tensor_parallel_md():
    """§6: 78.8 GB per rank at TP 8 bf16 (MTP excluded), 10.4 GB at TP 64; ~0.30 B params
    replicated; KDA state 18.5 MB/sequence at TP 8; latent 11 KiB/token + 176 B pooled keys.
    Tolerance 0.1 GB (the table's rounding)."""
    cfg = real_config()
    w8 = weight_bytes(cfg, 8, 1, "bfloat16")
    assert abs(w8.total / GB - 78.8) < 0.1
    assert abs(weight_bytes(cfg, 8, 8, "bfloat16").total / GB - 78.8) < 0.1
    assert abs(weight_bytes(cfg, 64, 1, "bfloat16").total / GB - 10.4) < 0.1
    assert abs(w8.replicated / 2 / GB - 0.30) < 0.01
    s = state_bytes(cfg, 8, 1, 16, "bfloat16")
    assert abs(s.kda_slot / 1e6 - 18.5) < 0.1
    assert s.token == 11264 + 176


def _engine(**kw):
    return EngineConfig(dtype="bfloat16", block_size=16, max_model_len=131072, num_blocks=2, num_slots=2, **kw)


def test_h100_tp8_bf16_refused_naming_the_smallest_fitting_layout():
    with pytest.raises(PlanError) as e:
        check_fits(real_config(), _engine(), tp=8, ep=1, device="h100")
    assert "TP 8 EP 1 on h100" in str(e.value)
    assert "smallest layout that fits is TP 16 EP 1" in str(e.value)
    assert e.value.smallest.tp == 16 and e.value.smallest.fits


def test_h200_tp8_and_trn2_tp64_fit():
    p = check_fits(real_config(), _engine(), tp=8, ep=1, device="h200")
    assert p.max_running_requests >= 1 and p.max_total_tokens >= 131072
    assert check_fits(real_config(), _engine(), tp=64, ep=1, device="trn2").max_running_requests >= 1


def test_tiny_on_cpu_fits_at_the_default_preset(tiny):
    from trnrt.config.presets import load_preset

    assert check_fits(tiny, load_preset("default"), tp=1, device="cpu").fits


def test_cli_prints_the_table_and_exits_1_when_it_does_not_fit():
    from trnrt.cli import app

    runner = CliRunner()
    ok = runner.invoke(app, ["plan", "--tp-size", "8", "--device", "h200", "--context-length", "131072"])
    assert ok.exit_code == 0, ok.output
    assert "weights" in ok.output and "78.85 GB" in ok.output and "max running requests" in ok.output
    bad = runner.invoke(app, ["plan", "--tp-size", "8", "--device", "h100"])
    assert bad.exit_code == 1 and "TP 16" in bad.output


def test_cpu_ranks_share_the_host_memory(tiny, monkeypatch):
    from trnrt.config.presets import load_preset
    from trnrt.plan import devices
    from trnrt.plan.devices import device

    # the CPU's memory is MemAvailable, read at each call: hold it still (other tests allocate meanwhile)
    monkeypatch.setattr(devices, "_mem_available", lambda: 20 * 2**30)

    cpu = device("cpu")
    p1 = check_fits(tiny, load_preset("default"), tp=1, device="cpu")
    p2 = check_fits(tiny, load_preset("default"), tp=2, device="cpu")
    assert (p1.device_bytes, p2.device_bytes) == (cpu.bytes_per_rank, cpu.bytes_per_rank // 2)
    assert device("h100").rank_bytes(8) == 80 * 10**9


def test_cli_reads_a_model_directory():
    from trnrt.cli import app
    from trnrt.models.paths import resolve_model_dir

    tiny_dir = resolve_model_dir(None)
    out = CliRunner().invoke(app, ["plan", "--model", str(tiny_dir), "--tp-size", "2", "--ep-size", "2",
                                   "--device", "cpu", "--dtype", "float32"])
    assert out.exit_code == 0, out.output
    assert "TP 2 EP 2 on 2 x cpu" in out.output and "yes" in out.output
    bad = CliRunner().invoke(app, ["plan", "--model", str(tiny_dir), "--tp-size", "3", "--device", "cpu"])
    assert bad.exit_code == 2 and "divisible" in bad.output


def test_tp1_weight_bytes_equal_the_loaded_models_resident_bytes():
    """The plan against what the loaders actually hold (the tiny checkpoint, bf16 and FP8):
    bf16 exactly; FP8 within 0.1 % (prepare's fused FP8 matrices keep each part's scale rows,
    which the tiny dims, below one 128-block, round differently)."""
    from trnrt.models.glm5_next.fp8.load import weight_bytes as resident
    from trnrt.models.glm5_next.loading import load_model
    from trnrt.models.paths import resolve_model_dir
    from trnrt.plan.fit import model_config

    d = resolve_model_dir(None)
    cfg, _ = model_config(d)
    bf16 = sum(resident(load_model(d, dtype=torch.bfloat16)).values())
    assert weight_bytes(cfg, 1, 1, "bfloat16").total == bf16
    fp8 = sum(resident(load_model(d, dtype=torch.bfloat16, quantization="fp8")).values())
    assert abs(weight_bytes(cfg, 1, 1, "bfloat16", quantization="fp8").total / fp8 - 1) < 1e-3


def test_h100_tp8_fits_with_fp8_weights():
    """tensor_parallel.md §6: FP8 experts 40.8 GB/rank at TP 8; the FP8 policy also quantizes the
    attention and shared experts (~1.1 GB less, docs/DEPLOY.md): 39.7 GB."""
    cfg = real_config()
    assert abs(weight_bytes(cfg, 8, 1, "bfloat16", quantization="fp8").total / GB - 39.7) < 0.1
    assert check_fits(cfg, _engine(), tp=8, ep=1, device="h100", quantization="fp8").max_running_requests >= 1


def test_fp8_layouts_that_split_a_scale_block_are_refused_as_serve_refuses_them():
    """At real dims the release's 128 x 128 scale blocks allow TP 8 and 16 (any EP) but not TP 32
    or 64: a rank would hold part of a block (the shared experts' 2048 rows at TP 32: 64 each). The
    plan refuses those naming the tensor, as the FP8 rank loader does, and never proposes them as
    the smallest fitting layout."""
    from trnrt.parallel.shard import ShardingError
    from trnrt.plan.memory import layouts

    cfg = real_config()
    for tp, ep in ((8, 1), (8, 8), (16, 8)):
        weight_bytes(cfg, tp, ep, "bfloat16", quantization="fp8")
    for tp, ep, tensor in ((32, 8, "layers.3.mlp.shared_experts.gate_proj.weight"),
                           (64, 1, "layers.0.mlp.gate_proj.weight")):
        with pytest.raises(ShardingError) as e:
            weight_bytes(cfg, tp, ep, "bfloat16", quantization="fp8")
        assert e.value.tensor == tensor and "128-blocks of the FP8 scales" in str(e.value), str(e.value)
    assert (64, 8) in layouts(cfg, 64) and not any(tp >= 32 for tp, _ in layouts(cfg, 64, "fp8"))
    with pytest.raises(ShardingError):
        check_fits(cfg, _engine(), tp=64, ep=8, device="trn2", quantization="fp8")
