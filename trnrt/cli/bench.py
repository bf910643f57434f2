"""`trnrt bench`: offline prefill / decode throughput, optionally against transformers.

The measuring lives in trnrt.benchmark.engine_bench.run_bench (see its module doc for what is timed); this
module parses options, draws the progress bar and prints. Nothing heavy is imported at module level.
"""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from trnrt.cli import app


def _fail(message: str, code: int = 2) -> None:
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True).print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


# `trnrt bench` is a group whose callback is the offline benchmark (so `trnrt bench --batch 8 ...`
# works as before) with one subcommand, `trnrt bench serve` (trnrt.benchmark: the HTTP serving
# benchmark, no torch).
bench_app = typer.Typer(name="bench", rich_markup_mode="rich", pretty_exceptions_show_locals=False)
app.add_typer(bench_app, name="bench")


def _register_serve() -> None:
    from trnrt.benchmark.cli import bench_serve

    bench_app.command("serve", short_help="Serving benchmark over HTTP (TTFT, TPOT, ITL, throughput), like SGLang's bench_serving.")(bench_serve)


_register_serve()


@bench_app.callback(invoke_without_command=True)
def bench(
    ctx: typer.Context,
    model: Annotated[Optional[str], typer.Option("--model", help="Checkpoint directory (default: the embedded tiny model).")] = None,
    batch: Annotated[int, typer.Option("--batch", help="Sequences decoded together.")] = 8,
    input_len: Annotated[int, typer.Option("--input-len", help="Prompt tokens per sequence.")] = 32,
    output_len: Annotated[int, typer.Option("--output-len", help="Generated tokens per sequence (>= 2).")] = 32,
    num_prompts: Annotated[Optional[int], typer.Option("--num-prompts", help="Prompts in all, run in waves of --batch (default: --batch).")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random prompts.")] = 0,
    compare_hf: Annotated[bool, typer.Option("--compare-hf", help="Also run transformers' generate on the same checkpoint and prompts; print the ratios.")] = False,
    compiled: Annotated[Optional[str], typer.Option("--compiled", help="Run the graphs compiled by `trnrt compile` under DIR (uses --preset's settings).", metavar="DIR")] = None,
    preset: Annotated[Optional[str], typer.Option("--preset", help="Graph-shaping preset, used as is (default: the 'default' preset, widened to fit the run; as is with --compiled).")] = None,
    backend: Annotated[Optional[str], typer.Option("--backend", help="With --compiled: the artifact backend directory to use.")] = None,
    threads: Annotated[Optional[int], typer.Option("--threads", help="torch intra-op threads, the same for both sides (default: $TRNRT_TORCH_THREADS, else the engine's default: 1 on the CPU below 1e8 parameters, else the physical cores). The --json output's \"threads\" says which ran.", min=1)] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")] = False,
) -> None:
    """Benchmark prefill and decode throughput on random prompts (offline, greedy, ignore_eos).

    `trnrt bench serve --help`: the serving benchmark (HTTP, against a running or a started server).
    """
    if ctx.invoked_subcommand is not None:
        given = [p.opts[0] for p in ctx.command.params
                 if getattr(ctx.get_parameter_source(p.name), "name", None) == "COMMANDLINE"]
        if given:
            _fail(f"{', '.join(given)}: an option of the offline `trnrt bench`; "
                  f"give `{ctx.invoked_subcommand}`'s options after `{ctx.invoked_subcommand}`")
        return
    from trnrt.benchmark.engine_bench import BenchError, check_bench_args

    try:
        check_bench_args(batch, input_len, output_len, num_prompts)
    except BenchError as e:
        _fail(f"--{(e.field or '').replace('_', '-')}: {e}")

    engine_config = None
    if preset is not None or compiled is not None:
        from trnrt.config.presets import PresetError, load_preset

        try:
            engine_config = load_preset(preset or "default")
        except PresetError as e:
            _fail(f"--preset: {e}")
    from trnrt.cli.serve_engine import compiled_loader  # serve's and generate's loader

    loader = compiled_loader(compiled, backend) if compiled is not None else None

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from trnrt.benchmark.engine_bench import run_bench

    # The bar goes to stderr so that --json output on stdout stays one clean object. It is redrawn
    # only when a stage ends: rich's auto-refresh thread wakes 10 times a second and takes the GIL
    # from whatever is being timed (measured: +50 us per batch-8 compiled decode step of ~1.03 ms).
    err = Console(stderr=True)
    with Progress(TextColumn("{task.description:<22}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=json_out, auto_refresh=False) as bar:
        task = bar.add_task("starting", total=None)

        def progress(desc: str, done: int, total: int) -> None:
            bar.update(task, description=desc, completed=done, total=total)
            bar.refresh()

        try:
            result = run_bench(model, batch=batch, input_len=input_len, output_len=output_len,
                               num_prompts=num_prompts, compare_hf=compare_hf, seed=seed,
                               engine_config=engine_config, compiled_loader=loader, progress=progress,
                               threads=threads)
        except BenchError as e:
            bar.stop()
            _fail(f"--{(e.field or '').replace('_', '-')}: {e}")
        except ValueError as e:  # --model, or a compiled artifact that does not fit (CompiledArtifactError)
            bar.stop()
            _fail(f"{'--compiled' if compiled and type(e).__name__ == 'CompiledArtifactError' else '--model'}: {e}")
    if json_out:
        typer.echo(json.dumps(result))
        return
    _print_table(result, compiled is not None)


def _fmt(v, unit: str = "") -> str:
    return "-" if v is None else f"{v:,.2f}{unit}"


def _print_table(r: dict, compiled: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    hf = r.get("hf")
    t = Table(title=f"batch {r['batch']}, {r['input_len']} in, {r['output_len']} out, "
              + ("compiled" if compiled else "eager"), title_justify="left")
    t.add_column("")
    t.add_column("trnrt", justify="right")
    if hf:
        t.add_column("transformers", justify="right")
        t.add_column("ratio", justify="right")
    rows = (("prefill tok/s", "prefill_tok_s", "prefill"), ("decode tok/s", "decode_tok_s", "decode"),
            ("decode step ms", "decode_step_ms", None))
    for label, key, rkey in rows:
        cells = [label, _fmt(r[key])]
        if hf:
            ratio = r["ratio"].get(rkey) if rkey else (hf[key] / r[key] if r[key] and hf[key] else None)
            cells += [_fmt(hf[key]), "-" if ratio is None else f"{ratio:.2f}x"]
        t.add_row(*cells)
    Console().print(t)
