"""Offline benchmark (`trnrt bench`): prefill and decode throughput, optionally against transformers.

What is measured (docs/PERFORMANCE.md):
- trnrt prefill: time to first token of a batch of `batch` random prompts of `input_len` tokens,
  submitted together with `max_new_tokens=1, ignore_eos` (submit -> every stream finished);
  prefill_tok_s = prompt tokens / that time.
- trnrt decode: the same prompts with `max_new_tokens=output_len, ignore_eos`, greedy. The engine
  thread's `runner.execute` calls are timestamped; the steady state is every pair of consecutive
  steps that both hold only decode rows, and a step's time is the interval between their starts (so
  it includes scheduling, sampling, detokenization and output handling, not just the forward).
  decode_step_ms = mean interval, decode_tok_s = decode rows / summed intervals. With fewer than two
  decode steps (output_len 2) it falls back to (decode run - prefill run) / (output_len - 1).
- transformers (`compare_hf`): Glm5NextForConditionalGeneration from the same checkpoint, fp32, the
  same prompts in the same batches (equal lengths, so no padding). Prefill = one forward over the
  batch; decode step = (generate time - prefill) / (output_len - 1), generate being greedy with
  min_new_tokens = max_new_tokens = output_len.
Both sides are warmed up once (one batch, a few tokens) before anything is timed. `num_prompts`
prompts run in waves of `batch`; the figures aggregate every wave.

Threads: both sides run at the same torch intra-op thread count, reported as "threads" (top level
and in "hf"): `threads` when given, else what the engine would pick by itself
(trnrt.engine.runner.threads: $TRNRT_TORCH_THREADS, else 1 on the CPU for a model below 1e8
parameters, the physical cores for a larger one). torch's own default (one thread per core) made
the comparison unfair on a shared box: transformers' step went from ~11 ms to 0.15-1.5 s at two
threads while trnrt's stayed within ~3x, and the ratio read 151x.

torch and transformers are imported inside functions: the CLI imports nothing heavy at start-up.
"""

from __future__ import annotations

import math
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

# progress(description, completed_units, total_units)
ProgressFn = Callable[[str, int, int], None]
# compiled_loader(model, state, engine_config) -> {GraphSpec: callable}  (trnrt.compile.load_compiled)
CompiledLoader = Callable[[Any, Any, Any], dict]

RESULT_KEYS = ("batch", "input_len", "output_len", "prefill_tok_s", "decode_tok_s", "decode_step_ms", "threads")


class BenchError(ValueError):
    """A bench setting is out of range; `field` names the option."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


@dataclass
class _StepRecord:
    t_start: float
    t_end: float
    num_rows: int
    all_decode: bool


def make_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int = 0,
                 exclude_ids: set[int] | frozenset[int] = frozenset()) -> list[list[int]]:
    """`num_prompts` random prompts of exactly `input_len` token ids (seeded; special ids excluded)."""
    rng = random.Random(seed)
    allowed = [i for i in range(vocab_size) if i not in exclude_ids]
    return [[rng.choice(allowed) for _ in range(input_len)] for _ in range(num_prompts)]


def check_bench_args(batch: int, input_len: int, output_len: int, num_prompts: int | None) -> int:
    """Validate the sizes; return the effective num_prompts (default: batch)."""
    for name, v, lo in (("batch", batch, 1), ("input_len", input_len, 1), ("output_len", output_len, 2)):
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise BenchError(f"{name} must be an integer >= {lo}, got {v!r}", field=name)
    n = batch if num_prompts is None else num_prompts
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise BenchError(f"num_prompts must be an integer >= 1, got {num_prompts!r}", field="num_prompts")
    return n


def bench_engine_config(batch: int, input_len: int, output_len: int, base=None):
    """An EngineConfig that runs `batch` sequences of input_len + output_len tokens at once.

    `base` (default: the "default" preset, what `Engine.from_model_dir` and `trnrt serve` run) is
    widened where it is too small: max_model_len, a decode bucket for `batch`, slots and pages.
    An explicit preset (or a compiled one) is used as it is (see run_bench).
    """
    cfg = base or _default_preset()
    need_len = input_len + output_len
    max_len = max(cfg.max_model_len, -(-need_len // cfg.block_size) * cfg.block_size)
    buckets = cfg.decode_batch_buckets
    if batch > buckets[-1]:
        buckets = (*buckets, batch)
    per_seq = -(-max_len // cfg.block_size)
    blocks = max(cfg.num_blocks, 1 + max(per_seq, batch * -(-need_len // cfg.block_size)))
    slots = max(cfg.num_slots, batch + 1)
    return cfg.replace(max_model_len=max_len, decode_batch_buckets=buckets, num_blocks=blocks, num_slots=slots)


def _default_preset():
    from trnrt.config import EngineConfig
    from trnrt.config.presets import PresetError, load_preset

    try:
        return load_preset("default")
    except PresetError:  # no presets directory (an unusual install): the built-in defaults
        return EngineConfig()


def _ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None where either side has no rate: a short run on a busy machine can time a
    side's decode as zero (generate minus its prefill forward), and then there is no ratio to give."""
    return round(a / b, 3) if a is not None and b is not None and b > 0 else None


