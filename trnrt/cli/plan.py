"""`trnrt plan`: the memory plan of a TP / EP layout per rank (torch imported only when run)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from trnrt.cli import app


@app.command("plan")
def plan_cmd(
    model: Annotated[Optional[Path], typer.Option("--model", "--model-path", help="Checkpoint directory (its config.json only).")] = None,
    dims: Annotated[str, typer.Option("--dims", help="'real': GLM-5.3-Flash's dims (used when --model is not given).")] = "real",
    tp_size: Annotated[int, typer.Option("--tp-size", help="Tensor-parallel ranks.")] = 1,
    ep_size: Annotated[int, typer.Option("--ep-size", help="Expert-parallel degree (divides --tp-size).")] = 1,
    device: Annotated[str, typer.Option("--device", help="h200 | h100 | trn2 | cpu.")] = "h200",
    mem_fraction_static: Annotated[Optional[float], typer.Option("--mem-fraction-static", help="Share of device memory for weights + state (default: SGLang's for the TP size).")] = None,
    preset: Annotated[str, typer.Option("--preset", help="Preset (block size, max_model_len, buckets, allocation).")] = "default",
    dtype: Annotated[str, typer.Option("--dtype", help="Weight / state dtype (float32 | bfloat16 | float16).")] = "bfloat16",
    context_length: Annotated[Optional[int], typer.Option("--context-length", help="Override the preset's max_model_len.")] = None,
    mtp: Annotated[Optional[bool], typer.Option("--mtp/--no-mtp", help="Count the MTP layer (default: when the preset speculates).")] = None,
    quantization: Annotated[Optional[str], typer.Option("--quantization", help="fp8: FP8 weights with 128x128 block scales (default: an FP8 checkpoint's own).")] = None,
    kv_cache_dtype: Annotated[Optional[str], typer.Option("--kv-cache-dtype", help="fp8_e4m3: MLA latents and indexer keys in 1 byte.")] = None,
) -> None:
    """Print weight, state and capacity bytes per rank of a layout; exit 1 if it does not fit."""
    import dataclasses

    from rich.console import Console

    from trnrt.config.presets import load_preset
    from trnrt.plan.devices import device as get_device
    from trnrt.plan.fit import PlanError, check_fits, model_config, real_config
    from trnrt.plan.render import plan_table

    console = Console(width=140)
    try:
        if model is not None:
            cfg, fp8 = model_config(model)
            name, quantization = str(model), quantization or ("fp8" if fp8 else None)
        elif dims == "real":
            cfg, name = real_config(), "GLM-5.3-Flash"
        else:
            raise ValueError(f"--dims must be 'real', got {dims!r}")
        engine = load_preset(preset)
        if context_length:
            engine = dataclasses.replace(engine, max_model_len=context_length)
        dev = get_device(device)
        p = check_fits(cfg, engine, tp_size, ep_size, device, mem_fraction_static, dtype, mtp, quantization,
                       kv_cache_dtype)
        code = 0
    except PlanError as e:
        p, code = e.plan, 1
        console.print(plan_table(p, dev, dtype + (', fp8 weights' if quantization else ''), name))
        console.print(f"[red]does not fit:[/red] {e}")
        raise typer.Exit(code) from None
    except ValueError as e:  # config, preset, layout or option errors
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None
    console.print(plan_table(p, dev, dtype + (', fp8 weights' if quantization else ''), name))
