"""`trnrt serve`: one engine behind the OpenAI-compatible HTTP API (Falcon on waitress).

The command is thin: its options (trnrt.cli.serve_options, grouped as SGLang groups them) fill a
ServerArgs (trnrt.cli.server_args) in one place; `resolve_server_configs` (trnrt.cli.server_configs)
turns that into every config and checks the flags; trnrt.cli.serve_engine starts the engine.
Flag names follow SGLang's `launch_server` wherever SGLang has the flag. Nothing heavy is imported
at module level (this module is imported by `trnrt --help`).
"""

from __future__ import annotations

import typer

from trnrt.cli import app
from trnrt.cli import serve_options as o
from trnrt.cli.server_args import ServerArgs, check_log_level, resolve_api_key

D = ServerArgs()  # the options' defaults are the dataclass's (a test checks from_cli's round trip)


@app.command("serve")
def serve(
    ctx: typer.Context,
    # Model and tokenizer; graphs
    model: o.Model = D.model,
    tokenizer_path: o.TokenizerPath = D.tokenizer_path,
    context_length: o.ContextLength = D.context_length,
    quantization: o.Quantization = D.quantization,
    kv_cache_dtype: o.KvCacheDtype = D.kv_cache_dtype,
    preset: o.Preset = D.preset,
    compiled: o.Compiled = D.compiled,
    backend: o.Backend = D.backend,
    disable_compiled_cache: o.DisableCompiledCache = D.disable_compiled_cache,
    # HTTP server
    host: o.Host = D.host,
    port: o.Port = D.port,
    threads: o.Threads = D.threads,
    drain_timeout_s: o.DrainTimeout = D.drain_timeout_s,
    allowed_origins: o.AllowedOrigins = None,
    allowed_hosts: o.AllowedHosts = None,
    # Memory and scheduling
    max_running_requests: o.MaxRunningRequests = D.max_running_requests,
    max_queued_requests: o.MaxQueuedRequests = D.max_queued_requests,
    max_queued_tokens: o.MaxQueuedTokens = D.max_queued_tokens,
    max_num_batched_tokens: o.MaxNumBatchedTokens = D.max_num_batched_tokens,
    chunked_prefill_size: o.ChunkedPrefillSize = D.chunked_prefill_size,
    schedule_policy: o.SchedulePolicy = D.schedule_policy,
    enable_priority_scheduling: o.EnablePriorityScheduling = D.enable_priority_scheduling,
    schedule_low_priority_values_first: o.ScheduleLowPriorityValuesFirst = D.schedule_low_priority_values_first,
    priority_scheduling_preemption_threshold: o.PrioritySchedulingPreemptionThreshold = D.priority_scheduling_preemption_threshold,
    disable_priority_preemption: o.DisablePriorityPreemption = D.disable_priority_preemption,
    default_priority_value: o.DefaultPriorityValue = D.default_priority_value,
    abort_on_priority_when_disabled: o.AbortOnPriorityWhenDisabled = D.abort_on_priority_when_disabled,
    # Runtime options
    stream_interval: o.StreamInterval = D.stream_interval,
    incremental_streaming_output: o.IncrementalStreamingOutput = D.incremental_streaming_output,
    engine_process: o.EngineProcess = D.engine_process,
    scripted: o.Scripted = D.scripted,
    scripted_step_delay_s: o.ScriptedStepDelay = D.scripted_step_delay_s,
    # Logging
    log_level: o.LogLevel = D.log_level,
    # API related
    api_key: o.ApiKey = D.api_key,
    api_key_file: o.ApiKeyFile = D.api_key_file,
    admin_api_key: o.AdminApiKey = D.admin_api_key,
    served_model_name: o.ServedModelName = D.served_model_name,
    tool_call_parser: o.ToolCallParser = "glm47",
    reasoning_parser: o.ReasoningParser = "glm45",
    default_chat_template_kwargs: o.DefaultChatTemplateKwargs = None,
    trust_request_chat_template: o.TrustRequestChatTemplate = D.trust_request_chat_template,
    stream_response_default_include_usage: o.StreamResponseDefaultIncludeUsage = D.stream_response_default_include_usage,
    enable_response_store: o.EnableResponseStore = D.enable_response_store,
    response_store_size_mb: o.ResponseStoreSizeMb = D.response_store_size_mb,
    response_store_ttl: o.ResponseStoreTtl = D.response_store_ttl,
    # Data parallelism
    dp: o.Dp = D.dp,
    router_policy: o.RouterPolicy = D.router_policy,
    # Tensor and expert parallelism
    tp_size: o.TpSize = D.tp_size,
    ep_size: o.EpSize = D.ep_size,
    nnodes: o.Nnodes = D.nnodes,
    node_rank: o.NodeRank = D.node_rank,
    dist_init_addr: o.DistInitAddr = D.dist_init_addr,
    # Sampling features (variant graphs)
    structured_outputs: o.StructuredOutputs = D.structured_outputs,
    penalties: o.Penalties = D.penalties,
    prompt_logprobs: o.PromptLogprobs = D.prompt_logprobs,
    # Speculative decoding
    speculative_algorithm: o.SpeculativeAlgorithm = D.speculative_algorithm,
    speculative_num_steps: o.SpeculativeNumSteps = D.speculative_num_steps,
    speculative_eagle_topk: o.SpeculativeEagleTopk = D.speculative_eagle_topk,
    speculative_num_draft_tokens: o.SpeculativeNumDraftTokens = D.speculative_num_draft_tokens,
    speculative_config: o.SpeculativeConfig = D.speculative_config,
    speculative_min_accept_length: o.SpeculativeMinAcceptLength = D.speculative_min_accept_length,
    # Prefix cache; hierarchical cache
    disable_radix_cache: o.DisableRadixCache = D.disable_radix_cache,
    checkpoint_interval: o.CheckpointInterval = D.checkpoint_interval,
    num_checkpoints: o.NumCheckpoints = D.num_checkpoints,
    radix_eviction_policy: o.RadixEvictionPolicy = D.radix_eviction_policy,
    radix_eviction_policy_config: o.RadixEvictionPolicyConfig = None,
    enable_hierarchical_cache: o.EnableHierarchicalCache = D.enable_hierarchical_cache,
    hicache_ratio: o.HicacheRatio = D.hicache_ratio,
    hicache_size: o.HicacheSize = D.hicache_size,
    hicache_write_policy: o.HicacheWritePolicy = D.hicache_write_policy,
) -> None:
    """Serve the HTTP API; see docs/API.md for every route. The main families:

    OpenAI: /v1/* (/v1/models, /v1/completions, /v1/chat/completions, ...).
    SGLang native: /generate, /tokenize, /detokenize.
    Admin: /server_info, /model_info, /v1/loads, /get_load, /flush_cache, /abort_request.
    Health and stats: /health, /health_generate, /v1/stats, /metrics.
    """
    import logging

    check_log_level(log_level)
    logging.basicConfig(level=getattr(logging, log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("trnrt.serve")
    if dp > 1:
        raise typer.Exit(_serve_dp(ctx, ctx.params))
    args = ServerArgs.from_cli(ctx.params)  # the one place the options become ServerArgs
    from trnrt.cli import serve_engine  # by module: tests patch its start_engine / use_engine_process
    from trnrt.cli.server_configs import resolve_server_configs

    parallel = args.parallel_config()
    if parallel.node_rank > 0:  # another node of a multi-node group: its ranks only, no HTTP
        from trnrt.engine.core.tp_launch import run_node

        log.info("trnrt serve: node %d of %d, ranks %s, rendezvous at %s", parallel.node_rank, parallel.nnodes,
                 list(parallel.node_ranks()), parallel.dist_init_addr)
        raise typer.Exit(run_node(parallel))
    try:
        settings = resolve_server_configs(args).settings  # the flags checked before the model loads
        _check_port_free(args.host, args.port)  # before the model loads (seconds), not after
        engine, tokenizer_factory = serve_engine.start_engine(args)
    except ValueError as e:  # a bad checkpoint, preset or compiled artifact: say which, exit 2
        typer.secho(f"error: {e}", err=True, fg="red")
        raise typer.Exit(2)
    except RuntimeError as e:
        from trnrt.engine.sample.grammar import GrammarUnavailableError

        if not isinstance(e, GrammarUnavailableError):
            raise
        typer.secho(f"error: --structured-outputs: {e}", err=True, fg="red")
        raise typer.Exit(2)
    from trnrt.serve import create_app
    from trnrt.serve.server import run

    wsgi = create_app(engine, tokenizer_factory, settings)
    name = settings.served_model_name or engine.model_info.served_model_name
    watch = None
    if parallel.enabled:  # a dead rank ends the engine: answer 503, then exit non-zero
        from trnrt.serve.engine_watch import EngineWatch

        watch = EngineWatch(engine, wsgi).start()
    code = run(wsgi, engine, host=args.host, port=args.port, threads=args.threads,
               drain_timeout_s=args.drain_timeout_s,
               on_ready=lambda url: log.info("trnrt serve: ready at %s (model %s)", url, name))
    raise typer.Exit(watch.exit_code or code if watch is not None else code)


def _check_port_free(host: str, port: int) -> None:
    """A usage error naming --port when host:port cannot be bound (checked before loading the model)."""
    import errno
    import socket

    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise typer.BadParameter(f"cannot resolve {host!r}: {e}", param_hint="--host")
    family, _, _, _, addr = infos[0]
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as waitress binds
        s.bind(addr)
    except OSError as e:
        why = "is already in use" if e.errno == errno.EADDRINUSE else f"cannot be bound: {e.strerror}"
        raise typer.BadParameter(f"{host}:{port} {why}", param_hint="--port")
    finally:
        s.close()


def _serve_dp(ctx, p: dict) -> int:
    """`--dp N`: the engines and sglang-router under trnrt.serve.dp's supervisor (each engine
    checks its own flags)."""
    from trnrt.serve import dp as dp_mod

    if p["router_policy"] not in dp_mod.ROUTER_POLICIES:
        raise typer.BadParameter(f"must be one of {', '.join(dp_mod.ROUTER_POLICIES)}", param_hint="--router-policy")
    if not dp_mod.router_available():
        typer.secho(f"error: {dp_mod.INSTALL_HINT}", err=True, fg="red")
        raise typer.Exit(2)
    _check_port_free(p["host"], p["port"])
    port = p["port"] or dp_mod.free_port(p["host"])
    engine_args = dp_mod.engine_args_from_context(ctx, drop=(
        "dp", "router_policy", "host", "port", "api_key", "api_key_file", "admin_api_key"))
    return dp_mod.run(dp_mod.DPConfig(
        dp=p["dp"], engine_args=engine_args, host=p["host"], port=port, router_policy=p["router_policy"],
        max_running_requests=p["max_running_requests"], drain_timeout_s=p["drain_timeout_s"],
        log_level=p["log_level"], api_key=resolve_api_key(p["api_key"], p["api_key_file"]),
        admin_api_key=p["admin_api_key"] or None))
