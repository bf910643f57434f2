"""How an engine is built: `Engine.from_model_dir` (the checkpoint, a ModelRunner or a
SpecModelRunner) and `Engine.scripted` (the scripted runner, no torch), and the parts `__init__`
builds from the configs (the prefix cache with its pools, the grammar compiler).

EngineBuilderMixin is one of the mixins of trnrt.engine.core.engine.Engine. The classmethods
resolve the configs (trnrt.engine.core.engine_setup), build the runner and call `cls(...)`; then
they set `speculative_config`, `spec_policy` and `startup_time_s` on the new engine and register
its speculative stats sections. `_build_prefix_cache` and `_build_grammar_service` run inside
`Engine.__init__`: they read `engine_config`, `model_info`, `tokenizer`, `runner` and `cache`,
write nothing, and return what `__init__` stores (`prefix_cache`, `grammar_service`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import TYPE_CHECKING, Callable, Self

from trnrt.config import EngineConfig
from trnrt.engine.core.client import ModelInfo
from trnrt.engine.core.engine_setup import (
    PENALTIES,
    STRUCTURED_OUTPUTS,
    default_checkpoint_interval,
    read_eos_token_ids,
    resolve_configs,
    with_flag,
    with_structured_outputs,
)
from trnrt.engine.runner.threads import count_params, resolve_torch_threads
from trnrt.engine.sample.prompt_logprob_collector import PROMPT_LOGPROBS
from trnrt.engine.sched.scheduler import SchedulerConfig
from trnrt.engine.spec.policy import DynamicSpeculation

if TYPE_CHECKING:
    from trnrt.engine.cache.cache_config import PrefixCacheConfig  # the model runner imports torch; the engine itself need not (scripted runs)
    from trnrt.engine.spec.config import SpeculativeConfig

log = logging.getLogger(__name__)

DEFAULT_SERVED_MODEL_NAME = "glm-5.3-flash-tiny"


class EngineBuilderMixin:
    """Engine's constructors and the cache / grammar parts its `__init__` builds."""

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
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        parallel=None,
    ) -> Self:
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

        quantization ("fp8" or None; `trnrt serve --quantization`): quantize a bf16 checkpoint's
        weights per 128x128 block at load; an FP8 checkpoint is FP8 without it (compiled: the
        FP8 graphs `trnrt compile` builds for that model, which the loader tells from the default
        ones by the manifest's quantization). kv_cache_dtype (`--kv-cache-dtype`, checked by
        trnrt.models.glm5_next.fp8.kv_dtype): auto / bf16 = the model's dtype; fp8_e4m3: the MLA
        latent and indexer key caches in float8_e4m3fn (fp8/kv_cache.py; compiled: the graphs of
        `trnrt compile --kv-cache-dtype fp8_e4m3`).

        compiled_loader(model, state, engine_config) -> {GraphSpec: callable} runs compiled graphs
        (the CLI passes trnrt.compile.load_compiled; the engine layer never imports compile). The
        cache sizes and max_model_len are graph inputs then, so they stay the preset's.

        stream_interval (SGLang's --stream-interval): a streamed request (GenerateRequest.stream)
        gets an output every `stream_interval` tokens (merged), and its final one; a non-streamed
        request gets its final output only.

        parallel (trnrt.engine.core.tp_config.ParallelConfig; `trnrt serve --tp-size N`): with
        tp_size > 1 this engine is rank 0: it starts the worker ranks and runs a MirroredRunner
        (trnrt.engine.core.tp_runner); its compiled_loader must then be a picklable rank loader
        (`tensor_parallel` true: trnrt.compile.tp_loader.RankCompiledLoader), which every rank
        calls with its own model (trnrt.engine.core.tp_compiled); tp_size 1 (or None) is the
        single-process path.
        """
        import torch
        from transformers import AutoTokenizer

        from trnrt.engine.runner.model_runner import ModelRunner
        from trnrt.models.glm5_next.state import ModelState
        from trnrt.models.glm5_next.loading import load_model
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
        if parallel is not None and parallel.enabled:
            if drafter_factory is not None:
                raise ValueError("--tp-size > 1 builds its drafter on every rank (no drafter_factory)")
            if compiled_loader is not None and not getattr(compiled_loader, "tensor_parallel", False):
                # the loader travels to every rank (pickled) and is called with that rank's model
                raise ValueError("--tp-size > 1 needs a rank loader of compiled graphs "
                                 "(trnrt.compile.tp_loader.RankCompiledLoader), not a one-process one")
            if compiled_loader is not None and (quantization or kv_cache_dtype == "fp8_e4m3"):
                raise ValueError("--tp-size > 1 with FP8 (--quantization / --kv-cache-dtype fp8_e4m3) runs eagerly: "
                                 "no FP8 graphs per rank are compiled")
            from trnrt.engine.core.tp_build import RankSetup
            from trnrt.engine.core.tp_launch import start_rank_zero
            from trnrt.models.glm5_next.fp8.kv_dtype import resolve_kv_cache_dtype
            from trnrt.models.glm5_next.fp8.rank_load import check_fp8_layout

            resolve_kv_cache_dtype(kv_cache_dtype, dtype)  # bad values fail here, before any rank starts
            check_fp8_layout(path, parallel.tp_size, parallel.ep_size, quantization)  # a split scale block
            setup = RankSetup(str(path), ecfg, speculative.num_steps if speculative is not None else None, device,
                              quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                              compiled_loader=compiled_loader, compiled_backend=compiled_backend)
            runner = start_rank_zero(parallel, setup)  # torch threads resolved per rank there
            model, compiled = runner.model, (runner.compiled or None)  # the same graphs on every rank
            mcfg = model.config
            if speculative is not None:
                scfg = dataclasses.replace(scfg, num_speculative_tokens=speculative.num_steps)
        else:
            from trnrt.models.glm5_next.fp8.kv_dtype import resolve_kv_cache_dtype

            fp8_kv = resolve_kv_cache_dtype(kv_cache_dtype, dtype) == torch.float8_e4m3fn
            model = load_model(path, dtype=dtype, device=device, load_mtp=speculative is not None,
                               quantization=quantization)
            mcfg = model.config
            state = ModelState.allocate(mcfg, ecfg.num_blocks, ecfg.block_size, ecfg.num_slots, dtype, device,
                                        mtp=speculative is not None)
            if fp8_kv:
                from trnrt.models.glm5_next.fp8.kv_cache import to_fp8_kv_state, use_fp8_kv_cache

                use_fp8_kv_cache(model)
                state = to_fp8_kv_state(state)
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
        if parallel is not None and parallel.enabled:
            engine.stats_collector.set_section("parallel", runner.stats)
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
    ) -> Self:
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

    # -- parts of __init__ ------------------------------------------------------------------------

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
            default_checkpoint_interval(ecfg)
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
