"""Loading compiled graphs for `trnrt serve --compiled DIR` / `trnrt bench --compiled DIR`.

An artifact is used only if it was built from the same model config, the same preset settings
and, per graph, the same graph hash as the code that will run now; otherwise it is refused with
a message saying which of the three differs. The graph hash check re-exports each spec (several
seconds per graph on the tiny model), which is what catches a model edit made after the compile;
by default it runs only when the source of the graph-defining modules (manifest `code_digest`)
or torch changed since the compile, so an unchanged tree starts fast and an edited one is checked
graph by graph (an edit that leaves the graphs equal, such as a comment, is accepted).

An FP8 model's artifacts are those of <dir>/<preset>/<backend>/fp8/ (FP8 KV cache: kv_fp8/,
both: fp8+kv_fp8/; found by themselves), and the manifest's quantization and quantized-weight
layout must be the model's and state's: default (bf16 / fp32) artifacts are refused for an FP8
model and FP8 ones for a default model (reason "quantization"), whether or not the graph hashes
are re-checked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from trnrt.config.engine_config import EngineConfig
from trnrt.config.presets import graph_settings, preset_hash
from trnrt.engine.runner.step import GraphSpec

from .backends import get_backend
from .catalogue import expand
from .export import export_spec
from .graph_hash import fingerprint
from .manifest import (MANIFEST_NAME, Manifest, code_digest, model_config_hash, quantization_of, quantized_dir,
                       quantized_weights_hash, versions)


class CompiledArtifactError(ValueError):
    """A compiled artifact does not fit the model / preset / code. `reason` is one of
    "missing", "model_config", "quantization", "preset", "flags", "versions", "graph_hash",
    "graph_missing", "graph_failed", "backend", "parallel" (a tensor-parallel layout: compile.tp_loader)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def find_manifest_dir(directory: str | Path, engine_config: EngineConfig, backend: str | None = None,
                      quantization: str | None = None) -> Path:
    """The directory holding manifest.json: DIR itself, DIR/<preset>/<backend>, or the only
    backend directory under DIR/<preset> (each with `/fp8` for quantization "fp8")."""
    d = Path(directory)
    if quantization and (quantized_dir(d, quantization) / MANIFEST_NAME).is_file():
        return quantized_dir(d, quantization)  # DIR is <preset>/<backend>
    if (d / MANIFEST_NAME).is_file():
        return d
    p = d / engine_config.preset
    if backend and (quantized_dir(p / backend, quantization) / MANIFEST_NAME).is_file():
        return quantized_dir(p / backend, quantization)
    if p.is_dir():
        found = sorted(quantized_dir(x, quantization) for x in p.iterdir()
                       if (quantized_dir(x, quantization) / MANIFEST_NAME).is_file())
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise CompiledArtifactError("missing", f"{p} holds artifacts of several backends "
                                        f"({', '.join(str(x.relative_to(p)) for x in found)}): pass the backend directory")
    sub = f"{quantization}/" if quantization else ""
    raise CompiledArtifactError("missing", f"no {MANIFEST_NAME} in {d} or {p}/<backend>/{sub} (run `trnrt compile "
                                f"--preset {engine_config.preset} --out {d}` first"
                                f"{' with this ' + quantization + ' model' if quantization else ''})")


