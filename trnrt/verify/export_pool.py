"""Graph exports in parallel processes, for `trnrt verify graph-equiv` over many graphs.

An export is CPU-bound Python (torch.export's tracing and functionalisation, ~15 s a graph of
the tiny model on one core), so graphs are exported in worker processes, one torch thread each,
as many as there are cores and as memory allows (`worker_count`). Each worker builds the model of
a (preset, flags, dims) once and exports every graph it is handed for it; it stores each
fingerprint in the fingerprint cache itself (work done survives an interrupted check) and sends
it back. Jobs are deduplicated by cache key first: the MTP presets' plain graphs are default's.

Workers are spawned (not forked): they import the source tree from disk, so an in-process patch
of the model (tests do that) is invisible to them. `fingerprints_for` in graph_equiv exports in
the calling process instead, and the CLI uses it whenever it has fewer than two graphs to export
or `--jobs 1`.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable, Iterable

# Peak resident memory of one worker while it exports (torch imported, the model built, one graph
# traced and functionalised), measured with /usr/bin/time on a 2-core CPU: ~0.7 GB at tiny dims,
# ~0.9 GB at real dims on the meta device (docs/COMPILE.md); the bound keeps a margin on both.
WORKER_BYTES = {"tiny": 1 << 30, "real": 3 << 29}


@dataclass(frozen=True)
class ExportJob:
    """One graph to export: the preset (path), flags and dims its model is built from."""
    preset: str
    flags: tuple[str, ...]
    dims: str
    graph_id: str
    key: str
    store: bool = True  # put the fingerprint in the cache (not with --fresh)


def available_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def available_memory() -> int | None:
    """MemAvailable in bytes (Linux), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def worker_count(jobs: int, dims: Iterable[str], requested: int | None = None) -> int:
    """How many export processes to run for `jobs` exports: `requested` when given, else one a core,
    at most as many as ~80% of the available memory holds (WORKER_BYTES each), never more than
    there are jobs, at least 1."""
    if requested is not None:
        return max(1, min(requested, jobs))
    n = available_cores()
    mem = available_memory()
    if mem is not None:
        per = max((WORKER_BYTES.get(d, WORKER_BYTES["real"]) for d in dims), default=WORKER_BYTES["tiny"])
        n = min(n, int(mem * 0.8) // per)
    return max(1, min(n, jobs))


# -- worker side ----------------------------------------------------------------------------------

_exporters: dict = {}


def _init_worker(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def _export(job: ExportJob) -> tuple[str, dict]:
    """In a worker: export and hash one graph, store it in the fingerprint cache, return it as JSON."""
    from trnrt.compile import fingerprint_cache
    from trnrt.verify.graph_equiv import GraphExporter

    model_key = (job.preset, job.flags, job.dims)
    exporter = _exporters.get(model_key)
    if exporter is None:
        _exporters.clear()  # one model at a time: bounded memory per worker
        exporter = _exporters[model_key] = GraphExporter(job.preset, job.flags, job.dims)
    fp = exporter.fingerprint(job.graph_id)
    if job.store:
        fingerprint_cache.put(job.key, fp)
    return job.key, fingerprint_cache.to_json(fp)


# -- parent side ----------------------------------------------------------------------------------


class ExportFailed(RuntimeError):
    def __init__(self, job: ExportJob, error: BaseException):
        super().__init__(f"{job.graph_id}: {type(error).__name__}: {error}")
        self.job = job


def run(jobs: list[ExportJob], workers: int, on_done: Callable[[ExportJob, object], None]) -> None:
    """Export `jobs` (distinct keys) in `workers` spawned processes; `on_done(job, fingerprint)` in
    this process as each finishes. Jobs of one model go out together, so a worker builds each model
    it needs about once. The first failure cancels what has not started and raises ExportFailed."""
    from trnrt.compile.fingerprint_cache import from_json

    order = sorted(jobs, key=lambda j: (j.preset, j.flags, j.dims))
    threads = max(1, available_cores() // workers)
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_init_worker,
                             initargs=(threads,)) as pool:
        pending = {pool.submit(_export, j): j for j in order}
        try:
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    job = pending.pop(fut)
                    try:
                        _, d = fut.result()
                    except BaseException as e:
                        raise ExportFailed(job, e) from e
                    on_done(job, from_json(d))
        finally:
            for fut in pending:
                fut.cancel()
