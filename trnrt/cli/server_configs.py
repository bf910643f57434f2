"""ServerArgs -> the engine's and the server's configs, in one function (`resolve_server_configs`).

Where each setting lives (docs/ARCHITECTURE.md "Where a setting lives"): graph-shaping settings
in the preset's EngineConfig; host-only scheduling in SchedulerConfig; the prefix cache in
PrefixCacheConfig; speculative decoding in SpeculativeConfig; the HTTP layer in ServeSettings.
The cross-flag rules (SGLang's startup checks, the flags against the preset) are checked here,
before any model loads: a usage error (typer.BadParameter, exit 2) names the flag. Nothing heavy
is imported at module level.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import typer

from trnrt.cli.server_args import ServerArgs

if TYPE_CHECKING:
    from trnrt.config import EngineConfig
    from trnrt.engine.cache.cache_config import PrefixCacheConfig
    from trnrt.engine.sched.scheduler import SchedulerConfig
    from trnrt.engine.spec.config import SpeculativeConfig
    from trnrt.serve import ServeSettings

PRIORITY_POLICIES = ("fcfs", "lof")
# SGLang's startup errors, word for word.
PRIORITY_POLICY_MESSAGE = "To use priority scheduling, schedule_policy must be 'fcfs' or 'lof'."
HICACHE_RADIX_MESSAGE = ("The arguments enable-hierarchical-cache and disable-radix-cache are mutually exclusive "
                         "and cannot be used at the same time. Please use only one of them.")
SCRIPTED_MAX_MODEL_LEN = 4096  # the scripted engine's context without --context-length


@dataclass(frozen=True)
class ServerConfigs:
    """Every config a `trnrt serve` (or an engine process) runs with, from one ServerArgs.

    engine_config / scheduler_config: `resolve_configs` of the preset ("default" for --scripted),
    with the scheduling options on top of the scheduler's. The engine is still given the preset
    by name (Engine.from_model_dir resolves the same EngineConfig and adds the feature flags)."""

    engine_config: "EngineConfig"
    scheduler_config: "SchedulerConfig"
    prefix_cache_config: "PrefixCacheConfig"
    speculative: "SpeculativeConfig | None"
    settings: "ServeSettings"


def resolve_server_configs(args: ServerArgs, *, compiled: bool = False) -> ServerConfigs:
    """The configs of `args`; `compiled`: compiled graphs will run (their cache sizes are graph
    inputs, so they stay the preset's: see resolve_configs). Raises typer.BadParameter naming
    the flag for a usage error, and the preset's PresetError (a ValueError) when it cannot be read."""
    from trnrt.engine.core.engine_setup import resolve_configs
    from trnrt.serve import ServeSettings

    speculative = _speculative(args)
    prefix_cache = _check(args, speculative)
    scripted_len = (args.context_length or SCRIPTED_MAX_MODEL_LEN) if args.scripted else None
    ecfg, scfg = resolve_configs(None, preset="default" if args.scripted else args.preset,
                                 max_running_requests=args.max_running_requests,
                                 context_length=scripted_len or args.context_length, compiled=compiled)
    scfg = dataclasses.replace(scfg, **scheduler_overrides(args))
    settings = ServeSettings(
        served_model_name=args.served_model_name, api_key=args.api_key, context_length=args.context_length,
        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
        max_concurrent_requests=args.max_concurrent_requests,
        default_chat_template_kwargs=args.default_chat_template_kwargs,
        incremental_streaming_output=args.incremental_streaming_output,
        stream_response_default_include_usage=args.stream_response_default_include_usage,
        allowed_origins=tuple(args.allowed_origins), allowed_hosts=tuple(args.allowed_hosts) or None,
        bind_host=args.host, tokenizer_path=args.tokenizer_path, admin_api_key=args.admin_api_key or None,
        trust_request_chat_template=args.trust_request_chat_template,
        enable_priority_scheduling=args.enable_priority_scheduling,
        abort_on_priority_when_disabled=args.abort_on_priority_when_disabled,
        enable_hierarchical_cache=args.enable_hierarchical_cache and not args.disable_radix_cache,
        enable_response_store=args.enable_response_store, response_store_size_mb=args.response_store_size_mb,
        response_store_ttl_s=args.response_store_ttl,
        server_args=args.reported(),  # reported by /server_info; keys never are
    )
    return ServerConfigs(ecfg, scfg, prefix_cache, speculative, settings)


def scheduler_overrides(args: ServerArgs) -> dict[str, Any]:
    """The SchedulerConfig fields the options set (on top of the preset's resolved ones)."""
    out: dict[str, Any] = {
        "schedule_policy": args.schedule_policy,
        "enable_priority_scheduling": args.enable_priority_scheduling,
        "schedule_low_priority_values_first": args.schedule_low_priority_values_first,
        "priority_preemption_threshold": args.priority_scheduling_preemption_threshold,
        "disable_priority_preemption": args.disable_priority_preemption,
        "default_priority_value": args.default_priority_value,
        "abort_on_priority_when_disabled": args.abort_on_priority_when_disabled,
        "max_queued_requests": args.max_queued_requests,
        "max_queued_tokens": args.max_queued_tokens,
    }
    if args.max_num_batched_tokens is not None:
        out["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.chunked_prefill_size is not None:
        if args.chunked_prefill_size == -1:
            out["chunked_prefill"] = False
        else:
            out["max_prefill_chunk_tokens"] = args.chunked_prefill_size
    return out


def prefix_cache_config(args: ServerArgs) -> "PrefixCacheConfig":
    """The PrefixCacheConfig of the options (the radix cache is on unless disabled, as in SGLang);
    raises ValueError from PrefixCacheConfig's own checks."""
    from trnrt.engine.cache.cache_config import PrefixCacheConfig

    return PrefixCacheConfig(
        enabled=not args.disable_radix_cache, checkpoint_interval=args.checkpoint_interval,
        num_checkpoints=args.num_checkpoints, eviction_policy=args.radix_eviction_policy,
        eviction_policy_config=dict(args.radix_eviction_policy_config),
        hierarchical=args.enable_hierarchical_cache, hicache_ratio=args.hicache_ratio,
        hicache_size_mb=args.hicache_size * 1024, write_policy=args.hicache_write_policy)


def speculative_config(args: ServerArgs) -> "SpeculativeConfig | None":
    """The engine's SpeculativeConfig (None: off), the preset's included (an mtp-* preset turns
    it on: `preset_speculative`); raises SpeculativeConfigError naming the flag."""
    from trnrt.engine.spec.config import preset_speculative, resolve_speculative

    ecfg = None if args.scripted else preset_config(args.preset)
    algorithm = args.speculative_algorithm
    if algorithm is None and args.speculative_config is None and ecfg is not None and ecfg.speculative_num_steps:
        algorithm = "NEXTN"  # the preset speculates: its flags need no --speculative-algorithm
    spec = resolve_speculative(algorithm, args.speculative_num_steps, args.speculative_eagle_topk,
                               args.speculative_num_draft_tokens, args.speculative_config,
                               args.speculative_min_accept_length)
    if ecfg is None:
        return spec
    try:
        vllm_steps = "num_speculative_tokens" in json.loads(args.speculative_config or "{}")
    except ValueError:
        vllm_steps = False
    steps_given = args.speculative_num_steps is not None or args.speculative_num_draft_tokens is not None or vllm_steps
    return preset_speculative(spec, ecfg, num_steps_given=steps_given,
                              min_accept_given=args.speculative_min_accept_length is not None)


def preset_config(preset: str) -> "EngineConfig | None":
    """The preset's EngineConfig (None when it cannot be read: resolving the configs reports that)."""
    try:
        from trnrt.config.presets import load_preset

        return load_preset(preset or "default")
    except Exception:
        return None


def _speculative(args: ServerArgs):
    from trnrt.engine.spec.config import SpeculativeConfigError

    try:
        spec = speculative_config(args)
    except SpeculativeConfigError as e:
        raise typer.BadParameter(str(e), param_hint=e.field)
    if spec is not None and args.scripted:
        raise typer.BadParameter("speculative decoding needs the model (its MTP layer), not --scripted",
                                 param_hint="--speculative-algorithm")
    return spec


def _check(args: ServerArgs, spec) -> "PrefixCacheConfig":
    """The cross-flag rules of the speculative, prefix cache and scheduling options (SGLang's
    startup checks, and the checkpoint interval against the preset's block size); returns the
    PrefixCacheConfig."""
    from trnrt.engine.spec.config import REFUSED_FLAGS, SpeculativeFlagError, check_speculative_flags

    ecfg = preset_config(args.preset)
    if ecfg is not None:
        try:
            check_speculative_flags(ecfg, [f for f in REFUSED_FLAGS if getattr(args, f)])
        except SpeculativeFlagError as e:
            raise typer.BadParameter(str(e), param_hint=e.field)
    for flag, value, least in (("--max-queued-requests", args.max_queued_requests, 0),
                               ("--max-queued-tokens", args.max_queued_tokens, 1)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
            raise typer.BadParameter(f"must be an integer >= {least}, got {value!r}", param_hint=flag)
    if args.enable_priority_scheduling and args.schedule_policy not in PRIORITY_POLICIES:
        raise typer.BadParameter(PRIORITY_POLICY_MESSAGE, param_hint="--schedule-policy")
    if args.enable_hierarchical_cache and args.disable_radix_cache:
        raise typer.BadParameter(HICACHE_RADIX_MESSAGE, param_hint="--enable-hierarchical-cache")
    if not args.hicache_ratio > 0:
        raise typer.BadParameter(f"must be > 0, got {args.hicache_ratio}", param_hint="--hicache-ratio")
    try:
        pcc = prefix_cache_config(args)
    except ValueError as e:  # PrefixCacheConfig's own checks (the flags' ranges are checked by click)
        raise typer.BadParameter(str(e), param_hint="--radix-eviction-policy-config")
    _check_budget(args, ecfg)
    if args.checkpoint_interval and ecfg is not None and int(ecfg.block_size):
        try:
            pcc.resolved_interval(int(ecfg.block_size))
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--checkpoint-interval")
    return pcc


def _check_budget(args: ServerArgs, ecfg: "EngineConfig | None") -> None:
    """--chunked-prefill-size within the preset's prefill buckets; no chunking only with a budget
    that holds a whole prompt (SGLang refuses the same)."""
    size = args.chunked_prefill_size
    if size is None:
        return
    if size == 0:
        raise typer.BadParameter("must be a positive number of tokens or -1 (no chunking)",
                                 param_hint="--chunked-prefill-size")
    if ecfg is None:
        return  # resolving the configs reports the preset
    if size == -1:
        need = min(args.context_length or ecfg.max_model_len, ecfg.max_model_len)
        if ecfg.max_prefill_tokens < need:  # a whole prompt must fit one prefill graph call
            raise typer.BadParameter(
                f"-1 (no chunking) needs a preset whose largest prefill graph holds the context length ({need} "
                f"tokens); preset {args.preset!r} stops at {ecfg.max_prefill_tokens}", param_hint="--chunked-prefill-size")
        if (args.max_num_batched_tokens or 0) < need:
            raise typer.BadParameter(
                f"-1 (no chunking) needs --max-num-batched-tokens >= the context length ({need})",
                param_hint="--chunked-prefill-size")
        return
    if size > ecfg.max_prefill_tokens:
        raise typer.BadParameter(
            f"{size} exceeds the preset's largest prefill graph ({ecfg.max_prefill_tokens} tokens; "
            f"prefill_token_buckets of preset {args.preset!r})", param_hint="--chunked-prefill-size")

