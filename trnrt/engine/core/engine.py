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

`Engine` holds the state (`__init__` below); its methods live in one mixin per job, each module's
docstring naming the attributes it reads and writes:

- trnrt.engine.core.engine_builder: `from_model_dir`, `scripted`, the prefix cache / grammar parts
  (the configs they resolve: trnrt.engine.core.engine_setup);
- trnrt.engine.core.intake: `submit` / `submit_many`, validation, the inbox add;
- trnrt.engine.core.engine_loop: the engine thread's loop, inbox dispatch and `step`;
- trnrt.engine.core.output_processor: outputs onto streams, finishes, live stats and load;
- trnrt.engine.core.admin: abort, flush_cache, load, server_info, stats, shutdown and their handlers;
- trnrt.engine.core.speculation: which requests speculate, dynamic speculation's verdicts.
"""

from __future__ import annotations

import collections
import queue
import threading
from typing import TYPE_CHECKING, Callable

from trnrt.config import EngineConfig
from trnrt.engine.cache.cache_manager import CacheManager
from trnrt.engine.core.admin import AdminMixin
from trnrt.engine.core.client import EngineLoad, ModelInfo
from trnrt.engine.core.engine_builder import EngineBuilderMixin
from trnrt.engine.core.engine_loop import EngineLoopMixin
from trnrt.engine.core.engine_setup import PENALTIES, fast_decoder, special_token_id
from trnrt.engine.core.intake import IntakeMixin
from trnrt.engine.core.messages import FlushCacheMsg
from trnrt.engine.core.output_processor import GEN_THROUGHPUT_WINDOW_S, OutputProcessorMixin, TokenRate
from trnrt.engine.core.speculation import SpeculationMixin
from trnrt.engine.output.detokenizer import IncrementalDetokenizer
from trnrt.engine.output.outputs import RequestOutput
from trnrt.engine.output.stream import OutputStream
from trnrt.engine.request import GenerateRequest
from trnrt.engine.sample.prompt_logprob_collector import PROMPT_LOGPROBS
from trnrt.engine.sched.scheduler import Scheduler, SchedulerConfig
from trnrt.engine.spec.policy import DynamicSpeculation

if TYPE_CHECKING:
    from trnrt.engine.cache.cache_config import PrefixCacheConfig  # the model runner imports torch; the engine itself need not (scripted runs)
    from trnrt.engine.runner.model_runner import ModelRunner


class Engine(EngineBuilderMixin, IntakeMixin, EngineLoopMixin, OutputProcessorMixin, AdminMixin, SpeculationMixin):
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
        self._gen_rate = TokenRate(GEN_THROUGHPUT_WINDOW_S)
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

    def wait_warm(self, timeout: float | None = None) -> bool:
        """Wait for the engine thread's warm-up (Engine._warm_up) to be over; False on timeout."""
        return self._warmed.wait(timeout)
