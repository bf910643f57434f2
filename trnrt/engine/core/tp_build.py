"""One rank's runner: the rank's model, its state and the ModelRunner (or SpecModelRunner) over
them, built the same way on rank 0 and on every worker from one picklable RankSetup.

The model is `trnrt.models.glm5_next.rank_model.load_rank_model(model_dir, dtype, ctx,
load_mtp, device)` (the rank's shards; logits all-gathered to the full vocabulary) where that
module exists, `fp8.rank_load.load_fp8_rank_model` for FP8 weights (an FP8 checkpoint or
`quantization="fp8"`; `kv_cache_dtype="fp8_e4m3"` re-classes its MLA to the FP8-cache forms);
otherwise (`REPLICATED_FALLBACK`) every rank loads the whole TP=1 model, which
runs the same steps and samples the same tokens on every rank: the process model, the broadcast,
the agreement check and the death handling are then exercised without any sharding.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import Any

from trnrt.config import EngineConfig

log = logging.getLogger("trnrt.engine.core.tp")

RANK_MODEL_MODULE = "trnrt.models.glm5_next.rank_model"


@dataclass(frozen=True)
class RankSetup:
    """What every rank builds its runner from (rank 0 broadcasts it once, before loading).

    spec_steps: k of speculative decoding (SpecModelRunner, the MTP layer loaded); None: plain.
    quantization: "fp8" quantizes a bf16 checkpoint per block at load (an FP8 checkpoint is FP8
    without it): the FP8 rank model (glm5_next.fp8.rank_load). kv_cache_dtype: "fp8_e4m3" stores
    the (replicated) MLA latents and indexer keys in FP8 on every rank.
    compiled_loader: None (eager), or a picklable `loader(model, state, engine_config, ctx) ->
    {GraphSpec: callable}` that each rank calls with its own model (the CLI passes
    trnrt.compile.tp_loader.RankCompiledLoader; the ranks then agree: tp_compiled.load_agreed).
    compiled_backend: the backend name of those graphs (torch threads, reports).
    """

    model_dir: str
    engine_config: EngineConfig
    spec_steps: int | None = None
    device: str = "cpu"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    compiled_loader: Any = None
    compiled_backend: str = "cpu"


def rank_model_available() -> bool:
    """Whether the sharded rank-local model (issue #31 item 1's loader) is in this build."""
    try:
        return importlib.util.find_spec(RANK_MODEL_MODULE) is not None
    except ModuleNotFoundError:
        return False


def model_kind() -> str:
    """'sharded' (rank_model.load_rank_model) or 'replicated' (the whole model on every rank)."""
    return "sharded" if rank_model_available() else "replicated"


def load_rank(setup: RankSetup, ctx, dtype):
    """The model of `ctx`'s rank (see the module doc)."""
    load_mtp = setup.spec_steps is not None
    if rank_model_available():
        from trnrt.models.glm5_next.fp8.load import wants_fp8
        from trnrt.models.glm5_next.rank_model import load_rank_model

        if wants_fp8(setup.model_dir, setup.quantization):  # FP8 weights + their scale shards per rank
            from trnrt.models.glm5_next.fp8.rank_load import load_fp8_rank_model

            return load_fp8_rank_model(setup.model_dir, dtype, ctx, load_mtp=load_mtp, device=setup.device,
                                       quantization=setup.quantization)
        return load_rank_model(setup.model_dir, dtype, ctx, load_mtp=load_mtp, device=setup.device)
    from trnrt.models.glm5_next.loading import load_model  # bf16 as weights.load_model, or the whole FP8 model

    return load_model(setup.model_dir, dtype=dtype, device=setup.device, load_mtp=load_mtp,
                      quantization=setup.quantization)


def allocate_state(model, ecfg: EngineConfig, dtype, device: str, mtp: bool):
    """The rank's ModelState: a rank model's own allocator (its local head counts), else
    ModelState.allocate over the config, as at TP=1."""
    if rank_model_available():
        return model.allocate_state(ecfg.num_blocks, ecfg.block_size, ecfg.num_slots, mtp=mtp)
    from trnrt.models.glm5_next.state import ModelState

    return ModelState.allocate(model.config, ecfg.num_blocks, ecfg.block_size, ecfg.num_slots, dtype, device,
                               mtp=mtp)


def build_runner(setup: RankSetup, ctx, ranks_per_node: int = 1):
    """The ModelRunner (SpecModelRunner with spec_steps) of `ctx`'s rank: eager, or with the
    compiled graphs of `setup.compiled_loader` bound to this rank's model and state (the same
    graphs on every rank, or start-up fails: tp_compiled.load_agreed; a collective, so every rank
    calls build_runner). Its torch threads: as at TP=1 (one for a small model), a default
    share of the cores divided by the ranks on this node (an explicit $TRNRT_TORCH_THREADS is kept)."""
    import torch

    from trnrt.engine.runner.model_runner import ModelRunner
    from trnrt.engine.runner.threads import count_params, resolve_torch_threads

    ecfg = setup.engine_config
    dtype = getattr(torch, ecfg.dtype)
    model = load_rank(setup, ctx, dtype)
    mtp = setup.spec_steps is not None
    state = allocate_state(model, ecfg, dtype, setup.device, mtp)
    from trnrt.models.glm5_next.fp8.kv_dtype import resolve_kv_cache_dtype

    if resolve_kv_cache_dtype(setup.kv_cache_dtype, dtype) == torch.float8_e4m3fn:  # as at TP=1 (engine_builder)
        from trnrt.models.glm5_next.fp8.kv_cache import to_fp8_kv_state, use_fp8_kv_cache

        use_fp8_kv_cache(model)
        state = to_fp8_kv_state(state)
    vocab = model.config.vocab_size
    compiled = None
    if setup.compiled_loader is not None:
        from trnrt.engine.core.tp_compiled import load_agreed

        compiled = load_agreed(setup.compiled_loader, model, state, ecfg, ctx) or None
    if not mtp:
        runner = ModelRunner(model, state, ecfg, vocab, compiled=compiled)
    else:
        from trnrt.engine.spec.runner import SpecModelRunner

        runner = SpecModelRunner(model, state, ecfg, vocab, num_steps=setup.spec_steps, compiled=compiled)
    backend = setup.compiled_backend if compiled else "eager"
    n, source = resolve_torch_threads(backend, setup.device, None, count_params(model))
    runner.torch_threads = max(1, n // ranks_per_node) if source == "default" else n
    from trnrt.engine.core.tp_fault import install_test_fault

    install_test_fault(runner, ctx.tp_rank)  # a test hook: nothing unless $TRNRT_TP_TEST_FAULT is set
    return runner
