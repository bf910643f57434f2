"""`trnrt compile`: export every spec of a preset, hash it, compile it, write the manifest.

An entry is reused (not recompiled) when its graph hash, the preset hash, the model config hash,
the backend, the versions and its artifact file (size and sha256) all still match: the graph
hash is taken before compiling, so a changed model line recompiles exactly the graphs it reaches.
The manifest is rewritten after every graph, so an interrupted run keeps what it finished.
An FP8 model (manifest.quantization_of) compiles into <out>/<preset>/<backend>/fp8/: its graphs
have hashes of their own (float8 weight placeholders), and its manifest records the quantization.
"""

from __future__ import annotations

import shutil

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from trnrt.config.engine_config import EngineConfig
from trnrt.config.presets import compiler_options, graph_settings, phase_settings_hash, preset_hash

from .backends import Backend, get_backend
from .catalogue import expand
from .export import export_spec
from . import fingerprint_cache
from .graph_hash import fingerprint
from .manifest import (GraphEntry, Manifest, code_digest, file_sha256, model_config_hash, quantization_of,
                       quantized_dir, quantized_weights_hash, versions)


def artifact_dir(out: Path, preset: str, backend: str, quantization: str | None = None) -> Path:
    """<out>/<preset>/<backend>, and its `fp8/` folder for an FP8 model."""
    return quantized_dir(Path(out) / preset / backend, quantization)


@dataclass
class Event:
    """Progress report of one graph: stage is "export", "hash", "compile", "reused", "done", "failed"."""

    index: int
    total: int
    graph_id: str
    stage: str
    entry: GraphEntry | None = None
    message: str = ""


class CompileFailed(RuntimeError):
    def __init__(self, graph_id: str, error: str, manifest_path: Path):
        super().__init__(f"{graph_id}: {error}")
        self.graph_id = graph_id
        self.manifest_path = manifest_path


def _reusable(old: GraphEntry | None, new_hash: str, art_dir: Path, backend: Backend) -> bool:
    if old is None or old.status not in ("ok", "load-time") or old.graph_hash != new_hash:
        return False
    if not backend.produces_artifacts:
        return old.status == "load-time"
    if old.artifact is None:
        return False
    path = art_dir / old.artifact
    return path.is_file() and path.stat().st_size == old.bytes and file_sha256(path) == old.artifact_sha256 and \
        all((art_dir / f).is_file() for f in old.files)


def _same_graph_elsewhere(out: Path, backend: Backend, art_dir: Path, graph_hash: str, mhash: str, vers: dict,
                          opts: dict, quant: tuple = (None, None)) -> tuple[Path, GraphEntry] | None:
    """An up-to-date artifact of the same graph (equal hash) that another preset under `out`
    compiled with this backend, model config, quantization, torch build / machine and compiler options."""
    sub = f"{quant[0]}/" if quant[0] else ""
    for man_path in sorted(Path(out).glob(f"*/{backend.name}/{sub}manifest.json")):
        other = man_path.parent
        if other.resolve() == art_dir.resolve():
            continue
        try:
            man = Manifest.read(other)
        except Exception:
            continue
        if man.model_config_sha256 != mhash or man.versions != vers or man.compiler != opts or \
                (man.quantization, man.quantized_weights_sha256) != quant:
            continue
        for g in man.graphs:
            if g.graph_hash == graph_hash and g.status == "ok" and _reusable(g, graph_hash, other, backend):
                return other, g
    return None


def _copy_entry(src_dir: Path, src: GraphEntry, art_dir: Path, gid: str) -> tuple[list[str], str | None]:
    """Copy `src`'s files into art_dir under `gid`'s names; returns (files, artifact)."""
    files = []
    for f in src.files:
        name = Path(f).name.replace(src.id, gid, 1)
        dst = Path(f).parent / name
        (art_dir / dst).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src_dir / f, art_dir / dst)
        files.append(str(dst))
    artifact = None
    if src.artifact is not None:
        artifact = str(Path(src.artifact).parent / Path(src.artifact).name.replace(src.id, gid, 1))
    return files, artifact


