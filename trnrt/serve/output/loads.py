"""SGLang 0.5.23's load documents from an EngineLoad: `/v1/loads` (JSON and Prometheus) and the
historical `/get_load` list. Pure Python.

One engine is one SGLang DP rank (rank 0). What trnrt cannot measure is reported as SGLang reports
what does not apply: a section that does not apply (LoRA; speculative decoding while it is off or
before its first verify, as SGLang leaves it out) is left out;
a figure inside a section that trnrt has no number for is null (never a made-up 0). Counts that
are truly zero here (no PD disaggregation queues, no grammar queue) are 0.
"""

from __future__ import annotations

import time

# (JSON key of the section, its `include=` token), in SGLang's order.
_SECTIONS = (
    ("memory", "memory"),
    ("speculative", "spec"),
    ("lora", "lora"),
    ("disaggregation", "disagg"),
    ("queues", "queues"),
    ("prefix_cache", "cache"),  # trnrt's; only while the engine runs a prefix cache
)
# Prometheus names of a section's figures: sglang_<prefix>_<key> (SGLang's v1_loads.py).
_PROM_PREFIX = {"speculative": "spec", "disaggregation": "disagg"}


def prefix_cache_section(load: dict) -> dict | None:
    """The `prefix_cache` section (trnrt's; SGLang has no such section), or None while the engine
    runs without a prefix cache (the section then does not apply and is left out). Pages and
    checkpoints of the device pool and of the host tier (0 without --enable-hierarchical-cache);
    `*_tokens` are the pages times the page size. The hit rate is the core `cache_hit_rate`."""
    if not load.get("prefix_cache"):
        return None
    page = int(load.get("page_size", 0))

    def n(key: str) -> int:
        return int(load.get(key, 0) or 0)

    return {
        "page_size": page,
        "num_cached_pages": n("num_cached_pages"),
        "num_evictable_pages": n("num_evictable_pages"),
        "num_cached_tokens": n("num_cached_pages") * page,
        "num_evictable_tokens": n("num_evictable_pages") * page,
        "num_used_checkpoints": n("num_used_checkpoints"),
        "num_total_checkpoints": n("num_total_checkpoints"),
        "num_host_used_pages": n("num_host_used_pages"),
        "num_host_total_pages": n("num_host_total_pages"),
        "num_host_used_checkpoints": n("num_host_used_checkpoints"),
        "num_host_total_checkpoints": n("num_host_total_checkpoints"),
        "cache_hit_rate": round(float(load.get("cache_hit_rate", 0.0)), 4),
    }


def speculative_section(load: dict) -> dict | None:
    """SGLang's `speculative` section, `{"accept_length", "accept_rate"}` since start (EngineLoad's
    spec_accept_length / spec_accept_rate), or None while speculative decoding is off or nothing was
    verified yet (SGLang leaves the section out then). accept_length counts the bonus token (1.0:
    no draft accepted)."""
    length = load.get("spec_accept_length")
    if length is None:
        return None
    rate = load.get("spec_accept_rate")
    return {"accept_length": round(float(length), 4), "accept_rate": None if rate is None else round(float(rate), 4)}


PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def load_entry(load: dict, dp_rank: int = 0, now: float | None = None) -> dict:
    """One `loads[]` entry with every section that applies, from `EngineLoad.to_dict()`.

    Core keys are SGLang 0.5.23's (LoadSnapshot); the ones trnrt computes itself:
    - num_active_tokens: tokens of the running requests (EngineLoad's num_total_tokens counts
      running and waiting requests; its num_waiting_uncached_tokens is the waiting ones' part);
    - utilization: SGLang's formula, max(running / max_running_requests, token_usage / 0.9);
    - num_prealloc_ready_tokens: 0 (no PD disaggregation);
    - total_prefill_uncached_tokens, total_prefill_busy_us, decode_moments: null (not measured).
    """
    running = int(load.get("num_running_reqs", 0))
    max_running = int(load.get("max_running_requests", 0))
    token_usage = float(load.get("token_usage", 0.0))
    total = int(load.get("num_total_tokens", 0))
    waiting_tokens = int(load.get("num_waiting_uncached_tokens", 0))
    utilization = max(running / max_running if max_running else 0.0, token_usage / 0.9)
    spec = speculative_section(load)
    entry = {
        "timestamp": time.time() if now is None else now,
        "dp_rank": dp_rank,
        "num_running_reqs": running,
        "num_waiting_reqs": int(load.get("num_waiting_reqs", 0)),
        "num_waiting_uncached_tokens": waiting_tokens,
        "num_used_tokens": int(load.get("num_used_tokens", 0)),
        "num_total_tokens": total,
        "num_active_tokens": max(0, total - waiting_tokens),
        "num_prealloc_ready_tokens": 0,
        "max_total_num_tokens": int(load.get("max_total_num_tokens", 0)),
        "max_running_requests": max_running,
        "token_usage": round(token_usage, 4),
        "gen_throughput": round(float(load.get("gen_throughput", 0.0)), 2),
        "cache_hit_rate": round(float(load.get("cache_hit_rate", 0.0)), 4),
        "utilization": round(utilization, 4),
        "total_prefill_uncached_tokens": None,
        "total_prefill_busy_us": None,
        "decode_moments": None,
        # Sections (filtered by `select`):
        # weights, KV cache and graph sizes are not reported by the engine; its token capacity is.
        "memory": {"weight_gb": None, "kv_cache_gb": None, "graph_gb": None,
                   "token_capacity": int(load.get("max_total_num_tokens", 0))},
        **({"speculative": spec} if spec is not None else {}),
        # no PD disaggregation: SGLang's mode "null" with empty queues
        "disaggregation": {"mode": "null", "prefill_bootstrap_queue_reqs": 0, "prefill_inflight_queue_reqs": 0,
                           "decode_prealloc_queue_reqs": 0, "decode_transfer_queue_reqs": 0,
                           "decode_retracted_queue_reqs": 0, "kv_transfer_speed_gb_s": 0.0,
                           "kv_transfer_latency_ms": 0.0},
        # Preempted requests wait in the waiting queue to be prefilled again (as SGLang's retracted
        # ones do), so they are in `waiting`; no grammar backend, no paused generation.
        "queues": {"waiting": int(load.get("num_waiting_reqs", 0)), "grammar": 0, "paused": 0, "retracted": 0,
                   "prealloc_ready": 0},
    }
    cache = prefix_cache_section(load)
    if cache is not None:
        entry["prefix_cache"] = cache
    return entry


def select(entry: dict, include: frozenset | None) -> dict:
    """The entry with only the sections `include` asks for (None or "all": every one that exists;
    "core" alone: none). `include` holds valid tokens only (protocol.admin checks them)."""
    every = include is None or "all" in include
    out = {}
    wanted = {key for key, token in _SECTIONS if every or token in include}
    section_keys = {key for key, _ in _SECTIONS}
    for key, value in entry.items():
        if key in section_keys and key not in wanted:
            continue
        out[key] = value
    return out


def loads_document(entries: list[dict], *, version: str, accelerator: str | None, num_accelerators: int,
                   now: float | None = None) -> dict:
    """The `/v1/loads` JSON body."""
    from datetime import datetime, timezone

    ts = datetime.fromtimestamp(time.time() if now is None else now, timezone.utc).isoformat()
    return {"timestamp": ts, "version": version, "accelerator": accelerator, "num_accelerators": num_accelerators,
            "loads": entries}


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def to_prometheus(entries: list[dict]) -> str:
    """`/v1/loads?format=prometheus`: every numeric figure as a gauge labelled with its dp_rank,
    named as SGLang names them (`sglang_<key>`, `sglang_<section prefix>_<key>`). Nulls and strings
    are left out."""
    samples: dict[str, list[tuple[int, object]]] = {}
    for entry in entries:
        entry = dict(entry)
        rank = entry.pop("dp_rank")
        for key, value in entry.items():
            if isinstance(value, dict):
                prefix = _PROM_PREFIX.get(key, key)
                for sub, v in value.items():
                    if _number(v):
                        samples.setdefault(f"sglang_{prefix}_{sub}", []).append((rank, v))
            elif _number(value):
                samples.setdefault(f"sglang_{key}", []).append((rank, value))
    lines = []
    for name, values in samples.items():
        lines.append(f"# TYPE {name} gauge")
        lines.extend(f'{name}{{dp_rank="{rank}"}} {v}' for rank, v in values)
    return "\n".join(lines) + "\n"


def get_load_entry(load: dict, dp_rank: int = 0) -> dict:
    """One entry of the historical `/get_load` list (SGLang's pre-0.5.23 scheduler.get_load):
    num_reqs = running + waiting; num_tokens = tokens in used pages + tokens of waiting requests."""
    waiting = int(load.get("num_waiting_reqs", 0))
    return {
        "dp_rank": dp_rank,
        "num_reqs": int(load.get("num_running_reqs", 0)) + waiting,
        "num_waiting_reqs": waiting,
        "num_tokens": int(load.get("num_used_tokens", 0)) + int(load.get("num_waiting_uncached_tokens", 0)),
    }
