"""Engine: one thread owns the scheduler, the runner, detokenizers and stats.

Request flow (docs/ARCHITECTURE.md): a client thread calls `submit()` (validation happens there and raises
InvalidRequestError naming the field) -> a typed message on the engine thread's inbox
(trnrt.engine.core.messages: submit, abort, abort by prefix / all, flush cache, load query) -> the
engine thread handles the inbox in order between steps -> `scheduler.schedule()` ->
`runner.execute()` (model + sampler per bucket; or the scripted runner) ->
`scheduler.update_from_output()` -> incremental detokenization and stop strings -> a
RequestOutput on each request's OutputStream -> stats. Only the engine thread touches scheduler,
cache and runner state, so none of them needs a lock; what other threads read (the live request
ids, the published EngineLoad, the stats collector) is guarded or swapped atomically.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from trnrt.config import EngineConfig
from trnrt.engine.cache.cache_manager import CacheIntegrityError, CacheManager
from trnrt.engine.core.client import (
    ABORT_WAITING_MESSAGE,
    FLUSH_BUSY_MESSAGE,
    FLUSH_IN_PROGRESS_MESSAGE,
    FLUSH_OK_MESSAGE,
    FLUSH_TIMEOUT_MESSAGE,
    EngineDeadError,
    EngineLoad,
    FlushResult,
    ModelInfo,
)
from trnrt.engine.output.detokenizer import IncrementalDetokenizer
from trnrt.engine.core.messages import AbortMatchingMsg, AbortMsg, FlushCacheMsg, LoadQueryMsg, Reply, SubmitMsg
from trnrt.engine.output.outputs import RequestOutput, RowInput, RunnerOutput, SchedulerOutput, TokenLogprob
from trnrt.engine.request import FinishReason, GenerateRequest, InvalidRequestError, check_new_request_ids
from trnrt.engine.sched.scheduler import Scheduler, SchedulerConfig
from trnrt.engine.output.sequence import SequenceStatus
from trnrt.engine.spec.policy import DynamicSpeculation
from trnrt.engine.output.stop import StopChecker, is_token_stop
from trnrt.engine.output.stream import OutputStream
from trnrt.engine.runner.threads import apply_torch_threads, count_params, resolve_torch_threads

if TYPE_CHECKING:
    from trnrt.engine.cache.cache_config import PrefixCacheConfig  # the model runner imports torch; the engine itself need not (scripted runs)
    from trnrt.engine.runner.model_runner import ModelRunner
    from trnrt.engine.spec.config import SpeculativeConfig

log = logging.getLogger(__name__)

_SEED_MASK = (1 << 63) - 1
DEFAULT_SERVED_MODEL_NAME = "glm-5.3-flash-tiny"
SHUTDOWN_MESSAGE = "server shutting down"
SHUTDOWN_STATUS_CODE = 503  # SGLang: a system abort carries an HTTP status (service unavailable)
# How long a synchronous call waits for the engine thread beyond its own timeout: the thread
# handles the inbox between steps, so one step (a long prefill on a big model) can delay it.
_REPLY_GRACE_S = 5.0
_GEN_THROUGHPUT_WINDOW_S = 60.0  # load().gen_throughput: output tok/s over the last minute (stats' "1m" rate)


STRUCTURED_OUTPUTS = "structured_outputs"  # the feature flag (and variant) of grammars
STRUCTURED_OUTPUTS_OFF_MESSAGE = "{param} needs structured outputs: start the server with --structured-outputs"


PENALTIES = "penalties"  # the feature flag (and variant) of penalties, logit_bias and min_tokens
PENALTIES_OFF_MESSAGE = "{param} needs penalties: start the server with --penalties"


from trnrt.engine.sample.prompt_logprob_collector import PROMPT_LOGPROBS  # noqa: E402  (the flag of prompt logprobs)
PROMPT_LOGPROBS_OFF_MESSAGE = "{param} needs prompt logprobs: start the server with --prompt-logprobs"


def with_flag(ecfg: EngineConfig, flag: str, on: bool) -> EngineConfig:
    """`ecfg` with the variant flag `flag` added (on) or left as it is."""
    if not on or flag in ecfg.variants:
        return ecfg
    return ecfg.replace(variants=tuple(sorted({*ecfg.variants, flag})))


def with_structured_outputs(ecfg: EngineConfig, on: bool) -> EngineConfig:
    """`ecfg` with the structured_outputs variant flag added (on) or left as it is."""
    return with_flag(ecfg, STRUCTURED_OUTPUTS, on)


def special_token_id(tokenizer, text: str) -> int | None:
    """The id of a single (special) token spelled `text` in the tokenizer, or None."""
    for name in ("token_to_id", "convert_tokens_to_ids"):
        fn = getattr(tokenizer, name, None)
        if fn is not None:
            try:
                i = fn(text)
            except Exception:
                continue
            unk = getattr(tokenizer, "unk_token_id", None)
            if isinstance(i, int) and i >= 0 and (i != unk or unk is None):
                return i
    return None


def read_eos_token_ids(model_dir: Path, tokenizer) -> tuple[int, ...]:
    """EOS ids from generation_config.json (int or list), else the tokenizer's eos token."""
    ids: list[int] = []
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if isinstance(eos, int):
            ids = [eos]
        elif isinstance(eos, list):
            ids = [int(t) for t in eos]
    if not ids and getattr(tokenizer, "eos_token_id", None) is not None:
        ids = [int(tokenizer.eos_token_id)]
    return tuple(dict.fromkeys(ids))