def run_bench(
    model_dir: str | None = None,
    *,
    batch: int = 8,
    input_len: int = 32,
    output_len: int = 32,
    num_prompts: int | None = None,
    compare_hf: bool = False,
    seed: int = 0,
    engine_config=None,
    compiled_loader: CompiledLoader | None = None,
    progress: ProgressFn | None = None,
    threads: int | None = None,
) -> dict:
    """Run the benchmark; return {batch, input_len, output_len, prefill_tok_s, decode_tok_s,
    decode_step_ms, threads} plus, with compare_hf, "hf" (the same fields for transformers) and
    "ratio" ({"prefill", "decode"}: trnrt / transformers throughput).

    engine_config: used as is when given (a preset, e.g. the compiled one); else bench_engine_config()
    (the default preset, widened to fit the run).
    compiled_loader: called with (model, state, engine_config) before the engine starts; its dict
    of compiled graphs replaces the eager step function for the specs it holds.
    threads: torch intra-op threads for the run, both sides (the process's setting is restored
    afterwards); None: the engine's own choice (trnrt.engine.runner.threads.resolve_torch_threads:
    $TRNRT_TORCH_THREADS, else the default for the backend and model size). "threads" in the
    result says which count both sides ran at.
    Raises BenchError (naming the field) for sizes the engine cannot run.
    """
    n_prompts = check_bench_args(batch, input_len, output_len, num_prompts)
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
        raise BenchError(f"threads must be an integer >= 1, got {threads!r}", field="threads")
    if threads is None:
        from trnrt.engine.runner.threads import resolve_torch_threads

        try:  # a bad $TRNRT_TORCH_THREADS fails here, before anything is loaded
            resolve_torch_threads("eager", "cpu")
        except ValueError as e:
            raise BenchError(str(e), field="threads") from None
    import torch

    before = torch.get_num_threads()
    try:
        return _run_bench(model_dir, batch, input_len, output_len, n_prompts, compare_hf, seed, engine_config,
                          compiled_loader, progress, threads)
    finally:
        torch.set_num_threads(before)


def bench_threads(requested: int | None, compiled: bool, model) -> int:
    """The torch thread count both sides of the bench run at (see the module doc)."""
    from trnrt.engine.runner.threads import count_params, resolve_torch_threads

    device = str(next(iter(model.parameters())).device) if count_params(model) else "cpu"
    return resolve_torch_threads("compiled" if compiled else "eager", device, requested, count_params(model))[0]


