"""`trnrt make-tiny DIR`: write the tiny GLM-5.3-Flash checkpoint (torch imported only when run)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from trnrt.cli import app


@app.command("make-tiny")
def make_tiny(
    out_dir: Annotated[Path, typer.Argument(help="Directory to write (replaced if it holds a checkpoint).", metavar="DIR")],
    seed: Annotated[int, typer.Option("--seed", help="Weight seed; the same seed gives byte-identical files.")] = 0,
    fp8: Annotated[bool, typer.Option("--fp8", help="Write the FP8 release layout: float8_e4m3fn weights with a "
                                      "weight_scale_inv per 128x128 block, quantized from the bf16 tiny weights.")] = False,
    train_steps: Annotated[int, typer.Option("--train-steps", min=0, help="Train the random weights N AdamW steps on "
                                             "the tiny corpus first (a model with clear favourites, for "
                                             "accuracy measurements such as FP8 vs bf16; ~0.3-0.6 s a step).")] = 0,
    shards: Annotated[int, typer.Option("--shards", min=1, help="Write the weights as N safetensors shards "
                                        "plus model.safetensors.index.json (the layout of large releases).")] = 1,
) -> None:
    """Write the tiny random-weight glm5_next checkpoint (config, weights, tokenizer, chat template)."""
    from rich.console import Console
    from rich.table import Table

    from trnrt.models.tiny import write_tiny_checkpoint
    from trnrt.models.tiny.fp8 import write_tiny_fp8_checkpoint

    console = Console()
    try:
        path = (write_tiny_fp8_checkpoint if fp8 else write_tiny_checkpoint)(out_dir, seed=seed, train_steps=train_steps)
        if shards > 1:
            from trnrt.models.glm5_next.reshard import write_shards

            write_shards(path, shards)
    except FileExistsError as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None
    table = Table(title=f"tiny glm5_next checkpoint{' (FP8)' if fp8 else ''}, seed {seed}"
                  + (f", trained {train_steps} steps" if train_steps else ""), title_justify="left")
    table.add_column("file")
    table.add_column("bytes", justify="right")
    for p in sorted(path.iterdir()):
        table.add_row(p.name, f"{p.stat().st_size:,}")
    console.print(table)
    console.print(f"wrote [bold]{path}[/bold]")
