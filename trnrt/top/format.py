"""Formatting shared by the live dashboard and `trnrt top --once` (rich only, no Textual).

Also `instant_rates`: the dashboard's throughput from counter deltas between two polls, which
reacts within one interval (the server's 1-minute rates lag by design) and tolerates poll jitter
because it divides by the server's own uptime delta.
"""

from __future__ import annotations

from typing import Iterable

from rich.console import Group
from rich.table import Table

from trnrt.stats.schema import LATENCY_KEYS

LATENCY_LABELS = {"ttft_ms": "TTFT", "itl_ms": "ITL", "e2e_ms": "E2E", "queue_ms": "queue"}

ENGINE_COLUMNS: tuple[tuple[str, str], ...] = (
    # (column key, header)
    ("engine", "engine"),
    ("state", "state"),
    ("running", "run"),
    ("queued", "queue"),
    ("gen_tps", "gen tok/s"),
    ("prompt_tps", "prompt tok/s"),
    ("rps", "req/s"),
    ("ttft_p50", "TTFT p50"),
    ("ttft_p99", "TTFT p99"),
    ("itl_p50", "ITL p50"),
    ("itl_p99", "ITL p99"),
    ("e2e_p50", "E2E p50"),
    ("pages", "KV pages"),
    ("slots", "slots"),
    ("hit", "prefix hit"),
    ("finished", "done"),
    ("aborts", "aborts"),
    ("errors", "errors"),
)


def fmt_ms(v: float | None) -> str:
    """Milliseconds for humans: "-" for no data, "850ms", "1.25s"."""
    if v is None:
        return "-"
    if v >= 1000:
        return f"{v / 1000:.2f}s"
    if v >= 10:
        return f"{v:.0f}ms"
    return f"{v:.1f}ms"


def fmt_rate(v: float | None) -> str:
    if v is None:
        return "-"
    if v >= 1000:
        return f"{v / 1000:.1f}k"
    return f"{v:.1f}"


def fmt_pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def spec_text(spec: object) -> str | None:
    """"spec accept length 2.50 (rate 75%)" (since start) for a `speculative` section that is
    enabled; None when it is off or missing (an older server), so nothing is shown. "-" before the
    first verify."""
    if not isinstance(spec, dict) or not spec.get("enabled"):
        return None
    length = spec.get("avg_accept_length")
    return f"spec accept length {'-' if length is None else f'{length:.2f}'} (rate {fmt_pct(spec.get('accept_rate'))})"


def fmt_bytes(v: float | None) -> str:
    """Bytes in binary units for humans: "-", "512K", "310M", "1.5G"."""
    if v is None:
        return "-"
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if v >= scale:
            x = v / scale
            return f"{x:.1f}{unit}" if x < 10 else f"{x:.0f}{unit}"
    return f"{int(v)}B"


def parallel_section(snap: dict) -> dict | None:
    """The first engine's `parallel` section (tensor parallelism on: TP > 1), else None."""
    for eng in snap.get("engines") or []:
        par = eng.get("parallel")
        if isinstance(par, dict) and "tp_size" in par:
            return par
    return None


def parallel_text(par: object) -> str | None:
    """One line for a `parallel` section: the layout, the collectives' time per step and their share
    of the step (rank 0's, mean since start), the agreement, and each rank's memory (RSS, weights,
    state; rank 0's now, the others' at the last agreement check). None without a section."""
    if not isinstance(par, dict) or "tp_size" not in par:
        return None
    ms, share, calls = par.get("collective_ms_per_step"), par.get("collective_share"), par.get("collective_calls_per_step")
    coll = f"collectives {fmt_ms(ms)}/step"
    if ms is not None:
        coll += f" ({fmt_pct(share)} of the {fmt_ms(par.get('step_ms'))} step, {calls:g} per step)"
    ag = par.get("agreement") or {}
    agree = "ranks agree" if not ag.get("mismatches") else f"⚠ {ag['mismatches']} disagreements"
    mem = ", ".join(f"r{r.get('rank')} {fmt_bytes(r.get('rss_bytes'))}·{fmt_bytes(r.get('weight_bytes'))}·"
                    f"{fmt_bytes(r.get('state_bytes'))}" for r in par.get("ranks") or [])
    return (f"TP{par.get('tp_size')}×EP{par.get('ep_size', 1)} · {coll} · {agree}"
            + (f" · memory RSS·weights·state {mem}" if mem else ""))


def fmt_duration(s: float | None) -> str:
    """Uptime as "45s", "12m05s", "3h02m", "2d04h"."""
    if s is None:
        return "-"
    s = int(s)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600:02d}h"


def ratio(used: float | None, total: float | None) -> float | None:
    return (used or 0) / total if total else None


def used_of(used: float | None, total: float | None) -> str:
    r = ratio(used, total)
    return f"{used or 0}/{total or 0}" + ("" if r is None else f" {100 * r:.0f}%")


