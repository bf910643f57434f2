"""`trnrt top`: live dashboard over GET /v1/stats, or one table with --once.

Module level imports only typer and the CLI root: Textual, rich tables and the HTTP source load
inside the command, so registering the command costs nothing at `trnrt --help`.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from trnrt.cli import app

DEFAULT_URL = "http://127.0.0.1:30000"  # same as trnrt.top.source.DEFAULT_URL (not imported: keep this light)


@app.command("top", rich_help_panel="Observe")
def top(
    urls: Annotated[Optional[list[str]], typer.Argument(
        help="Server base URL (or the full /v1/stats URL); a router's URL lists its engines; "
             "several engine URLs give one row each plus a total.", show_default=DEFAULT_URL)] = None,
    interval: Annotated[float, typer.Option("--interval", "-i", min=0.1, help="Seconds between polls.")] = 1.0,
    once: Annotated[bool, typer.Option("--once", "-1", help="Print one snapshot as a table and exit.")] = False,
    timeout: Annotated[float, typer.Option("--timeout", min=0.1, help="HTTP timeout per fetch, seconds.")] = 2.0,
    demo: Annotated[bool, typer.Option("--demo", help="Show synthetic traffic instead of a server.")] = False,
    api_key: Annotated[Optional[str], typer.Option(
        "--api-key", envvar="TRNRT_API_KEY", show_envvar=True,
        help="Send `Authorization: Bearer KEY` (for a server started with --api-key).")] = None,
    router: Annotated[bool, typer.Option(
        "--router", help="URL is an SGLang router: list its workers (GET /workers) and show each engine "
                         "(found by itself when the URL has no /v1/stats).")] = False,
) -> None:
    """Live dashboard of a trnrt server: throughput, latency percentiles, queue and cache use.

    Keys: [bold]q[/] quit, [bold]p[/] pause, [bold]r[/] refresh now.

    With [bold]--once[/]: prints one snapshot as tables and exits; exit 1 if the server is unreachable
    (with several engines: if none answers; an unreachable one is marked "down").
    """
    from trnrt.top.source import (AutoStatsSource, DemoStatsSource, EnginesStatsSource, RouterStatsSource,
                                  SourceError)

    urls = urls or [DEFAULT_URL]
    if demo:
        source = DemoStatsSource()
    elif len(urls) > 1:
        if router:
            raise typer.BadParameter("--router takes one URL", param_hint="URLS")
        source = EnginesStatsSource(urls, timeout_s=timeout, api_key=api_key)
    elif router:
        source = RouterStatsSource(urls[0], timeout_s=timeout, api_key=api_key)
    else:
        source = AutoStatsSource(urls[0], timeout_s=timeout, api_key=api_key)
    if once:
        from rich.console import Console

        from trnrt.top.format import once_renderable

        try:
            snap = source.fetch()
        except SourceError as e:
            typer.secho(f"trnrt top: cannot reach {source.description}: {e}", err=True, fg="red")
            raise typer.Exit(code=1)
        Console().print(once_renderable(snap, source.description))
        engines = snap.get("engines") or []
        if engines and all(e.get("state") == "down" for e in engines):
            typer.secho(f"trnrt top: no engine answered ({source.description})", err=True, fg="red")
            raise typer.Exit(code=1)
        return

    from trnrt.top.app import TopApp

    TopApp(source, interval=interval).run()
