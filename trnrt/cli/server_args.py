"""ServerArgs: every `trnrt serve` option, parsed, in one dataclass (SGLang's `ServerArgs`).

The fields are grouped as the options are (trnrt.cli.serve_options, SGLang's groups) and named as
the Typer command's parameters, so `ServerArgs.from_cli(ctx.params)` fills it in one place: JSON
options parsed, choices checked, the API key read from its file. Turning a ServerArgs into the
engine's and the server's configs is trnrt.cli.server_configs.resolve_server_configs. Nothing heavy
is imported here (`trnrt --help` imports this module).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

import typer

# Generation requests the HTTP layer admits beyond running + --max-queued-requests, so that the
# engine's own queue limit (and priority displacement) answers them.
QUEUE_OVERFLOW_HEADROOM = 8
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# = trnrt.engine.sched.schedule_policy's SCHEDULE_POLICIES and SCHEDULE_POLICY_ALIASES (a test checks)
SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random", "shortest-prefill-first")
SCHEDULE_POLICY_ALIASES = {"spf": "shortest-prefill-first"}
EVICTION_POLICIES = ("lru", "lfu", "slru", "priority", "tlru")  # = trnrt.engine.cache.cache_config's
HICACHE_WRITE_POLICIES = ("write_through", "write_back")
TOOL_CALL_PARSERS = ("glm47", "glm45")
REASONING_PARSERS = ("glm45",)
QUANTIZATIONS = ("fp8",)  # = trnrt.models.glm5_next.fp8.load.QUANTIZATIONS (less None)
KV_CACHE_DTYPES = ("auto", "bf16", "fp8_e4m3")  # = trnrt.models.glm5_next.fp8.kv_dtype.KV_CACHE_DTYPES


@dataclass
class ServerArgs:
    """Parsed `trnrt serve` options (field = the option's name with `_`; see --help for each).
    The serve command builds it with `from_cli`; tests build it directly."""

    # Model and tokenizer
    model: str | None = None
    tokenizer_path: str | None = None
    context_length: int | None = None
    quantization: str | None = None  # fp8: online block quantization (an FP8 checkpoint needs none)
    kv_cache_dtype: str = "auto"
    # Graphs: preset and compiled artifacts (without --compiled, the artifact cache's graphs of
    # this model and preset run when valid, unless disable_compiled_cache)
    preset: str = "default"
    compiled: str | None = None
    backend: str | None = None
    disable_compiled_cache: bool = False
    # HTTP server
    host: str = "127.0.0.1"
    port: int = 30000
    threads: int | None = None
    drain_timeout_s: float = 30.0
    allowed_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()  # empty: loopback and --host
    # Memory and scheduling (SGLang's names; -> SchedulerConfig). The step budget (vLLM's
    # --max-num-batched-tokens) and prefill chunk size (SGLang's --chunked-prefill-size; -1
    # turns chunking off): None, the preset's defaults (resolve_configs)
    max_running_requests: int = 64
    max_queued_requests: int | None = None
    max_queued_tokens: int | None = None
    max_num_batched_tokens: int | None = None
    chunked_prefill_size: int | None = None
    schedule_policy: str = "fcfs"
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    priority_scheduling_preemption_threshold: int = 10
    disable_priority_preemption: bool = False
    default_priority_value: int | None = None
    abort_on_priority_when_disabled: bool = False
    # Runtime options. engine_process: the engine core in its own process
    # (trnrt.engine.core.mp_client); None: yes for the model, no for --scripted (the API tests' engine)
    stream_interval: int = 1
    incremental_streaming_output: bool = False
    engine_process: bool | None = None
    scripted: bool = False
    scripted_step_delay_s: float = 0.0
    # Logging
    log_level: str = "info"
    # API related (api_key: --api-key, TRNRT_API_KEY or read from --api-key-file)
    api_key: str | None = None
    api_key_file: str | None = None
    admin_api_key: str | None = None
    served_model_name: str | None = None
    tool_call_parser: str | None = "glm47"
    reasoning_parser: str | None = "glm45"
    default_chat_template_kwargs: dict = field(default_factory=dict)
    trust_request_chat_template: bool = False
    stream_response_default_include_usage: bool = False
    enable_response_store: bool = False
    response_store_size_mb: float = 256.0
    response_store_ttl: float = 3600.0
    # Data parallelism (trnrt.serve.dp)
    dp: int = 1
    router_policy: str = "cache_aware"
    # Tensor and expert parallelism (trnrt.engine.core.tp_config.ParallelConfig)
    tp_size: int = 1
    ep_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    # Sampling features: each one the variant graphs of its name. Structured outputs (xgrammar);
    # penalties, logit_bias and min_tokens; prompt logprobs (completions echo + logprobs, vLLM
    # prompt_logprobs, SGLang logprob_start_len)
    structured_outputs: bool = False
    penalties: bool = False
    prompt_logprobs: bool = False
    # Speculative decoding (SGLang's --speculative-* names, vLLM's --speculative-config JSON;
    # -> SpeculativeConfig)
    speculative_algorithm: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_config: str | None = None
    speculative_min_accept_length: float | None = None
    # Prefix cache (SGLang's flag names; -> PrefixCacheConfig)
    disable_radix_cache: bool = False
    checkpoint_interval: int = 0
    num_checkpoints: int = 0
    radix_eviction_policy: str = "lru"
    radix_eviction_policy_config: dict = field(default_factory=dict)
    # Hierarchical cache (SGLang's HiCache; -> PrefixCacheConfig)
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0
    hicache_size: int = 0  # GB (SGLang's unit); 0: --hicache-ratio decides
    hicache_write_policy: str = "write_through"

    def __post_init__(self) -> None:
        # the canonical policy name, so /server_info reports SGLang's name for an alias
        self.schedule_policy = SCHEDULE_POLICY_ALIASES.get(self.schedule_policy, self.schedule_policy)

    @classmethod
    def from_cli(cls, params: dict) -> "ServerArgs":
        """The ServerArgs of the serve command's raw parameters (click's `ctx.params`): JSON
        parsed, choices checked, the API key file read. Usage errors (typer.BadParameter, exit 2)
        name the flag."""
        from trnrt.engine.cache.cache_config import PrefixCacheConfig

        raw = {f.name: params[f.name] for f in fields(cls) if f.name in params}
        raw["default_chat_template_kwargs"] = _json_object(params.get("default_chat_template_kwargs"),
                                                           "--default-chat-template-kwargs")
        raw["api_key"] = resolve_api_key(params.get("api_key"), params.get("api_key_file"))
        try:
            raw["radix_eviction_policy_config"] = PrefixCacheConfig.parse_policy_config(
                params.get("radix_eviction_policy_config"))
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--radix-eviction-policy-config")
        for name, choices in (("tool_call_parser", TOOL_CALL_PARSERS), ("reasoning_parser", REASONING_PARSERS)):
            if name in raw:
                raw[name] = _parser_choice(raw[name], choices, "--" + name.replace("_", "-"))
        for name, choices in (("radix_eviction_policy", EVICTION_POLICIES),
                              ("hicache_write_policy", HICACHE_WRITE_POLICIES),
                              ("kv_cache_dtype", KV_CACHE_DTYPES),
                              ("schedule_policy", SCHEDULE_POLICIES + tuple(SCHEDULE_POLICY_ALIASES))):
            if name in raw:
                _choice(raw[name], choices, "--" + name.replace("_", "-"))
        if raw.get("quantization") is not None:
            raw["quantization"] = _parser_choice(raw["quantization"], QUANTIZATIONS, "--quantization")
        for name in ("allowed_origins", "allowed_hosts"):
            if name in raw:
                raw[name] = csv(raw[name])
        return cls(**raw)

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

    def parallel_config(self):
        """The ParallelConfig of --tp-size, --ep-size, --nnodes, --node-rank, --dist-init-addr
        (typer.BadParameter naming the flag when they do not fit together)."""
        from trnrt.engine.core.tp_config import ParallelConfig

        try:
            return ParallelConfig(tp_size=self.tp_size, ep_size=self.ep_size, nnodes=self.nnodes,
                                  node_rank=self.node_rank, dist_init_addr=self.dist_init_addr)
        except ValueError as e:
            flag = str(e).split()[0] if str(e).startswith("--") else "--tp-size"
            raise typer.BadParameter(str(e), param_hint=flag)

    def reported(self) -> dict:
        """The options /server_info reports (ServeSettings.server_args): every field but the keys."""
        return {f.name: getattr(self, f.name) for f in fields(self) if "api_key" not in f.name}


def check_log_level(log_level: str) -> str:
    if log_level.lower() not in LOG_LEVELS:
        raise typer.BadParameter(f"must be one of {', '.join(LOG_LEVELS)}", param_hint="--log-level")
    return log_level


def _json_object(value: str | None, flag: str) -> dict:
    try:
        out = json.loads(value) if value else {}
    except ValueError as e:
        raise typer.BadParameter(f"not JSON: {e}", param_hint=flag)
    if not isinstance(out, dict):
        raise typer.BadParameter("must be a JSON object", param_hint=flag)
    return out


def _choice(value: str, choices: tuple[str, ...], flag: str) -> str:
    if value not in choices:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(choices)}", param_hint=flag)
    return value


def _parser_choice(value: str | None, choices: tuple[str, ...], flag: str) -> str | None:
    if value is None or value.lower() in ("none", ""):
        return None
    if value == "glm" and flag == "--tool-call-parser":
        value = "glm45"  # SGLang's alias
    if value not in choices:
        raise typer.BadParameter(f"must be one of {', '.join(choices)} or none", param_hint=flag)
    return value


def csv(value: str | tuple | None) -> tuple[str, ...]:
    """A comma-separated option's values (a tuple passes through)."""
    if isinstance(value, tuple):
        return value
    return tuple(v.strip() for v in (value or "").split(",") if v.strip())


def resolve_api_key(api_key: str | None, api_key_file: str | None) -> str | None:
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
