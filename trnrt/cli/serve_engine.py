"""The engine behind `trnrt serve`: built from a ServerArgs, in this process or its own.

`start_engine(args)` is what the serve command runs; `build_engine(args)` constructs the Engine
(the model, or `--scripted`'s scripted runner) from `resolve_server_configs(args)`;
`engine_core_factory` is the picklable factory the engine process (trnrt.engine.core.core_proc)
calls by name. The compiled-graph loaders (`--compiled DIR`, the artifact cache) are here too;
`trnrt generate` shares `compiled_loader`; `rank_loader` is `--tp-size` N's (every rank loads the
layout's graphs with its own model: trnrt.compile.tp_loader). Nothing heavy is imported at module level.
"""

from __future__ import annotations

import logging

import typer

from trnrt.cli.server_args import ServerArgs
from trnrt.cli.server_configs import SCRIPTED_MAX_MODEL_LEN, resolve_server_configs

log = logging.getLogger("trnrt.serve")


def resolve_model_dir(args: ServerArgs) -> str:
    """--model, or the embedded tiny checkpoint (written into the cache on first use).

    With --scripted the directory only needs a tokenizer (no weights are read).
    """
    if args.scripted and args.model:
        return args.model
    from trnrt.models.paths import resolve_model_dir as resolve

    try:
        return str(resolve(args.model))
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--model")


def use_engine_process(args: ServerArgs) -> bool:
    """Whether `trnrt serve` runs the engine core in its own process (see start_engine)."""
    return (not args.scripted) if args.engine_process is None else bool(args.engine_process)


def start_engine(args: ServerArgs):
    """The EngineClient `trnrt serve` runs: the engine of `build_engine(args)`, in a process of its
    own (trnrt.engine.core.mp_client.MPEngineClient: the HTTP threads and the engine thread then never
    share a GIL) when `use_engine_process(args)`, else in this process. Returns (engine,
    tokenizer_factory); raises what building the engine raised (its own type, from either process)."""
    if not use_engine_process(args):
        return build_engine(args)
    import threading

    from trnrt.engine.core.mp_client import MPEngineClient
    from trnrt.serve import hf_tokenizer_factory

    model_dir = resolve_model_dir(args)  # here first: the embedded checkpoint is written once, before the child reads it
    tokenizer_factory = hf_tokenizer_factory(args.tokenizer_path or model_dir)

    # While the engine process loads the model: import transformers and load the tokenizer here
    # once, so that the first request does not pay for it (seconds; more than a client's timeout
    # on a loaded machine). A failure is only logged: each HTTP thread loads its own tokenizer,
    # and reports the same error on its first request, as with the engine in this process.
    def warm_tokenizer():
        try:
            tokenizer_factory()
        except Exception as e:
            log.warning("could not load the tokenizer: %s", e)

    warm = threading.Thread(target=warm_tokenizer, name="trnrt-tokenizer-warmup", daemon=True)
    warm.start()
    try:
        engine = MPEngineClient(engine_core_factory, (args,), log_level=logging.getLogger().getEffectiveLevel())
    finally:
        warm.join()
    log.info("engine core running in process %d", engine.pid)
    return engine, tokenizer_factory


def engine_core_factory(args: ServerArgs):
    """The engine process's factory (trnrt.engine.core.core_proc): `build_engine(args)` over there."""
    engine, _ = build_engine(args)
    return engine


