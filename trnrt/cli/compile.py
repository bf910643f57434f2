"""`trnrt compile`: ahead-of-time compile every graph of a preset; writes a manifest.

Nothing heavy is imported at module level (this module is imported by `trnrt --help`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from trnrt.cli import app

BACKEND_CHOICES = ("cpu", "cuda", "neuron", "eager")


def selected_flags(structured_outputs: bool, penalties: bool, prompt_logprobs: bool = False) -> list[str]:
    return [f for f, on in (("structured_outputs", structured_outputs), ("penalties", penalties),
                            ("prompt_logprobs", prompt_logprobs)) if on]


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


SUMMARY_COLUMNS = ("graph", "status", "graph hash", "export s", "compile s", "bytes")


def summary_lines(graphs) -> list[str]:
    """The summary table of `trnrt compile` as plain aligned lines: a header, then one row per
    manifest entry, the graph id always in full.

    Not a rich Table on purpose: rich fits a table to the terminal by cutting cells, and on an
    80-column terminal it cut every id to "decode-b8-t1-…", so the rows looked identical. A line
    wider than the terminal wraps instead; nothing is cut.
    """
    rows = [SUMMARY_COLUMNS]
    for g in graphs:
        rows.append((g.id, g.status + (" (reused)" if g.reused else ""), g.graph_hash[:16] or "-",
                     f"{g.export_s:.1f}", f"{g.compile_s:.1f}", _fmt_bytes(g.bytes)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(SUMMARY_COLUMNS))]
    right = (False, False, False, True, True, True)
    return ["  ".join(c.rjust(w) if r else c.ljust(w) for c, w, r in zip(row, widths, right)).rstrip()
            for row in rows]


@app.command("compile")
def compile_cmd(
    preset: Annotated[str, typer.Option("--preset", help="Preset name (presets/NAME.toml) or path to a .toml.")] = "default",
    structured_outputs: Annotated[bool, typer.Option("--structured-outputs", help="Also compile the structured-output variant graphs.")] = False,
    penalties: Annotated[bool, typer.Option("--penalties", help="Also compile the penalties variant graphs.")] = False,
    prompt_logprobs: Annotated[bool, typer.Option("--prompt-logprobs", help="Also compile the prompt-logprobs prefill graphs (every prompt position's logprob).")] = False,
    model: Annotated[Optional[str], typer.Option("--model", help="Checkpoint directory (default: the embedded tiny model). An FP8 checkpoint compiles its FP8 graphs into PRESET/BACKEND/fp8/.")] = None,
    quantization: Annotated[Optional[str], typer.Option("--quantization", help="fp8: compile the graphs of the checkpoint quantized per 128x128 block at load (what `trnrt serve --quantization fp8` runs), into PRESET/BACKEND/fp8/.")] = None,
    kv_cache_dtype: Annotated[str, typer.Option("--kv-cache-dtype", help="auto, bf16 or fp8_e4m3: the graphs of `trnrt serve --kv-cache-dtype fp8_e4m3` (FP8 latent / key cache), into PRESET/BACKEND/kv_fp8/ (fp8+kv_fp8/ with FP8 weights).")] = "auto",
    backend: Annotated[str, typer.Option("--backend", help="cpu (AOTInductor), cuda (CUDA graphs), neuron, or eager.")] = "cpu",
    out: Annotated[Optional[Path], typer.Option("--out", help="Artifact root; writes OUT/PRESET/BACKEND/manifest.json. Default: the artifact cache, where `trnrt serve` finds the graphs of this model and preset by itself.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Export and hash only; compile nothing.")] = False,
    keep_going: Annotated[bool, typer.Option("--keep-going", help="Go on after a graph fails (exit 1 at the end).")] = False,
    only: Annotated[Optional[list[str]], typer.Option("--only", help="Compile only this graph id (repeatable).")] = None,
    tp_size: Annotated[Optional[int], typer.Option("--tp-size", help="Tensor-parallel degree (default: the preset's tensor_parallel): compile the rank graphs of this layout (one program for every rank) into PRESET/BACKEND/tp{N}ep{M}/.")] = None,
    ep_size: Annotated[int, typer.Option("--ep-size", help="Expert-parallel degree (divides --tp-size).")] = 1,
) -> None:
    """Export, hash and compile every graph of a preset; reuse up-to-date artifacts.

    Exit codes: 0 all graphs ok, 1 a graph failed, 2 usage error (unknown preset or flag, backend
    not available on this machine).
    """
    from rich.console import Console

    console = Console(stderr=False)
    err = Console(stderr=True)
    if backend not in BACKEND_CHOICES:
        err.print(f"[red]error:[/red] --backend must be one of {', '.join(BACKEND_CHOICES)}, got {backend!r}")
        raise typer.Exit(2)
    flags = selected_flags(structured_outputs, penalties, prompt_logprobs)

    from trnrt.config.presets import PresetError, read_preset

    try:
        p = read_preset(preset)
    except PresetError as e:
        err.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2)

    preset_tp = p.engine_config.tensor_parallel
    if tp_size is not None and preset_tp > 1 and tp_size != preset_tp:
        err.print(f"[red]error:[/red] --tp-size {tp_size} but the preset says tensor_parallel = {preset_tp}")
        raise typer.Exit(2)
    tp_size = tp_size if tp_size is not None else preset_tp
    if tp_size < 1 or ep_size < 1 or tp_size % ep_size:
        err.print(f"[red]error:[/red] --ep-size ({ep_size}) must divide --tp-size ({tp_size}), both >= 1")
        raise typer.Exit(2)
    if quantization not in (None, "fp8"):
        err.print(f"[red]error:[/red] --quantization must be fp8 (or left out), got {quantization!r}")
        raise typer.Exit(2)
    if (quantization or kv_cache_dtype != "auto") and tp_size > 1:
        err.print("[red]error:[/red] --quantization / --kv-cache-dtype with --tp-size > 1: compiled FP8 graphs per "
                  "rank are not built yet (`trnrt serve --tp-size N` runs FP8 weights and the FP8 KV cache eagerly)")
        raise typer.Exit(2)

    from trnrt.compile.backends import get_backend
    from trnrt.compile.catalogue import SpeculativeFlagError, UnknownVariantError, expand

    ok, why = get_backend(backend).available()
    if not ok:
        err.print(f"[red]error:[/red] {why}")
        raise typer.Exit(2)
    cfg = p.engine_config.replace(variants=tuple(flags))
    try:
        specs = expand(cfg, flags)
    except (UnknownVariantError, SpeculativeFlagError) as e:
        err.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2)

    import time

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from trnrt.compile.pipeline import CompileFailed, compile_graphs, load_model_and_state

    parallel = None
    try:
        # The graphs are exported (and hashed) on the device they will run on.
        device = "cuda" if backend == "cuda" else "cpu"
        if tp_size > 1:  # rank 0's model on a fake world: its graphs are every rank's (compile.tp)
            from trnrt.compile.tp import rank_model_and_state
            from trnrt.parallel.fake import fake_context

            parallel = fake_context(tp_size, ep_size)
            mdl, state = rank_model_and_state(model, cfg, parallel, device=device)
        else:
            mdl, state = load_model_and_state(model, cfg, device=device, quantization=quantization,
                                              kv_cache_dtype=kv_cache_dtype)
    except (ValueError, OSError) as e:
        err.print(f"[red]error:[/red] --model: {e}")
        raise typer.Exit(2)

    if out is None:  # the artifact cache: `trnrt serve` (no --compiled) runs these graphs by itself
        from trnrt.compile.artifact_cache import artifact_root
        from trnrt.models.paths import resolve_model_dir

        out = artifact_root(resolve_model_dir(model))
    n = len(only) if only else len(specs)
    from trnrt.compile.manifest import quantization_of

    quant = quantization_of(mdl, state)
    lay = (f" tp {tp_size} ep {ep_size}" if tp_size > 1 else "") + (f", {quant} weights" if quant else "")
    console.print(f"compile [bold]{p.name}[/bold] ({p.path}) backend [bold]{backend}[/bold]{lay}, {n} graph(s)"
                  f"{', flags ' + '+'.join(flags) if flags else ''}{' (dry run)' if dry_run else ''}")
    started: dict[str, float] = {}
    id_width = max((len(s.graph_id) for s in specs), default=28)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as progress:
        task = progress.add_task("starting", total=n)

        def on_event(ev) -> None:
            if ev.stage == "export":
                started[ev.graph_id] = time.perf_counter()
            if ev.stage in ("export", "hash", "compile"):
                progress.update(task, description=f"{ev.graph_id}: {ev.stage}")
            elif ev.stage in ("done", "reused", "failed"):
                dt = time.perf_counter() - started.get(ev.graph_id, time.perf_counter())
                mark = {"done": "[green]ok[/green]", "reused": "[cyan]up to date[/cyan]", "failed": "[red]FAILED[/red]"}[ev.stage]
                progress.console.print(f"  {ev.graph_id:<{id_width}} {mark}  {dt:6.1f} s"
                                       + (f"  {ev.message[:200]}" if ev.message else ""))
                progress.advance(task)

        try:
            manifest, art_dir = compile_graphs(mdl, state, cfg, backend=backend, out=out, flags=flags, dry_run=dry_run,
                                               keep_going=keep_going, only=only, on_event=on_event,
                                               parallel=parallel)
        except CompileFailed as e:
            progress.stop()
            err.print(f"[red]error:[/red] {e}\nmanifest: {e.manifest_path}")
            raise typer.Exit(1)
        except ValueError as e:
            progress.stop()
            err.print(f"[red]error:[/red] {e}")
            raise typer.Exit(2)

    console.print(f"manifest: {art_dir / 'manifest.json'}", soft_wrap=True, highlight=False, markup=False)
    lines = summary_lines(manifest.graphs)
    console.print(lines[0], style="bold", soft_wrap=True, highlight=False, markup=False)
    for line in lines[1:]:
        console.print(line, soft_wrap=True, highlight=False, markup=False)
    failed = sum(g.status == "failed" for g in manifest.graphs)
    if failed:
        raise typer.Exit(1)
