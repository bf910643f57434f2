"""The `trnrt` command line (Typer).

Each subcommand lives in its own module and imports torch, the engine or the server only inside
the command function, so `trnrt --help` and `trnrt top` stay light.

Exit codes: 0 ok; 1 a check failed; 2 usage error (bad option, missing SDK for a backend).
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

app = typer.Typer(
    name="trnrt",
    help="Inference and serving runtime for GLM-5.3-Flash (glm5_next).",
    no_args_is_help=True,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_show_locals=False,
    epilog="Exit codes: 0 ok, 1 check failed, 2 usage error.",
)


def _version_callback(value: bool) -> None:
    if value:
        from trnrt import __version__

        typer.echo(f"trnrt {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        Optional[bool],
        typer.Option("--version", help="Print the version and exit.", callback=_version_callback, is_eager=True),
    ] = None,
) -> None:
    """Inference and serving runtime for GLM-5.3-Flash (glm5_next)."""


def _register() -> None:
    # Each module adds its commands to `app`; none imports torch at module level.
    import importlib

    for name in ("make_tiny", "generate", "bench", "serve", "top", "compile", "verify", "plan"):
        try:
            importlib.import_module(f"trnrt.cli.{name}")
        except ModuleNotFoundError as e:  # a command not built yet is simply not listed
            if e.name != f"trnrt.cli.{name}":
                raise


_register()


def main() -> None:
    app()
