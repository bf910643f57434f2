"""`trnrt serve`: one engine behind the OpenAI-compatible HTTP API (Falcon on waitress).

Flag names follow SGLang's `launch_server` wherever SGLang has the flag. Nothing heavy is imported
at module level (this module is imported by `trnrt --help`).
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field
from typing import Annotated, Optional

import typer

from trnrt.cli import app


@dataclass
class ServeArgs:
    """Parsed `trnrt serve` options; `build_engine` receives this."""

    model: str | None = None
    tokenizer_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    served_model_name: str | None = None
    max_running_requests: int = 64
    max_queued_requests: int | None = None
    context_length: int | None = None
    tool_call_parser: str | None = "glm47"
    reasoning_parser: str | None = "glm45"
    threads: int | None = None
    preset: str = "default"
    drain_timeout_s: float = 30.0
    default_chat_template_kwargs: dict = field(default_factory=dict)
    scripted: bool = False
    scripted_step_delay_s: float = 0.0
    compiled: str | None = None
    backend: str | None = None
    stream_interval: int = 1
    # Prefix cache (SGLang's flag names; -> PrefixCacheConfig)
    disable_radix_cache: bool = False
    checkpoint_interval: int = 0
    num_checkpoints: int = 0
    radix_eviction_policy: str = "lru"
    radix_eviction_policy_config: dict = field(default_factory=dict)
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0
    hicache_size: int = 0  # GB (SGLang's unit); 0: --hicache-ratio decides
    hicache_write_policy: str = "write_through"
    # Scheduling policies (SGLang's flag names; -> SchedulerConfig)
    schedule_policy: str = "fcfs"
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    priority_scheduling_preemption_threshold: int = 10
    disable_priority_preemption: bool = False
    default_priority_value: int | None = None
    abort_on_priority_when_disabled: bool = False
    # Step budget (vLLM's --max-num-batched-tokens) and prefill chunk size (SGLang's
    # --chunked-prefill-size; -1 turns chunking off); None: the preset's defaults (resolve_configs)
    max_num_batched_tokens: int | None = None
    chunked_prefill_size: int | None = None
    # Without --compiled, run the artifact cache's graphs of this model and preset when valid
    disable_compiled_cache: bool = False
    # Structured outputs (xgrammar; the "structured_outputs" variant graphs)
    structured_outputs: bool = False
    # Penalties, logit_bias and min_tokens (the "penalties" variant graphs)
    penalties: bool = False
    # Prompt logprobs: completions echo + logprobs, vLLM prompt_logprobs, SGLang logprob_start_len
    # (the "prompt_logprobs" prefill variant graphs)
    prompt_logprobs: bool = False
    # The engine core in its own process (trnrt.engine.core.mp_client); None: yes for the model, no
    # for --scripted (the API tests' engine)
    engine_process: bool | None = None
    # Speculative decoding (SGLang's --speculative-* names, vLLM's --speculative-config JSON)
    speculative_algorithm: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_config: str | None = None
    speculative_min_accept_length: float | None = None

    def speculative(self):
        """The engine's SpeculativeConfig (None: off), the preset's included (an mtp-* preset
        turns it on: `preset_speculative`); raises SpeculativeConfigError naming the flag."""
        import json

        from trnrt.engine.spec.config import preset_speculative, resolve_speculative

        ecfg = None if self.scripted else _preset_config(self.preset)
        algorithm = self.speculative_algorithm
        if algorithm is None and self.speculative_config is None and ecfg is not None and ecfg.speculative_num_steps:
            algorithm = "NEXTN"  # the preset speculates: its flags need no --speculative-algorithm
        spec = resolve_speculative(algorithm, self.speculative_num_steps,
                                   self.speculative_eagle_topk, self.speculative_num_draft_tokens,
                                   self.speculative_config, self.speculative_min_accept_length)
        if ecfg is None:
            return spec
        try:
            vllm_steps = "num_speculative_tokens" in json.loads(self.speculative_config or "{}")
        except ValueError:
            vllm_steps = False
        steps_given = self.speculative_num_steps is not None or self.speculative_num_draft_tokens is not None or vllm_steps
        return preset_speculative(spec, ecfg, num_steps_given=steps_given,
                                  min_accept_given=self.speculative_min_accept_length is not None)

    @property
    def max_concurrent_requests(self) -> int:
        """Requests the HTTP layer holds at once. Without --max-queued-requests: 2 x running (the
        engine's queue is unbounded, SGLang's default, so the HTTP layer bounds it). With it, the
        engine enforces the limit (SGLang's 503 "The request queue is full.", or a displaced
        lower-priority request), so the HTTP layer admits QUEUE_OVERFLOW_HEADROOM more: those
        reach the engine and get its answer instead of the HTTP layer's."""
        if self.max_queued_requests is None:
            return 2 * self.max_running_requests
        return self.max_running_requests + self.max_queued_requests + QUEUE_OVERFLOW_HEADROOM

    def scheduler_overrides(self) -> dict:
        """The SchedulerConfig fields these options set (on top of the preset's resolved ones)."""
        return {
            "schedule_policy": self.schedule_policy,
            "enable_priority_scheduling": self.enable_priority_scheduling,
            "schedule_low_priority_values_first": self.schedule_low_priority_values_first,
            "priority_preemption_threshold": self.priority_scheduling_preemption_threshold,
            "disable_priority_preemption": self.disable_priority_preemption,
            "default_priority_value": self.default_priority_value,
            "abort_on_priority_when_disabled": self.abort_on_priority_when_disabled,
            "max_queued_requests": self.max_queued_requests,
            **self._budget_overrides(),
        }

    def _budget_overrides(self) -> dict:
        out = {}
        if self.max_num_batched_tokens is not None:
            out["max_num_batched_tokens"] = self.max_num_batched_tokens
        if self.chunked_prefill_size is not None:
            if self.chunked_prefill_size == -1:
                out["chunked_prefill"] = False
            else:
                out["max_prefill_chunk_tokens"] = self.chunked_prefill_size
        return out

    def prefix_cache_config(self):
        """The PrefixCacheConfig these options give (the radix cache is on unless disabled, as in SGLang)."""
        from trnrt.engine.cache.cache_config import PrefixCacheConfig

        return PrefixCacheConfig(
            enabled=not self.disable_radix_cache, checkpoint_interval=self.checkpoint_interval,
            num_checkpoints=self.num_checkpoints, eviction_policy=self.radix_eviction_policy, eviction_policy_config=dict(self.radix_eviction_policy_config),
            hierarchical=self.enable_hierarchical_cache, hicache_ratio=self.hicache_ratio,
            hicache_size_mb=self.hicache_size * 1024, write_policy=self.hicache_write_policy)


