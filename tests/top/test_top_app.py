"""The Textual dashboard against fake stats sources (headless, App.run_test / Pilot).

No pytest-asyncio in the venv: each test drives its coroutine with asyncio.run.
"""

from __future__ import annotations

import asyncio
import html
import os
import re
from pathlib import Path

from textual.widgets import DataTable, Sparkline, Static

from trnrt.top.app import Gauge, TopApp
from trnrt.top.source import FakeStatsSource

SIZE = (140, 36)
SNAPSHOT_FILE = Path(__file__).parent / "snapshots" / "top_screen.txt"


async def wait_for(pilot, predicate, timeout: float = 5.0) -> None:
    """Let the app run until `predicate()` holds (polls land from a worker thread)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await pilot.pause(0.02)


def screen_text(svg: str) -> list[str]:
    """The terminal text of an exported SVG screenshot, one string per screen row.

    Terminal cells are the <text> elements clipped to a line; each sits at x = column * cell
    width (textLength / characters), so spans are placed back at their columns.
    """
    rows: dict[float, list[tuple[float, str]]] = {}
    cell_w = None
    for attrs, body in re.findall(r"<text([^>]*clip-path[^>]*)>(.*?)</text>", svg):
        chars = html.unescape(body).replace("\xa0", " ")
        x = float(re.search(r'\bx="([\d.]+)"', attrs).group(1))
        y = float(re.search(r'\by="([\d.]+)"', attrs).group(1))
        width = float(re.search(r'textLength="([\d.]+)"', attrs).group(1))
        if chars and (cell_w is None or width / len(chars) < cell_w):
            cell_w = width / len(chars)
        rows.setdefault(y, []).append((x, chars))
    lines = []
    for _, parts in sorted(rows.items()):
        line = ""
        for x, chars in sorted(parts):
            line = line.ljust(round(x / cell_w)) + chars
        lines.append(line.rstrip())
    return lines


def test_values_shown_and_rows_updated_in_place(make_snapshot):
    src = FakeStatsSource(lambda n: make_snapshot(n))

    async def run():
        app = TopApp(src, interval=0.05)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.polls_applied >= 3)
            assert "glm-5.3-flash" in app.sub_title and "batch8" in app.sub_title
            assert "up 1h00m" in app.sub_title
            engines = app.query_one("#engines", DataTable)
            assert engines.row_count == 3  # two engines + the total, updated in place, never accumulated
            assert list(engines.rows)[-1].value == "total"
            assert engines.get_cell("total", "queued") == "2" and engines.get_cell("total", "running") == "7"
            done = [int(engines.get_cell(e, "finished")) for e in ("engine-0", "engine-1")]
            assert engines.get_cell("total", "finished") == str(sum(done))
            assert engines.get_cell("total", "gen_tps") == "240.0"
            assert engines.get_cell("total", "state") == "2/2 ok"
            assert engines.get_cell("engine-1", "queued") == "2"
            assert engines.get_cell("engine-0", "ttft_p50") == "50ms"
            assert engines.get_cell("engine-0", "pages") == "48/64 75%"
            # Rates from counter deltas between polls: 120 tok/s and 2 req/s per engine.
            assert engines.get_cell("engine-0", "gen_tps") == "120.0"
            assert engines.get_cell("engine-0", "rps") == "2.0"
            assert app.tok_history[-1] == 240.0 and app.req_history[-1] == 4.0
            assert app.query_one("#tok", Sparkline).data[-1] == 240.0
            lat = app.query_one("#latency", DataTable)
            assert [lat.get_cell(k, "p50") for k in ("ttft_ms", "itl_ms", "e2e_ms", "queue_ms")] == [
                "50ms", "20ms", "1.23s", "10ms"]
            assert app.query_one("#g-pages", Gauge).ratio == 0.75
            assert app.query_one("#g-slots", Gauge).ratio == 7 / 16
            assert app.query_one("#g-queue", Gauge).value_text == "2 queued"
            assert app.query_one("#g-hit", Gauge).ratio == 0.25
            assert not app.query_one("#banner", Static).display
            assert app.last_error is None

    asyncio.run(run())


def test_engine_rows_follow_the_engine_list(make_snapshot):
    two = make_snapshot(0)
    one = dict(two, engines=two["engines"][:1])
    src = FakeStatsSource([two, one])

    async def run():
        app = TopApp(src, interval=0.05)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.polls_applied >= 2)
            table = app.query_one("#engines", DataTable)
            assert table.row_count == 1 and "engine-0" in table.rows

    asyncio.run(run())


def test_unreachable_banner_keeps_retrying_then_recovers(make_snapshot):
    src = FakeStatsSource([make_snapshot(0)], unreachable=True, description="http://127.0.0.1:9/v1/stats")

    async def run():
        app = TopApp(src, interval=0.05)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.polls_applied >= 3)  # it keeps polling
            banner = app.query_one("#banner", Static)
            assert banner.display
            text = str(banner.render())
            assert "unreachable" in text and "127.0.0.1:9" in text and "retrying" in text
            assert app.query_one("#engines", DataTable).row_count == 0
            svg = "\n".join(screen_text(app.export_screenshot()))
            assert "unreachable" in svg  # visible on screen, not just in a widget's state

            src.unreachable = False  # the server comes back
            await wait_for(pilot, lambda: app.last_error is None)
            await pilot.pause(0.05)
            assert not banner.display
            assert app.query_one("#engines", DataTable).row_count == 3  # two engines + the total

    asyncio.run(run())


def test_key_bindings_pause_refresh_quit(make_snapshot):
    src = FakeStatsSource([make_snapshot(0)])

    async def run():
        app = TopApp(src, interval=0.05)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.polls_applied >= 2)
            await pilot.press("p")
            assert app.paused
            await app.workers.wait_for_complete()  # a fetch already in flight may still land
            await pilot.pause(0.05)
            frozen = src.fetches
            await pilot.pause(0.4)  # eight intervals
            assert src.fetches == frozen, "paused but still fetching"
            assert "paused" in str(app.query_one("#banner", Static).render())

            await pilot.press("r")  # forces one fetch, even while paused
            await wait_for(pilot, lambda: src.fetches == frozen + 1)
            await app.workers.wait_for_complete()
            await pilot.pause(0.2)
            assert src.fetches == frozen + 1

            await pilot.press("p")  # resume
            assert not app.paused
            await wait_for(pilot, lambda: src.fetches >= frozen + 3)

            await pilot.press("q")
            await pilot.pause(0.05)
            assert not app.is_running

    asyncio.run(run())
    assert src.fetches > 0


def test_summary_shows_spec_accept_length_only_when_enabled(make_snapshot):
    """Speculative decoding off (every fixture snapshot): no spec line; on: a line under the summary
    with the accept length and rate of the top-level `speculative` section."""
    from trnrt.stats import StatsCollector

    off = make_snapshot(0)
    c = StatsCollector()
    c.set_speculative("NEXTN", 3)
    c.on_spec_step(4, 12, 6, [3, 2, 1])  # (6 + 4) / 4 = 2.5 tokens per verify, 6 / 12 = 50% accepted
    on = dict(off, speculative=c.snapshot()["speculative"])
    src = FakeStatsSource([off, on])

    async def run():
        app = TopApp(src, interval=60.0)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.polls_applied >= 1)
            line = app.query_one("#spec", Static)
            await pilot.pause(0.05)
            assert not line.display and "spec" not in "\n".join(screen_text(app.export_screenshot()))
            await pilot.press("r")
            await wait_for(pilot, lambda: app.polls_applied >= 2)
            await pilot.pause(0.05)
            assert line.display
            assert str(line.render()) == "spec accept length 2.50 (rate 50%) · NEXTN, 3 draft steps"
            screen = screen_text(app.export_screenshot())
            # its own line, right under the summary
            assert screen[2].strip() == "spec accept length 2.50 (rate 50%) · NEXTN, 3 draft steps"

    asyncio.run(run())


def test_parallel_line_only_with_tensor_parallelism(make_snapshot):
    """No engine with a `parallel` section (every fixture snapshot): no parallel line; with one
    (TP=2): a line under the summary with TP×EP, the collectives per step and the ranks' memory."""
    off = make_snapshot(0)
    par = {"tp_size": 2, "ep_size": 2, "steps": 4, "step_ms": 8.0, "collective_ms_per_step": 2.0,
           "collective_share": 0.25, "collective_calls_per_step": 12.0, "agreement": {"mismatches": 0},
           "ranks": [{"rank": r, "rss_bytes": 2**30, "weight_bytes": 2**28, "state_bytes": 2**24} for r in (0, 1)]}
    on = dict(off, engines=[dict(off["engines"][0], parallel=par), *off["engines"][1:]])
    src = FakeStatsSource([off, on])
    expected = ("parallel TP2×EP2 · collectives 2.0ms/step (25% of the 8.0ms step, 12 per step) · ranks agree · "
                "memory RSS·weights·state r0 1.0G·256M·16M, r1 1.0G·256M·16M")

    async def run():
        app = TopApp(src, interval=60.0)
        async with app.run_test(size=(200, 36)) as pilot:
            await wait_for(pilot, lambda: app.polls_applied >= 1)
            line = app.query_one("#parallel", Static)
            await pilot.pause(0.05)
            assert not line.display and "TP2" not in "\n".join(screen_text(app.export_screenshot()))
            await pilot.press("r")
            await wait_for(pilot, lambda: app.polls_applied >= 2)
            await pilot.pause(0.05)
            assert line.display and str(line.render()) == expected
            assert screen_text(app.export_screenshot())[2].strip() == expected  # right under the summary

    asyncio.run(run())