def build_engine(args: ServerArgs):
    """Construct the EngineClient for `trnrt serve`. Returns (engine, tokenizer_factory).

    The model directory is `resolve_model_dir(args)`; the tokenizer is read from
    --tokenizer-path or the model directory (one instance per waitress thread). The configs are
    `resolve_server_configs(args)`'s. `--scripted` serves the same Engine with a scripted runner
    in place of the model (`Engine.scripted` with `echo_script`; only a tokenizer is read).
    """
    from trnrt.serve import hf_tokenizer_factory

    model_dir = resolve_model_dir(args)
    tokenizer_factory = hf_tokenizer_factory(args.tokenizer_path or model_dir)
    if args.scripted:
        from trnrt.engine.core.engine import Engine
        from trnrt.engine.runner.scripted_runner import echo_script

        cfgs = resolve_server_configs(args)
        engine = Engine.scripted(
            tokenizer_factory(), echo_script, scheduler_config=cfgs.scheduler_config,
            prefix_cache_config=cfgs.prefix_cache_config, served_model_name=args.served_model_name or "trnrt-tiny",
            model_path=model_dir, max_model_len=args.context_length or SCRIPTED_MAX_MODEL_LEN,
            max_running_requests=args.max_running_requests, step_delay_s=args.scripted_step_delay_s,
            stream_interval=args.stream_interval, submit_log_size=0, structured_outputs=args.structured_outputs,
            penalties=args.penalties, prompt_logprobs=args.prompt_logprobs)
        return engine, tokenizer_factory
    try:
        from trnrt.engine.core.engine import Engine  # the real engine (written against the same contract)
    except ModuleNotFoundError as e:
        if e.name != "trnrt.engine.core.engine":
            raise
        typer.echo("trnrt serve: the engine (trnrt.engine.core.engine) is not available in this build", err=True)
        raise typer.Exit(1)

    parallel = args.parallel_config()
    if parallel.enabled:  # every rank loads the layout's graphs with its own model (compile.tp_loader)
        from trnrt.models.glm5_next.fp8.load import wants_fp8
        from trnrt.models.glm5_next.fp8.rank_load import check_fp8_layout
        from trnrt.parallel.shard import ShardingError

        try:  # FP8 weights at TP > 1: refuse a layout that splits a scale block before any rank starts
            check_fp8_layout(model_dir, parallel.tp_size, parallel.ep_size, args.quantization)
        except ShardingError as e:
            raise typer.BadParameter(str(e), param_hint="--tp-size / --ep-size") from None
        fp8 = wants_fp8(model_dir, args.quantization) or args.kv_cache_dtype == "fp8_e4m3"
        if fp8 and args.compiled:  # the FP8 rank model runs eagerly: no FP8 graphs per rank are built
            raise typer.BadParameter("--tp-size > 1 with FP8 weights or an FP8 KV cache runs eagerly (trnrt compile "
                                     "builds no FP8 graphs per rank yet)", param_hint="--compiled")
        loader = None if fp8 else rank_loader(args, model_dir, parallel)
    elif args.compiled:
        loader = compiled_loader(args.compiled, args.backend)
    else:
        loader = None if args.disable_compiled_cache else cached_loader(model_dir, args.preset, args.backend,
                                                                        args.quantization, args.kv_cache_dtype)
    cfgs = resolve_server_configs(args, compiled=loader is not None)
    from trnrt.plan.fit import check_serve_fits  # refuse a layout that cannot fit before any weight loads

    check_serve_fits(model_dir, args.preset, tp=getattr(args, "tp_size", 1), ep=getattr(args, "ep_size", 1),
                     device="trn2" if args.backend == "neuron" else "cpu",
                     mem_fraction_static=getattr(args, "mem_fraction_static", None), quantization=args.quantization,
                     kv_cache_dtype=args.kv_cache_dtype)
    engine = Engine.from_model_dir(model_dir, preset=args.preset, max_running_requests=args.max_running_requests,
                                   context_length=args.context_length, scheduler_config=cfgs.scheduler_config,
                                   served_model_name=args.served_model_name,
                                   compiled_loader=loader, compiled_backend=args.backend or "cpu",
                                   stream_interval=args.stream_interval, structured_outputs=args.structured_outputs,
                                   penalties=args.penalties, prompt_logprobs=args.prompt_logprobs,
                                   speculative=cfgs.speculative, prefix_cache_config=cfgs.prefix_cache_config,
                                   quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                                   parallel=parallel if parallel.enabled else None)
    return engine, tokenizer_factory