# Generation requests the HTTP layer admits beyond running + --max-queued-requests, so that the
# engine's own queue limit (and priority displacement) answers them.
QUEUE_OVERFLOW_HEADROOM = 8
SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random")
PRIORITY_POLICIES = ("fcfs", "lof")
EVICTION_POLICIES = ("lru", "lfu", "slru", "priority", "tlru")  # = trnrt.engine.cache.cache_config's
HICACHE_WRITE_POLICIES = ("write_through", "write_back")
# SGLang's startup errors, word for word.
PRIORITY_POLICY_MESSAGE = "To use priority scheduling, schedule_policy must be 'fcfs' or 'lof'."
HICACHE_RADIX_MESSAGE = ("The arguments enable-hierarchical-cache and disable-radix-cache are mutually exclusive "
                         "and cannot be used at the same time. Please use only one of them.")


def _choice(value: str, choices: tuple[str, ...], flag: str) -> str:
    if value not in choices:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(choices)}", param_hint=flag)
    return value


def check_cache_and_scheduling(args: ServeArgs) -> None:
    """The cross-flag rules of the prefix cache and scheduling options (usage errors, exit 2),
    checked before the model loads: SGLang's startup checks, and the checkpoint interval against
    the preset's block size. Also the speculative-decoding flags."""
    from trnrt.engine.spec.config import SpeculativeConfigError

    try:
        spec = args.speculative()
    except SpeculativeConfigError as e:
        raise typer.BadParameter(str(e), param_hint=e.field)
    if spec is not None and args.scripted:
        raise typer.BadParameter("speculative decoding needs the model (its MTP layer), not --scripted",
                                 param_hint="--speculative-algorithm")
    from trnrt.engine.spec.config import REFUSED_FLAGS, SpeculativeFlagError, check_speculative_flags

    ecfg = _preset_config(args.preset)
    if ecfg is not None:
        try:
            check_speculative_flags(ecfg, [f for f in REFUSED_FLAGS if getattr(args, f)])
        except SpeculativeFlagError as e:
            raise typer.BadParameter(str(e), param_hint=e.field)
    if args.enable_priority_scheduling and args.schedule_policy not in PRIORITY_POLICIES:
        raise typer.BadParameter(PRIORITY_POLICY_MESSAGE, param_hint="--schedule-policy")
    if args.enable_hierarchical_cache and args.disable_radix_cache:
        raise typer.BadParameter(HICACHE_RADIX_MESSAGE, param_hint="--enable-hierarchical-cache")
    if not args.hicache_ratio > 0:
        raise typer.BadParameter(f"must be > 0, got {args.hicache_ratio}", param_hint="--hicache-ratio")
    try:
        pcc = args.prefix_cache_config()
    except ValueError as e:  # PrefixCacheConfig's own checks (the flags' ranges are checked by click)
        raise typer.BadParameter(str(e), param_hint="--radix-eviction-policy-config")
    _check_budget(args)
    if args.checkpoint_interval:
        block_size = _preset_block_size(args.preset)
        if block_size:
            try:
                pcc.resolved_interval(block_size)
            except ValueError as e:
                raise typer.BadParameter(str(e), param_hint="--checkpoint-interval")


