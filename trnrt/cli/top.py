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
    url: Annotated[str, typer.Argument(help="Server base URL (or the full /v1/stats URL).")] = DEFAULT_URL,
    interval: Annotated[float, typer.Option("--interval", "-i", min=0.1, help="Seconds between polls.")] = 1.0,
    once: Annotated[bool, typer.Option("--once", "-1", help="Print one snapshot as a table and exit.")] = False,
    timeout: Annotated[float, typer.Option("--timeout", min=0.1, help="HTTP timeout per fetch, seconds.")] = 2.0,
    demo: Annotated[bool, typer.Option("--demo", help="Show synthetic traffic instead of a server.")] = False,
    api_key: Annotated[Optional[str], typer.Option(
        "--api-key", envvar="TRNRT_API_KEY", show_envvar=True,
        help="Send `Authorization: Bearer KEY` (for a server started with --api-key).")] = None,
) -> None:
    """Live dashboard of a trnrt server: throughput, latency percentiles, queue and cache use.

    Keys: [bold]q[/] quit, [bold]p[/] pause, [bold]r[/] refresh now.

    With [bold]--once[/]: prints one snapshot as tables and exits; exit 1 if the server is unreachable.
    """
    from trnrt.top.source import DemoStatsSource, HttpStatsSource, SourceError

    source = DemoStatsSource() if demo else HttpStatsSource(url, timeout_s=timeout, api_key=api_key)
    if once:
        from rich.console import Console

        from trnrt.top.format import once_renderable

        try:
            snap = source.fetch()
        except SourceError as e:
            typer.secho(f"trnrt top: cannot reach {source.description}: {e}", err=True, fg="red")
            raise typer.Exit(code=1)
        Console().print(once_renderable(snap, source.description))
        return

    from trnrt.top.app import TopApp

    TopApp(source, interval=interval).run()
