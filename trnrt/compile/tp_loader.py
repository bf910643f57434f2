"""Loading one rank's compiled graphs of a tensor-parallel layout (`trnrt serve --tp-size N
--compiled DIR`, or the artifact cache; issue #31 item 5, the serve side).

`trnrt compile --tp-size N [--ep-size M]` writes ONE program per graph for every rank, under
<out>/<preset>/<backend>/tp{N}ep{M}/ (compile.tp). Every rank calls `load_rank_compiled` with its
own rank model, state and ParallelContext:

* the manifest's `engine_config.parallel` must be this rank's layout (compile.tp.layout), else
  CompiledArtifactError reason "parallel" (a tp2ep2 directory served at tp 2 / ep 1, say);
* the TP=1 loader's checks then run unchanged (model config, preset settings, flags, torch and
  machine, status), and a re-checked graph hash is `layout_hash(fingerprint, ctx)` of the rank's
  own export (the manifest's key at TP > 1);
* the cpu backend binds THIS rank's model tensors (its shards, vocab_start / expert_start) into
  the shared package (`load_constants(..., user_managed=True)`), so one package runs every rank.

A TP manifest may hold a subset of the preset's graphs (`trnrt compile --only ...`: a full TP
preset is a long compile); the graphs it lacks run eagerly. Every rank must make the same choice
(the collectives pair up in graph order): the engine gathers each rank's loaded graph ids and
refuses start-up (or, for the artifact cache, runs eagerly on every rank) when they differ
(trnrt.engine.core.tp_compiled).

`RankCompiledLoader` is the picklable loader rank 0 broadcasts to the workers in its RankSetup.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from trnrt.config.engine_config import EngineConfig
from trnrt.engine.runner.step import GraphSpec
from trnrt.parallel.context import ParallelContext

from .loader import CompiledArtifactError, load_compiled
from .manifest import MANIFEST_NAME, Manifest
from .tp import layout, layout_hash, layout_key


def _describe(lay: dict) -> str:
    return f"tp {lay['tp_size']} / ep {lay['ep_size']}" if lay else "TP=1"


def find_layout_dir(directory: str | Path, engine_config: EngineConfig, ctx: ParallelContext,
                    backend: str | None = None) -> Path:
    """The directory of the layout's manifest.json: DIR itself when it is a TP layout's
    directory (any layout: the layout check then names a wrong one), DIR/tp{N}ep{M}, or
    DIR/<preset>/<backend>/tp{N}ep{M} (the only backend holding one, without `backend`)."""
    d, key = Path(directory), layout_key(ctx)
    if (d / MANIFEST_NAME).is_file() and Manifest.read(d).engine_config.get("parallel"):
        return d
    if (d / key / MANIFEST_NAME).is_file():
        return d / key
    p = d / engine_config.preset
    found = [p / backend / key] if backend else (sorted(x / key for x in p.iterdir()) if p.is_dir() else [])
    found = [x for x in found if (x / MANIFEST_NAME).is_file()]
    if len(found) == 1:
        return found[0]
    if len(found) > 1:
        raise CompiledArtifactError("missing", f"{p} holds {key} artifacts of several backends: pass --backend")
    raise CompiledArtifactError(
        "missing", f"no {key} {MANIFEST_NAME} in {d}, {d / key} or {p}/<backend>/{key} (run `trnrt compile "
        f"--preset {engine_config.preset} --tp-size {ctx.tp_size} --ep-size {ctx.ep_size} --out {d}` first)")


def check_layout(man: Manifest, mdir: Path, ctx: ParallelContext) -> None:
    """Refuse a manifest compiled for another parallel layout than this rank's."""
    want, got = layout(ctx), man.engine_config.get("parallel") or {}
    if got != want:
        raise CompiledArtifactError(
            "parallel", f"refusing {mdir}: compiled for {_describe(got)} ({got or 'no layout'}), this rank runs "
            f"{_describe(want)} ({want}); compile this layout (`trnrt compile --tp-size {ctx.tp_size} "
            f"--ep-size {ctx.ep_size}`)")


def load_rank_compiled(directory: str | Path, model: Any, state: Any, engine_config: EngineConfig,
                       ctx: ParallelContext, *, backend: str | None = None,
                       check_graphs: bool | None = None) -> dict[GraphSpec, Callable]:
    """This rank's callables for the graphs of its layout's manifest under `directory` (see the
    module doc). check_graphs as in load_compiled (None: re-export only when the graph code or
    torch changed since the compile). Raises CompiledArtifactError."""
    mdir = find_layout_dir(directory, engine_config, ctx, backend)
    check_layout(Manifest.read(mdir), mdir, ctx)
    return load_compiled(mdir, model, state, engine_config, backend=backend, check_graphs=check_graphs,
                         manifest_dir=mdir, graph_key=lambda h: layout_hash(h, ctx), partial=True)


@dataclass(frozen=True)
class RankCompiledLoader:
    """The compiled-graph loader of a tensor-parallel engine: picklable (rank 0 sends it to every
    worker in the RankSetup, which imports this module by name there), called on each rank as
    `loader(model, state, engine_config, ctx) -> {GraphSpec: callable}` with that rank's own model.

    fallback_eager: what the ranks do when any of them refuses the artifacts: False (`--compiled
    DIR`) fails the start-up, True (the artifact cache) runs every rank eagerly, logged.
    """

    directory: str
    backend: str | None = None
    fallback_eager: bool = False
    check_graphs: bool | None = None

    tensor_parallel = True  # the engine accepts only such loaders at TP > 1 (not a field)

    def __call__(self, model: Any, state: Any, engine_config: EngineConfig, ctx: ParallelContext):
        return load_rank_compiled(self.directory, model, state, engine_config, ctx, backend=self.backend,
                                  check_graphs=self.check_graphs)