def _run_bench(model_dir, batch, input_len, output_len, n_prompts, compare_hf, seed, engine_config,
               compiled_loader, progress, threads) -> dict:
    from trnrt.models.paths import resolve_model_dir

    path = resolve_model_dir(model_dir)
    ecfg = engine_config or bench_engine_config(batch, input_len, output_len)
    if batch > ecfg.max_decode_batch:
        raise BenchError(f"batch {batch} exceeds the largest decode bucket {ecfg.max_decode_batch} of the preset",
                         field="batch")
    if input_len + output_len > ecfg.max_model_len:
        raise BenchError(f"input_len + output_len ({input_len + output_len}) exceeds max_model_len "
                         f"{ecfg.max_model_len}", field="input_len")
    if batch > ecfg.num_slots - 1:
        raise BenchError(f"batch {batch} exceeds the {ecfg.num_slots - 1} sequence slots", field="batch")
    pages = batch * -(-(input_len + output_len) // ecfg.block_size)
    if pages > ecfg.num_blocks - 1:  # the run would preempt, and time recomputation
        raise BenchError(f"batch {batch} x {input_len + output_len} tokens needs {pages} pages, the cache has "
                         f"{ecfg.num_blocks - 1}", field="batch")

    waves = math.ceil(n_prompts / batch)
    # units: trnrt warm-up + (prefill + decode) per wave; the same again for transformers
    total = (1 + 2 * waves) * (2 if compare_hf else 1)
    done = 0

    def tick(desc: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(desc, done, total)

    if progress is not None:
        progress("loading trnrt", 0, total)
    engine, n_threads = _build_engine(path, ecfg, batch, compiled_loader, threads)
    try:
        special = set(getattr(engine.tokenizer, "all_special_ids", []) or []) | set(engine.model_info.eos_token_ids)
        prompts = make_prompts(n_prompts, input_len, engine.model_info.vocab_size, seed, frozenset(special))
        result = _bench_trnrt(engine, prompts, batch, output_len, tick)
    finally:
        engine.shutdown()
    # result["threads"]: what the engine thread itself reported during the timed steps
    out = {"batch": batch, "input_len": input_len, "output_len": output_len, **result}
    if compare_hf:
        if progress is not None:
            progress("loading transformers", done, total)
        import torch

        torch.set_num_threads(n_threads)  # transformers runs on this (the main) thread
        hf = _bench_hf(path, prompts, batch, output_len, tick)
        hf["threads"] = torch.get_num_threads()
        out["hf"] = {"batch": batch, "input_len": input_len, "output_len": output_len, **hf}
        out["ratio"] = {"prefill": _ratio(out["prefill_tok_s"], hf["prefill_tok_s"]),
                        "decode": _ratio(out["decode_tok_s"], hf["decode_tok_s"])}
    if progress is not None:
        progress(threads_note(out), total, total)
    return out


def threads_note(result: dict) -> str:
    """One line saying which torch thread count each side ran at (the bench's last progress line)."""
    t, hf = result.get("threads"), (result.get("hf") or {}).get("threads")
    if "hf" not in result:
        return f"done: torch threads {t}"
    if hf == t:
        return f"done: torch threads {t}, both sides"
    return f"done: torch threads trnrt {t}, transformers {hf}"


def _build_engine(path, ecfg, batch: int, compiled_loader: CompiledLoader | None, threads: int | None):
    """The engine, started at the bench's thread count; returns (engine, that count)."""
    import dataclasses

    import torch

    from trnrt.engine.core.engine import Engine
    from trnrt.engine.sched.scheduler import SchedulerConfig

    scfg = SchedulerConfig(
        max_num_seqs=batch,
        max_num_batched_tokens=max(ecfg.max_prefill_tokens, batch),
        max_model_len=min(ecfg.max_model_len, ecfg.max_blocks_per_seq * ecfg.block_size),
        max_prefill_chunk_tokens=ecfg.max_prefill_tokens,
    )
    engine = Engine.from_model_dir(path, engine_config=ecfg, scheduler_config=scfg, start=False)
    if compiled_loader is not None:
        engine.runner.compiled = compiled_loader(engine.runner.model, engine.runner.state, ecfg)
        engine.model_info = dataclasses.replace(engine.model_info, backend="compiled", compiled=True)
    n = bench_threads(threads, compiled_loader is not None, engine.runner.model)
    # Both routes into the engine thread: a thread adopts the process-wide count set here the first
    # time it runs torch work (so an engine that sets nothing runs at n), and an engine that sets
    # its own count at the top of its thread (trnrt.engine.runner.threads.apply_torch_threads) reads it
    # from runner.torch_threads, which from_model_dir fills with the engine's default.
    torch.set_num_threads(n)
    engine.runner.torch_threads = n
    engine.thread.start()
    engine.wait_warm()  # the compiled graphs' first calls, before anything is timed
    return engine, n


def _run_wave(engine, prompts: list[list[int]], sp) -> float:
    """Submit `prompts` together, wait for every stream to finish; return the wall time."""
    import sys

    from trnrt.engine.request import GenerateRequest

    # stream=False: the bench reads whole results (an offline generate, vLLM's FINAL_ONLY outputs)
    reqs = [GenerateRequest(prompt_token_ids=list(p), sampling_params=sp.clone(), stream=False) for p in prompts]
    # Keep the GIL until every request is in the engine's inbox, so the first step sees the whole
    # batch (otherwise the engine thread may wake on the first submit and prefill it alone).
    # submit() makes no blocking call when the request has a seed.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    try:
        t0 = time.perf_counter()
        streams = [engine.submit(r) for r in reqs]
    finally:
        sys.setswitchinterval(interval)
    for s in streams:
        for out in s:
            if out.finished and out.error:
                raise RuntimeError(f"bench request failed: {out.error}")
    return time.perf_counter() - t0


def _bench_trnrt(engine, prompts: list[list[int]], batch: int, output_len: int, tick) -> dict:
    import torch

    from trnrt.engine.request import SamplingParams

    # greedy; a seed anyway, so that submit() draws no random seed (a syscall that lets the engine
    # thread start on a partial batch)
    first_token = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True, seed=0)
    full = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True, seed=0)
    waves = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]

    # Warm-up: one wave, prefill and a few decode steps (the buckets the timed runs use).
    _run_wave(engine, waves[0], full.clone(max_new_tokens=min(output_len, 3)))
    tick("trnrt warm-up")

    records: list[_StepRecord] = []
    recording = threading.Event()
    runner = engine.runner
    inner = runner.execute

    engine_threads: list[int] = []

    def timed_execute(rows):  # runs on the engine thread
        if not engine_threads:
            engine_threads.append(torch.get_num_threads())  # this thread's own count
        t0 = time.perf_counter()
        res = inner(rows)
        if recording.is_set():
            records.append(_StepRecord(t0, time.perf_counter(), len(rows), all(len(r.token_ids) == 1 for r in rows)))
        return res

    runner.execute = timed_execute
    prefill_s = 0.0
    prefill_tokens = 0
    decode_s = 0.0
    decode_rows = 0
    num_intervals = 0
    fallback_s = 0.0
    fallback_steps = 0
    fallback_rows = 0
    had_own = "execute" in vars(runner)
    try:
        for w in waves:
            t_prefill = _run_wave(engine, w, first_token)
            prefill_s += t_prefill
            prefill_tokens += sum(len(p) for p in w)
            tick("trnrt prefill")
            records.clear()
            recording.set()
            t_full = _run_wave(engine, w, full)
            recording.clear()
            steps = list(records)
            for a, b in zip(steps, steps[1:]):
                if a.all_decode and b.all_decode:
                    decode_s += b.t_start - a.t_start
                    decode_rows += a.num_rows
                    num_intervals += 1
            fallback_s += max(t_full - t_prefill, 0.0)
            fallback_steps += output_len - 1
            fallback_rows += len(w) * (output_len - 1)
            tick("trnrt decode")
    finally:
        if had_own:
            runner.execute = inner
        else:
            del runner.execute  # back to the class method
    if num_intervals == 0:  # output_len 2: a single decode step per wave
        decode_s, num_intervals, decode_rows = fallback_s, fallback_steps, fallback_rows
    return {
        "prefill_tok_s": round(prefill_tokens / prefill_s, 2) if prefill_s > 0 else None,
        "decode_tok_s": round(decode_rows / decode_s, 2) if decode_s > 0 else None,
        "decode_step_ms": round(1000 * decode_s / num_intervals, 3) if num_intervals else None,
        "threads": engine_threads[0] if engine_threads else None,
    }


