"""`trnrt top`: a Textual live dashboard over a `StatsSource` (normally `GET /v1/stats`).

Layout, top to bottom: header (model · preset · uptime), a banner that appears only when the
server is unreachable or polling is paused, a one-line summary, a line that appears only with
speculative decoding on (its accept length and rate since start), a line that appears only with
tensor parallelism on (TP×EP, the collectives' time per step and share, each rank's memory),
sparklines of output tok/s and requests/s, the latency percentile table beside the queue / slot / KV-page / prefix-hit gauges, one
row per engine (a router lists several), and the footer with the key bindings (q quit, p pause,
r refresh now).

Fetching runs in a Textual thread worker so a slow or dead server never freezes the UI; results
come back to the UI thread with `call_from_thread`. At most one fetch is in flight: a timer tick
that finds one still running is skipped rather than queued or cancelling it, so a server slower
than the interval still gets its answers shown.
"""

from __future__ import annotations

from collections import deque

from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import DataTable, Footer, Header, Sparkline, Static

from trnrt.stats.schema import LATENCY_KEYS
from trnrt.top.format import (
    ENGINE_COLUMNS,
    LATENCY_LABELS,
    TOTAL_ID,
    engine_cells,
    fmt_pct,
    fmt_rate,
    header_info,
    instant_rates,
    latency_rows,
    parallel_section,
    parallel_text,
    ratio,
    spec_text,
    total_entry,
    used_of,
)
from trnrt.top.source import SourceError, StatsSource


class Gauge(Static):
    """A one-line meter: label, a fixed-width bar, and a text value. `ratio` is kept for tests."""

    BAR_WIDTH = 20

    def __init__(self, label: str, **kwargs) -> None:
        super().__init__("", **kwargs)
        self.label = label
        self.ratio: float | None = None
        self.value_text = "-"
        self.set_value(None, "-")

    def set_value(self, value: float | None, text: str) -> None:
        self.ratio = value
        self.value_text = text
        r = min(max(value or 0.0, 0.0), 1.0)
        filled = round(r * self.BAR_WIDTH)
        color = "green" if r < 0.7 else "yellow" if r < 0.9 else "red"
        line = Text()
        line.append(f"{self.label:<11}", style="bold")
        line.append("█" * filled, style=color)
        line.append("░" * (self.BAR_WIDTH - filled), style="dim")
        line.append(f" {text}")
        self.update(line)


