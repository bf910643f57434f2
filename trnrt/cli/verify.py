"""`trnrt verify graph-equiv`: canonical graph hashes of presets against lock files or a git ref.

Nothing heavy is imported at module level (this module is imported by `trnrt --help`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from trnrt.cli import app

verify_app = typer.Typer(help="Verification tools.", no_args_is_help=True)
app.add_typer(verify_app, name="verify")


@verify_app.command("graph-equiv")
def graph_equiv_cmd(
    preset: Annotated[Optional[list[str]], typer.Option("--preset", help="Preset name or path (repeatable; default: every preset).")] = None,
    structured_outputs: Annotated[bool, typer.Option("--structured-outputs", help="Enable the structured-output flag.")] = False,
    penalties: Annotated[bool, typer.Option("--penalties", help="Enable the penalties flag.")] = False,
    prompt_logprobs: Annotated[bool, typer.Option("--prompt-logprobs", help="Enable the prompt-logprobs flag.")] = False,
    against: Annotated[Optional[Path], typer.Option("--against", help="Lock file to compare with (default: presets/PRESET.graphs.lock.json).")] = None,
    base_ref: Annotated[Optional[str], typer.Option("--base-ref", help="Compare with the graphs at this git revision instead of a lock.")] = None,
    dims: Annotated[str, typer.Option("--dims", help="tiny: the tiny model's config; real: GLM-5.3-Flash's dimensions (meta device).")] = "tiny",
    only: Annotated[Optional[list[str]], typer.Option("--only", help="Check only this graph id (repeatable).")] = None,
    update_lock: Annotated[bool, typer.Option("--update-lock", help="Write the current hashes into the lock file (prints what changed).")] = False,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Also write the report as JSON to this file.")] = None,
    fresh: Annotated[bool, typer.Option("--fresh", help="Export every graph again, ignoring fingerprints that "
                                        "`trnrt compile` or an earlier check stored for this source tree.")] = False,
    jobs: Annotated[Optional[int], typer.Option("--jobs", "-j", min=1, help="Export processes (default: one a core, "
                                                "as memory allows; env TRNRT_VERIFY_JOBS).")] = None,
) -> None:
    """Exit 0 when every graph matches its reference, 1 with the first differing node otherwise.

    With --structured-outputs / --penalties / --prompt-logprobs the base graphs must hash exactly as with the flags
    off (the lock holds the flag-off hashes). Exit 2: usage error or a graph that fails to export.
    """
    from rich.console import Console

    console = Console(width=200)
    err = Console(stderr=True)
    from trnrt.cli.compile import selected_flags

    flags = selected_flags(structured_outputs, penalties, prompt_logprobs)
    if dims not in ("tiny", "real"):
        err.print(f"[red]error:[/red] --dims must be tiny or real, got {dims!r}")
        raise typer.Exit(2)
    if against is not None and base_ref is not None:
        err.print("[red]error:[/red] give either --against or --base-ref, not both")
        raise typer.Exit(2)
    if update_lock and base_ref is not None:
        err.print("[red]error:[/red] --update-lock writes the current hashes; it takes no --base-ref")
        raise typer.Exit(2)

    from trnrt.config.presets import PresetError, list_presets, read_preset

    names = list(preset or list_presets())
    if against is not None and len(names) != 1:
        err.print("[red]error:[/red] --against LOCK compares one preset: give exactly one --preset")
        raise typer.Exit(2)
    try:
        presets = [read_preset(n) for n in names]
    except PresetError as e:
        err.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2)

    from trnrt.compile.catalogue import SpeculativeFlagError, UnknownVariantError, check_speculative_flags
    from trnrt.engine.spec.config import REFUSED_FLAGS
    from trnrt.verify.graph_equiv import (
        compare_results, compare_to_lock, fingerprints_at_ref, plan_preset, read_lock, render, write_lock,
    )

    t0 = time.perf_counter()
    plans = []
    for p in presets:
        pflags = flags
        try:
            check_speculative_flags(p.engine_config, flags)
        except SpeculativeFlagError as e:
            if preset:  # named: the user asked for what it refuses
                err.print(f"[red]error:[/red] {e}")
                raise typer.Exit(2)
            pflags = [f for f in flags if f not in REFUSED_FLAGS]
            err.print(f"  {p.name}: takes no grammar / penalty flags (speculative_mode always): checked with "
                      f"{pflags or 'no flags'}", highlight=False)
        try:
            plans.append((p, pflags, plan_preset(str(p.path), pflags, dims, only)))
        except UnknownVariantError as e:
            err.print(f"[red]error:[/red] {e}")
            raise typer.Exit(2)
    if jobs is None and os.environ.get("TRNRT_VERIFY_JOBS", "").strip():
        jobs = max(1, int(os.environ["TRNRT_VERIFY_JOBS"]))
    try:
        fps, counts = _fingerprints([(p.name, plan) for p, _, plan in plans], use_cache=not fresh, jobs=jobs, err=err)
    except Exception as e:  # an export failure of a graph is itself a regression
        err.print(f"[red]error:[/red] exporting the graphs failed: {type(e).__name__}: {e}")
        raise typer.Exit(2)

    reports = []
    for p, pflags, plan in plans:
        result = {"preset_sha256": plan.preset_sha256, "model_config_sha256": plan.model_config_sha256,
                  "graphs": {gid: fps[k] for gid, k in plan.keys.items()}, "lock_path": plan.lock_path}
        lock_path = against or p.lock_path
        if update_lock:
            old = read_lock(lock_path) if lock_path.is_file() else None
            if pflags:
                # With a flag on, only the variant graphs are new: the base graphs must still
                # hash as locked with the flags off, or the flag changed the default graphs.
                if old is None:
                    err.print(f"[red]error:[/red] lock the flag-off graphs first (--update-lock without flags)")
                    raise typer.Exit(2)
                base = {k: v for k, v in result["graphs"].items() if k.endswith("-base")}
                rep = compare_to_lock({**result, "graphs": base}, old, p.name, dims, str(lock_path), complete=False)
                if not rep.ok:
                    render(rep, console)
                    err.print("[red]error:[/red] with the flags on, base graphs differ from the flag-off lock: "
                              "not written")
                    raise typer.Exit(1)
            changed = write_lock(lock_path, p.name, dims, result, old, replace=not only and not pflags)
            console.print(f"wrote {lock_path} ({dims}): " + ("; ".join(changed) if changed else "no change"))
            continue
        if base_ref is not None:
            try:
                ref = fingerprints_at_ref(base_ref, p.name, pflags, dims, only)
            except ValueError as e:
                err.print(f"[red]error:[/red] {e}")
                raise typer.Exit(2)
            rep = compare_results(ref, result, p.name, dims, base_ref)
        else:
            if not lock_path.is_file():
                err.print(f"[red]error:[/red] no lock file {lock_path} (create it with --update-lock)")
                raise typer.Exit(2)
            rep = compare_to_lock(result, read_lock(lock_path), p.name, dims, str(lock_path),
                                  complete=not only, flags=pflags)
        render(rep, console)
        reports.append(rep)
    if json_out is not None:
        json_out.write_text(json.dumps([r.to_json() for r in reports], indent=1) + "\n")
    n_graphs = sum(len(plan.keys) for _, _, plan in plans)
    how = f"{counts['exported']} exported"
    if counts["exported"]:
        how += f" in {counts['workers']} process{'es' if counts['workers'] > 1 else ''}"
    console.print(f"graph-equiv: {n_graphs} graph{'s' if n_graphs != 1 else ''} of {len(plans)} "
                  f"preset{'s' if len(plans) != 1 else ''} in {time.perf_counter() - t0:.1f} s ({how}, "
                  f"{counts['cached']} from the fingerprint cache, {counts['shared']} shared between presets)",
                  highlight=False)
    if not all(r.ok for r in reports):
        raise typer.Exit(1)


def _fingerprints(plans: list, use_cache: bool, jobs: int | None, err) -> tuple[dict, dict]:
    """{cache key: GraphFingerprint} for every graph of `plans` ([(preset name, PresetPlan)]), and
    counts: graphs read from the cache, exported, shared (a key another preset also has), workers.
    Each distinct key is exported once: in this process when fewer than two need it or jobs is 1
    (in-process patches count), else in parallel processes (trnrt.verify.export_pool). A progress
    bar per preset, and a line per graph saying where its fingerprint came from."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from trnrt.compile import fingerprint_cache
    from trnrt.verify import export_pool
    from trnrt.verify.graph_equiv import GraphExporter

    fps: dict = {}
    users: dict[str, list] = {}  # key -> [(preset name, graph id, task, index, total)]
    counts = {"cached": 0, "exported": 0, "shared": 0, "workers": 0}
    todo: dict[str, export_pool.ExportJob] = {}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True) as bar:
        def line(name: str, gid: str, i: int, n: int, how: str) -> None:
            bar.console.print(f"  {name}: {gid} ({i + 1}/{n}) {how}", highlight=False)

        for name, plan in plans:
            task = bar.add_task(name, total=len(plan.keys))
            for i, (gid, k) in enumerate(plan.keys.items()):
                if k in users or k in fps:
                    counts["shared"] += 1
                users.setdefault(k, []).append((name, gid, task, i, len(plan.keys)))
                if k in fps or k in todo:
                    continue
                fp = fingerprint_cache.get(k) if use_cache else None
                if fp is not None:
                    fps[k] = fp
                else:
                    todo[k] = export_pool.ExportJob(plan.preset, plan.flags, plan.dims, gid, k, store=use_cache)
        for k, fp in fps.items():
            for name, gid, task, i, n in users[k]:
                counts["cached"] += 1
                line(name, gid, i, n, "hashed earlier from this source tree (fingerprint cache)")
                bar.advance(task)

        def done(job, fp) -> None:
            fps[job.key] = fp
            counts["exported"] += 1
            for name, gid, task, i, n in users[job.key]:
                line(name, gid, i, n, "exported and hashed")
                bar.advance(task)

        if todo:
            workers = export_pool.worker_count(len(todo), {j.dims for j in todo.values()}, jobs)
            counts["workers"] = workers
            if workers < 2:
                exporters: dict = {}
                for job in todo.values():
                    mk = (job.preset, job.flags, job.dims)
                    exporters = {mk: exporters.get(mk) or GraphExporter(*mk)}
                    fp = exporters[mk].fingerprint(job.graph_id)
                    if use_cache:
                        fingerprint_cache.put(job.key, fp)
                    done(job, fp)
            else:
                bar.console.print(f"  exporting {len(todo)} graphs in {workers} processes", highlight=False)
                export_pool.run(list(todo.values()), workers, done)
    return fps, counts
