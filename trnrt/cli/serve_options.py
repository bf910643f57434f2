"""The Typer options of `trnrt serve`, grouped as SGLang groups its server arguments.

Each option is an `Annotated` type alias named after its ServerArgs field (trnrt.cli.server_args)
and shown in its group's panel of `--help` (`rich_help_panel`). `trnrt serve` takes every one;
other commands take the groups they share (`trnrt generate`: MODEL and GRAPHS), so one option has
one definition. Only typer is imported here (`trnrt --help` loads this module).
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

# The panels of `trnrt serve --help`, in SGLang's order (python/sglang/srt/server_args.py).
MODEL = "Model and tokenizer"
GRAPHS = "Graphs: preset and compiled artifacts"
HTTP = "HTTP server"
SCHEDULING = "Memory and scheduling"
RUNTIME = "Runtime options"
LOGGING = "Logging"
API = "API related"
DATA_PARALLEL = "Data parallelism"
PARALLEL = "Tensor and expert parallelism"
FEATURES = "Sampling features (variant graphs)"
SPECULATIVE = "Speculative decoding"
PREFIX_CACHE = "Prefix cache"
HICACHE = "Hierarchical cache"


def _opt(*names: str, panel: str, **kw):
    return typer.Option(*names, rich_help_panel=panel, **kw)


# -- Model and tokenizer -------------------------------------------------------------------------
Model = Annotated[Optional[str], _opt("--model", "--model-path", panel=MODEL, help="Model directory (HF layout). Default: the embedded tiny checkpoint.")]
TokenizerPath = Annotated[Optional[str], _opt("--tokenizer-path", panel=MODEL, help="Tokenizer directory (default: the model's).")]
ContextLength = Annotated[Optional[int], _opt("--context-length", panel=MODEL, help="Max prompt + completion tokens.", min=2)]
Quantization = Annotated[Optional[str], _opt("--quantization", panel=MODEL, help="fp8: quantize a bf16 checkpoint's linear and expert weights per 128x128 block at load (SGLang's online FP8); an FP8 checkpoint (config.json quantization_config) is detected without it. Compiled: the FP8 graphs of `trnrt compile --quantization fp8` (PRESET/BACKEND/fp8/).")]
KvCacheDtype = Annotated[str, _opt("--kv-cache-dtype", panel=MODEL, help="auto | bf16 | fp8_e4m3: dtype of the MLA latent cache and the indexer key pool (auto: the model's dtype; bf16 needs a bfloat16 preset; fp8_e4m3: float8_e4m3fn, scale 1; compiled graphs: `trnrt compile --kv-cache-dtype fp8_e4m3`). The KDA recurrent state is always fp32.")]

# -- Graphs: preset and compiled artifacts -------------------------------------------------------
Preset = Annotated[str, _opt("--preset", panel=GRAPHS, help="Graph-shaping preset (presets/*.toml).")]
Compiled = Annotated[Optional[str], _opt("--compiled", panel=GRAPHS, help="Run the graphs `trnrt compile --out DIR` built for --preset (refused if built from another model, preset or graph); with --tp-size N (experimental), the tp{N}ep{M}/ graphs of `trnrt compile --tp-size N`, each rank binding its own shards.", metavar="DIR")]
Backend = Annotated[Optional[str], _opt("--backend", panel=GRAPHS, help="Backend of the --compiled artifacts (cpu | cuda | neuron; default: the one found).")]
DisableCompiledCache = Annotated[bool, _opt("--disable-compiled-cache/", panel=GRAPHS, help="Without --compiled: run eagerly even when `trnrt compile` left graphs of this model and preset in the artifact cache (default: use them when valid).")]

# -- HTTP server ---------------------------------------------------------------------------------
Host = Annotated[str, _opt("--host", panel=HTTP, help="Interface to bind.")]
Port = Annotated[int, _opt("--port", panel=HTTP, help="Port (0: any free port).", min=0, max=65535)]
Threads = Annotated[Optional[int], _opt("--threads", panel=HTTP, help="waitress worker threads (default: admitted generation requests + 8).", min=1)]
DrainTimeout = Annotated[float, _opt("--drain-timeout", panel=HTTP, help="Seconds to let in-flight requests finish on SIGINT/SIGTERM.", min=0)]
AllowedOrigins = Annotated[Optional[str], _opt("--allowed-origins", panel=HTTP, help="Comma-separated browser origins allowed to call the server (default: none but its own; * for any).")]
AllowedHosts = Annotated[Optional[str], _opt("--allowed-hosts", panel=HTTP, help="Comma-separated Host names the server answers to (default: loopback and --host; any when bound to 0.0.0.0).")]

# -- Memory and scheduling -----------------------------------------------------------------------
MaxRunningRequests = Annotated[int, _opt("--max-running-requests", panel=SCHEDULING, help="Requests decoding at once.", min=1)]
MaxQueuedRequests = Annotated[Optional[int], _opt("--max-queued-requests", panel=SCHEDULING, help="Most requests waiting in the engine (SGLang's flag; default: unlimited, the HTTP layer then admits 2 x running). Past it, 503 \"The request queue is full.\" with Retry-After and X-Trnrt-Queue-Full headers.", min=0)]
MaxQueuedTokens = Annotated[Optional[int], _opt("--max-queued-tokens", panel=SCHEDULING, help="Most prompt tokens waiting in the engine, summed over the waiting requests (trnrt's; default: unlimited). An arrival that would go past it gets the same 503 as --max-queued-requests (with priority scheduling it may displace worse waiting requests instead); one that finds no request waiting is always queued, so a prompt longer than N can still run.", min=1)]
MaxNumBatchedTokens = Annotated[Optional[int], _opt("--max-num-batched-tokens", "--max-prefill-tokens", panel=SCHEDULING, help="Tokens one engine step may compute, decodes and prefill chunks together (vLLM's flag; SGLang's --max-prefill-tokens is accepted as the same budget). Default: the largest decode batch + 4 x the largest prefill chunk.", min=1)]
ChunkedPrefillSize = Annotated[Optional[int], _opt("--chunked-prefill-size", panel=SCHEDULING, help="Most tokens in one prefill chunk (SGLang's flag), at most the preset's largest prefill bucket (the default); -1: no chunking (needs --max-num-batched-tokens >= the context length).", min=-1)]
SchedulePolicy = Annotated[str, _opt("--schedule-policy", panel=SCHEDULING, help="Waiting-queue order: fcfs | lpm | dfs-weight | lof | random | shortest-prefill-first (alias spf) (SGLang's flag; lpm and dfs-weight need the radix cache, else fcfs; shortest-prefill-first counts the tokens the radix cache does not hold, or whole prompts without it).")]
EnablePriorityScheduling = Annotated[bool, _opt("--enable-priority-scheduling/", panel=SCHEDULING, help="Order the queue and preempt by each request's `priority` (with --schedule-policy fcfs or lof).")]
ScheduleLowPriorityValuesFirst = Annotated[bool, _opt("--schedule-low-priority-values-first/", panel=SCHEDULING, help="Smaller priority values are preferred (default: larger ones).")]
PrioritySchedulingPreemptionThreshold = Annotated[int, _opt("--priority-scheduling-preemption-threshold", panel=SCHEDULING, help="A waiting request preempts a running one only when its priority is better by more than this.")]
DisablePriorityPreemption = Annotated[bool, _opt("--disable-priority-preemption/", panel=SCHEDULING, help="Priority scheduling orders the queue but never preempts a running request.")]
DefaultPriorityValue = Annotated[Optional[int], _opt("--default-priority-value", panel=SCHEDULING, help="The priority of a request that sets none (default: the least preferred).")]
AbortOnPriorityWhenDisabled = Annotated[bool, _opt("--abort-on-priority-when-disabled/", panel=SCHEDULING, help="Without priority scheduling, refuse (503) a request that sets `priority` instead of ignoring the field.")]

# -- Runtime options -----------------------------------------------------------------------------
StreamInterval = Annotated[int, _opt("--stream-interval", panel=RUNTIME, help="Streamed responses get a chunk every N tokens (SGLang's flag); non-streamed ones wait for the end.", min=1)]
IncrementalStreamingOutput = Annotated[bool, _opt("--incremental-streaming-output", panel=RUNTIME, help="/generate streams carry deltas instead of cumulative text (SGLang's flag).")]
EngineProcess = Annotated[Optional[bool], _opt("--engine-process/--engine-in-process", panel=RUNTIME, help="Run the engine core (scheduler, model runner, detokenizer) in a process of its own, as SGLang does, so HTTP work and engine steps never wait for each other on one GIL (default: on; --engine-in-process runs it on a thread of the server's process).")]
Scripted = Annotated[bool, _opt("--scripted", panel=RUNTIME, hidden=True, help="Serve a scripted engine (tests).")]
ScriptedStepDelay = Annotated[float, _opt("--scripted-step-delay", panel=RUNTIME, hidden=True, help="Seconds per scripted decode step.")]

# -- Logging -------------------------------------------------------------------------------------
LogLevel = Annotated[str, _opt("--log-level", panel=LOGGING, help="debug | info | warning | error | critical (any case).")]

# -- API related ---------------------------------------------------------------------------------
ApiKey = Annotated[Optional[str], _opt("--api-key", panel=API, envvar="TRNRT_API_KEY", show_envvar=True, help="Require `Authorization: Bearer KEY` (all routes but /health). Prefer --api-key-file or TRNRT_API_KEY: a command-line key is visible to every local user in the process list.")]
ApiKeyFile = Annotated[Optional[str], _opt("--api-key-file", panel=API, help="Read the API key from this file (first line).", metavar="FILE")]
AdminApiKey = Annotated[Optional[str], _opt("--admin-api-key", panel=API, envvar="TRNRT_ADMIN_API_KEY", show_envvar=True, help="The key /flush_cache and /abort_request need instead of --api-key (SGLang's flag); other routes are unaffected.")]
ServedModelName = Annotated[Optional[str], _opt("--served-model-name", panel=API, help="Model id in the API.")]
ToolCallParser = Annotated[str, _opt("--tool-call-parser", panel=API, help="glm47 | glm45 (alias glm) | none.")]
ReasoningParser = Annotated[str, _opt("--reasoning-parser", panel=API, help="glm45 | none.")]
DefaultChatTemplateKwargs = Annotated[Optional[str], _opt("--default-chat-template-kwargs", panel=API, help="JSON object merged under each request's chat_template_kwargs.")]
TrustRequestChatTemplate = Annotated[bool, _opt("--trust-request-chat-template", panel=API, help="Render a chat request's own chat_template (vLLM's flag), in a sandbox bounded in time and memory; without it such a request is a 400. For trusted clients only.")]
StreamResponseDefaultIncludeUsage = Annotated[bool, _opt("--stream-response-default-include-usage", panel=API, help="Every streamed /v1 response ends with the usage chunk, as if stream_options.include_usage were true (SGLang's flag).")]
EnableResponseStore = Annotated[bool, _opt("--enable-response-store/", panel=API, help="Keep /v1/responses answers for previous_response_id, GET /v1/responses/{id} and cancel (SGLang's flag), in a bounded in-memory store.")]
ResponseStoreSizeMb = Annotated[float, _opt("--response-store-size-mb", panel=API, help="Size bound of the response store in MB (least recently used responses are evicted).", min=0.001)]
ResponseStoreTtl = Annotated[float, _opt("--response-store-ttl", panel=API, help="Seconds a stored response is kept after its last write (0: until evicted for size).", min=0)]

# -- Data parallelism ----------------------------------------------------------------------------
Dp = Annotated[int, _opt("--dp", "--data-parallel-size", panel=DATA_PARALLEL, help="Run N engines (one model each, on 127.0.0.1) behind sglang-router on --host/--port (SGLang's flag; needs the router extra: `pip install -e '.[router]'` or `pip install sglang-router==0.3.2`). See docs/DEPLOY.md.", min=1)]
RouterPolicy = Annotated[str, _opt("--router-policy", panel=DATA_PARALLEL, help="With --dp: the router's policy, cache_aware | round_robin | random | power_of_two | manual (manual: the X-SMG-Routing-Key header keeps a conversation on one engine).")]

# Tensor and expert parallelism (trnrt.engine.core.tp_config; docs/DEPLOY.md)
TpSize = Annotated[int, _opt("--tp-size", "--tp", "--tensor-parallel-size", panel=PARALLEL, help="Tensor-parallel ranks (SGLang's flag): N processes on this host (or over --nnodes); rank 0 serves HTTP and runs the scheduler, every rank runs each step (eager; gloo on the CPU). 1: one process, as without it.", min=1)]
EpSize = Annotated[int, _opt("--ep-size", "--expert-parallel-size", panel=PARALLEL, help="Expert-parallel degree (SGLang's flag): the routed experts are owned whole by groups of ranks; must divide --tp-size.", min=1)]
Nnodes = Annotated[int, _opt("--nnodes", panel=PARALLEL, help="Nodes the --tp-size ranks are spread over (SGLang's flag); each node runs `trnrt serve` with its --node-rank.", min=1)]
NodeRank = Annotated[int, _opt("--node-rank", panel=PARALLEL, help="This node's rank among --nnodes (SGLang's flag): node 0 serves HTTP and holds rank 0; another node runs only its ranks.", min=0)]
DistInitAddr = Annotated[Optional[str], _opt("--dist-init-addr", panel=PARALLEL, help="HOST:PORT of node 0's rendezvous (torch.distributed TCP store; SGLang's flag). Needed with --nnodes > 1; default on one node: 127.0.0.1 on a free port.", metavar="HOST:PORT")]

# -- Sampling features (variant graphs) ----------------------------------------------------------
StructuredOutputs = Annotated[bool, _opt("--structured-outputs", panel=FEATURES, help="Serve structured outputs (JSON schema, regex, EBNF, choice, structural tags; tool_choice required/named) with xgrammar: needs `pip install 'trnrt[grammar]'`, and with --compiled artifacts built with `trnrt compile --structured-outputs`.")]
Penalties = Annotated[bool, _opt("--penalties", panel=FEATURES, help="Serve repetition_penalty, frequency_penalty, presence_penalty, logit_bias and min_tokens (the penalties variant graphs; with --compiled, artifacts built with `trnrt compile --penalties`).")]
PromptLogprobs = Annotated[bool, _opt("--prompt-logprobs", panel=FEATURES, help="Serve prompt logprobs: /v1/completions echo with logprobs, vLLM's prompt_logprobs (completions, chat) and /generate's logprob_start_len >= 0 (the prompt_logprobs prefill variant graphs; with --compiled, artifacts compiled with that flag). Such requests bypass the prefix cache.")]

# -- Speculative decoding ------------------------------------------------------------------------
SpeculativeAlgorithm = Annotated[Optional[str], _opt("--speculative-algorithm", panel=SPECULATIVE, help="NEXTN (alias EAGLE, MTP): draft with the model's own MTP layer and verify the drafts in one target pass (SGLang's flag). Requests with a grammar, penalties, logprobs, prompt logprobs, a thinking budget or n > 1 run plain steps beside them; speculative requests bypass the prefix cache. Eager draft/verify steps.")]
SpeculativeNumSteps = Annotated[Optional[int], _opt("--speculative-num-steps", panel=SPECULATIVE, help="Drafts per verify (1..8; default 3).")]
SpeculativeEagleTopk = Annotated[Optional[int], _opt("--speculative-eagle-topk", panel=SPECULATIVE, help="Only 1 (chain drafting).")]
SpeculativeNumDraftTokens = Annotated[Optional[int], _opt("--speculative-num-draft-tokens", panel=SPECULATIVE, help="--speculative-num-steps + 1 with top-k 1 (SGLang's flag; sets the steps when they are not given).")]
SpeculativeConfig = Annotated[Optional[str], _opt("--speculative-config", panel=SPECULATIVE, help="vLLM's spelling: a JSON object {\"method\": \"mtp\", \"num_speculative_tokens\": k}.")]
SpeculativeMinAcceptLength = Annotated[Optional[float], _opt("--speculative-min-accept-length", panel=SPECULATIVE, help="Dynamic speculation (trnrt's): the least tokens per verify (accepted drafts + 1) that pay, a floor under the break-even the engine measures on itself; after 4 verifies below the line a request goes on with plain decode steps (after one while the engine's last 100 verifies are below it, and new requests then start plain but for probes). Default 0: always speculate.")]

# -- Prefix cache --------------------------------------------------------------------------------
DisableRadixCache = Annotated[bool, _opt("--disable-radix-cache/", panel=PREFIX_CACHE, help="Turn the radix prefix cache off (SGLang's flag; on by default).")]
CheckpointInterval = Annotated[int, _opt("--checkpoint-interval", panel=PREFIX_CACHE, help="Tokens between the prefix cache's state checkpoints, the granularity of prefix reuse; a multiple of the preset's block size (0: the engine picks).", min=0)]
NumCheckpoints = Annotated[int, _opt("--num-checkpoints", panel=PREFIX_CACHE, help="Device state checkpoints the prefix cache keeps (each one slot's KDA state, conv window and indexer tail; the start-up log says the memory). 0: 2 x --max-running-requests.", min=0)]
RadixEvictionPolicy = Annotated[str, _opt("--radix-eviction-policy", panel=PREFIX_CACHE, help="Prefix-cache eviction: lru | lfu | slru | priority | tlru (SGLang's flag).")]
RadixEvictionPolicyConfig = Annotated[Optional[str], _opt("--radix-eviction-policy-config", panel=PREFIX_CACHE, help="JSON object of eviction-policy parameters, e.g. '{\"protected_threshold\": 4}' for slru.", metavar="JSON")]

# -- Hierarchical cache --------------------------------------------------------------------------
EnableHierarchicalCache = Annotated[bool, _opt("--enable-hierarchical-cache/", "--enable-hicache/", panel=HICACHE, help="Keep prefix-cache pages evicted from the device in a host pool (SGLang's HiCache).")]
HicacheRatio = Annotated[float, _opt("--hicache-ratio", panel=HICACHE, help="Host pool size as a multiple of the device pool (with --enable-hierarchical-cache).")]
HicacheSize = Annotated[int, _opt("--hicache-size", panel=HICACHE, help="Host pool size in GB; overrides --hicache-ratio when > 0.", min=0)]
HicacheWritePolicy = Annotated[str, _opt("--hicache-write-policy", panel=HICACHE, help="write_through (copy to the host on insert) | write_back (copy on eviction).")]