class TopApp(App):
    """The dashboard. `source` is any StatsSource; `interval` is seconds between polls."""

    TITLE = "trnrt top"
    CSS = """
    #banner { display: none; background: $error; color: $text; text-style: bold; padding: 0 1; }
    #banner.shown { display: block; }
    #banner.paused { background: $warning; color: $background; }
    #summary { height: auto; padding: 0 1; }
    #spec { display: none; padding: 0 1; }
    #spec.shown { display: block; }
    #parallel { display: none; padding: 0 1; }
    #parallel.shown { display: block; }
    #charts { height: 4; }
    .chart { width: 1fr; padding: 0 1; }
    .chart Sparkline { height: 3; }
    #middle { height: 7; }
    #latency { width: 1fr; height: 7; }
    #gauges { width: 1fr; padding: 0 1; }
    Gauge { height: 1; }
    #engines { height: 1fr; }
    """
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("p", "toggle_pause", "Pause"),
        Binding("r", "refresh_now", "Refresh"),
    ]

    def __init__(self, source: StatsSource, interval: float = 1.0, history: int = 60) -> None:
        super().__init__()
        self.source = source
        self.interval = interval
        self.paused = False
        self.last_snapshot: dict | None = None
        self.last_error: str | None = None
        self.polls_applied = 0  # fetch results handled on the UI thread (tests wait on it)
        self._fetching = False  # touched only on the UI thread
        self._prev: dict | None = None
        self._prev_engines: dict[str, dict] = {}
        self.tok_history: deque[float] = deque(maxlen=history)
        self.req_history: deque[float] = deque(maxlen=history)

    # ---- layout ---------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)  # no clock: it would make screenshots differ run to run
        yield Static("", id="banner")
        yield Static(f"waiting for {self.source.description} …", id="summary")
        yield Static("", id="spec")
        yield Static("", id="parallel")
        with Horizontal(id="charts"):
            with Vertical(classes="chart"):
                yield Static("output tok/s", id="tok-label")
                yield Sparkline([], id="tok", summary_function=max)
            with Vertical(classes="chart"):
                yield Static("requests/s", id="req-label")
                yield Sparkline([], id="req", summary_function=max)
        with Horizontal(id="middle"):
            yield DataTable(id="latency", cursor_type="none", show_cursor=False)
            with Vertical(id="gauges"):
                yield Gauge("queue", id="g-queue")
                yield Gauge("slots", id="g-slots")
                yield Gauge("KV pages", id="g-pages")
                yield Gauge("prefix hit", id="g-hit")
        yield DataTable(id="engines", cursor_type="row", zebra_stripes=True)
        yield Footer()

    def on_mount(self) -> None:
        lat = self.query_one("#latency", DataTable)
        for col in ("latency", "p50", "p90", "p99", "n"):
            lat.add_column(col, key=col, width=9)
        for key in LATENCY_KEYS:
            lat.add_row(LATENCY_LABELS[key], "-", "-", "-", "0", key=key)
        eng = self.query_one("#engines", DataTable)
        for key, header in ENGINE_COLUMNS:
            eng.add_column(header, key=key)
        self.timer = self.set_interval(self.interval, self.poll)
        self.poll()

    # ---- polling --------------------------------------------------------------------------------

    def poll(self) -> None:
        """Start a fetch unless one is already in flight (UI thread)."""
        if self._fetching:
            return
        self._fetching = True
        self._fetch()

    @work(thread=True, group="poll", exit_on_error=False)
    def _fetch(self) -> None:
        try:
            snap, err = self.source.fetch(), None
        except SourceError as e:
            snap, err = None, str(e)
        except Exception as e:  # a bug in a source must not kill the dashboard
            snap, err = None, f"{type(e).__name__}: {e}"
        try:
            self.call_from_thread(self._apply, snap, err)
        except RuntimeError:  # the app exited while we were fetching
            pass

    def _apply(self, snap: dict | None, err: str | None) -> None:
        self._fetching = False
        self.polls_applied += 1
        self.last_error = err
        if snap is not None:
            self._show(snap)
        self._update_banner()

    # ---- rendering ------------------------------------------------------------------------------

    def _update_banner(self) -> None:
        banner = self.query_one("#banner", Static)
        if self.last_error is not None:
            state = " (paused)" if self.paused else f" · retrying every {self.interval:g}s"
            banner.update(f"⚠ unreachable: {self.source.description}: {self.last_error}{state}")
            banner.set_classes("shown")
        elif self.paused:
            banner.update("⏸ paused · p resumes · r fetches once")
            banner.set_classes("shown paused")
        else:
            banner.update("")
            banner.set_classes("")

    def _show(self, snap: dict) -> None:
        self.last_snapshot = snap
        h = header_info(snap)
        self.sub_title = f"{h['model']} · {h['preset']} · up {h['uptime']}"
        live = snap.get("live") or {}
        cnt = snap.get("counters") or {}
        rates = instant_rates(self._prev, snap)
        self._prev = snap

        self.query_one("#summary", Static).update(
            f"{h['model']} · preset {h['preset']} · {h['runtime']} · trnrt {h['version']} · "
            f"up {h['uptime']} · {h['engines']} engine(s) · {live.get('running', 0)} running · "
            f"{live.get('queued', 0)} queued · {cnt.get('requests_finished_total', 0)} done · "
            f"{cnt.get('errors', 0)} errors"
        )
        self._show_spec(snap.get("speculative"))
        self._show_parallel(parallel_text(parallel_section(snap)))

        self.tok_history.append(rates["gen_tps"])
        self.req_history.append(rates["rps"])
        self.query_one("#tok", Sparkline).data = list(self.tok_history)
        self.query_one("#req", Sparkline).data = list(self.req_history)
        self.query_one("#tok-label", Static).update(
            f"output tok/s  {fmt_rate(rates['gen_tps'])}  (prompt {fmt_rate(rates['prompt_tps'])})")
        self.query_one("#req-label", Static).update(f"requests/s  {fmt_rate(rates['rps'])}")

        lat = self.query_one("#latency", DataTable)
        for key, row in zip(LATENCY_KEYS, latency_rows(snap)):
            for col, val in zip(("p50", "p90", "p99", "n"), row[1:]):
                lat.update_cell(key, col, val)

        slots_total = live.get("slots_total") or 0
        queued = live.get("queued") or 0
        # The queue bar is full when a whole batch's worth of requests (slots_total) is waiting.
        self.query_one("#g-queue", Gauge).set_value(
            min(queued / slots_total, 1.0) if slots_total else None, f"{queued} queued")
        self.query_one("#g-slots", Gauge).set_value(
            ratio(live.get("slots_used"), slots_total), used_of(live.get("slots_used"), slots_total))
        self.query_one("#g-pages", Gauge).set_value(
            ratio(live.get("pages_used"), live.get("pages_total")),
            used_of(live.get("pages_used"), live.get("pages_total")))
        hit = snap.get("prefix_hit_rate")
        self.query_one("#g-hit", Gauge).set_value(hit, fmt_pct(hit))

        engines = list(snap.get("engines") or [])
        if len(engines) > 1:  # several engines: a last row with the totals (one engine is its own total)
            engines.append(total_entry(snap))
        self._show_engines(engines)

    def _show_spec(self, section: object) -> None:
        # Its own line, shown only with speculative decoding on: without it the screen is unchanged.
        line = self.query_one("#spec", Static)
        text = spec_text(section)
        if text is None:
            line.update("")
            line.set_classes("")
        else:
            line.update(f"{text} · {section.get('algorithm')}, {section.get('num_steps', 0)} draft steps")
            line.set_classes("shown")

    def _show_parallel(self, text: str | None) -> None:
        # Its own line, shown only with tensor parallelism on (an engine's `parallel` section).
        line = self.query_one("#parallel", Static)
        line.update("" if text is None else f"parallel {text}")
        line.set_classes("" if text is None else "shown")

    def _show_engines(self, engines: list[dict]) -> None:
        # Rows are keyed by engine id and updated in place, so the cursor stays put and the table
        # never accumulates rows; engines that disappear are removed.
        table = self.query_one("#engines", DataTable)
        seen = set()
        for eng in engines:
            eid = str(eng.get("id", "?"))
            if eid == TOTAL_ID and eng is not engines[-1]:
                eid = f"{eid} (engine)"  # an engine that calls itself "total" keeps its own row
            seen.add(eid)
            cells = engine_cells(eng, instant_rates(self._prev_engines.get(eid), eng))
            self._prev_engines[eid] = eng
            if eid in table.rows:
                for key, _ in ENGINE_COLUMNS:
                    table.update_cell(eid, key, cells[key], update_width=True)
            else:
                table.add_row(*(cells[k] for k, _ in ENGINE_COLUMNS), key=eid)
        for row_key in list(table.rows):
            if row_key.value not in seen:
                table.remove_row(row_key)
                self._prev_engines.pop(row_key.value, None)

    # ---- actions --------------------------------------------------------------------------------

    def action_toggle_pause(self) -> None:
        """p: stop or restart polling (a fetch already in flight still lands)."""
        self.paused = not self.paused
        if self.paused:
            self.timer.pause()
        else:
            self.timer.resume()
            self.poll()
        self._update_banner()

    def action_refresh_now(self) -> None:
        """r: fetch now, even while paused."""
        self.poll()