def _check_budget(args: ServeArgs) -> None:
    """--chunked-prefill-size within the preset's prefill buckets; no chunking only with a budget
    that holds a whole prompt (SGLang refuses the same)."""
    size = args.chunked_prefill_size
    if size is None:
        return
    if size == 0:
        raise typer.BadParameter("must be a positive number of tokens or -1 (no chunking)",
                                 param_hint="--chunked-prefill-size")
    try:
        from trnrt.config.presets import load_preset

        ecfg = load_preset(args.preset or "default")
    except Exception:
        return  # build_engine reports the preset
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


def _preset_config(preset: str):
    """The preset's EngineConfig (None when it cannot be read: build_engine reports that)."""
    try:
        from trnrt.config.presets import load_preset

        return load_preset(preset or "default")
    except Exception:
        return None


def _preset_block_size(preset: str) -> int | None:
    """The preset's page size (None when the preset cannot be read: build_engine reports that)."""
    try:
        from trnrt.config.presets import load_preset

        return int(load_preset(preset or "default").block_size)
    except Exception:
        return None


def _accepts(fn, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def resolve_model_dir(args: ServeArgs) -> str:
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


def use_engine_process(args: ServeArgs) -> bool:
    """Whether `trnrt serve` runs the engine core in its own process (see start_engine)."""
    return (not args.scripted) if args.engine_process is None else bool(args.engine_process)


def start_engine(args: ServeArgs):
    """The EngineClient `trnrt serve` runs: the engine of `build_engine(args)`, in a process of its
    own (trnrt.engine.core.mp_client.MPEngineClient: the HTTP threads and the engine thread then never
    share a GIL) when `use_engine_process(args)`, else in this process. Returns (engine,
    tokenizer_factory); raises what building the engine raised (its own type, from either process)."""
    if not use_engine_process(args):
        return build_engine(args)
    import logging

    from trnrt.engine.core.mp_client import MPEngineClient
    from trnrt.serve import hf_tokenizer_factory

    import threading

    log = logging.getLogger("trnrt.serve")
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


def engine_core_factory(args: ServeArgs):
    """The engine process's factory (trnrt.engine.core.core_proc): `build_engine(args)` over there."""
    engine, _ = build_engine(args)
    return engine


def build_engine(args: ServeArgs):
    """Construct the EngineClient for `trnrt serve`. Returns (engine, tokenizer_factory).

    The model directory is `resolve_model_dir(args)`; the tokenizer is read from
    --tokenizer-path or the model directory (one instance per waitress thread).

    HOOK: the real engine is wired here (`Engine.from_model_dir(model_dir, ...)`); it must satisfy
    trnrt.engine.core.client.EngineClient. `--scripted` serves the same Engine with a scripted runner
    in place of the model (`Engine.scripted` with `echo_script`; only a tokenizer is read).
    """
    from trnrt.serve import hf_tokenizer_factory

    model_dir = resolve_model_dir(args)
    tokenizer_factory = hf_tokenizer_factory(args.tokenizer_path or model_dir)
    if args.scripted:
        import dataclasses

        from trnrt.engine.core.engine import Engine
        from trnrt.engine.runner.scripted_runner import echo_script

        kw = {}
        if _accepts(Engine.scripted, "prefix_cache_config"):
            kw["prefix_cache_config"] = args.prefix_cache_config()
        max_model_len = args.context_length or 4096
        common = dict(served_model_name=args.served_model_name or "trnrt-tiny", model_path=model_dir,
                      max_model_len=max_model_len, max_running_requests=args.max_running_requests,
                      step_delay_s=args.scripted_step_delay_s, stream_interval=args.stream_interval,
                      submit_log_size=0, structured_outputs=args.structured_outputs,
                      penalties=args.penalties, prompt_logprobs=args.prompt_logprobs)
        if _accepts(Engine.scripted, "scheduler_config"):
            from trnrt.engine.core.engine import resolve_configs

            _, scfg = resolve_configs(None, preset="default", max_running_requests=args.max_running_requests,
                                      context_length=max_model_len)
            scfg = dataclasses.replace(scfg, **args.scheduler_overrides())
            engine = Engine.scripted(tokenizer_factory(), echo_script, scheduler_config=scfg, **common, **kw)
        else:  # an engine without the keyword: the same engine rebuilt with the scheduling options
            engine = Engine.scripted(tokenizer_factory(), echo_script, start=False, **common, **kw)
            scfg = dataclasses.replace(engine.scheduler_config, **args.scheduler_overrides())
            engine = Engine(engine.runner, engine.tokenizer, engine.model_info, engine.engine_config, scfg,
                            stream_interval=args.stream_interval, submit_log_size=0, **kw)
            engine.startup_time_s = 0.0
        return engine, tokenizer_factory
    try:
        from trnrt.engine.core.engine import Engine  # the real engine (written against the same contract)
    except ModuleNotFoundError as e:
        if e.name != "trnrt.engine.core.engine":
            raise
        typer.echo("trnrt serve: the engine (trnrt.engine.core.engine) is not available in this build", err=True)
        raise typer.Exit(1)

    loader = None
    if args.compiled:
        from trnrt.compile import load_compiled

        def loader(model, state, engine_config):
            return load_compiled(args.compiled, model, state, engine_config, backend=args.backend)
    elif not args.disable_compiled_cache:
        loader = _cached_loader(model_dir, args)

    import dataclasses

    from trnrt.engine.core.engine import resolve_configs

    # The scheduler config from_model_dir would resolve, with the scheduling options on top.
    _, scfg = resolve_configs(None, preset=args.preset, max_running_requests=args.max_running_requests,
                              context_length=args.context_length, compiled=loader is not None)
    scfg = dataclasses.replace(scfg, **args.scheduler_overrides())
    kw = {}
    if _accepts(Engine.from_model_dir, "prefix_cache_config"):
        kw["prefix_cache_config"] = args.prefix_cache_config()
    engine = Engine.from_model_dir(model_dir, preset=args.preset, max_running_requests=args.max_running_requests,
                                   context_length=args.context_length, scheduler_config=scfg,
                                   served_model_name=args.served_model_name,
                                   compiled_loader=loader, compiled_backend=args.backend or "cpu",
                                   stream_interval=args.stream_interval, structured_outputs=args.structured_outputs,
                                   penalties=args.penalties, prompt_logprobs=args.prompt_logprobs,
                                   speculative=args.speculative(), **kw)
    return engine, tokenizer_factory


def _cached_loader(model_dir: str, args: ServeArgs):
    """A compiled-graph loader over the artifact cache (`trnrt compile` without --out writes
    there), or None when the cache holds nothing for this model, preset and backend. Artifacts
    the loader refuses (another model config, preset settings, torch or graph code) are logged and
    the engine runs eagerly: a stale cache never stops a server."""
    import logging

    from trnrt.compile.artifact_cache import cached_artifacts
    from trnrt.config.presets import PresetError, read_preset

    log = logging.getLogger("trnrt.serve")
    try:
        preset = read_preset(args.preset or "default").name
    except PresetError:
        return None  # build_engine reports the preset
    backend = args.backend or "cpu"
    cached = cached_artifacts(model_dir, preset, backend)
    if cached is None:
        log.info("no compiled graphs of preset %s (%s) in the artifact cache: running eagerly "
                 "(`trnrt compile --preset %s` builds them once)", preset, backend, preset)
        return None

    def loader(model, state, engine_config):
        from trnrt.compile import load_compiled
        from trnrt.compile.loader import CompiledArtifactError

        try:
            graphs = load_compiled(cached, model, state, engine_config, backend=backend)
        except CompiledArtifactError as e:
            log.warning("compiled graphs in the artifact cache not used, running eagerly: %s", e)
            return {}
        log.info("running the compiled graphs of preset %s from the artifact cache (%s)", preset, cached)
        return graphs

    return loader


def _parser_choice(value: str | None, choices: tuple[str, ...], flag: str) -> str | None:
    if value is None or value.lower() in ("none", ""):
        return None
    if value == "glm" and flag == "--tool-call-parser":
        value = "glm45"  # SGLang's alias
    if value not in choices:
        raise typer.BadParameter(f"must be one of {', '.join(choices)} or none", param_hint=flag)
    return value


def _csv(value: str | None) -> tuple[str, ...]:
    return tuple(v.strip() for v in (value or "").split(",") if v.strip())


def _resolve_api_key(api_key: str | None, api_key_file: str | None) -> str | None:
    """--api-key (or TRNRT_API_KEY) or --api-key-file; both is a usage error."""
    if api_key_file is None:
        return api_key or None
    if api_key:
        raise typer.BadParameter("give --api-key (or TRNRT_API_KEY) or --api-key-file, not both",
                                 param_hint="--api-key-file")
    try:
        with open(api_key_file, encoding="utf-8") as f:
            key = f.readline().strip()
    except OSError as e:
        raise typer.BadParameter(f"cannot read it: {e.strerror}", param_hint="--api-key-file")
    if not key:
        raise typer.BadParameter("the file holds no key", param_hint="--api-key-file")
    return key


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


def _serve_dp(ctx, dp: int, router_policy: str, host: str, port: int, api_key, api_key_file, admin_api_key,
              max_running_requests: int, drain_timeout: float, log_level: str) -> int:
    """`--dp N`: the engines and sglang-router under trnrt.serve.dp's supervisor."""
    from trnrt.serve import dp as dp_mod

    if router_policy not in dp_mod.ROUTER_POLICIES:
        raise typer.BadParameter(f"must be one of {', '.join(dp_mod.ROUTER_POLICIES)}", param_hint="--router-policy")
    if not dp_mod.router_available():
        typer.secho(f"error: {dp_mod.INSTALL_HINT}", err=True, fg="red")
        raise typer.Exit(2)
    _check_port_free(host, port)
    port = port or dp_mod.free_port(host)
    engine_args = dp_mod.engine_args_from_context(ctx, drop=(
        "dp", "router_policy", "host", "port", "api_key", "api_key_file", "admin_api_key"))
    return dp_mod.run(dp_mod.DPConfig(
        dp=dp, engine_args=engine_args, host=host, port=port, router_policy=router_policy,
        max_running_requests=max_running_requests, drain_timeout_s=drain_timeout, log_level=log_level,
        api_key=_resolve_api_key(api_key, api_key_file), admin_api_key=admin_api_key or None))


@app.command("serve")
def serve(
    ctx: typer.Context,
    model: Annotated[Optional[str], typer.Option("--model", "--model-path", help="Model directory (HF layout). Default: the embedded tiny checkpoint.")] = None,
    tokenizer_path: Annotated[Optional[str], typer.Option("--tokenizer-path", help="Tokenizer directory (default: the model's).")] = None,
    host: Annotated[str, typer.Option("--host", help="Interface to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port (0: any free port).", min=0, max=65535)] = 30000,
    dp: Annotated[int, typer.Option("--dp", "--data-parallel-size", help="Run N engines (one model each, on 127.0.0.1) behind sglang-router on --host/--port (SGLang's flag; needs the router extra: `pip install -e '.[router]'` or `pip install sglang-router==0.3.2`). See docs/DEPLOY.md.", min=1)] = 1,
    router_policy: Annotated[str, typer.Option("--router-policy", help="With --dp: the router's policy, cache_aware | round_robin | random | power_of_two | manual (manual: the X-SMG-Routing-Key header keeps a conversation on one engine).")] = "cache_aware",
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="TRNRT_API_KEY", show_envvar=True, help="Require `Authorization: Bearer KEY` (all routes but /health). Prefer --api-key-file or TRNRT_API_KEY: a command-line key is visible to every local user in the process list.")] = None,
    api_key_file: Annotated[Optional[str], typer.Option("--api-key-file", help="Read the API key from this file (first line).", metavar="FILE")] = None,
    admin_api_key: Annotated[Optional[str], typer.Option("--admin-api-key", envvar="TRNRT_ADMIN_API_KEY", show_envvar=True, help="The key /flush_cache and /abort_request need instead of --api-key (SGLang's flag); other routes are unaffected.")] = None,
    served_model_name: Annotated[Optional[str], typer.Option("--served-model-name", help="Model id in the API.")] = None,
    max_running_requests: Annotated[int, typer.Option("--max-running-requests", help="Requests decoding at once.", min=1)] = 64,
    max_queued_requests: Annotated[Optional[int], typer.Option("--max-queued-requests", help="Most requests waiting in the engine (SGLang's flag; default: unlimited, the HTTP layer then admits 2 x running). Past it, 503 \"The request queue is full.\" with Retry-After and X-Trnrt-Queue-Full headers.", min=0)] = None,
    context_length: Annotated[Optional[int], typer.Option("--context-length", help="Max prompt + completion tokens.", min=2)] = None,
    tool_call_parser: Annotated[str, typer.Option("--tool-call-parser", help="glm47 | glm45 (alias glm) | none.")] = "glm47",
    reasoning_parser: Annotated[str, typer.Option("--reasoning-parser", help="glm45 | none.")] = "glm45",
    threads: Annotated[Optional[int], typer.Option("--threads", help="waitress worker threads (default: admitted generation requests + 8).", min=1)] = None,
    preset: Annotated[str, typer.Option("--preset", help="Graph-shaping preset (presets/*.toml).")] = "default",
    default_chat_template_kwargs: Annotated[Optional[str], typer.Option("--default-chat-template-kwargs", help="JSON object merged under each request's chat_template_kwargs.")] = None,
    drain_timeout: Annotated[float, typer.Option("--drain-timeout", help="Seconds to let in-flight requests finish on SIGINT/SIGTERM.", min=0)] = 30.0,
    log_level: Annotated[str, typer.Option("--log-level", help="debug | info | warning | error | critical (any case).")] = "info",
    structured_outputs: Annotated[bool, typer.Option("--structured-outputs", help="Serve structured outputs (JSON schema, regex, EBNF, choice, structural tags; tool_choice required/named) with xgrammar: needs `pip install 'trnrt[grammar]'`, and with --compiled artifacts built with `trnrt compile --structured-outputs`.")] = False,
    penalties: Annotated[bool, typer.Option("--penalties", help="Serve repetition_penalty, frequency_penalty, presence_penalty, logit_bias and min_tokens (the penalties variant graphs; with --compiled, artifacts built with `trnrt compile --penalties`).")] = False,
    prompt_logprobs: Annotated[bool, typer.Option("--prompt-logprobs", help="Serve prompt logprobs: /v1/completions echo with logprobs, vLLM's prompt_logprobs (completions, chat) and /generate's logprob_start_len >= 0 (the prompt_logprobs prefill variant graphs; with --compiled, artifacts compiled with that flag). Such requests bypass the prefix cache.")] = False,
    scripted: Annotated[bool, typer.Option("--scripted", hidden=True, help="Serve a scripted engine (tests).")] = False,
    scripted_step_delay: Annotated[float, typer.Option("--scripted-step-delay", hidden=True, help="Seconds per scripted decode step.")] = 0.0,
    compiled: Annotated[Optional[str], typer.Option("--compiled", help="Run the graphs `trnrt compile --out DIR` built for --preset (refused if built from another model, preset or graph).", metavar="DIR")] = None,
    backend: Annotated[Optional[str], typer.Option("--backend", help="Backend of the --compiled artifacts (cpu | cuda | neuron; default: the one found).")] = None,
    stream_interval: Annotated[int, typer.Option("--stream-interval", help="Streamed responses get a chunk every N tokens (SGLang's flag); non-streamed ones wait for the end.", min=1)] = 1,
    incremental_streaming_output: Annotated[bool, typer.Option("--incremental-streaming-output", help="/generate streams carry deltas instead of cumulative text (SGLang's flag).")] = False,
    stream_response_default_include_usage: Annotated[bool, typer.Option("--stream-response-default-include-usage", help="Every streamed /v1 response ends with the usage chunk, as if stream_options.include_usage were true (SGLang's flag).")] = False,
    allowed_origins: Annotated[Optional[str], typer.Option("--allowed-origins", help="Comma-separated browser origins allowed to call the server (default: none but its own; * for any).")] = None,
    allowed_hosts: Annotated[Optional[str], typer.Option("--allowed-hosts", help="Comma-separated Host names the server answers to (default: loopback and --host; any when bound to 0.0.0.0).")] = None,
    trust_request_chat_template: Annotated[bool, typer.Option("--trust-request-chat-template", help="Render a chat request's own chat_template (vLLM's flag), in a sandbox bounded in time and memory; without it such a request is a 400. For trusted clients only.")] = False,
    disable_radix_cache: Annotated[bool, typer.Option("--disable-radix-cache/", help="Turn the radix prefix cache off (SGLang's flag; on by default).")] = False,
    checkpoint_interval: Annotated[int, typer.Option("--checkpoint-interval", help="Tokens between the prefix cache's state checkpoints, the granularity of prefix reuse; a multiple of the preset's block size (0: the engine picks).", min=0)] = 0,
    num_checkpoints: Annotated[int, typer.Option("--num-checkpoints", help="Device state checkpoints the prefix cache keeps (each one slot's KDA state, conv window and indexer tail; the start-up log says the memory). 0: 2 x --max-running-requests.", min=0)] = 0,
    radix_eviction_policy: Annotated[str, typer.Option("--radix-eviction-policy", help="Prefix-cache eviction: lru | lfu | slru | priority | tlru (SGLang's flag).")] = "lru",
    radix_eviction_policy_config: Annotated[Optional[str], typer.Option("--radix-eviction-policy-config", help="JSON object of eviction-policy parameters, e.g. '{\"protected_threshold\": 4}' for slru.", metavar="JSON")] = None,
    enable_hierarchical_cache: Annotated[bool, typer.Option("--enable-hierarchical-cache/", "--enable-hicache/", help="Keep prefix-cache pages evicted from the device in a host pool (SGLang's HiCache).")] = False,
    hicache_ratio: Annotated[float, typer.Option("--hicache-ratio", help="Host pool size as a multiple of the device pool (with --enable-hierarchical-cache).")] = 2.0,
    hicache_size: Annotated[int, typer.Option("--hicache-size", help="Host pool size in GB; overrides --hicache-ratio when > 0.", min=0)] = 0,
    hicache_write_policy: Annotated[str, typer.Option("--hicache-write-policy", help="write_through (copy to the host on insert) | write_back (copy on eviction).")] = "write_through",
    schedule_policy: Annotated[str, typer.Option("--schedule-policy", help="Waiting-queue order: fcfs | lpm | dfs-weight | lof | random (SGLang's flag; lpm and dfs-weight need the radix cache, else fcfs).")] = "fcfs",
    enable_priority_scheduling: Annotated[bool, typer.Option("--enable-priority-scheduling/", help="Order the queue and preempt by each request's `priority` (with --schedule-policy fcfs or lof).")] = False,
    schedule_low_priority_values_first: Annotated[bool, typer.Option("--schedule-low-priority-values-first/", help="Smaller priority values are preferred (default: larger ones).")] = False,
    priority_scheduling_preemption_threshold: Annotated[int, typer.Option("--priority-scheduling-preemption-threshold", help="A waiting request preempts a running one only when its priority is better by more than this.")] = 10,
    disable_priority_preemption: Annotated[bool, typer.Option("--disable-priority-preemption/", help="Priority scheduling orders the queue but never preempts a running request.")] = False,
    default_priority_value: Annotated[Optional[int], typer.Option("--default-priority-value", help="The priority of a request that sets none (default: the least preferred).")] = None,
    abort_on_priority_when_disabled: Annotated[bool, typer.Option("--abort-on-priority-when-disabled/", help="Without priority scheduling, refuse (503) a request that sets `priority` instead of ignoring the field.")] = False,
    enable_response_store: Annotated[bool, typer.Option("--enable-response-store/", help="Keep /v1/responses answers for previous_response_id, GET /v1/responses/{id} and cancel (SGLang's flag), in a bounded in-memory store.")] = False,
    response_store_size_mb: Annotated[float, typer.Option("--response-store-size-mb", help="Size bound of the response store in MB (least recently used responses are evicted).", min=0.001)] = 256.0,
    response_store_ttl: Annotated[float, typer.Option("--response-store-ttl", help="Seconds a stored response is kept after its last write (0: until evicted for size).", min=0)] = 3600.0,
    max_num_batched_tokens: Annotated[Optional[int], typer.Option("--max-num-batched-tokens", "--max-prefill-tokens", help="Tokens one engine step may compute, decodes and prefill chunks together (vLLM's flag; SGLang's --max-prefill-tokens is accepted as the same budget). Default: the largest decode batch + 4 x the largest prefill chunk.", min=1)] = None,
    disable_compiled_cache: Annotated[bool, typer.Option("--disable-compiled-cache/", help="Without --compiled: run eagerly even when `trnrt compile` left graphs of this model and preset in the artifact cache (default: use them when valid).")] = False,
    speculative_algorithm: Annotated[Optional[str], typer.Option("--speculative-algorithm", help="NEXTN (alias EAGLE, MTP): draft with the model's own MTP layer and verify the drafts in one target pass (SGLang's flag). Requests with a grammar, penalties, logprobs, prompt logprobs, a thinking budget or n > 1 run plain steps beside them; speculative requests bypass the prefix cache. Eager draft/verify steps.")] = None,
    speculative_num_steps: Annotated[Optional[int], typer.Option("--speculative-num-steps", help="Drafts per verify (1..8; default 3).")] = None,
    speculative_eagle_topk: Annotated[Optional[int], typer.Option("--speculative-eagle-topk", help="Only 1 (chain drafting).")] = None,
    speculative_num_draft_tokens: Annotated[Optional[int], typer.Option("--speculative-num-draft-tokens", help="--speculative-num-steps + 1 with top-k 1 (SGLang's flag; sets the steps when they are not given).")] = None,
    speculative_config: Annotated[Optional[str], typer.Option("--speculative-config", help="vLLM's spelling: a JSON object {\"method\": \"mtp\", \"num_speculative_tokens\": k}.")] = None,
    speculative_min_accept_length: Annotated[Optional[float], typer.Option("--speculative-min-accept-length", help="Dynamic speculation (trnrt's): the least tokens per verify (accepted drafts + 1) that pay, a floor under the break-even the engine measures on itself; after 4 verifies below the line a request goes on with plain decode steps (after one while the engine's last 100 verifies are below it, and new requests then start plain but for probes). Default 0: always speculate.")] = None,
    engine_process: Annotated[Optional[bool], typer.Option("--engine-process/--engine-in-process", help="Run the engine core (scheduler, model runner, detokenizer) in a process of its own, as SGLang does, so HTTP work and engine steps never wait for each other on one GIL (default: on; --engine-in-process runs it on a thread of the server's process).")] = None,
    chunked_prefill_size: Annotated[Optional[int], typer.Option("--chunked-prefill-size", help="Most tokens in one prefill chunk (SGLang's flag), at most the preset's largest prefill bucket (the default); -1: no chunking (needs --max-num-batched-tokens >= the context length).", min=-1)] = None,
) -> None:
    """Serve the HTTP API; see docs/API.md for every route. The main families:

    OpenAI: /v1/* (/v1/models, /v1/completions, /v1/chat/completions, ...).
    SGLang native: /generate, /tokenize, /detokenize.
    Admin: /server_info, /model_info, /v1/loads, /get_load, /flush_cache, /abort_request.
    Health and stats: /health, /health_generate, /v1/stats, /metrics.
    """
    import logging

    if log_level.lower() not in ("debug", "info", "warning", "error", "critical"):
        raise typer.BadParameter("must be one of debug, info, warning, error, critical", param_hint="--log-level")
    logging.basicConfig(level=getattr(logging, log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("trnrt.serve")
    if dp > 1:
        raise typer.Exit(_serve_dp(ctx, dp, router_policy, host, port, api_key, api_key_file, admin_api_key,
                                   max_running_requests, drain_timeout, log_level))
    try:
        kwargs = json.loads(default_chat_template_kwargs) if default_chat_template_kwargs else {}
    except ValueError as e:
        raise typer.BadParameter(f"not JSON: {e}", param_hint="--default-chat-template-kwargs")
    if not isinstance(kwargs, dict):
        raise typer.BadParameter("must be a JSON object", param_hint="--default-chat-template-kwargs")
    api_key = _resolve_api_key(api_key, api_key_file)
    try:
        from trnrt.engine.cache.cache_config import PrefixCacheConfig

        policy_config = PrefixCacheConfig.parse_policy_config(radix_eviction_policy_config)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--radix-eviction-policy-config")
    args = ServeArgs(
        model=model, tokenizer_path=tokenizer_path, host=host, port=port, api_key=api_key,
        served_model_name=served_model_name, max_running_requests=max_running_requests,
        max_queued_requests=max_queued_requests, context_length=context_length,
        tool_call_parser=_parser_choice(tool_call_parser, ("glm47", "glm45"), "--tool-call-parser"),
        reasoning_parser=_parser_choice(reasoning_parser, ("glm45",), "--reasoning-parser"),
        threads=threads, preset=preset, drain_timeout_s=drain_timeout, default_chat_template_kwargs=kwargs,
        scripted=scripted, scripted_step_delay_s=scripted_step_delay, compiled=compiled, backend=backend,
        stream_interval=stream_interval,
        disable_radix_cache=disable_radix_cache, checkpoint_interval=checkpoint_interval,
        num_checkpoints=num_checkpoints, radix_eviction_policy=_choice(radix_eviction_policy, EVICTION_POLICIES, "--radix-eviction-policy"),
        radix_eviction_policy_config=policy_config, enable_hierarchical_cache=enable_hierarchical_cache,
        hicache_ratio=hicache_ratio, hicache_size=hicache_size,
        hicache_write_policy=_choice(hicache_write_policy, HICACHE_WRITE_POLICIES, "--hicache-write-policy"),
        schedule_policy=_choice(schedule_policy, SCHEDULE_POLICIES, "--schedule-policy"),
        enable_priority_scheduling=enable_priority_scheduling,
        schedule_low_priority_values_first=schedule_low_priority_values_first,
        priority_scheduling_preemption_threshold=priority_scheduling_preemption_threshold,
        disable_priority_preemption=disable_priority_preemption, default_priority_value=default_priority_value,
        abort_on_priority_when_disabled=abort_on_priority_when_disabled,
        max_num_batched_tokens=max_num_batched_tokens, chunked_prefill_size=chunked_prefill_size,
        disable_compiled_cache=disable_compiled_cache,
        structured_outputs=structured_outputs, penalties=penalties, prompt_logprobs=prompt_logprobs,
        engine_process=engine_process, speculative_algorithm=speculative_algorithm,
        speculative_num_steps=speculative_num_steps, speculative_eagle_topk=speculative_eagle_topk,
        speculative_num_draft_tokens=speculative_num_draft_tokens, speculative_config=speculative_config,
        speculative_min_accept_length=speculative_min_accept_length,
    )
    check_cache_and_scheduling(args)
    _check_port_free(host, port)  # before the model loads (seconds), not after
    from trnrt.serve import ServeSettings, create_app
    from trnrt.serve.server import run

    try:
        engine, tokenizer_factory = start_engine(args)
    except ValueError as e:  # a bad checkpoint, preset or compiled artifact: say which, exit 2
        typer.secho(f"error: {e}", err=True, fg="red")
        raise typer.Exit(2)
    except RuntimeError as e:
        from trnrt.engine.sample.grammar import GrammarUnavailableError

        if not isinstance(e, GrammarUnavailableError):
            raise
        typer.secho(f"error: --structured-outputs: {e}", err=True, fg="red")
        raise typer.Exit(2)
    settings = ServeSettings(
        served_model_name=args.served_model_name, api_key=args.api_key, context_length=args.context_length,
        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
        max_concurrent_requests=args.max_concurrent_requests,
        default_chat_template_kwargs=args.default_chat_template_kwargs,
        incremental_streaming_output=incremental_streaming_output,
        stream_response_default_include_usage=stream_response_default_include_usage,
        allowed_origins=_csv(allowed_origins), allowed_hosts=_csv(allowed_hosts) or None, bind_host=args.host,
        tokenizer_path=args.tokenizer_path, admin_api_key=admin_api_key or None,
        trust_request_chat_template=trust_request_chat_template,
        enable_priority_scheduling=args.enable_priority_scheduling,
        abort_on_priority_when_disabled=args.abort_on_priority_when_disabled,
        enable_hierarchical_cache=args.enable_hierarchical_cache and not args.disable_radix_cache,
        enable_response_store=enable_response_store, response_store_size_mb=response_store_size_mb,
        response_store_ttl_s=response_store_ttl,
        # reported by /server_info; keys never are
        server_args={k: v for k, v in vars(args).items() if "api_key" not in k},
    )
    wsgi = create_app(engine, tokenizer_factory, settings)
    name = settings.served_model_name or engine.model_info.served_model_name
    code = run(wsgi, engine, host=args.host, port=args.port, threads=args.threads,
               drain_timeout_s=args.drain_timeout_s,
               on_ready=lambda url: log.info("trnrt serve: ready at %s (model %s)", url, name))
    raise typer.Exit(code)
