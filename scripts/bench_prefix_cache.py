#!/usr/bin/env python3
"""Prefix-cache benchmark: TTFT and prefill tokens with the radix cache on vs off, in one run.

Two workloads on the embedded tiny model (or --model), each run on an engine with the cache and one
without, alternating, in the same process:
- shared-system: R requests sharing one S-token system prompt, each with its own U-token user turn
  (sent one after another, so TTFT is the engine's, not queueing; the first request warms the cache);
- multi-turn: C conversations of T turns; turn t's prompt is turn t-1's prompt + its answer + a new
  U-token user turn.
TTFT is measured from submit to the first output token (in-process: no HTTP). Prints a table and,
with --json, one JSON object. Usage:

    .venv/bin/python scripts/bench_prefix_cache.py [--system-len 512] [--user-len 64] [--requests 16]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def _engine(model, cache: bool, interval: int):
    from trnrt.engine.cache.cache_config import PrefixCacheConfig
    from trnrt.engine.core.engine import Engine

    pcc = PrefixCacheConfig(checkpoint_interval=interval) if cache else None
    return Engine.from_model_dir(model, prefix_cache_config=pcc, max_running_requests=8)


def _ttft(engine, prompt: list[int], max_new: int, rid: str) -> tuple[float, list[int]]:
    from trnrt.engine.request import GenerateRequest, SamplingParams

    t0 = time.perf_counter()
    stream = engine.submit(GenerateRequest(prompt_token_ids=prompt, request_id=rid, stream=True,
                                           sampling_params=SamplingParams(max_new_tokens=max_new, ignore_eos=True)))
    ttft, out = None, []
    while True:
        o = stream.get(timeout=120)
        if o.new_token_ids and ttft is None:
            ttft = time.perf_counter() - t0
        out += o.new_token_ids
        if o.finished:
            return ttft, out


def _workloads(vocab: int, special: set[int], args):
    rng = random.Random(args.seed)
    allowed = [i for i in range(vocab) if i not in special]

    def toks(n):
        return [rng.choice(allowed) for _ in range(n)]

    system = toks(args.system_len)
    shared = [system + toks(args.user_len) for _ in range(args.requests + 1)]
    convs = [toks(args.user_len) for _ in range(args.conversations)]
    turns = [[toks(args.user_len) for _ in range(args.turns)] for _ in range(args.conversations)]
    return shared, convs, turns


def run_shared(engine, prompts, max_new, tag):
    _ttft(engine, prompts[0], max_new, f"{tag}-warm")  # the first one fills the cache
    return [_ttft(engine, p, max_new, f"{tag}-{i}")[0] for i, p in enumerate(prompts[1:])]


def run_multi_turn(engine, convs, turns, max_new, tag):
    ttfts = []
    for c, (first, extra) in enumerate(zip(convs, turns)):
        prompt = list(first)
        for t, user in enumerate(extra):
            ttft, out = _ttft(engine, prompt, max_new, f"{tag}-c{c}t{t}")
            if t:  # turn 0 has nothing to reuse
                ttfts.append(ttft)
            prompt = prompt + out + user
    return ttfts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--user-len", type=int, default=64)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=16)
    ap.add_argument("--interval", type=int, default=64, help="checkpoint interval (tokens)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (same for both sides)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    on, off = _engine(args.model, True, args.interval), _engine(args.model, False, args.interval)
    try:
        special = set(on.tokenizer.all_special_ids)
        shared, convs, turns = _workloads(on.model_info.vocab_size, special, args)
        res = {}
        for name, fn in (("shared-system", lambda e, tag: run_shared(e, shared, args.max_new, tag)),
                         ("multi-turn", lambda e, tag: run_multi_turn(e, convs, turns, args.max_new, tag))):
            row = {}
            for rnd in range(2):  # alternate: on, off, on, off
                for label, eng in (("on", on), ("off", off)):
                    before = eng.scheduler.num_prefill_tokens_computed
                    t = fn(eng, f"{name}-{label}-{rnd}")
                    row.setdefault(label, {"ttft": [], "prefill_tokens": 0})
                    row[label]["ttft"] += t
                    row[label]["prefill_tokens"] += eng.scheduler.num_prefill_tokens_computed - before
            for label in ("on", "off"):
                ts = row[label]["ttft"]
                row[label] = {"ttft_p50_ms": 1e3 * statistics.median(ts), "ttft_mean_ms": 1e3 * statistics.mean(ts),
                              "prefill_tokens": row[label]["prefill_tokens"], "requests": len(ts)}
            row["ttft_p50_ratio_off_over_on"] = row["off"]["ttft_p50_ms"] / row["on"]["ttft_p50_ms"]
            row["prefill_tokens_ratio_off_over_on"] = row["off"]["prefill_tokens"] / max(1, row["on"]["prefill_tokens"])
            res[name] = row
        res["cache_hit_rate"] = on.scheduler.cache_hit_rate
        res["settings"] = {k: v for k, v in vars(args).items() if k != "json"}
    finally:
        on.shutdown()
        off.shutdown()
    if args.json:
        print(json.dumps(res, indent=1))
        return
    print(f"{'workload':<14} {'cache':<5} {'TTFT p50 ms':>12} {'TTFT mean ms':>13} {'prefill tokens':>15}")
    for name in ("shared-system", "multi-turn"):
        for label in ("on", "off"):
            r = res[name][label]
            print(f"{name:<14} {label:<5} {r['ttft_p50_ms']:>12.1f} {r['ttft_mean_ms']:>13.1f} {r['prefill_tokens']:>15}")
        print(f"{'':<14} ratio off/on: TTFT p50 {res[name]['ttft_p50_ratio_off_over_on']:.2f}x, "
              f"prefill tokens {res[name]['prefill_tokens_ratio_off_over_on']:.2f}x")
    print(f"cache hit rate (cache on engine): {res['cache_hit_rate']:.2f}")


if __name__ == "__main__":
    main()