def header_info(snap: dict) -> dict:
    """Model, preset, backend, compiled and version of the first engine (a router's are alike)."""
    engines = snap.get("engines") or []
    info = dict((engines[0].get("info") or {}) if engines else {})
    backend = info.get("backend") or "?"
    mode = "compiled" if info.get("compiled") else "eager"
    return {
        "model": info.get("served_model_name") or info.get("model") or "?",
        "preset": info.get("preset") or "?",
        "backend": backend,
        "mode": mode,
        # "cpu compiled", or just "eager" when the backend already says it (no "eager eager")
        "runtime": backend if backend == mode else f"{backend} {mode}",
        "version": info.get("version") or "?",
        "uptime": fmt_duration(snap.get("uptime_s")),
        "engines": len(engines),
    }


def instant_rates(prev: dict | None, cur: dict) -> dict:
    """{"gen_tps", "prompt_tps", "rps"} for a snapshot-like dict (top level or one engine).

    From counter deltas over the uptime delta since `prev`; falls back to the server's 1-minute
    rates on the first poll, when time did not advance, or when counters went backwards (the
    server restarted).
    """
    def uptime(d: dict) -> float:
        return float(d.get("uptime_s") or (d.get("info") or {}).get("uptime_s") or 0.0)

    c1 = cur.get("counters") or {}
    if prev is not None:
        c0 = prev.get("counters") or {}
        dt = uptime(cur) - uptime(prev)
        deltas = {
            "gen_tps": (c1.get("generation_tokens") or 0) - (c0.get("generation_tokens") or 0),
            "prompt_tps": (c1.get("prompt_tokens") or 0) - (c0.get("prompt_tokens") or 0),
            "rps": (c1.get("requests_finished_total") or 0) - (c0.get("requests_finished_total") or 0),
        }
        if dt > 0 and all(v >= 0 for v in deltas.values()):
            return {k: v / dt for k, v in deltas.items()}
    r = (cur.get("rates") or {}).get("1m") or {}
    return {
        "gen_tps": r.get("generation_tokens_per_s") or 0.0,
        "prompt_tps": r.get("prompt_tokens_per_s") or 0.0,
        "rps": r.get("requests_finished_per_s") or 0.0,
    }


def engine_cells(eng: dict, rates: dict) -> dict[str, str]:
    """Cell text for one engine row, keyed like ENGINE_COLUMNS."""
    live = eng.get("live") or {}
    cnt = eng.get("counters") or {}
    lat = eng.get("latency") or {}

    def p(key: str, q: str) -> str:
        return fmt_ms((lat.get(key) or {}).get(q))

    if eng.get("state") == "down":  # no figures: every cell but the id and state is "-"
        return {key: "-" for key, _ in ENGINE_COLUMNS} | {"engine": str(eng.get("id", "?")), "state": "down"}
    return {
        "engine": str(eng.get("id", "?")),
        "state": str(eng.get("state", "?")),
        "running": str(live.get("running", 0)),
        "queued": str(live.get("queued", 0)),
        "gen_tps": fmt_rate(rates.get("gen_tps")),
        "prompt_tps": fmt_rate(rates.get("prompt_tps")),
        "rps": fmt_rate(rates.get("rps")),
        "ttft_p50": p("ttft_ms", "p50"),
        "ttft_p99": p("ttft_ms", "p99"),
        "itl_p50": p("itl_ms", "p50"),
        "itl_p99": p("itl_ms", "p99"),
        "e2e_p50": p("e2e_ms", "p50"),
        "pages": used_of(live.get("pages_used"), live.get("pages_total")),
        "slots": used_of(live.get("slots_used"), live.get("slots_total")),
        "hit": fmt_pct(eng.get("prefix_hit_rate")),
        "finished": str(cnt.get("requests_finished_total", 0)),
        "aborts": str(cnt.get("aborts", 0)),
        "errors": str(cnt.get("errors", 0)),
    }


TOTAL_ID = "total"


def total_entry(snap: dict) -> dict:
    """The top-level sums of `snap` shaped like an engine entry (the "total" row/column); its
    state counts the engines that answered ("2/3 ok")."""
    engines = snap.get("engines") or []
    ok = sum(1 for e in engines if e.get("state") != "down")
    return {"id": TOTAL_ID, "state": f"{ok}/{len(engines)} ok", "uptime_s": snap.get("uptime_s"),
            **{k: snap.get(k) for k in ("live", "counters", "rates", "latency", "prefix_hit_rate")}}


def down_engines(snap: dict) -> list[dict]:
    return [e for e in snap.get("engines") or [] if e.get("state") == "down"]


# Extra rows of `--once`'s engine table: the counters since start, so a total can be checked
# against the traffic sent.
COUNTER_ROWS: tuple[tuple[str, str], ...] = (
    ("requests_arrived", "arrived"),
    ("prompt_tokens", "prompt tokens"),
    ("generation_tokens", "output tokens"),
    ("cached_tokens", "cached tokens"),
)