def test_screenshot_snapshot(make_snapshot):
    """Constant data, fixed size, no clock, a long interval: the screen is deterministic.

    Compared as text rows (colours and fonts may change with Textual's theme; layout and values
    must not). Regenerate with TRNRT_UPDATE_SNAPSHOTS=1 after a deliberate change or a Textual
    upgrade, and review the diff.
    """
    src = FakeStatsSource([make_snapshot(0)])
    needles = ("trnrt top", "glm-5.3-flash · batch8 · up 1h00m", "output tok/s", "requests/s",
               "TTFT", "ITL", "E2E", "50ms", "1.23s", "KV pages", "96/128 75%", "prefix hit",
               "engine-0", "engine-1", "Quit", "Pause", "Refresh")

    async def run():
        app = TopApp(src, interval=60.0)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.polls_applied >= 1)
            # On a loaded machine the first paint after the poll can land late (CI once caught a
            # screen with only the header drawn): take screenshots until every needle is on the
            # screen and two in a row agree, then compare that settled screen.
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 20.0
            previous = None
            while True:
                await pilot.pause(0.2)
                text = "\n".join(screen_text(app.export_screenshot(title="trnrt top")))
                settled = text == previous and all(n in text for n in needles)
                if settled or loop.time() > deadline:
                    return text
                previous = text

    text = asyncio.run(run())
    for needle in needles:
        assert needle in text, needle
    if os.environ.get("TRNRT_UPDATE_SNAPSHOTS") or not SNAPSHOT_FILE.exists():
        SNAPSHOT_FILE.parent.mkdir(exist_ok=True)
        SNAPSHOT_FILE.write_text(text + "\n", encoding="utf-8")
    assert text + "\n" == SNAPSHOT_FILE.read_text(encoding="utf-8")
