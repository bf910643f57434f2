"""Compile backends behind one interface: cpu (AOTInductor), cuda (CUDA graphs), neuron, eager.

Every backend turns an ExportedGraph into files under the artifact directory (`compile`) and
turns a manifest entry back into a callable `fn(*step_inputs) -> (token_ids, token_logprobs,
top_ids, top_logprobs)` that updates the engine's state tensors in place (`load`).

Weights are never inside an artifact: the cpu backend compiles with
`aot_inductor.package_constants_in_so=False` and binds the live model's tensors at load with
`load_constants(..., user_managed=True)`, so every graph shares the one copy of the weights the
engine loaded. `always_keep_tensor_constants=True` stops Inductor from inlining small tensors
(1-D of <= 8 elements, 0-d) as literals in the generated code, which would bake those weights
into the .so (measured: a 4-element bias came out frozen at its compile-time value).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import shutil
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from trnrt.config.engine_config import EngineConfig
from trnrt.engine.runner.step import GraphSpec

from . import inductor_memo
from .export import (ExportedGraph, eager_callable, graph_model_state, model_constants, state_tensors,
                     step_output_names)


class BackendUnavailable(RuntimeError):
    """The backend cannot run on this machine (missing SDK or device); the message says why."""


@dataclass
class CompileResult:
    status: str  # "ok" | "load-time"
    files: list[str] = field(default_factory=list)  # relative to the artifact directory
    artifact: str | None = None
    seconds: float = 0.0
    note: str = ""


class Backend:
    name = "?"
    # Whether compile() produces files (False: the work happens at load, e.g. CUDA graph capture).
    produces_artifacts = True

    def available(self) -> tuple[bool, str]:
        return True, ""

    def check_available(self) -> None:
        ok, why = self.available()
        if not ok:
            raise BackendUnavailable(why)

    def compile(self, graph: ExportedGraph, art_dir: Path, options: dict) -> CompileResult:
        raise NotImplementedError

    def load(self, entry: dict, art_dir: Path, model: torch.nn.Module, state: Any,
             engine_config: EngineConfig, spec: GraphSpec) -> Callable:
        raise NotImplementedError


class EagerBackend(Backend):
    """No compilation: the same specs run eagerly (tests, debugging)."""

    name = "eager"
    produces_artifacts = False

    def compile(self, graph, art_dir, options):
        return CompileResult(status="load-time", note="eager: nothing to compile")

    def load(self, entry, art_dir, model, state, engine_config, spec):
        return eager_callable(model, state, engine_config, spec)


class CpuBackend(Backend):
    """torch.export + AOTInductor, one .pt2 per graph, weights bound from the live model at load."""

    name = "cpu"

    BASE_OPTIONS = {
        "aot_inductor.package_constants_in_so": False,
        "always_keep_tensor_constants": True,
        # Compile-time option: it changes how the generated C++ is built, not what it computes.
        # cpp.vec_isa_ok True: take the vector ISA from the CPU flags instead of compiling and
        # dlopen-probing a test program per ISA (~6-7 s of g++ at the first compile of a process
        # with a fresh Inductor cache). Same generated code (kernel .cpp identical, AVX512 here);
        # it also removes the probe's timeout, under which a loaded machine silently falls back
        # to unvectorised kernels. (Not taken: compile_wrapper_opt_level "O0" saves ~4 s of g++
        # per graph but made the compiled steps ~5% slower; serving speed wins.)
        "cpp.vec_isa_ok": True,
        # No -g1 line tables in the .so (debug info only: same machine code): ~1.6 s less g++ CPU
        # per graph on the wrapper (25.8 -> 24.2 s, decode-b8 of the tiny model), nothing on the
        # kernels; a stack trace through a compiled graph names functions, not source lines.
        "aot_inductor.enable_line_tables": False,
    }

    def compile(self, graph: ExportedGraph, art_dir: Path, options: dict) -> CompileResult:
        from torch._inductor import aoti_compile_and_package

        from .torch_warnings import quiet_torch_leafspec_warning

        gdir = art_dir / "graphs"
        gdir.mkdir(parents=True, exist_ok=True)
        gid = graph.spec.graph_id
        pkg = gdir / f"{gid}.pt2"
        files = [f"graphs/{gid}.pt2"]
        configs = {**self.BASE_OPTIONS, **dict(options.get("inductor", {}))}
        inductor_memo.install()  # same generated code, less Python time (see the module)
        t0 = time.perf_counter()
        with identical_compile_lock(graph.graph_hash, configs), quiet_torch_leafspec_warning():
            aoti_compile_and_package(graph.program, package_path=str(pkg), inductor_configs=configs)
        check_package(pkg)
        # Lifted tensor constants (tensors the step creates from Python data at trace time) are
        # part of the graph, not the model: keep them beside the package for load().
        # (ep.constants also holds the model's non-persistent buffers: those come from the model.)
        from torch.export.graph_signature import InputKind

        lifted = [s.target for s in graph.program.graph_signature.input_specs if s.kind == InputKind.CONSTANT_TENSOR]
        consts = {k: graph.program.constants[k].detach().contiguous().clone() for k in lifted
                  if isinstance(graph.program.constants.get(k), torch.Tensor)}
        if consts:
            torch.save(consts, gdir / f"{gid}.constants.pt")
            files.append(f"graphs/{gid}.constants.pt")
        return CompileResult(status="ok", files=files, artifact=files[0], seconds=time.perf_counter() - t0)

    def load(self, entry, art_dir, model, state, engine_config, spec):
        from torch._inductor import aoti_load_package

        runner = aoti_load_package(str(art_dir / entry["artifact"]))
        consts = model_constants(model)
        side = art_dir / "graphs" / f"{entry['id']}.constants.pt"
        if side.exists():
            consts.update(torch.load(side, weights_only=True))
        fqns = runner.get_constant_fqns()
        missing = [f for f in fqns if f not in consts]
        if missing:
            raise ValueError(f"{entry['id']}: the model has no tensor {missing[0]!r} that the compiled graph reads "
                             f"({len(missing)} missing): the artifact was built from another model")
        bound = {f: consts[f] for f in fqns}
        runner.load_constants(bound, check_full_update=True, user_managed=True)
        st = [t for _, t in state_tensors(graph_model_state(model, state, spec)[1])]
        boxed = _flat_boxed_run(runner, len(entry["inputs"]))

        def run(*inputs: torch.Tensor):
            return tuple(boxed([*inputs, *st]) if boxed is not None else runner(*inputs, *st))

        run.runner = runner  # keeps the loaded .so alive with the callable
        run.constants = bound  # user-managed constants: the graph reads these very tensors
        return run


def _flat_boxed_run(runner, num_inputs: int):
    """The package's `loader.boxed_run` when the graph takes `num_inputs` tensors and returns a
    flat tuple of tensors (every step graph): calling it directly skips what
    AOTICompiledModel.__call__ does per call (two treespec JSON parses, a flatten and an
    unflatten; ~60 us of a ~0.75 ms batch-8 decode step). None otherwise (then call the runner)."""
    from torch.utils import _pytree as pytree

    loader = getattr(runner, "loader", None)
    if loader is None or not hasattr(loader, "boxed_run"):
        return None
    in_spec, out_spec = (pytree.treespec_loads(s) for s in loader.get_call_spec())
    flat_in = in_spec.num_leaves == num_inputs and in_spec.unflatten(list(range(num_inputs))) == \
        (tuple(range(num_inputs)), {})
    flat_out = out_spec.type is tuple and all(c.is_leaf() for c in out_spec.children())
    return loader.boxed_run if flat_in and flat_out else None


def identical_compile_lock(graph_hash: str, configs: dict):
    """Serialises compiles of the same graph with the same options across processes.

    AOTInductor writes its intermediate files (kernel and wrapper C++, metadata JSON, .so) into
    the shared Inductor cache directory under names derived from the generated code, and rewrites
    them in place; two processes compiling the same graph at once (e.g. `trnrt compile` of two
    presets that share a graph, side by side) write the same files, and one package came out with
    an empty metadata file (seen in the compile tests). Different graphs never wait on each other.
    """
    if not graph_hash:
        return contextlib.nullcontext()
    from filelock import FileLock
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    key = hashlib.sha256(json.dumps([graph_hash, configs], sort_keys=True, default=str).encode()).hexdigest()[:32]
    locks = Path(cache_dir()) / "trnrt-locks"
    locks.mkdir(parents=True, exist_ok=True)
    return FileLock(str(locks / f"{key}.lock"))


def check_package(pkg: Path) -> None:
    """Raises if an AOTInductor package is incomplete: no shared library, or a metadata JSON
    file that is empty or not JSON (loading it would fail later with a bare parse error)."""
    with zipfile.ZipFile(pkg) as z:
        names = z.namelist()
        if not any(n.endswith(".so") for n in names):
            raise RuntimeError(f"{pkg.name}: AOTInductor wrote a package without a shared library")
        for n in names:
            if n.endswith(".json"):
                try:
                    json.loads(z.read(n) or b"!")
                except ValueError:
                    raise RuntimeError(f"{pkg.name}: AOTInductor wrote an incomplete package ({n} is empty or "
                                       f"not JSON; was the same graph compiled elsewhere at the same time?)") from None


class CudaBackend(Backend):
    """CUDA-graph capture per decode bucket at load; prefill graphs run eagerly.

    Why not AOTInductor: on the H200 image it compiled but `aoti_load_package` segfaulted
    (compile_and_graph_equiv.md §3.3), and capture costs milliseconds per bucket. The captured
    graph reads its inputs from static buffers and the state tensors at their current addresses,
    so the engine must keep the same state tensors for the life of the callables.
    """

    name = "cuda"
    produces_artifacts = False

    def available(self):
        if not torch.cuda.is_available():
            return False, "the cuda backend needs a CUDA device; torch.cuda.is_available() is False"
        return True, ""

    def compile(self, graph, art_dir, options):
        return CompileResult(status="load-time", note="cuda: decode graphs are captured at load")

    def load(self, entry, art_dir, model, state, engine_config, spec):
        self.check_available()
        eager = eager_callable(model, state, engine_config, spec)
        if spec.phase not in ("decode", "verify", "draft"):
            return eager
        from .export import spec_inputs

        dev = next(iter(state_tensors(state)))[1].device
        static_in = [t.to(dev) for t in spec_inputs(spec, engine_config, int(model.config.vocab_size), device=dev,
                                                     hidden_size=model.config.hidden_size)]
        # Warm up on a side stream (allocator and lazy init), as torch.cuda.graphs recommends. The
        # example inputs are padding rows: they write only the scratch block 0 and slot 0.
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                eager(*static_in)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = eager(*static_in)

        def run(*inputs: torch.Tensor):
            for dst, src in zip(static_in, inputs):
                dst.copy_(src, non_blocking=True)
            graph.replay()
            return tuple(o.clone() for o in static_out)

        run.graph = graph
        return run


class NeuronBackend(Backend):
    """torch-neuronx tracing, one NEFF per graph, weights kept out of the NEFF.

    The Neuron SDK is not on PyPI (the PyPI packages are placeholders that raise ImportError), so
    it is imported only here, and `available()` says what is missing. This path has not been run
    on a Trainium host yet.
    """

    name = "neuron"

    def available(self):
        try:
            importlib.import_module("torch_neuronx")
        except Exception as e:  # the PyPI placeholder raises ImportError("WRONG PACKAGE ...")
            return False, (f"the neuron backend needs the AWS Neuron SDK (torch-neuronx, neuronx-cc) from the "
                           f"Neuron repository or a Neuron DLAMI; torch_neuronx is not importable here "
                           f"({type(e).__name__}: {str(e)[:120]})")
        if shutil.which("neuronx-cc") is None:
            return False, "the neuron backend needs the neuronx-cc compiler on PATH (AWS Neuron SDK)"
        return True, ""

    def compile(self, graph: ExportedGraph, art_dir: Path, options: dict) -> CompileResult:
        self.check_available()
        import torch_neuronx  # noqa: F401  (SDK only)

        gdir = art_dir / "graphs"
        gdir.mkdir(parents=True, exist_ok=True)
        gid = graph.spec.graph_id
        # The unlifted program applies the state updates to its state inputs itself (copy_ at the
        # end of the graph). Whether torch_neuronx keeps those updates on the device tensors
        # (or needs input_output_aliases) has not been checked on a Neuron host yet.
        module = graph.program.module()
        example = tuple(_example_from_meta(m) for m in graph.inputs)
        t0 = time.perf_counter()
        traced = torch_neuronx.trace(
            module, example, compiler_workdir=str(gdir / f"{gid}.work"),
            compiler_args=" ".join(options.get("args", [])), inline_weights_to_neff=False,
        )
        path = gdir / f"{gid}.neuron.pt"
        torch.jit.save(traced, str(path))
        return CompileResult(status="ok", files=[f"graphs/{gid}.neuron.pt"], artifact=f"graphs/{gid}.neuron.pt",
                             seconds=time.perf_counter() - t0)

    def load(self, entry, art_dir, model, state, engine_config, spec):
        self.check_available()
        import torch_neuronx  # noqa: F401

        traced = torch.jit.load(str(art_dir / entry["artifact"]))
        st = [t for _, t in state_tensors(graph_model_state(model, state, spec)[1])]

        n_out = len(step_output_names(spec))

        def run(*inputs):
            out = traced(*inputs, *st)
            return tuple(out)[-n_out:]  # the step outputs follow the state tensors

        return run


def _example_from_meta(m: dict) -> torch.Tensor:
    return torch.zeros(m["shape"], dtype=getattr(torch, m["dtype"]))


BACKENDS: dict[str, type[Backend]] = {
    "cpu": CpuBackend, "cuda": CudaBackend, "neuron": NeuronBackend, "eager": EagerBackend,
}


def get_backend(name: str) -> Backend:
    try:
        return BACKENDS[name]()
    except KeyError:
        raise ValueError(f"unknown backend {name!r} (known: {', '.join(BACKENDS)})") from None