def compiled_loader(directory: str, backend: str | None):
    """An Engine compiled_loader over the graphs `trnrt compile --out DIR` built (the CLI layer
    may import trnrt.compile; the engine never does)."""
    def loader(model, state, engine_config):
        from trnrt.compile import load_compiled

        return load_compiled(directory, model, state, engine_config, backend=backend)

    return loader


def rank_loader(args, model_dir: str, parallel):
    """The compiled-graph loader of a `--tp-size N` engine (trnrt.compile.tp_loader): the
    tp{N}ep{M} graphs of `--compiled DIR` (any rank refusing them fails the start-up), else None
    (eager). Compiled TP graphs are experimental (docs/COMPILE.md: an intermittent hang of an
    in-graph collective under concurrent load, not root-caused), so they run only when asked
    for: the artifact cache is not read at TP > 1."""
    from trnrt.compile.tp_loader import RankCompiledLoader

    if args.compiled:
        log.warning("compiled tensor-parallel graphs are experimental (docs/COMPILE.md): an in-graph collective "
                    "has hung intermittently under load; a hung rank fails after TRNRT_TP_TIMEOUT_S")
        return RankCompiledLoader(str(args.compiled), args.backend, fallback_eager=False)
    log.info("tp%dep%d: running eagerly (compiled TP graphs run only with --compiled DIR; the artifact cache is not "
             "read at --tp-size > 1)", parallel.tp_size, parallel.ep_size)
    return None


def cached_loader(model_dir: str, preset: str | None, backend: str | None, quantization: str | None = None,
                  kv_cache_dtype: str = "auto"):
    """A compiled-graph loader over the artifact cache (`trnrt compile` without --out writes
    there), or None when the cache holds nothing for this model, preset and backend. An FP8 model
    (an FP8 checkpoint, or `quantization="fp8"`) or FP8 KV cache (`kv_cache_dtype="fp8_e4m3"`)
    looks for its own graphs (`<backend>/fp8/`, `kv_fp8/`, `fp8+kv_fp8/`). Artifacts
    the loader refuses (another model config, preset settings, torch or graph code) are logged and
    the engine runs eagerly: a stale cache never stops a server."""
    from trnrt.compile.artifact_cache import cached_artifacts
    from trnrt.config.presets import PresetError, read_preset

    try:
        preset = read_preset(preset or "default").name
    except PresetError:
        return None  # resolving the configs reports the preset
    from trnrt.compile.manifest import quantization_name
    from trnrt.models.glm5_next.fp8.load import wants_fp8

    backend = backend or "cpu"
    quant = quantization_name(wants_fp8(model_dir, quantization), kv_cache_dtype == "fp8_e4m3")
    cached = cached_artifacts(model_dir, preset, backend, quant)
    if cached is None:
        q = f" for {quant} weights" if quant else ""
        log.info("no compiled graphs of preset %s (%s)%s in the artifact cache: running eagerly "
                 "(`trnrt compile --preset %s%s` builds them once)", preset, backend, q, preset,
                 (" --quantization fp8" if quantization else "") +
                 (" --kv-cache-dtype fp8_e4m3" if kv_cache_dtype == "fp8_e4m3" else ""))
        return None

    def loader(model, state, engine_config):
        from trnrt.compile import load_compiled
        from trnrt.compile.loader import CompiledArtifactError

        try:
            graphs = load_compiled(cached, model, state, engine_config, backend=backend)
        except CompiledArtifactError as e:
            log.warning("compiled graphs in the artifact cache not used, running eagerly: %s", e)
            return {}
        log.info("running the compiled graphs of preset %s%s from the artifact cache (%s)", preset,
                 f" ({quant} weights)" if quant else "", cached)
        return graphs

    return loader