def load_compiled(directory: str | Path, model: torch.nn.Module, state: Any, engine_config: EngineConfig,
                  *, backend: str | None = None, check_graphs: bool | None = None,
                  specs: Iterable[GraphSpec] | None = None, manifest_dir: Path | None = None,
                  graph_key: Callable[[str], str] | None = None,
                  partial: bool = False) -> dict[GraphSpec, Callable]:
    """Callables for every spec of expand(engine_config), from the artifacts in `directory`.

    Each callable takes the step inputs (STEP_INPUT_NAMES, then a variant's extra inputs) at the
    spec's exact shapes, returns (token_ids, token_logprobs, top_ids, top_logprobs) and updates
    `state`'s tensors in place. `state` must stay the same tensors while the callables live.
    specs: load only these (default: every spec of the preset; all must be present).
    check_graphs: re-export every spec and compare its graph hash with the manifest's. None
    (default) does so only when the source of the graph-defining modules or the torch version
    differs from the compile's (a few seconds per graph); True always; False never.
    manifest_dir: the directory of manifest.json, already found (a tensor-parallel layout's,
    compile.tp_loader); graph_key(fingerprint) -> the manifest's graph_hash (default: itself; at
    TP > 1 compile.tp.layout_hash over the rank's layout). partial: load the specs the manifest
    holds and leave out the others (they run eagerly) instead of refusing a missing one.
    Raises CompiledArtifactError (reason says which check failed).
    """
    quant = quantization_of(model, state)
    mdir = Path(manifest_dir) if manifest_dir is not None else find_manifest_dir(directory, engine_config, backend, quant)
    man = Manifest.read(mdir)
    if backend is not None and man.backend != backend:
        raise CompiledArtifactError("backend", f"{mdir} holds {man.backend} artifacts, not {backend}")
    mh = model_config_hash(model)
    if man.model_config_sha256 != mh:
        raise CompiledArtifactError(
            "model_config", f"refusing {mdir}: built from another model config "
            f"(artifact {man.model_config_sha256[:12]}, model {mh[:12]}); recompile with this --model")
    qh = quantized_weights_hash(model)
    if (man.quantization, man.quantized_weights_sha256) != (quant, qh):
        def name(q):
            return f"{q} weights" if q else "default (unquantized) weights"

        why = (f"compiled for a model with {name(man.quantization)}, the model has {name(quant)}"
               if man.quantization != quant else
               f"compiled for another {quant} weight layout (artifact {str(man.quantized_weights_sha256)[:12]}, "
               f"model {str(qh)[:12]}: other linears in FP8 or another block size)")
        raise CompiledArtifactError(
            "quantization", f"refusing {mdir}: {why}; compile this model (`trnrt compile --model DIR"
            f"{' [--quantization fp8]' if quant else ''}`)")
    ph = preset_hash(engine_config)
    if man.preset_sha256 != ph:
        now = graph_settings(engine_config)
        diff = [f"{k} {man.engine_config.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(now) | set(man.engine_config))
                if man.engine_config.get(k) != now.get(k)]
        raise CompiledArtifactError(
            "preset", f"refusing {mdir}: built from other preset settings than {engine_config.preset!r} "
            f"({'; '.join(diff) or 'hash ' + man.preset_sha256[:12] + ' vs ' + ph[:12]}); these shape the graphs: "
            f"recompile, or run with the compiled settings")
    if sorted(man.flags) != sorted(set(engine_config.variants)):
        raise CompiledArtifactError(
            "flags", f"refusing {mdir}: compiled with flags {man.flags or 'none'}, the engine runs with "
            f"{sorted(set(engine_config.variants)) or 'none'}")
    vers = versions()
    if man.backend == "cpu" and (man.versions.get("torch") != vers["torch"] or man.versions.get("machine") != vers["machine"]):
        raise CompiledArtifactError(
            "versions", f"refusing {mdir}: compiled with torch {man.versions.get('torch')} on "
            f"{man.versions.get('machine')}, running torch {vers['torch']} on {vers['machine']}; recompile")
    if check_graphs is None:
        check_graphs = man.code_digest != code_digest() or man.versions.get("torch") != vers["torch"]
    be = get_backend(man.backend)
    be.check_available()
    out: dict[GraphSpec, Callable] = {}
    for spec in (expand(engine_config) if specs is None else list(specs)):
        entry = man.entry(spec.graph_id)
        if entry is None and partial:
            continue
        if entry is None:
            raise CompiledArtifactError("graph_missing", f"refusing {mdir}: no compiled graph {spec.graph_id}")
        if entry.status not in ("ok", "load-time"):
            raise CompiledArtifactError("graph_failed", f"refusing {mdir}: graph {spec.graph_id} has status "
                                        f"{entry.status!r}{': ' + entry.error if entry.error else ''}")
        if check_graphs:
            h = fingerprint(export_spec(model, state, engine_config, spec).program).hash
            h = graph_key(h) if graph_key is not None else h
            if h != entry.graph_hash:
                raise CompiledArtifactError(
                    "graph_hash", f"refusing {mdir}: graph {spec.graph_id} was compiled from other code "
                    f"(graph hash {entry.graph_hash[:12]}, now {h[:12]}); recompile, or run `trnrt verify "
                    f"graph-equiv --preset {engine_config.preset}` to see what changed")
        out[spec] = be.load(entry.__dict__, mdir, model, state, engine_config, spec)
    return out