def compile_graphs(model: torch.nn.Module, state: Any, engine_config: EngineConfig, *, backend: str,
                   out: Path, flags: Iterable[str] = (), dry_run: bool = False, keep_going: bool = False,
                   only: Iterable[str] | None = None,
                   on_event: Callable[[Event], None] | None = None,
                   parallel: Any = None) -> tuple[Manifest, Path]:
    """Compile every spec of expand(engine_config, flags) with `backend` into <out>/<preset>/<backend>.

    only: graph ids to restrict to (the others keep their manifest entries untouched).
    Returns the manifest and its directory. Raises CompileFailed on the first failure unless
    keep_going (then the failed entries have status "failed"; the manifest records them either way).
    parallel: the ParallelContext the model was built for (None: TP=1). At TP>1 (compile.tp) the
    graphs go to <out>/<preset>/<backend>/tp{N}ep{M}/ and their hashes cover the layout.
    """
    from .tp import layout, layout_dir, layout_hash

    tp = parallel is not None and parallel.tp_size > 1
    be = get_backend(backend)
    be.check_available()
    flags = sorted(set(flags))
    specs = expand(engine_config, flags)
    if only is not None:
        wanted = set(only)
        unknown = wanted - {s.graph_id for s in specs}
        if unknown:
            raise ValueError(f"unknown graph id(s) {sorted(unknown)}; the preset has {[s.graph_id for s in specs]}")
        specs = [s for s in specs if s.graph_id in wanted]
    quant = (quantization_of(model, state), quantized_weights_hash(model))
    art_dir = artifact_dir(out, engine_config.preset, backend, quant[0])
    if tp:
        art_dir = layout_dir(art_dir, parallel)
    old: Manifest | None = None
    if (art_dir / "manifest.json").is_file():
        try:
            old = Manifest.read(art_dir)
        except Exception:
            old = None
    mhash, phash, vers = model_config_hash(model), preset_hash(engine_config), versions()
    opts = compiler_options(engine_config, backend)
    compatible = old is not None and old.model_config_sha256 == mhash and old.preset_sha256 == phash and \
        old.versions == vers and old.backend == backend and old.compiler == opts and \
        (old.quantization, old.quantized_weights_sha256) == quant
    manifest = Manifest(preset=engine_config.preset, preset_sha256=phash, model_config_sha256=mhash, backend=backend,
                        flags=flags, engine_config=graph_settings(engine_config), versions=vers, compiler=opts,
                        code_digest=code_digest(), quantization=quant[0], quantized_weights_sha256=quant[1])
    if tp:
        manifest.engine_config = {**manifest.engine_config, "parallel": layout(parallel)}
    # Keep the entries of specs outside `only` from a compatible manifest of the same flag set.
    keep = {g.id: g for g in old.graphs} if (compatible and old is not None and old.flags == flags) else {}
    all_ids = [s.graph_id for s in expand(engine_config, flags)]
    results: dict[str, GraphEntry] = {k: v for k, v in keep.items() if k in all_ids}
    emit = on_event or (lambda e: None)

    def write() -> None:
        manifest.graphs = [results[i] for i in all_ids if i in results]
        manifest.write(art_dir)

    for i, spec in enumerate(specs):
        gid = spec.graph_id
        emit(Event(i, len(specs), gid, "export"))
        entry = GraphEntry(id=gid, phase=spec.phase, batch=spec.batch, tokens=spec.tokens, variant=spec.variant,
                           sampling=spec.sampling,
                           inputs=[], outputs=[], graph_hash="", status="pending")
        try:
            eg = export_spec(model, state, engine_config, spec)
            entry.inputs, entry.outputs, entry.export_s = eg.inputs, eg.outputs, round(eg.export_s, 3)
            emit(Event(i, len(specs), gid, "hash"))
            fp = fingerprint(eg.program)
            entry.graph_hash = eg.graph_hash = layout_hash(fp.hash, parallel) if tp else fp.hash
            if not tp and quant[0] is None:  # the cache is keyed for TP=1 default graphs (graph-equiv's locks)
                fingerprint_cache.put(fingerprint_cache.key(phase_settings_hash(engine_config, spec.phase), model,
                                                            engine_config.variants, gid), fp)
            prev = (old.entry(gid) if (old is not None and compatible) else None)
            if _reusable(prev, entry.graph_hash, art_dir, be):
                entry = GraphEntry(**{**prev.__dict__, "reused": True, "export_s": entry.export_s})
                results[gid] = entry
                write()
                emit(Event(i, len(specs), gid, "reused", entry))
                continue
            shared = None if dry_run or tp or not be.produces_artifacts else \
                _same_graph_elsewhere(out, be, art_dir, entry.graph_hash, mhash, vers, opts, quant)
            if shared is not None:  # another preset compiled this very graph: copy, don't recompile
                src_dir, src = shared
                entry.files, entry.artifact = _copy_entry(src_dir, src, art_dir, gid)
                entry.status, entry.compile_s, entry.bytes, entry.reused = "ok", 0.0, src.bytes, True
                entry.artifact_sha256 = src.artifact_sha256
                results[gid] = entry
                write()
                emit(Event(i, len(specs), gid, "reused", entry,
                           f"same graph as {src_dir.parent.name}'s {src.id}: copied, not recompiled"))
                continue
            if dry_run:
                entry.status = "exported"
                results[gid] = entry
                write()
                emit(Event(i, len(specs), gid, "done", entry))
                continue
            emit(Event(i, len(specs), gid, "compile", entry))
            res = be.compile(eg, art_dir, opts)
            entry.status, entry.files, entry.artifact = res.status, res.files, res.artifact
            entry.compile_s = round(res.seconds, 3)
            entry.bytes = sum((art_dir / f).stat().st_size for f in res.files) if res.files else 0
            if res.artifact:
                entry.bytes = (art_dir / res.artifact).stat().st_size
                entry.artifact_sha256 = file_sha256(art_dir / res.artifact)
            results[gid] = entry
            write()
            emit(Event(i, len(specs), gid, "done", entry))
        except Exception as e:  # recorded in the manifest; re-raised unless keep_going
            entry.status, entry.error = "failed", f"{type(e).__name__}: {e}"[:2000]
            results[gid] = entry
            write()
            emit(Event(i, len(specs), gid, "failed", entry, entry.error))
            if not keep_going:
                raise CompileFailed(gid, entry.error, art_dir / "manifest.json") from e
    write()
    return manifest, art_dir


