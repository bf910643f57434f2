"""Percentiles and the summary dict, with the keys and definitions of SGLang's bench_serving.

- throughputs divide by the run's `duration` (first arrival to last response end);
- TTFT, E2E latency: per successful request; TPOT = (latency - ttft) / (output_tokens - 1) for
  requests with more than one output token; ITL: every inter-chunk gap of every successful request
  (see `client` for how /generate chunks of several tokens are spread);
- `mean/median/std/p90/p95/p99_*_ms`: numpy's default (linear) percentile, population std; a
  metric with no sample is 0 (as SGLang);
- `concurrency`: sum of E2E latencies / duration (SGLang's); `max_concurrent_requests`: the most
  requests that were in flight at once (exact, from the request intervals); `max_output_tokens_per_s`:
  the most output chunks' tokens that arrived within one 1-second bucket (SGLang's peak);
- input tokens: the server's count (usage / meta_info) when it reports one, else the data set's
  nominal length (words for text data sets; then `input_tokens_reported` is false).
"""

from __future__ import annotations

import math
from typing import Iterable

from trnrt.benchmark.client import RequestResult

STATS = ("mean", "median", "std", "p90", "p95", "p99")
LATENCIES = ("ttft", "tpot", "itl", "e2e_latency")


def percentile(values: Iterable[float], q: float) -> float:
    """numpy.percentile(values, q) with the default linear interpolation; 0.0 for no values."""
    a = sorted(values)
    if not a:
        return 0.0
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    pos = (len(a) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(a) - 1)
    return a[lo] + (a[hi] - a[lo]) * (pos - lo)


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def std(values: list[float]) -> float:
    if not values:
        return 0.0
    m = mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / len(values))


def describe(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    """{mean, median, std, p90, p95, p99} of `values` times `scale` (s -> ms by default)."""
    return {"mean": mean(values) * scale, "median": percentile(values, 50) * scale, "std": std(values) * scale,
            "p90": percentile(values, 90) * scale, "p95": percentile(values, 95) * scale,
            "p99": percentile(values, 99) * scale}


def peak_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals [start, end) open at one instant."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda x: (x[0], x[1]))
    cur = best = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


def peak_tokens_per_s(results: list[RequestResult]) -> float:
    """SGLang's `max_output_tokens_per_s`: tokens per 1-s bucket, from each request's first token
    time and its ITLs; the largest bucket."""
    ok = [r for r in results if r.success]
    if not ok:
        return 0.0
    t0 = min(r.start_time for r in ok)
    buckets: dict[int, int] = {}
    for r in ok:
        t = r.start_time + r.ttft
        times = [t]
        for gap in r.itl:
            t += gap
            times.append(t)
        for x in times:
            k = int(x - t0)
            buckets[k] = buckets.get(k, 0) + 1
    return float(max(buckets.values()))


def summarize(results: list[RequestResult], duration: float, config: dict | None = None) -> dict:
    """The result dict (SGLang's key names), `config` (backend, dataset, rates...) merged first."""
    out: dict = dict(config or {})
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    total_in = sum(r.prompt_tokens if r.prompt_tokens is not None else r.input_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    ttfts = [r.ttft for r in ok]
    e2e = [r.latency for r in ok]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [x for r in ok for x in r.itl]
    dur = max(duration, 1e-9)
    out.update({
        "duration": duration,
        "completed": len(ok),
        "failed": len(failed),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "input_tokens_reported": all(r.prompt_tokens is not None for r in ok),
        "output_tokens_reported": not any(r.usage_missing for r in ok),
        "request_throughput": len(ok) / dur,
        "input_throughput": total_in / dur,
        "output_throughput": total_out / dur,
        "total_throughput": (total_in + total_out) / dur,
    })
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2e_latency", e2e)):
        for stat, v in describe(values).items():
            out[f"{stat}_{name}_ms"] = v
    out["max_itl_ms"] = max(itls) * 1000 if itls else 0.0
    out["concurrency"] = sum(e2e) / dur
    out["max_output_tokens_per_s"] = peak_tokens_per_s(ok)
    out["max_concurrent_requests"] = peak_overlap([(r.start_time, r.start_time + r.latency) for r in ok])
    errors: dict[str, int] = {}
    for r in failed:
        errors[r.error] = errors.get(r.error, 0) + 1
    out["errors"] = [{"error": e, "count": c} for e, c in sorted(errors.items(), key=lambda x: -x[1])[:5]]
    return out