def latency_rows(snap: dict) -> Iterable[tuple[str, str, str, str, str]]:
    """(metric, p50, p90, p99, samples) rows of the top-level latency."""
    lat = snap.get("latency") or {}
    for key in LATENCY_KEYS:
        s = lat.get(key) or {}
        yield (LATENCY_LABELS[key], fmt_ms(s.get("p50")), fmt_ms(s.get("p90")), fmt_ms(s.get("p99")),
               str(s.get("count", 0)))


def once_renderable(snap: dict, source: str) -> Group:
    """What `trnrt top --once` prints: a summary, the latency table and one row per engine."""
    h = header_info(snap)
    live = snap.get("live") or {}
    cnt = snap.get("counters") or {}
    rates = (snap.get("rates") or {}).get("1m") or {}

    summary = Table(title=f"trnrt top · {source}", show_header=False, title_justify="left")
    summary.add_column("key", style="bold")
    summary.add_column("value")
    summary.add_row("model", f"{h['model']} (preset {h['preset']}, {h['runtime']}, trnrt {h['version']})")
    summary.add_row("uptime", f"{h['uptime']} · {h['engines']} engine(s)")
    summary.add_row("requests", f"{live.get('running', 0)} running · {live.get('queued', 0)} queued · "
                                f"{cnt.get('requests_finished_total', 0)} finished · "
                                f"{cnt.get('aborts', 0)} aborted · {cnt.get('errors', 0)} errors")
    by = cnt.get("requests_finished") or {}
    summary.add_row("totals", f"{cnt.get('requests_arrived', 0)} arrived · finished: "
                              + ", ".join(f"{by.get(k, 0)} {k}" for k in ("stop", "length", "abort", "error"))
                              + f" · {cnt.get('preemptions', 0)} preemptions")
    summary.add_row("tokens", f"{cnt.get('prompt_tokens', 0)} prompt · {cnt.get('generation_tokens', 0)} output · "
                              f"{cnt.get('cached_tokens', 0)} cached")
    summary.add_row("throughput 1m", f"{fmt_rate(rates.get('generation_tokens_per_s'))} output tok/s · "
                                     f"{fmt_rate(rates.get('prompt_tokens_per_s'))} prompt tok/s · "
                                     f"{fmt_rate(rates.get('requests_finished_per_s'))} req/s")
    summary.add_row("KV pages", used_of(live.get("pages_used"), live.get("pages_total")))
    summary.add_row("slots", used_of(live.get("slots_used"), live.get("slots_total")))
    summary.add_row("prefix hit", fmt_pct(snap.get("prefix_hit_rate")))
    par = parallel_text(parallel_section(snap))
    if par is not None:  # only with tensor parallelism on
        summary.add_row("parallel", par)
    spec = spec_text(snap.get("speculative"))
    if spec is not None:  # only with speculative decoding on
        s = snap["speculative"]
        summary.add_row("speculative", f"{spec} · {s.get('algorithm')}, {s.get('num_steps', 0)} draft steps · "
                                       f"{s.get('num_verifies', 0)} verifies")

    window = (snap.get("latency") or {}).get("window_s")
    lat = Table(title=f"latency (last {window or '?'}s)", title_justify="left")
    for col in ("metric", "p50", "p90", "p99", "n"):
        lat.add_column(col, justify="left" if col == "metric" else "right")
    for row in latency_rows(snap):
        lat.add_row(*row)

    # Engines as columns, metrics as rows: fits a terminal (and a CI log) for a handful of engines,
    # where 18 columns side by side would not.
    engines = list(snap.get("engines") or [])
    if len(engines) > 1:
        engines.append(total_entry(snap))
    cells = [engine_cells(e, instant_rates(None, e)) for e in engines]
    eng_table = Table(title="engines (rates over 1m)", title_justify="left")
    eng_table.add_column("engine", style="bold")
    for c in cells:
        eng_table.add_column(c["engine"], justify="right", style="bold" if c["engine"] == TOTAL_ID else None)
    for key, header in ENGINE_COLUMNS[1:]:
        eng_table.add_row(header, *(c[key] for c in cells))
    for key, header in COUNTER_ROWS:
        eng_table.add_row(header, *("-" if e.get("state") == "down" else str((e.get("counters") or {}).get(key, 0))
                                    for e in engines))
    parts = [summary, lat, eng_table]
    router = snap.get("router")
    if isinstance(router, dict):
        parts.insert(1, f"router {router.get('url', '?')}: {router.get('workers', '?')} workers, "
                        f"{router.get('healthy', '?')} healthy")
    for e in down_engines(snap):
        parts.append(f"[red]engine {e.get('id')} unreachable[/]: {e.get('error', '?')}")
    return Group(*parts)