def fast_decoder(tokenizer):
    """The object the detokenizers call `decode(ids, skip_special_tokens=...)` on: the Rust
    `tokenizers.Tokenizer` behind a transformers fast tokenizer when that gives the same text (no
    clean-up of tokenization spaces), else the tokenizer itself. The transformers wrapper checks
    every id in Python on each call: ~4x the cost of the decode, and two decodes per token per
    request (measured: 1.6 ms of a 1.65 ms batch-8 engine step with an instant model)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return backend
    return tokenizer


def resolve_configs(
    engine_config: EngineConfig | None = None,
    *,
    preset: str | None = None,
    scheduler_config: SchedulerConfig | None = None,
    max_running_requests: int | None = None,
    context_length: int | None = None,
    compiled: bool = False,
) -> tuple[EngineConfig, SchedulerConfig]:
    """The EngineConfig and SchedulerConfig an engine runs with (shared by `from_model_dir` and
    `scripted`, so a scripted engine schedules exactly like a real one).

    `preset` (a presets/*.toml name or path) gives the EngineConfig when `engine_config` is not
    passed. `max_running_requests` (SGLang's flag) sizes the slot pool and max_num_seqs;
    `context_length` caps max_model_len. With `compiled` graphs the cache sizes and max_model_len
    are graph inputs, so they stay the preset's: max_running_requests only caps max_num_seqs at
    the preset's slots, and context_length only caps the scheduler's max_model_len.
    """
    if engine_config is None:
        from trnrt.config.presets import load_preset

        engine_config = load_preset(preset or "default")
    ecfg = engine_config
    if context_length is not None and not compiled:
        # context buckets at or past the new length would be the full table: drop them
        ecfg = ecfg.replace(max_model_len=context_length,
                            decode_context_buckets=tuple(c for c in ecfg.decode_context_buckets if c < context_length),
                            prefill_context_buckets=tuple(c for c in ecfg.prefill_context_buckets if c < context_length))
    if max_running_requests is not None and compiled:
        if max_running_requests > ecfg.num_slots - 1:
            log.warning("compiled graphs hold %d slots: running at most %d requests, not %d",
                        ecfg.num_slots - 1, ecfg.num_slots - 1, max_running_requests)
            max_running_requests = ecfg.num_slots - 1
    elif max_running_requests is not None:
        blocks_per_seq = ecfg.max_blocks_per_seq
        ecfg = ecfg.replace(
            num_slots=max_running_requests + 1,
            # enough pages for every running request at a quarter of the context, and at
            # least one full-length request (preemption always makes progress)
            num_blocks=max(ecfg.num_blocks, blocks_per_seq * max(1, max_running_requests // 4) + 1,
                           blocks_per_seq + 1),
        )
    max_model_len = min(ecfg.max_model_len, ecfg.max_blocks_per_seq * ecfg.block_size)
    if context_length is not None:
        max_model_len = min(max_model_len, context_length)
    scfg = scheduler_config or SchedulerConfig(
        max_num_seqs=max_running_requests or min(ecfg.max_decode_batch, ecfg.num_slots - 1),
        max_num_batched_tokens=default_token_budget(ecfg),
        max_model_len=max_model_len,
        max_prefill_chunk_tokens=ecfg.max_prefill_tokens,
    )
    if scfg.max_num_seqs > ecfg.num_slots - 1:
        raise ValueError(f"max_num_seqs {scfg.max_num_seqs} exceeds the {ecfg.num_slots - 1} usable slots")
    return ecfg, scfg


def default_token_budget(ecfg: EngineConfig) -> int:
    """A step's default token budget: a full decode batch plus four largest prefill chunks.

    A budget of one chunk (the old default, 64 tokens) left a loaded server 32 tokens of prefill a
    step, so queued prompts waited seconds for their first token; four chunks admit a typical chat
    prompt in one step while a step stays a few prefill graph calls long (docs/PERFORMANCE.md)."""
    return ecfg.max_decode_batch + 4 * ecfg.max_prefill_tokens


def _default_checkpoint_interval(ecfg: EngineConfig) -> int:
    """Checkpoints every largest prefill chunk (at least 64 tokens), rounded up to a page: prefill
    chunks are cut there, so at the largest chunk size the cut costs no extra graph call."""
    bs = ecfg.block_size
    return -(-max(64, ecfg.max_prefill_tokens) // bs) * bs


class _TokenRate:
    """Output tokens per second over the last `window_s` seconds, in 1 s buckets. The engine
    thread adds, any thread reads. (Reading the stats collector's windows instead would build its
    whole snapshot, ~2 ms with full latency windows, on every load() poll.)"""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self._clock = clock
        self._start = clock()
        self._lock = threading.Lock()
        self._buckets: collections.deque[list[int]] = collections.deque()  # [second, tokens]

    def add(self, n: int, now: float) -> None:
        sec = int(now)
        with self._lock:
            b = self._buckets
            if b and b[-1][0] == sec:
                b[-1][1] += n
            else:
                b.append([sec, n])
            while b[0][0] <= sec - self.window_s:
                b.popleft()

    def rate(self) -> float:
        now = self._clock()
        with self._lock:
            total = sum(n for sec, n in self._buckets if sec > now - self.window_s)
        span = min(self.window_s, now - self._start)
        return total / span if span > 0 else 0.0


def _jsonable(value):
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value


class Engine:
    """A running engine (implements trnrt.engine.core.client.EngineClient).

    Build it with `Engine.from_model_dir(...)` (the model) or `Engine.scripted(...)` (a scripted
    runner, for API tests). Every client method (`submit`, `submit_many`, `abort`,
    `abort_requests`, `flush_cache`, `load`, `server_info`, `is_idle`, `stats`, `shutdown`) is
    thread-safe.

    Args:
        runner: has `execute(rows: list[RowInput]) -> list[RowResult]` (ModelRunner's contract),
            and optionally `thread_context()` (entered around the engine loop), `release(ids)`
            (called when requests finish) and `flush_cache()` (called by an idle flush).
        submit_log_size: keep the last N submitted GenerateRequests in `self.submitted` (tests
            read what the server submitted); 0 keeps none (`submitted` is None).
    """

    def __init__(self, runner: "ModelRunner", tokenizer, model_info: ModelInfo, engine_config: EngineConfig,
                 scheduler_config: SchedulerConfig, *, start: bool = True, stream_interval: int = 1,
                 submit_log_size: int = 0, prefix_cache_config: "PrefixCacheConfig | None" = None,
                 grammar_cache_mb: int = 256):
        from trnrt.stats import StatsCollector  # pure Python

        if not isinstance(stream_interval, int) or isinstance(stream_interval, bool) or stream_interval < 1:
            raise ValueError(f"stream_interval must be an integer >= 1, got {stream_interval!r}")
        self.stream_interval = stream_interval

        self.runner = runner
        self.tokenizer = tokenizer
        self._decoder = fast_decoder(tokenizer)
        self.model_info = model_info
        self.engine_config = engine_config
        self.scheduler_config = scheduler_config
        self.cache = CacheManager(engine_config.num_blocks, engine_config.block_size, engine_config.num_slots)
        self.prefix_cache_config = prefix_cache_config
        self.prefix_cache, interval = self._build_prefix_cache(prefix_cache_config)
        self.scheduler = Scheduler(scheduler_config, self.cache, eos_token_ids=model_info.eos_token_ids,
                                   prefix_cache=self.prefix_cache, checkpoint_interval=interval)
        self.stats_collector = StatsCollector()
        self.speculative_config = None  # set by from_model_dir(speculative=...)
        self.spec_policy: DynamicSpeculation | None = None  # dynamic speculation (from_model_dir)
        self.num_spec_fallbacks = 0  # requests that went on with plain steps (dynamic speculation)
        self.stats_collector.set_engine_info(
            model_info.model_path, preset=model_info.preset, backend=model_info.backend,
            compiled=model_info.compiled, served_model_name=model_info.served_model_name,
        )
        self.submitted: collections.deque[GenerateRequest] | None = (
            collections.deque(maxlen=submit_log_size) if submit_log_size else None)
        self.startup_time_s: float | None = None  # set by the constructors that can measure it
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, OutputStream] = {}
        self._detoks: dict[str, IncrementalDetokenizer] = {}
        # Request ids submitted and not finished (queued, running, or still in the inbox): a
        # duplicate is refused at submit, and "idle" means this set is empty. Removed just before
        # the finished output is put on the stream, so a client that saw its request end may
        # reuse the id at once.
        self._live_lock = threading.Lock()
        self._live_ids: set[str] = set()
        # Finished outputs waiting for the live stats to drop their requests (engine thread only).
        self._finished_out: list[tuple[OutputStream, RequestOutput]] = []
        self._pending_flush: FlushCacheMsg | None = None  # engine thread only
        # Structured outputs (engine_config.variants holds "structured_outputs"): the grammar
        # compiler (used on submitting threads) and each live request's matcher (engine thread).
        self.grammar_service = self._build_grammar_service(grammar_cache_mb)
        self._grammars: dict = {}
        # Penalties (engine_config.variants holds "penalties") and thinking budgets (host-only):
        # each live request's PenaltyState / ThinkingBudget (engine thread).
        self.penalties = PENALTIES in engine_config.variants
        self._penalties: dict = {}
        # Prompt logprobs (engine_config.variants holds "prompt_logprobs"): each live request's
        # PromptLogprobCollector until its first output carries the entries (engine thread).
        self.prompt_logprobs = PROMPT_LOGPROBS in engine_config.variants
        self._prompt_lps: dict = {}
        self._thinking: dict = {}
        self._think_ids = (special_token_id(tokenizer, "<think>"), special_token_id(tokenizer, "</think>"))
        self.num_forced_think_ends = 0
        self._cache_poisoned = False  # a prefix-cache copy failed this step
        self._gen_rate = _TokenRate(_GEN_THROUGHPUT_WINDOW_S)
        self._load = EngineLoad()
        self._accepting = True
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._warmed = threading.Event()  # set once the engine thread's warm-up is over (_warm_up)
        self.warmup_s = 0.0
        self.num_steps = 0
        # An engine in its own process (trnrt.engine.core.core_proc) forwards outputs over a pipe: its
        # streams come from `stream_factory(request_id, interval)`, and the engine thread calls
        # `flush_outputs()` after every loop turn so that a turn's outputs travel in one message.
        self.stream_factory: Callable[[str, int], OutputStream] = OutputStream
        self.flush_outputs: Callable[[], None] | None = None
        self._publish_load()
        self.thread = threading.Thread(target=self._run, name="trnrt-engine", daemon=True)
        if start:
            self.thread.start()

    def _build_grammar_service(self, cache_mb: int):
        """The GrammarCompilerService when structured outputs are on (None otherwise). Raises
        GrammarUnavailableError (a clear message) when xgrammar is not installed."""
        if STRUCTURED_OUTPUTS not in self.engine_config.variants:
            return None
        from trnrt.engine.sample.grammar import GrammarCompilerService

        info = self.model_info
        return GrammarCompilerService(self.tokenizer, info.vocab_size, info.eos_token_ids, cache_mb=cache_mb)

    def _build_prefix_cache(self, pcc):
        """The RadixCache, its pools and the runner's state copies for `pcc` (None / disabled:
        no cache). Returns (cache or None, checkpoint interval)."""
        if pcc is None or not pcc.enabled:
            return None, 0
        from trnrt.engine.cache.cache_manager import IdPool
        from trnrt.engine.cache.radix_cache import RadixCache
        from trnrt.engine.cache.eviction_policy import make_eviction_strategy

        ecfg = self.engine_config
        interval = pcc.resolved_interval(ecfg.block_size) if pcc.checkpoint_interval else \
            _default_checkpoint_interval(ecfg)
        # A checkpoint is one slot's state (for the real model, ~the KDA state of every linear layer:
        # tens of MB), so the default pool is twice the slot pool: it keeps two resumable prefixes
        # per running request's worth of memory. --num-checkpoints sets it.
        n_ckpt = pcc.num_checkpoints or 2 * (ecfg.num_slots - 1)
        host_pages = host_ckpts = None
        if pcc.hierarchical:
            n_dev = ecfg.num_blocks - 1
            if pcc.hicache_size_mb:
                per_page = getattr(self.runner, "page_nbytes", lambda: 0)() or 1
                n_host = max(1, pcc.hicache_size_mb * (1 << 20) // per_page)
            else:
                n_host = max(1, int(n_dev * pcc.hicache_ratio))
            host_pages = IdPool(n_host, "host page")
            host_ckpts = IdPool(max(1, int(n_ckpt * pcc.hicache_ratio)), "host checkpoint")
        ckpts = IdPool(n_ckpt, "checkpoint")
        alloc = getattr(self.runner, "allocate_cache_tiers", None)
        if alloc is not None:
            alloc(n_ckpt, host_pages.size if host_pages else 0, host_ckpts.size if host_ckpts else 0)
        strategy = make_eviction_strategy(pcc.eviction_policy, pcc.eviction_policy_config)
        tree = RadixCache(self.cache, ckpts, host_pages=host_pages, host_checkpoints=host_ckpts,
                          strategy=strategy, write_policy=pcc.write_policy)
        nbytes = getattr(self.runner, "checkpoint_nbytes", lambda: 0)()
        log.info("prefix cache: checkpoints every %d tokens, %d device checkpoints (%.1f MiB)%s, eviction %s",
                 interval, n_ckpt, n_ckpt * nbytes / (1 << 20),
                 f", host tier {host_pages.size} pages ({pcc.write_policy})" if host_pages else "", pcc.eviction_policy)
        return tree, interval

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str | os.PathLike | None = None,
        *,
        engine_config: EngineConfig | None = None,
        scheduler_config: SchedulerConfig | None = None,
        served_model_name: str | None = None,
        device: str = "cpu",
        compiled_loader=None,
        compiled_backend: str = "cpu",
        preset: str | None = None,
        max_running_requests: int | None = None,
        context_length: int | None = None,
        start: bool = True,
        stream_interval: int = 1,
        prefix_cache_config: "PrefixCacheConfig | None" = None,
        structured_outputs: bool = False,
        penalties: bool = False,
        prompt_logprobs: bool = False,
        speculative: "SpeculativeConfig | None" = None,
        drafter_factory=None,
    ) -> "Engine":
        """Load the checkpoint (None: the embedded tiny model) and start the engine thread.

        speculative (trnrt.engine.spec.config; `trnrt serve --speculative-algorithm NEXTN`): load
        the MTP layer and run speculative decode steps for the requests that allow them
        (`Engine.speculative_ok`): the preset's verify / draft graphs when it has them (an mtp-*
        preset, which turns speculation on by itself: `preset_speculative`), else eagerly;
        drafter_factory(runner) -> Drafter replaces the MTP drafter (tests: the oracle drafter).

        structured_outputs: serve grammars (xgrammar; `trnrt serve --structured-outputs`): the
        engine config gets the "structured_outputs" variant flag, so compiled artifacts must
        hold its variant graphs. penalties: serve repetition/frequency/presence penalties,
        logit_bias and min_tokens (`trnrt serve --penalties`; the "penalties" variant graphs).

        `preset`, `max_running_requests` and `context_length`: see `resolve_configs`.

        compiled_loader(model, state, engine_config) -> {GraphSpec: callable} runs compiled graphs
        (the CLI passes trnrt.compile.load_compiled; the engine layer never imports compile). The
        cache sizes and max_model_len are graph inputs then, so they stay the preset's.

        stream_interval (SGLang's --stream-interval): a streamed request (GenerateRequest.stream)
        gets an output every `stream_interval` tokens (merged), and its final one; a non-streamed
        request gets its final output only.
        """
        import torch
        from transformers import AutoTokenizer

        from trnrt.engine.runner.model_runner import ModelRunner
        from trnrt.models.glm5_next.state import ModelState
        from trnrt.models.glm5_next.weights import load_model
        from trnrt.models.paths import resolve_model_dir

        t0 = time.monotonic()
        path = resolve_model_dir(model_dir)
        ecfg, scfg = resolve_configs(engine_config, preset=preset, scheduler_config=scheduler_config,
                                     max_running_requests=max_running_requests, context_length=context_length,
                                     compiled=compiled_loader is not None)
        ecfg = with_flag(with_structured_outputs(ecfg, structured_outputs), PENALTIES, penalties)
        ecfg = with_flag(ecfg, PROMPT_LOGPROBS, prompt_logprobs)
        from trnrt.engine.spec.config import check_speculative_flags, preset_speculative

        # an mtp-* preset turns speculation on by itself (its k; the dynamic preset's minimum)
        speculative = preset_speculative(speculative, ecfg)
        check_speculative_flags(ecfg, ecfg.variants)
        dtype = getattr(torch, ecfg.dtype)
        model = load_model(path, dtype=dtype, device=device, load_mtp=speculative is not None)
        mcfg = model.config
        state = ModelState.allocate(mcfg, ecfg.num_blocks, ecfg.block_size, ecfg.num_slots, dtype, device,
                                    mtp=speculative is not None)
        compiled = compiled_loader(model, state, ecfg) if compiled_loader is not None else None
        if speculative is None:
            runner = ModelRunner(model, state, ecfg, mcfg.vocab_size, compiled=compiled)
        else:
            from trnrt.engine.spec.runner import SpecModelRunner

            runner = SpecModelRunner(model, state, ecfg, mcfg.vocab_size, num_steps=speculative.num_steps,
                                     drafter_factory=drafter_factory, compiled=compiled)
            scfg = dataclasses.replace(scfg, num_speculative_tokens=speculative.num_steps)
        # the engine thread's torch intra-op threads (resolved here, on the caller's thread, so a
        # bad TRNRT_TORCH_THREADS fails before the engine starts; applied in _run)
        runner.torch_threads = resolve_torch_threads(compiled_backend if compiled else "eager", device, None,
                                                     count_params(model))[0]
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        if served_model_name is None:
            from trnrt.models.tiny import default_model_dir

            # SGLang and vLLM name a model after the --model string; the embedded checkpoint
            # gets a stable name instead of its content-hashed cache directory.
            is_default = model_dir is None or path.resolve() == default_model_dir().resolve()
            served_model_name = DEFAULT_SERVED_MODEL_NAME if is_default else str(model_dir)
        info = ModelInfo(
            model_path=str(path),
            served_model_name=served_model_name,
            vocab_size=mcfg.vocab_size,
            max_model_len=scfg.max_model_len,
            eos_token_ids=read_eos_token_ids(path, tokenizer),
            preset=ecfg.preset,
            backend=compiled_backend if compiled else "eager",
            compiled=bool(compiled),
        )
        engine = cls(runner, tokenizer, info, ecfg, scfg, start=start, stream_interval=stream_interval,
                     prefix_cache_config=prefix_cache_config)
        engine.speculative_config = speculative
        if speculative is not None and speculative.min_accept_length > 0:
            engine.spec_policy = DynamicSpeculation(speculative.min_accept_length, speculative.probe_verifies,
                                                    speculative.probe_every,
                                                    max_tokens_per_verify=speculative.num_steps + 1)
            engine.stats_collector.set_section("speculative_dynamic", engine._dynamic_speculation_status)
        if speculative is not None:
            engine.stats_collector.set_speculative(speculative.algorithm, speculative.num_steps)
        if start:  # the engine a caller gets has its compiled graphs warm (its startup time counts it)
            engine.wait_warm()
        engine.startup_time_s = time.monotonic() - t0
        return engine

    @classmethod
    def scripted(
        cls,
        tokenizer,
        script: Callable[[list[int]], list[int]],
        *,
        served_model_name: str = "trnrt-tiny",
        model_path: str = "scripted",
        max_model_len: int = 1024,
        max_running_requests: int = 64,
        num_blocks: int | None = None,
        max_num_batched_tokens: int | None = None,
        step_delay_s: float = 0.0,
        stream_interval: int = 1,
        eos_token_ids: tuple[int, ...] | None = None,
        submit_log_size: int = 256,
        start: bool = True,
        prefix_cache_config: "PrefixCacheConfig | None" = None,
        scheduler_config: SchedulerConfig | None = None,
        structured_outputs: bool = False,
        penalties: bool = False,
        prompt_logprobs: bool = False,
    ) -> "Engine":
        """An Engine whose runner replays `script(prompt_ids)` (trnrt.engine.runner.scripted_runner)
        instead of running a model: everything else (scheduler, stop checks, detokenizer, streams,
        pages and slots, stats) is the real engine's. No torch, no weights.

        The configs are what `from_model_dir(context_length=max_model_len,
        max_running_requests=max_running_requests)` would build from the default preset;
        `num_blocks` then overrides the page count (a tiny pool forces preemption) and
        `max_num_batched_tokens` the step's token budget. `eos_token_ids` (default: the
        tokenizer's eos token) are the model's EOS ids; the first one ends an exhausted script.
        The runner is `engine.runner` (its `paused` switch and `step_delay_s`); the last
        `submit_log_size` submitted requests are in `engine.submitted`.
        """
        from trnrt.engine.runner.scripted_runner import ScriptedRunner

        t0 = time.monotonic()
        ecfg, scfg = resolve_configs(None, preset="default", max_running_requests=max_running_requests,
                                     context_length=max_model_len, scheduler_config=scheduler_config)
        if num_blocks is not None:
            ecfg = ecfg.replace(num_blocks=num_blocks)
        ecfg = with_flag(with_structured_outputs(ecfg, structured_outputs), PENALTIES, penalties)
        ecfg = with_flag(ecfg, PROMPT_LOGPROBS, prompt_logprobs)
        if max_num_batched_tokens is not None:
            scfg = dataclasses.replace(scfg, max_num_batched_tokens=max_num_batched_tokens)
        if eos_token_ids is None:
            eos = getattr(tokenizer, "eos_token_id", None)
            eos_token_ids = () if eos is None else (int(eos),)
        eos_token_ids = tuple(int(t) for t in eos_token_ids)
        if not eos_token_ids:
            raise ValueError("a scripted engine needs an EOS id (it ends an exhausted script with it)")
        # a transformers tokenizer has len(); a bare `tokenizers.Tokenizer` (pure tests) has get_vocab_size()
        vocab_size = len(tokenizer) if hasattr(tokenizer, "__len__") else tokenizer.get_vocab_size()
        runner = ScriptedRunner(script, eos_token_id=eos_token_ids[0], vocab_size=vocab_size,
                                step_delay_s=step_delay_s, block_size=ecfg.block_size)
        runner.eos_token_ids = eos_token_ids
        info = ModelInfo(model_path=str(model_path), served_model_name=served_model_name, vocab_size=vocab_size,
                         max_model_len=scfg.max_model_len, eos_token_ids=eos_token_ids, preset=ecfg.preset,
                         backend="scripted", compiled=False)
        engine = cls(runner, tokenizer, info, ecfg, scfg, start=start, stream_interval=stream_interval,
                     submit_log_size=submit_log_size, prefix_cache_config=prefix_cache_config)
        engine.startup_time_s = time.monotonic() - t0
        return engine

    def wait_warm(self, timeout: float | None = None) -> bool:
        """Wait for the engine thread's warm-up (Engine._warm_up) to be over; False on timeout."""
        return self._warmed.wait(timeout)

    # -- client API (any thread) -----------------------------------------------------------------

    def submit(self, request: GenerateRequest) -> OutputStream:
        """Queue a request. Raises InvalidRequestError naming the field if it can never run or if
        its request_id is in flight; EngineDeadError if the engine is shutting down."""
        return self.submit_many([request])[0]

    def submit_many(self, requests: list[GenerateRequest]) -> list[OutputStream]:
        """Validate every request first, then queue them together (one inbox message, so the engine
        thread admits them in the same step). Nothing is queued if any request is invalid or any
        request_id is in flight or repeated in the batch."""
        for request in requests:
            self._prepare(request)
        ids = [r.request_id for r in requests]
        with self._live_lock:
            check_new_request_ids(ids, self._live_ids)
            self._live_ids.update(ids)
        # A non-streamed request's client waits for the final output only: not waking it every
        # step keeps its thread off the GIL while the engine runs (trnrt.engine.output.stream).
        streams = [self.stream_factory(r.request_id, (r.stream_interval or self.stream_interval) if r.stream else 0)
                   for r in requests]
        if self.submitted is not None:
            self.submitted.extend(requests)
        self._post(SubmitMsg(list(requests), streams))
        return streams

    def _prepare(self, request: GenerateRequest) -> None:
        if not self._accepting or not self.thread.is_alive():
            raise EngineDeadError("the engine is not accepting requests (shutting down)")
        si = request.stream_interval
        if si is not None and (not isinstance(si, int) or isinstance(si, bool) or si < 1):
            raise InvalidRequestError(f"stream_interval must be an integer >= 1, got {si!r}", field="stream_interval")
        vocab = self.model_info.vocab_size
        for t in request.prompt_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not (0 <= t < vocab):
                raise InvalidRequestError(
                    f"prompt_token_ids contains {t!r}, outside the vocabulary [0, {vocab})", field="prompt_token_ids"
                )
        request.sampling_params.validate(vocab_size=vocab)
        self.scheduler.validate_request(request)  # reads only immutable config
        self._prepare_grammar(request)
        self._prepare_penalties(request)
        self._prepare_thinking(request)
        sp = request.sampling_params
        if sp.prompt_logprobs is not None:
            if not self.prompt_logprobs:
                raise InvalidRequestError(PROMPT_LOGPROBS_OFF_MESSAGE.format(param="prompt_logprobs"),
                                          field="prompt_logprobs")
            if sp.prompt_logprobs_start >= len(request.prompt_token_ids):
                raise InvalidRequestError(
                    f"prompt_logprobs_start ({sp.prompt_logprobs_start}) must be less than the prompt's "
                    f"{len(request.prompt_token_ids)} tokens", field="prompt_logprobs_start")
            request.prefix_group = None  # computed on its own: a fork would not compute the prompt
        if request.sampling_params.seed is None:
            # Unseeded requests still get a per-request seed: the in-graph sampler keys its noise
            # on (seed, position), so even random sampling is independent of batch composition.
            request.sampling_params = request.sampling_params.clone(seed=int.from_bytes(os.urandom(8), "little") & _SEED_MASK)
        if request.arrival_time_s is None:
            request.arrival_time_s = time.monotonic()

    def _prepare_grammar(self, request: GenerateRequest) -> None:
        """Caller's thread: compile the request's grammar and make its matcher (never on the
        engine thread). A grammar on an engine without structured outputs, or one xgrammar
        refuses, is an InvalidRequestError naming the client's field."""
        spec = request.sampling_params.grammar
        if spec is None:
            request.grammar_state = None
            return
        if self.grammar_service is None:
            raise InvalidRequestError(STRUCTURED_OUTPUTS_OFF_MESSAGE.format(param=spec.param), field=spec.param)
        request.grammar_state = self.grammar_service.new_state(spec)

    def _prepare_penalties(self, request: GenerateRequest) -> None:
        """Caller's thread: the request's PenaltyState (its prompt counted once, here). A penalty on
        an engine without the penalties variant is an InvalidRequestError naming the field and
        the flag."""
        sp = request.sampling_params
        name = sp.penalty_field()
        request.penalty_state = None
        if name is None:
            return
        if not self.penalties:
            raise InvalidRequestError(PENALTIES_OFF_MESSAGE.format(param=name), field=name)
        from trnrt.engine.sample.penalties import PenaltyState

        request.penalty_state = PenaltyState.from_params(sp, request.prompt_token_ids, self.model_info.eos_token_ids)

    def _prepare_thinking(self, request: GenerateRequest) -> None:
        """Caller's thread: the request's ThinkingBudget when it sets max_thinking_tokens."""
        budget = request.sampling_params.max_thinking_tokens
        request.thinking_state = None
        if budget is None:
            return
        start_id, end_id = self._think_ids
        if end_id is None:
            raise InvalidRequestError("max_thinking_tokens needs a model whose tokenizer has a </think> token",
                                      field="max_thinking_tokens")
        from trnrt.engine.sample.thinking_budget import ThinkingBudget

        request.thinking_state = ThinkingBudget(budget, start_id, end_id, request.prompt_token_ids)

    def abort(self, request_id: str) -> None:
        """Abort one request by id (queued or running; a no-op otherwise). Asynchronous."""
        self._post(AbortMsg(request_id))

    def abort_requests(self, prefix: str = "", *, abort_all: bool = False, message: str = "Aborted",
                       timeout_s: float = 5.0) -> list[str]:
        """Abort every queued or running request whose id starts with `prefix`, or all with
        `abort_all` (SGLang's /abort_request); returns the aborted ids. See EngineClient."""
        if not abort_all and not prefix:
            return []  # SGLang: an empty rid without abort_all aborts nothing
        msg = AbortMatchingMsg(prefix=prefix, abort_all=abort_all, message=message,
                               waiting_message=ABORT_WAITING_MESSAGE, reply=Reply())
        return self._ask(msg, msg.reply, timeout_s, default=[])

    def flush_cache(self, timeout_s: float = 0.0) -> FlushResult:
        """Empty the caches if the engine is idle (SGLang's /flush_cache); see EngineClient.

        The caches today: the cache manager's free lists (reset to their initial order) and any
        per-request runner state; the prefix cache will join them.
        """
        timeout_s = max(0.0, float(timeout_s))
        if timeout_s == 0.0 and not self.is_idle():
            return FlushResult(False, FLUSH_BUSY_MESSAGE)  # refused without waiting for a step
        if not self.thread.is_alive():
            return FlushResult(False, FLUSH_BUSY_MESSAGE)
        msg = FlushCacheMsg(deadline=time.monotonic() + timeout_s if timeout_s else None)
        if threading.current_thread() is self.thread:
            self._on_flush(msg)
            self._check_pending_flush()
            return msg.reply.value or FlushResult(False, FLUSH_BUSY_MESSAGE)
        self._post(msg)
        # The engine thread answers a deferred flush at its deadline, between steps; if a step is
        # still running then, answer for it (the first answer wins, and the engine thread does not
        # flush once the reply is answered). An immediate flush waits for the engine thread to
        # take the message (it was idle a moment ago, but a step may have started since).
        if not msg.reply.wait(timeout_s + 0.25 if timeout_s else _REPLY_GRACE_S):
            msg.reply.set(FlushResult(False, FLUSH_TIMEOUT_MESSAGE if timeout_s else FLUSH_BUSY_MESSAGE))
        return msg.reply.value

    def load(self, *, fresh: bool = False, timeout_s: float = 1.0) -> EngineLoad:
        """The engine's load, as published after the last step (never waits for the engine thread).

        fresh=True asks the engine thread instead (after every earlier message: e.g. counts a
        request submitted just before), waiting up to `timeout_s`, else the published load.
        """
        base = self._load
        if fresh:
            msg = LoadQueryMsg()
            base = self._ask(msg, msg.reply, timeout_s, default=None) or self._load
        with self._live_lock:
            pending = len(self._live_ids)
        return base.replace(num_pending_reqs=pending, gen_throughput=self._gen_rate.rate())

    def server_info(self) -> dict:
        """The resolved settings (pure data from the immutable config; callable from any thread):
        SGLang's /server_info names at the top level, the full configs under `engine_config` and
        `scheduler_config`."""
        ecfg, scfg, info, cache = self.engine_config, self.scheduler_config, self.model_info, self.cache
        ecfg_d = {f.name: _jsonable(getattr(ecfg, f.name)) for f in dataclasses.fields(ecfg)}
        ecfg_d["compiler_args"] = {b: json.loads(a) for b, a in ecfg.compiler_args}
        return {
            "model_path": info.model_path,
            "served_model_name": info.served_model_name,
            "preset": info.preset,
            "backend": info.backend,
            "compiled": info.compiled,
            "vocab_size": info.vocab_size,
            "eos_token_ids": list(info.eos_token_ids),
            "context_length": scfg.max_model_len,
            "max_req_input_len": scfg.max_model_len - 1,
            "max_total_num_tokens": cache.num_usable_blocks * cache.block_size,
            "page_size": cache.block_size,
            "max_running_requests": scfg.max_num_seqs,
            "max_prefill_tokens": scfg.max_num_batched_tokens,
            "chunked_prefill_size": scfg.max_prefill_tokens if scfg.chunked_prefill else -1,
            "stream_interval": self.stream_interval,
            "startup_time": self.startup_time_s,
            "engine_config": ecfg_d,
            "scheduler_config": {f.name: _jsonable(getattr(scfg, f.name)) for f in dataclasses.fields(scfg)},
            "disable_radix_cache": self.prefix_cache is None,
            "prefix_cache": self._prefix_cache_info(),
            # SGLang's names (None: off); speculative requests bypass the prefix cache
            **self._speculative_info(),
        }

    def _speculative_info(self) -> dict:
        spec = self.speculative_config
        if spec is None:
            return {"speculative_algorithm": None, "speculative_num_steps": None, "speculative_eagle_topk": None,
                    "speculative_num_draft_tokens": None, "speculative_min_accept_length": None}
        return {"speculative_algorithm": spec.algorithm, "speculative_num_steps": spec.num_steps,
                "speculative_eagle_topk": 1, "speculative_num_draft_tokens": spec.num_draft_tokens,
                "speculative_min_accept_length": spec.min_accept_length}

    def _prefix_cache_info(self) -> dict | None:
        pcc = self.prefix_cache_config
        if self.prefix_cache is None or pcc is None:
            return None
        d = {f.name: _jsonable(getattr(pcc, f.name)) for f in dataclasses.fields(pcc)}
        d["checkpoint_interval"] = self.scheduler.checkpoint_interval
        d["num_checkpoints"] = self.prefix_cache.checkpoints.size
        return d

    def is_idle(self) -> bool:
        """Nothing queued, running, or submitted and not yet taken from the inbox."""
        with self._live_lock:
            return not self._live_ids

    def stats(self) -> dict:
        """The /v1/stats document (trnrt.stats schema)."""
        return self.stats_collector.snapshot()

    def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Stop accepting, let in-flight requests run up to drain_timeout_s, abort the rest
        ("server shutting down", status 503), join the engine thread."""
        self._accepting = False
        deadline = time.monotonic() + max(0.0, drain_timeout_s)
        while time.monotonic() < deadline and not self.is_idle() and self.thread.is_alive():
            time.sleep(0.01)
        if self.thread.is_alive():
            msg = AbortMatchingMsg(abort_all=True, message=SHUTDOWN_MESSAGE, status_code=SHUTDOWN_STATUS_CODE,
                                   reply=Reply())
            self._ask(msg, msg.reply, 10.0, default=[])
        self._stop.set()
        self._wake.set()
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout=10)

    # -- inbox plumbing (client side) -------------------------------------------------------------

    def _post(self, msg) -> None:
        self._inbox.put(msg)
        self._wake.set()

    def _ask(self, msg, reply: Reply, timeout_s: float, default):
        """Post `msg` and wait up to timeout_s for the engine thread's answer. If it did not take
        the message in time, withdraw it (so it has no effect) and return `default`."""
        if threading.current_thread() is self.thread:
            self._handle(msg)  # called from the engine thread itself (a hook): answer inline
            return reply.value if reply.value is not None else default
        if not self.thread.is_alive():
            return default
        self._post(msg)
        deadline = time.monotonic() + max(0.0, timeout_s)
        while not reply.wait(0.05):
            if time.monotonic() >= deadline or not self.thread.is_alive():
                if reply.cancel():
                    log.warning("engine thread did not take %s within %.1f s", type(msg).__name__, timeout_s)
                    return default
                # Claimed: the engine thread is acting on it right now; the answer is moments away.
                reply.wait(_REPLY_GRACE_S)
                break
        return reply.value if reply.value is not None else default

    # -- engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        # torch's thread count is per Python thread once it has run torch work: set the engine
        # thread's own (trnrt.engine.runner.threads; a no-op without torch for the scripted runner).
        try:
            apply_torch_threads(getattr(self.runner, "torch_threads", None))
            # ModelRunner: the whole thread in inference mode (the runner then skips entering it
            # every step). The scripted runner needs nothing (and no torch).
            enter = getattr(self.runner, "thread_context", None)
            with enter() if enter is not None else contextlib.nullcontext():
                try:
                    self._warm_up()
                    self._loop()
                finally:
                    self._close()
        finally:
            self._warmed.set()  # whatever happened, nobody waits for a warm-up that will not come

    def _warm_up(self) -> None:
        """The runner's warm-up (every compiled graph called on padding rows, at the engine
        thread's torch threads), before the first step; a failure is logged, never fatal (the
        graphs then do their first-call work on requests, as before)."""
        warm = getattr(self.runner, "warm_up", None)
        try:
            if warm is not None and getattr(self.runner, "compiled", None):
                t0 = time.monotonic()
                times = warm()
                self.warmup_s = time.monotonic() - t0
                log.info("warm-up: %d compiled graphs called in %.2f s", len(times), self.warmup_s)
        except Exception:  # noqa: BLE001 - a warm-up is an optimisation
            log.warning("warm-up of the compiled graphs failed; serving without it", exc_info=True)
        finally:
            self._warmed.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._drain_inbox()
                self._check_pending_flush()
                if not self.scheduler.has_unfinished_requests():
                    self._update_live()
                    self._flush_turn()
                    self._wake.wait(timeout=0.05)
                    self._wake.clear()
                    continue
                self.step()
                self._check_pending_flush()
                self._flush_turn()
            except Exception:  # never let the engine thread die; fail what was in flight
                log.exception("engine step failed; aborting in-flight requests")
                for rid in list(self._streams):
                    self._abort(rid, "internal engine error", finish_type="error")
                self._flush_turn()

    def _flush_turn(self) -> None:
        self._deliver_finished()
        if self.flush_outputs is not None:
            self.flush_outputs()

    def _close(self) -> None:
        """The loop ended (shutdown): end every stream still open and answer every question still
        in the inbox, so no client thread waits forever on a stopped engine."""
        try:
            self._accepting = False
            for rid in list(self._streams):
                self._abort(rid, SHUTDOWN_MESSAGE, status_code=SHUTDOWN_STATUS_CODE)
            while True:
                try:
                    msg = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(msg, SubmitMsg):
                    reason = FinishReason("abort", message=SHUTDOWN_MESSAGE, status_code=SHUTDOWN_STATUS_CODE)
                    for request, stream in zip(msg.requests, msg.streams):
                        self._finish_stream(request.request_id, stream, RequestOutput(
                            request.request_id, finished=True, finish_reason=reason,
                            num_prompt_tokens=len(request.prompt_token_ids)))
                elif isinstance(msg, AbortMatchingMsg) and msg.reply is not None:
                    msg.reply.set([])
                elif isinstance(msg, FlushCacheMsg):
                    msg.reply.set(FlushResult(False, FLUSH_BUSY_MESSAGE))
                elif isinstance(msg, LoadQueryMsg):
                    msg.reply.set(self._compute_load())
            if self._pending_flush is not None:
                self._pending_flush.reply.set(FlushResult(False, FLUSH_TIMEOUT_MESSAGE))
                self._pending_flush = None
            self._update_live()
            self._flush_turn()
        except Exception:  # best effort at exit
            log.exception("engine shutdown cleanup failed")

    def _drain_inbox(self) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._handle(msg)

    def _handle(self, msg) -> None:
        if isinstance(msg, SubmitMsg):
            for request, stream in zip(msg.requests, msg.streams):
                try:
                    self._add(request, stream)
                except Exception as e:  # one bad request must not strand the rest of its batch
                    log.exception("could not add request %s", request.request_id)
                    message = f"internal engine error: {type(e).__name__}: {e}"
                    if request.request_id in self._streams:
                        self._abort(request.request_id, message, finish_type="error")
                    else:  # failed before it was tracked
                        self.scheduler.abort(request.request_id, message)
                        self._finish_stream(request.request_id, stream, RequestOutput(
                            request.request_id, finished=True, error=message,
                            finish_reason=FinishReason("abort", message=message)))
        elif isinstance(msg, AbortMsg):
            self._abort(msg.request_id, msg.message)
        elif isinstance(msg, AbortMatchingMsg):
            self._on_abort_matching(msg)
        elif isinstance(msg, FlushCacheMsg):
            self._on_flush(msg)
        elif isinstance(msg, LoadQueryMsg):
            if msg.reply.claim():
                msg.reply.set(self._compute_load())
        else:
            log.error("engine inbox: unknown message %r", msg)

    def _add(self, request: GenerateRequest, stream: OutputStream) -> None:
        rid = request.request_id
        try:
            seq = self.scheduler.add_request(request, speculative=self.speculative_ok(request))
        except InvalidRequestError as e:
            self._finish_stream(rid, stream, RequestOutput(
                rid, finished=True, finish_reason=FinishReason("abort", message=str(e)), error=str(e)))
            return
        for displaced in self.scheduler.take_finished():  # a full queue gave its place to this one
            self._abort(displaced.request_id, displaced.finish_reason.message or "aborted",
                        status_code=displaced.finish_reason.status_code)
        # Stamp the arrival at submit() (arrival_time_s, time.monotonic like the collector's clock),
        # not now: a request submitted mid-step waited in the inbox, and TTFT/queue/E2E include that.
        self.stats_collector.on_request_arrived(rid, len(request.prompt_token_ids), now=request.arrival_time_s)
        if seq.is_finished:  # max_new_tokens == 0
            self.stats_collector.on_request_finished(rid, seq.finish_reason.type)
            self._finish_stream(rid, stream, RequestOutput(rid, finished=True, finish_reason=seq.finish_reason,
                                                           num_prompt_tokens=seq.num_prompt_tokens))
            return
        sp = request.sampling_params
        self._streams[rid] = stream
        if request.grammar_state is not None:
            self._grammars[rid] = request.grammar_state
            request.grammar_state = None  # the engine thread owns it now
        if request.penalty_state is not None:
            self._penalties[rid] = request.penalty_state
            request.penalty_state = None
        if request.thinking_state is not None:
            self._thinking[rid] = request.thinking_state
            request.thinking_state = None
        if sp.prompt_logprobs is not None:
            from trnrt.engine.sample.prompt_logprob_collector import PromptLogprobCollector

            self._prompt_lps[rid] = PromptLogprobCollector(request.prompt_token_ids, sp.prompt_logprobs,
                                                           sp.prompt_logprobs_start)
        self._detoks[rid] = IncrementalDetokenizer(
            self._decoder, request.prompt_token_ids, skip_special_tokens=sp.skip_special_tokens, stop=sp.stop,
            stop_regex=sp.stop_regex, include_stop_str_in_output=sp.include_stop_str_in_output,
            # nobody reads a non-streamed request's text before it ends: decode it once, at the end
            deferred=not request.stream and not any(sp.stop) and not sp.stop_regex,
            min_tokens=sp.min_new_tokens,
        )

    def _judge_speculation(self, scheduled, results) -> None:
        """Dynamic speculation (trnrt.engine.spec.policy): take this step's measured break-even
        (the runner's StepCosts), record the step's verifies, then move the requests whose drafts
        do not pay to plain steps; the drafter forgets them."""
        policy = self.spec_policy
        last = getattr(self.runner, "last_spec", None)
        if last is not None and last.line is not None:
            policy.break_even = last.line
        verified = [(s.request_id, r.num_accepted) for s, r in zip(scheduled, results)
                    if s.speculative and not s.is_prefill and getattr(r, "num_drafts", 0)]
        for rid, num_accepted in verified:
            policy.record(rid, num_accepted)
        for rid, _ in verified:  # judged on the whole step's evidence
            if policy.should_fall_back(rid) and self.scheduler.stop_speculating(rid):
                self.num_spec_fallbacks += 1
                policy.fell_back(rid)
                self.runner.release([rid])

    def _dynamic_speculation_status(self) -> dict:
        """The /v1/stats `speculative_dynamic` section of an engine (dynamic speculation on):
        where the line stands and what it did. Read from the HTTP side: plain values and copies."""
        policy = self.spec_policy
        costs = getattr(self.runner, "step_costs", None)
        by_batch = {} if costs is None else {
            str(b): {k: (None if v is None else round(v, 6)) for k, v in c.items()} for b, c in costs.snapshot().items()}
        return {
            "line": policy.line,
            "min_accept_length": policy.min_accept_length,
            "recent_accept_length": policy.recent_accept_length,
            "num_fallbacks": self.num_spec_fallbacks,
            "num_started_plain": policy.num_gated,
            "probe_every": policy.probe_interval,
            "by_batch_bucket": by_batch,
        }

    def speculative_ok(self, request: GenerateRequest) -> bool:
        """Whether a request's decode steps may be speculative: speculative decoding is on and
        nothing the verify cannot serve is asked: per-token logits processing (a grammar,
        penalties, a thinking budget), logprobs, prompt logprobs, or n > 1 prompt sharing. Those
        requests run plain steps beside the speculative ones (as SGLang's dynamic fallback)."""
        if not self.scheduler_config.num_speculative_tokens:
            return False
        sp = request.sampling_params
        if not (request.grammar_state is None and request.penalty_state is None and request.thinking_state is None
                and sp.logprobs is None and sp.prompt_logprobs is None and request.prefix_group is None):
            return False
        if self.spec_policy is None:
            return True
        # the break-even of the decode step it would join: the running and waiting requests (a
        # batch submitted at once waits together), it speculating
        live = [*self.scheduler.running, *self.scheduler.waiting]
        n_spec = sum(1 for s in live if s.speculative)
        costs = getattr(self.runner, "step_costs", None)
        line = costs.line(len(live) - n_spec, n_spec + 1) if costs is not None else None
        return self.spec_policy.admit(request.request_id, line)

    def _finish_stream(self, rid: str, stream: OutputStream, output: RequestOutput) -> None:
        """Put a request's finished output on its stream; every finish goes through here.

        The id leaves the live set first: a client that reads the finish and resubmits the same
        id at once must be accepted. The runner forgets the request too.
        """
        with self._live_lock:
            self._live_ids.discard(rid)
        self._release_runner(rid)
        # Delivered once the live stats no longer count it (`_update_live`): a client that reads
        # the finish and then /v1/stats sees the request gone and its pages free.
        self._finished_out.append((stream, output))

    def _deliver_finished(self) -> None:
        """Engine thread: put the finished outputs held by `_finish_stream` on their streams."""
        done, self._finished_out = self._finished_out, []
        for stream, output in done:
            stream.put(output)

    def _release_runner(self, rid: str) -> None:
        if self.spec_policy is not None:
            self.spec_policy.forget(rid)
        self._grammars.pop(rid, None)
        self._prompt_lps.pop(rid, None)
        self._penalties.pop(rid, None)
        self._thinking.pop(rid, None)
        release = getattr(self.runner, "release", None)
        if release is not None:
            release([rid])

    def _abort(self, rid: str, message: str, finish_type: str = "abort", status_code: int | None = None) -> None:
        seq = self.scheduler.abort(rid, message)
        stream = self._streams.pop(rid, None)
        detok = self._detoks.pop(rid, None)
        if stream is None:
            if seq is not None:
                self._release_runner(rid)
            return
        # a deferred detokenizer has emitted nothing yet: the text so far goes with the abort
        text = detok.flush() if detok is not None and detok.deferred else ""
        n_out = seq.num_output_tokens if seq is not None else 0
        n_prompt = seq.num_prompt_tokens if seq is not None else 0
        self.stats_collector.on_request_finished(rid, finish_type)
        self._finish_stream(rid, stream, RequestOutput(
            rid, new_text=text, finished=True,
            finish_reason=FinishReason("abort", message=message, status_code=status_code),
            num_prompt_tokens=n_prompt, num_output_tokens=n_out,
            error=message if finish_type == "error" else None,
        ))

    def _on_abort_matching(self, msg: AbortMatchingMsg) -> None:
        if msg.reply is not None and not msg.reply.claim():
            return  # the caller gave up before the engine got here: abort nothing
        aborted = []
        for rid in list(self._streams):
            if not msg.matches(rid):
                continue
            seq = self.scheduler.get_sequence(rid)
            waiting = seq is None or seq.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED)
            text = msg.waiting_message if waiting and msg.waiting_message is not None else msg.message
            self._abort(rid, text, status_code=msg.status_code)
            aborted.append(rid)
        if aborted:
            self._update_live()
        if msg.reply is not None:
            msg.reply.set(aborted)

    # -- flush ------------------------------------------------------------------------------------

    def _is_idle_here(self) -> bool:
        """Engine thread: nothing in the scheduler and nothing submitted still to come."""
        return not self.scheduler.has_unfinished_requests() and not self._streams and self.is_idle()

    def _on_flush(self, msg: FlushCacheMsg) -> None:
        if not msg.reply.claim():
            return
        if self._is_idle_here():
            msg.reply.set(self._flush_caches())
        elif msg.deadline is None:
            msg.reply.set(FlushResult(False, FLUSH_BUSY_MESSAGE))
        elif self._pending_flush is not None and not self._pending_flush.reply.done:
            msg.reply.set(FlushResult(False, FLUSH_IN_PROGRESS_MESSAGE))
        else:
            # SGLang does not pause admission while a flush waits: it runs when the work drains.
            self._pending_flush = msg

    def _check_pending_flush(self) -> None:
        msg = self._pending_flush
        if msg is None:
            return
        if msg.reply.done:  # the caller gave up and answered itself
            self._pending_flush = None
        elif self._is_idle_here():
            self._pending_flush = None
            msg.reply.set(self._flush_caches())
        elif time.monotonic() >= msg.deadline:
            self._pending_flush = None
            msg.reply.set(FlushResult(False, FLUSH_TIMEOUT_MESSAGE))

    def _flush_caches(self) -> FlushResult:
        """Engine thread, idle: empty every cache (today the allocator's free lists and the runner's
        per-request state; the prefix cache joins here). Cumulative stats counters are not reset:
        Prometheus counters only go up."""
        try:
            self.scheduler.flush_prefix_cache()
            self.cache.reset()
        except CacheIntegrityError:  # a page or slot still held at idle: a leak, not a cache
            log.exception("cache flush refused: the allocator's books do not balance at idle")
            return FlushResult(False, FLUSH_BUSY_MESSAGE)
        flush = getattr(self.runner, "flush_cache", None)
        if flush is not None:
            flush()
        self._update_live()
        log.info("cache flushed")
        return FlushResult(True, FLUSH_OK_MESSAGE)

    # -- steps ------------------------------------------------------------------------------------

    def step(self) -> None:
        """One scheduler step: schedule, run the model, emit outputs."""
        sched_out = self.scheduler.schedule()
        self.num_steps += 1
        if sched_out.is_empty:
            if sched_out.cache_ops:  # tier copies queued by the last update (write-through)
                self._apply_cache_ops(sched_out.cache_ops)
            self._update_live()
            return
        # What runs now (admissions, pages just allocated) is the load for the whole step: publish
        # it before a step that may take long, for the router polling load().
        self._publish_load()
        for s in sched_out.scheduled:
            if s.is_prefill:  # only a prefill chunk can be a request's first service (queue time)
                self.stats_collector.on_request_scheduled(s.request_id)
        for rid in sched_out.preempted_request_ids:
            self.stats_collector.on_request_preempted(rid)
        runner_out = self._execute(sched_out)
        now = time.monotonic()
        updates = self.scheduler.update_from_output(sched_out, runner_out)
        if self._cache_poisoned:
            self._cache_poisoned = False
            log.error("prefix cache copy failed: dropping every cached prefix no request is using")
            self.prefix_cache.invalidate()
        produced = [(u.request_id, len(u.new_token_ids)) for u in updates if u.error is None and u.new_token_ids]
        self.stats_collector.on_tokens_many(produced, now=now)
        if produced:
            self._gen_rate.add(sum(n for _, n in produced), now)
        for u in updates:
            self._emit(u, now)
        # The load is published before the next step (or when the engine goes idle): once per
        # step is enough, and it walks every live request.
        self._update_live(publish_load=False)

    def _execute(self, sched_out: SchedulerOutput) -> RunnerOutput:
        if sched_out.cache_ops and not self._apply_cache_ops(sched_out.cache_ops):
            self._cache_poisoned = True  # invalidated after this step's requests are released
            msg = "prefix cache copy failed"
            return RunnerOutput(sampled_token_ids=[None] * len(sched_out.scheduled), logprobs=None,
                                failed={s.request_id: msg for s in sched_out.scheduled})
        rows = []
        for s in sched_out.scheduled:
            sp = s.sampling_params
            rows.append(RowInput(
                token_ids=s.token_ids, start_pos=s.num_computed_tokens, block_ids=s.block_table, slot_id=s.slot_id,
                temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p, seed=sp.seed or 0,
                num_logprobs=sp.logprobs, request_id=s.request_id, do_sample=s.do_sample,
                token_bitmask=self._grammar_mask(s.request_id) if s.do_sample and self._grammars else None,
                penalties=self._penalties.get(s.request_id) if s.do_sample and self._penalties else None,
                speculative=s.speculative, spec_decode=s.speculative and not s.is_prefill,
                num_lookahead=s.num_lookahead, next_token_id=s.next_token_id,
            ))
            if self._prompt_lps and s.is_prefill:
                col = self._prompt_lps.get(s.request_id)
                if col is not None:
                    rows[-1].prompt_next_ids = col.next_ids(s.num_computed_tokens, len(s.token_ids))
                    rows[-1].num_prompt_logprobs = col.num_top
        try:
            results = self.runner.execute(rows)
        except Exception as e:  # the step failed: fail the requests in it, keep serving the rest
            log.exception("model step failed")
            msg = f"model step failed: {type(e).__name__}: {e}"
            return RunnerOutput(sampled_token_ids=[None] * len(rows), logprobs=None,
                                failed={s.request_id: msg for s in sched_out.scheduled})
        if sched_out.snapshot_ops and not self._apply_cache_ops(sched_out.snapshot_ops):
            # a checkpoint that may be wrong must not be cached: fail the rows that took one
            snap = {s.request_id for s in sched_out.scheduled
                    if s.request_id in self.scheduler._pending_snapshots}
            for rid in snap:
                self.scheduler._drop_snapshot(rid)
        # A runner may fail single rows (RowResult.error): those requests finish with the error.
        failed = {s.request_id: r.error for s, r in zip(sched_out.scheduled, results)
                  if getattr(r, "error", None) is not None}
        if self._prompt_lps:
            for s, row, r in zip(sched_out.scheduled, rows, results):
                if row.prompt_next_ids is not None and s.request_id not in failed:
                    if r.prompt_logprobs is None or len(r.prompt_logprobs) != len(row.token_ids):
                        failed[s.request_id] = "the model runner returned no prompt logprobs"
                    else:
                        self._prompt_lps[s.request_id].record(s.num_computed_tokens, r.prompt_logprobs)
        sampled = [r.token_id if s.do_sample else None for s, r in zip(sched_out.scheduled, results)]
        logprobs = [r.logprob if s.do_sample else None for s, r in zip(sched_out.scheduled, results)]
        if self._thinking:
            self._force_think_ends(sched_out.scheduled, sampled, logprobs)
        extra = None
        if self.scheduler_config.num_speculative_tokens:
            extra = [list(getattr(r, "extra_token_ids", ())) if s.do_sample else []
                     for s, r in zip(sched_out.scheduled, results)]
            if self.spec_policy is not None:
                self._judge_speculation(sched_out.scheduled, results)
            spec = getattr(self.runner, "last_spec", None)
            if spec is not None and spec.num_verifies:
                self.stats_collector.on_spec_step(spec.num_verifies, spec.num_draft_tokens, spec.num_accepted_tokens,
                                                  spec.accepted_per_position)
        return RunnerOutput(sampled_token_ids=sampled, logprobs=logprobs, failed=failed, extra_token_ids=extra)

    def _force_think_ends(self, scheduled, sampled: list, logprobs: list) -> None:
        """Thinking budgets: a row whose request spent its budget while reasoning gets `</think>`
        instead of the sampled token, with logprob 0.0 (a point mass; see thinking_budget)."""
        for i, s in enumerate(scheduled):
            state = self._thinking.get(s.request_id)
            if state is None or sampled[i] is None:
                continue
            forced = state.forced_token()
            if forced is None:
                continue
            self.num_forced_think_ends += 1
            sampled[i] = forced
            if logprobs[i] is not None:
                logprobs[i] = TokenLogprob(token_id=forced, logprob=0.0, top=[(forced, 0.0)])

    def _grammar_mask(self, rid: str):
        """The packed next-token mask of a request with a grammar (None: none, or not applying yet)."""
        state = self._grammars.get(rid)
        return None if state is None else state.next_mask()

    def _grammar_advance(self, rid: str, token_ids: list[int]) -> FinishReason | None:
        """Accept a request's new tokens in its matcher and fill the next mask; a "stop" when the
        grammar cannot go on (a dead end: no token allowed; or a token it rejects) instead of
        sampling from an all -inf row next step."""
        state = self._grammars.get(rid)
        if state is None:
            return None
        for t in token_ids:
            if not state.accept(t):
                log.warning("request %s: the grammar rejected sampled token %d; ending it", rid, t)
                return FinishReason("stop")
        state.next_mask()
        return FinishReason("stop") if state.dead else None

    def _advance_states(self, rid: str, token_ids: list[int]) -> None:
        """Count a request's new tokens in its penalty state and thinking budget."""
        p = self._penalties.get(rid)
        if p is not None:
            p.add(token_ids)
        t = self._thinking.get(rid)
        if t is not None:
            t.advance(token_ids)

    def _apply_cache_ops(self, ops) -> bool:
        """Run the prefix cache's state copies on the runner. False (logged) if they failed."""
        apply = getattr(self.runner, "apply_cache_ops", None)
        if apply is None:
            return True
        try:
            apply(ops)
            return True
        except Exception:
            log.exception("prefix cache copy failed")
            return False

    def _emit(self, u, now: float) -> None:
        rid = u.request_id
        stream = self._streams.get(rid)
        detok = self._detoks.get(rid)
        if stream is None or detok is None:
            return
        if u.error is not None:
            self._streams.pop(rid, None)
            self._detoks.pop(rid, None)
            text = detok.flush() if detok.deferred else ""
            self.stats_collector.on_request_finished(rid, "error")
            self._finish_stream(rid, stream, RequestOutput(
                rid, new_text=text, finished=True, finish_reason=FinishReason("abort", message=u.error),
                error=u.error, num_prompt_tokens=u.seq.num_prompt_tokens, num_output_tokens=u.seq.num_output_tokens))
            return
        if self._penalties or self._thinking:
            self._advance_states(rid, u.new_token_ids)
        text = detok.step(u.new_token_ids, exclude_last=is_token_stop(u.finish_reason))
        reason = StopChecker.merge(u.finish_reason, detok.matched_stop)
        if reason is None and self._grammars:
            reason = self._grammar_advance(rid, u.new_token_ids)
        if reason is not None and not u.finished:  # a stop string ended a live request
            self.scheduler.finish_request(rid, reason)
        if reason is not None:
            text += detok.flush()
        seq = u.seq
        out = RequestOutput(
            rid, new_token_ids=list(u.new_token_ids), new_text=text,
            new_logprobs=list(u.new_logprobs) if seq.sampling_params.logprobs is not None else None,
            finished=reason is not None, finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens, num_cached_tokens_host=seq.num_cached_tokens_host,
        )
        if self._prompt_lps:
            col = self._prompt_lps.pop(rid, None)
            if col is not None:  # the first output after the prompt: every position was scored
                col.delivered = True
                out.prompt_logprobs = col.entries()
        if reason is None:
            stream.put(out)
            return
        self._streams.pop(rid, None)
        self._detoks.pop(rid, None)
        self.stats_collector.on_request_finished(rid, reason.type, num_cached_tokens=seq.num_cached_tokens)
        self._finish_stream(rid, stream, out)

    # -- published state (read by any thread) -----------------------------------------------------

    def _update_live(self, publish_load: bool = True) -> None:
        c = self.cache
        tokens_in_flight = sum(s.num_tokens for s in self.scheduler.running)
        self.stats_collector.set_live(
            running=self.scheduler.num_running, queued=self.scheduler.num_waiting,
            pages_used=self._used_pages(), pages_total=c.num_usable_blocks,
            slots_used=c.num_used_slots, slots_total=c.num_usable_slots, tokens_in_flight=tokens_in_flight,
        )
        if publish_load:
            self._publish_load()
        self._deliver_finished()

    def _publish_load(self) -> None:
        # One reference assignment: a reader on another thread sees the old or the new load, whole.
        self._load = self._compute_load()

    def _compute_load(self) -> EngineLoad:
        """Engine thread: the EngineLoad of this moment (gen_throughput and num_pending_reqs are
        filled in by `load()` on the reading thread)."""
        c, s = self.cache, self.scheduler
        page = c.block_size
        used_pages = self._used_pages()
        used_tokens = used_pages * page
        max_tokens = c.num_usable_blocks * page
        spec = self.stats_collector.spec_summary()
        return EngineLoad(
            num_running_reqs=s.num_running,
            num_waiting_reqs=s.num_waiting,
            num_used_tokens=used_tokens,
            num_total_tokens=sum(seq.num_tokens for seq in s.requests.values()),
            # what the waiting requests must prefill: their prompts (prompt + output once preempted)
            num_waiting_uncached_tokens=sum(seq.num_tokens for seq in s.waiting),
            max_total_num_tokens=max_tokens,
            max_running_requests=self.scheduler_config.max_num_seqs,
            token_usage=used_tokens / max_tokens if max_tokens else 0.0,
            num_used_pages=used_pages,
            num_total_pages=c.num_usable_blocks,
            num_used_slots=c.num_used_slots,
            num_total_slots=c.num_usable_slots,
            page_size=page,
            spec_accept_length=spec["avg_accept_length"],
            spec_accept_rate=spec["accept_rate"],
            **self._prefix_cache_load(),
        )

    def _used_pages(self) -> int:
        """Pages in use by requests. Cached pages no request holds are free for the asking (evicted
        on demand), so they count as free, as in SGLang's token usage; the cache's own gauges
        (num_cached_pages, num_evictable_pages) report them."""
        pc = self.prefix_cache
        return self.cache.num_used_blocks - (pc.evictable_pages() if pc is not None else 0)

    def _prefix_cache_load(self) -> dict:
        pc = self.prefix_cache
        if pc is None:
            return {}
        hp, hc = pc.host_pages, pc.host_checkpoints
        return dict(
            prefix_cache=True, cache_hit_rate=self.scheduler.cache_hit_rate,
            num_cached_pages=pc.num_device_pages(), num_evictable_pages=pc.evictable_pages(),
            num_used_checkpoints=pc.checkpoints.num_used, num_total_checkpoints=pc.checkpoints.size,
            num_host_used_pages=hp.num_used if hp else 0, num_host_total_pages=hp.size if hp else 0,
            num_host_used_checkpoints=hc.num_used if hc else 0, num_host_total_checkpoints=hc.size if hc else 0,
        )
