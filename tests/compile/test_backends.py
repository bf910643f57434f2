"""Backend selection and the cheap compile paths (dry run, eager); refusals exit 2 and say why."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from typer.testing import CliRunner

from trnrt.cli import app


def compile_(*args: str):
    return CliRunner().invoke(app, ["compile", *args], catch_exceptions=False)


def _neuron_sdk() -> bool:
    try:
        import torch_neuronx  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.skipif(_neuron_sdk(), reason="the Neuron SDK is installed here")
def test_neuron_without_sdk_exits_2(tmp_path):
    r = compile_("--preset", "batch8", "--backend", "neuron", "--out", str(tmp_path))
    assert r.exit_code == 2
    assert "Neuron SDK" in r.output
    assert not any(tmp_path.iterdir())  # nothing was written


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_cuda_without_device_exits_2(tmp_path):
    r = compile_("--preset", "batch8", "--backend", "cuda", "--out", str(tmp_path))
    assert r.exit_code == 2 and "CUDA device" in r.output


def test_usage_errors_exit_2(tmp_path):
    assert compile_("--backend", "tpu", "--out", str(tmp_path)).exit_code == 2
    r = compile_("--preset", "no-such", "--out", str(tmp_path))
    assert r.exit_code == 2 and "unknown preset" in r.output
    # an unknown --only id is refused before anything is exported (the eager backend: nothing
    # would be compiled even if the check were gone)
    r = compile_("--preset", "batch8", "--structured-outputs", "--backend", "eager", "--out", str(tmp_path),
                 "--only", "no-such-graph")
    assert r.exit_code == 2 and "unknown graph id(s) ['no-such-graph']" in r.output
    assert not any(tmp_path.iterdir())


def test_neuron_backend_module_imports_without_sdk():
    from trnrt.compile.backends import get_backend

    ok, why = get_backend("neuron").available()
    assert ok == _neuron_sdk()
    assert importlib.util.find_spec("trnrt.compile.backends") is not None


def test_dry_run_and_eager_backend(tiny_dir, tmp_path):
    """The eager backend's "load-time" entry runs the graph's own eager callable, and a dry run
    hashes what it compiled. On the smallest graph a lock holds (the MTP draft, ~870 nodes): each
    compile command exports it once."""
    import copy

    from trnrt.compile import expand, load_compiled
    from trnrt.compile.export import eager_callable, spec_inputs
    from trnrt.compile.manifest import Manifest
    from trnrt.config.presets import load_preset
    from trnrt.models.glm5_next.weights import load_model

    preset, gid = "mtp-always", "draft-b1-t4-base-greedy"
    r = compile_("--preset", preset, "--model", str(tiny_dir), "--out", str(tmp_path), "--backend", "eager",
                 "--only", gid)
    assert r.exit_code == 0, r.output
    man = Manifest.read(tmp_path / preset / "eager")
    e = man.entry(gid)
    assert e.status == "load-time" and e.bytes == 0 and len(e.graph_hash) == 64

    cfg = load_preset(preset)
    spec = next(s for s in expand(cfg) if s.graph_id == gid)
    model = load_model(tiny_dir, torch.float32, load_mtp=True)
    st = model.allocate_state(cfg.num_blocks, cfg.block_size, cfg.num_slots, mtp=True)
    st2 = copy.deepcopy(st)
    fns = load_compiled(tmp_path, model, st, cfg, specs=[spec], check_graphs=False)
    x = spec_inputs(spec, cfg, model.config.vocab_size, hidden_size=model.config.hidden_size)
    with torch.no_grad():
        ref = eager_callable(model, st2, cfg, spec)(*[t.clone() for t in x])
        out = fns[spec](*x)
    assert len(out) == len(ref) == 1
    for a, b in zip(out, ref):
        assert torch.equal(a, b)

    r = compile_("--preset", preset, "--model", str(tiny_dir), "--out", str(tmp_path), "--dry-run", "--only", gid)
    assert r.exit_code == 0, r.output
    e = Manifest.read(tmp_path / preset / "cpu").entry(gid)
    assert e.status == "exported" and e.artifact is None and e.graph_hash == man.entry(gid).graph_hash


def _fake_package(path, json_body: bytes = b"{}", so: bool = True) -> None:
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        z.writestr("g/data/aotinductor/model/x.wrapper.cpp", "// code")
        z.writestr("g/data/aotinductor/model/x.wrapper_metadata.json", json_body)
        if so:
            z.writestr("g/data/aotinductor/model/x.wrapper.so", b"\x7fELF")


def test_check_package_refuses_empty_metadata_and_missing_library(tmp_path):
    from trnrt.compile.backends import check_package

    good, empty, noso = tmp_path / "good.pt2", tmp_path / "empty.pt2", tmp_path / "noso.pt2"
    _fake_package(good)
    _fake_package(empty, json_body=b"")
    _fake_package(noso, so=False)
    check_package(good)
    with pytest.raises(RuntimeError, match="x.wrapper_metadata.json is empty"):
        check_package(empty)
    with pytest.raises(RuntimeError, match="without a shared library"):
        check_package(noso)


def test_identical_compiles_are_serialised_across_callers(tmp_path, monkeypatch):
    """Two compiles of the same graph and options never run AOTInductor at the same time (they
    would write the same files in Inductor's cache); two different graphs do run together."""
    import threading
    import time as _time
    from types import SimpleNamespace

    import torch._inductor
    from torch._inductor.runtime import cache_dir_utils

    from trnrt.compile.backends import CpuBackend

    monkeypatch.setattr(cache_dir_utils, "cache_dir", lambda: str(tmp_path / "inductor"))
    active, peak, lock = [0], [0], threading.Lock()
    started = threading.Barrier(2, timeout=5)

    def fake_compile(program, package_path, inductor_configs):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        _time.sleep(0.3)
        _fake_package(package_path)
        with lock:
            active[0] -= 1

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", fake_compile)
    program = SimpleNamespace(graph_signature=SimpleNamespace(input_specs=[]), constants={})

    def run(hashes):
        peak[0] = 0
        threads = []
        for i, h in enumerate(hashes):
            g = SimpleNamespace(spec=SimpleNamespace(graph_id=f"g{i}"), program=program, graph_hash=h)
            t = threading.Thread(target=lambda g=g, i=i: (started.wait(),
                                                          CpuBackend().compile(g, tmp_path / f"art{i}", {})))
            threads.append(t)
            t.start()
        for t in threads:
            t.join()
        return peak[0]

    assert run(["same", "same"]) == 1
    assert run(["one", "other"]) == 2
    assert (tmp_path / "inductor" / "trnrt-locks").is_dir()