def _bench_hf(path, prompts: list[list[int]], batch: int, output_len: int, tick) -> dict:
    import torch
    from transformers import Glm5NextForConditionalGeneration
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model = Glm5NextForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).eval()
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = 0
    waves = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]

    def forward(ids: torch.Tensor) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)
        return time.perf_counter() - t0

    def generate(ids: torch.Tensor, n: int) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                                 min_new_tokens=n, pad_token_id=pad)
        dt = time.perf_counter() - t0
        if out.shape != (ids.shape[0], ids.shape[1] + n):
            expected = (ids.shape[0], ids.shape[1] + n)
            raise RuntimeError(f"transformers generated {tuple(out.shape)}, expected {expected}")
        return dt

    first = torch.tensor(waves[0], dtype=torch.long)
    forward(first)
    generate(first, min(output_len, 3))
    tick("transformers warm-up")
    prefill_s = 0.0
    prefill_tokens = 0
    decode_s = 0.0
    decode_rows = 0
    steps = 0
    for w in waves:
        ids = torch.tensor(w, dtype=torch.long)
        t_prefill = forward(ids)
        prefill_s += t_prefill
        prefill_tokens += ids.numel()
        tick("transformers prefill")
        t_gen = generate(ids, output_len)
        decode_s += max(t_gen - t_prefill, 0.0)
        decode_rows += ids.shape[0] * (output_len - 1)
        steps += output_len - 1
        tick("transformers decode")
    return {
        "prefill_tok_s": round(prefill_tokens / prefill_s, 2) if prefill_s > 0 else None,
        "decode_tok_s": round(decode_rows / decode_s, 2) if decode_s > 0 else None,
        "decode_step_ms": round(1000 * decode_s / steps, 3) if steps else None,
    }
