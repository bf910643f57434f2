"""Regenerate docs/top.svg: `trnrt top` against a real server under steady load.

Starts `trnrt serve`'s stack in-process (waitress + the real engine on the embedded tiny model, with
few running slots so that a queue forms), drives completions from a few client threads, runs the
Textual dashboard headless (`App.run_test`) against the server's /v1/stats for a number of polls,
and saves Textual's SVG export of the screen.

    .venv/bin/python scripts/top_screenshot.py [--out docs/top.svg] [--clients 8] [--polls 16]

Takes about half a minute on a laptop CPU. The numbers in the picture are whatever this machine
measured; the layout is what the dashboard shows.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import random
import socket
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def start_server(max_running: int):
    from trnrt.engine.core.engine import Engine
    from trnrt.models.tiny import default_model_dir
    from trnrt.serve import ServeSettings, create_app, hf_tokenizer_factory
    from trnrt.serve.server import make_server

    engine = Engine.from_model_dir(default_model_dir(), max_running_requests=max_running)
    app = create_app(engine, hf_tokenizer_factory(engine.model_info.model_path), ServeSettings())
    srv = make_server(app, host="127.0.0.1", port=0, threads=32)
    threading.Thread(target=srv.run, name="waitress", daemon=True).start()
    return engine, app, srv, srv.effective_port


def client_loop(port: int, seed: int, stop: threading.Event, vocab: int) -> None:
    """Completions back to back: random prompt lengths and output lengths, now and then a stop
    (a whole-vocabulary stop_token_ids list) and a client that hangs up mid-stream (an abort)."""
    rng = random.Random(seed)
    while not stop.is_set():
        body = {"prompt": [rng.randrange(100, 4000) for _ in range(rng.randint(8, 120))],
                "max_tokens": rng.randint(16, 96), "ignore_eos": True, "temperature": 0.7, "seed": seed}
        kind = rng.choices(("length", "stop", "abort"), weights=(12, 2, 2))[0]
        if kind == "stop":
            body["stop_token_ids"] = list(range(vocab))
        if kind == "abort":
            body["stream"] = True
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            conn.request("POST", "/v1/completions", body=json.dumps(body),
                         headers={"Content-Type": "application/json"})
            sock = conn.sock  # getresponse() may hand it over to the response
            r = conn.getresponse()
            if kind == "abort":
                for _ in range(rng.randint(3, 10)):
                    r.fp.readline()
                # Hang up mid-stream. (The stream is `Connection: close`, so http.client gave the
                # socket to the response: conn.close() alone would leave it open.)
                sock.shutdown(socket.SHUT_RDWR)
                r.close()
            else:
                r.read()
        except OSError:
            pass
        finally:
            conn.close()


async def screenshot(url: str, out: Path, polls: int, interval: float, size: tuple[int, int]) -> str:
    from trnrt.top.app import TopApp
    from trnrt.top.source import HttpStatsSource

    app = TopApp(HttpStatsSource(url), interval=interval)
    async with app.run_test(size=size) as pilot:
        deadline = time.monotonic() + polls * interval * 4 + 10
        while app.polls_applied < polls:
            if time.monotonic() > deadline:
                raise SystemExit(f"only {app.polls_applied} polls in time")
            await pilot.pause(0.05)
        await pilot.pause(0.2)
        if app.last_error:
            raise SystemExit(f"the dashboard shows an error: {app.last_error}")
        svg = app.export_screenshot(title="trnrt top")
    out.write_text(svg)
    return svg


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "top.svg")
    ap.add_argument("--clients", type=int, default=8, help="client threads (more than --max-running: a queue)")
    ap.add_argument("--max-running", type=int, default=6, help="the engine's running slots")
    ap.add_argument("--warmup", type=float, default=4.0, help="seconds of load before the dashboard starts")
    ap.add_argument("--polls", type=int, default=14)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--size", default="170x34", help="terminal columns x rows (170: every engine column)")
    args = ap.parse_args()
    size = tuple(int(v) for v in args.size.split("x"))

    from trnrt.serve import get_state

    engine, app, srv, port = start_server(args.max_running)
    url = f"http://127.0.0.1:{port}"
    stop = threading.Event()
    clients = [threading.Thread(target=client_loop, args=(port, i, stop, engine.model_info.vocab_size), daemon=True)
               for i in range(args.clients)]
    for t in clients:
        t.start()
    try:
        time.sleep(args.warmup)
        asyncio.run(screenshot(url, args.out, args.polls, args.interval, size))
    finally:
        stop.set()
        counters = engine.stats()["counters"]
        engine.shutdown(0.0)  # aborts what runs; the workers answer and the clients stop
        get_state(app).wait_idle(10.0)
        for t in clients:
            t.join(10.0)
        srv.close()
    print(f"wrote {args.out} ({args.polls} polls every {args.interval}s); server counters at the end: "
          f"{counters['requests_arrived']} arrived, finished {counters['requests_finished']}, "
          f"{counters['generation_tokens']} output tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
