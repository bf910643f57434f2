"""`trnrt serve`'s start path runs check_fits before any weight loads: the tiny model on the CPU
fits; a layout that cannot fit stops before Engine.from_model_dir is reached."""

from __future__ import annotations

import dataclasses

import pytest


@pytest.fixture
def reached(monkeypatch):
    """Engine.from_model_dir replaced by a recorder that stops the build (no weights read)."""
    from trnrt.engine.core import engine as engine_mod

    calls: list = []

    def fake(model_dir=None, **kw):
        calls.append(model_dir)
        raise RuntimeError("engine reached")

    monkeypatch.setattr(engine_mod.Engine, "from_model_dir", staticmethod(fake))
    return calls


def _args(**kw):
    from trnrt.cli.server_args import ServerArgs

    return ServerArgs(disable_compiled_cache=True, **kw)


def test_tiny_model_fits_and_the_engine_is_reached(reached):
    from trnrt.cli.serve_engine import build_engine

    with pytest.raises(RuntimeError, match="engine reached"):
        build_engine(_args())
    assert len(reached) == 1


def test_a_layout_that_cannot_fit_stops_before_the_engine(reached, monkeypatch):
    import trnrt.plan.fit as fit
    from trnrt.cli.serve_engine import build_engine
    from trnrt.plan.fit import PlanError

    real = fit.get_device
    monkeypatch.setattr(fit, "get_device", lambda name: dataclasses.replace(real(name), bytes_per_rank=10**6))
    with pytest.raises(PlanError, match="does not fit"):
        build_engine(_args())
    assert reached == []


def test_an_fp8_checkpoint_is_planned_with_fp8_weights(reached, tmp_path):
    """Its quantization_config is set aside for the dims (Glm5NextConfig refuses it), and the
    plan counts FP8 weights; serve goes on to the engine."""
    from trnrt.cli.serve_engine import build_engine
    from trnrt.models.tiny.fp8 import write_tiny_fp8_checkpoint
    from trnrt.plan.fit import check_serve_fits, model_config

    d = write_tiny_fp8_checkpoint(tmp_path / "fp8")
    cfg, fp8 = model_config(d)
    assert fp8
    from trnrt.config.presets import load_preset
    from trnrt.plan.fit import check_fits

    planned = check_serve_fits(str(d), "default")
    unquantized = check_fits(cfg, load_preset("default"))  # the preset dtype, float32
    assert planned.weights.total < unquantized.weights.total  # FP8 weights were counted
    with pytest.raises(RuntimeError, match="engine reached"):
        build_engine(_args(model=str(d)))
    assert reached == [str(d)]
