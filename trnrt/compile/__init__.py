"""Ahead-of-time compilation of a preset's graphs (`trnrt compile`) and loading them back.

- catalogue.expand(config, flags) -> sorted GraphSpec list (what compiles, hashes and runs);
- export.export_spec(...) -> the torch.export program of one spec (state tensors as inputs);
- graph_hash.fingerprint(ep) -> canonical Merkle identity of an exported graph;
- pipeline.compile_graphs(...) -> artifacts + manifest.json under <out>/<preset>/<backend>/;
- loader.load_compiled(dir, model, state, engine_config) -> {GraphSpec: callable}.

Layering (docs/ARCHITECTURE.md): compile sits above engine and models; the engine's ModelRunner does not
import this package: the CLI / server call load_compiled and hand the dict to the runner.
"""

from .catalogue import BASE_VARIANT, UnknownVariantError, expand, register_variant, unregister_variant
from .loader import CompiledArtifactError, load_compiled
from .pipeline import CompileFailed, compile_graphs

__all__ = [
    "BASE_VARIANT", "CompileFailed", "CompiledArtifactError", "UnknownVariantError", "compile_graphs", "expand",
    "load_compiled", "register_variant", "unregister_variant",
]