def load_model_and_state(model_dir: str | Path | None, engine_config: EngineConfig, device: str = "cpu",
                         quantization: str | None = None, kv_cache_dtype: str = "auto"):
    """The serving model from `model_dir` (None: the embedded tiny checkpoint) and fresh state,
    loaded as the engine loads it (glm5_next.loading: an FP8 checkpoint, or quantization="fp8",
    gives the FP8 model; anything else weights.load_model's; kv_cache_dtype "fp8_e4m3": the
    FP8-cache attention forms and an FP8 latent / key cache, as the engine builds them)."""
    from trnrt.models.glm5_next.loading import load_model
    from trnrt.models.paths import resolve_model_dir

    d = resolve_model_dir(model_dir)
    dtype = getattr(torch, engine_config.dtype)
    spec = engine_config.speculative_num_steps > 0  # the draft graphs read the MTP layer and its stack
    model = load_model(d, dtype=dtype, device=device, load_mtp=spec, quantization=quantization)
    state = model.allocate_state(engine_config.num_blocks, engine_config.block_size, engine_config.num_slots,
                                 mtp=spec)
    # (allocate_state follows the model's dtype and device)
    from trnrt.models.glm5_next.fp8.kv_dtype import resolve_kv_cache_dtype

    if resolve_kv_cache_dtype(kv_cache_dtype, dtype) == torch.float8_e4m3fn:
        from trnrt.models.glm5_next.fp8.kv_cache import to_fp8_kv_state, use_fp8_kv_cache

        use_fp8_kv_cache(model)
        state = to_fp8_kv_state(state)
    return model, state


def meta_model_and_state(engine_config: EngineConfig, model_config: Any = None, device: str = "meta"):
    """A model and state with no weights read, for export and hashing only.

    model_config: a Glm5NextConfig (default: GLM-5.3-Flash's released dimensions).
    device: "meta" (no memory at all: real dims) or "cpu" (uninitialised weights: small configs,
    and the exported graph is then the very graph `trnrt compile` exports from a checkpoint on
    the CPU, so the hashes agree with the manifest's).
    """
    from trnrt.models.glm5_next.config import Glm5NextConfig
    from trnrt.models.glm5_next.model import Glm5NextForServing
    from trnrt.models.glm5_next.state import ModelState

    cfg = model_config if model_config is not None else Glm5NextConfig.from_dict({})
    dtype = getattr(torch, engine_config.dtype)
    from trnrt.models.glm5_next.weights import is_fp32_param

    spec = engine_config.speculative_num_steps > 0
    with torch.device(device):
        model = Glm5NextForServing(cfg)
        if spec:  # the MTP layer as the tiny checkpoint ships it (the target's embedding and head)
            from trnrt.models.glm5_next.mtp import Glm5NextMTP

            model.mtp = Glm5NextMTP(cfg)
        # The dtypes load_model gives: `dtype`, except the parameters transformers keeps in fp32.
        for name, p in model.named_parameters():
            p.data = p.data.to(torch.float32 if is_fp32_param(name) else dtype)
        model.eval()
        if hasattr(model, "prepare"):
            model.prepare()
    state = ModelState.allocate(cfg, engine_config.num_blocks, engine_config.block_size, engine_config.num_slots,
                                dtype=dtype, device=device, mtp=spec)
    return model, state
