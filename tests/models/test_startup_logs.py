"""What the first and later starts log: the one-time kernel build says so (before and after), and the
vision tower every GLM-5.x checkpoint carries is skipped at debug level."""

from __future__ import annotations

import logging

import torch

from trnrt.models import kernels


def _fake_build(calls):
    def load(name, sources, build_directory, **kw):
        calls.append(name)
        from pathlib import Path

        (Path(build_directory) / f"{name}.so").write_bytes(b"")  # what a real build leaves behind

    return load


def test_kernel_build_is_announced_once(monkeypatch, tmp_path, caplog):
    from torch.utils import cpp_extension

    calls: list[str] = []
    monkeypatch.setattr(cpp_extension, "load", _fake_build(calls))
    monkeypatch.setattr(kernels, "_build_dir", lambda digest: tmp_path / digest)
    monkeypatch.delenv("TRNRT_KERNELS", raising=False)

    monkeypatch.setattr(kernels, "_state", {})
    with caplog.at_level(logging.INFO, logger="trnrt.models.kernels"):
        assert kernels.load()
    messages = [r.getMessage() for r in caplog.records if r.name == "trnrt.models.kernels"]
    assert len(calls) == 1 and len(messages) == 2, messages
    assert messages[0].startswith("building trnrt's CPU kernels (once, ~15 s)")
    assert messages[1].startswith("built trnrt's CPU kernels in ")
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == "trnrt.models.kernels")

    # a later process: the library is there, it loads without a word
    caplog.clear()
    monkeypatch.setattr(kernels, "_state", {})
    with caplog.at_level(logging.INFO, logger="trnrt.models.kernels"):
        assert kernels.load()
    assert len(calls) == 2
    assert not [r for r in caplog.records if r.name == "trnrt.models.kernels"], caplog.text


def test_vision_tower_is_skipped_at_debug_level(caplog):
    from types import SimpleNamespace

    from trnrt.models.glm5_next.weights import to_serving_names

    cfg = SimpleNamespace(num_hidden_layers=1, n_routed_experts=0)
    raw = {"model.visual.blocks.0.weight": torch.zeros(1), "model.visual.merger.weight": torch.zeros(1),
           "model.layers.1.mlp.gate.weight": torch.zeros(1), "model.norm.weight": torch.zeros(1)}
    with caplog.at_level(logging.DEBUG, logger="trnrt.models.glm5_next"):
        out = to_serving_names(raw, cfg)
    assert not any("visual" in k for k in out)
    records = {r.getMessage(): r.levelno for r in caplog.records}
    assert records.get("glm5_next: skipped 2 vision-tower tensors") == logging.DEBUG, records
    mtp = [m for m in records if "MTP" in m]
    assert mtp and records[mtp[0]] == logging.INFO  # the MTP layer (not served yet) stays worth a line
