"""The body of every rank of tests/parallel/test_tp_serve_compiled.py: one TP=2 rank's runner as
`trnrt serve --tp-size 2 --compiled DIR` builds it (tp_build.build_runner over a RankSetup whose
loader is compile.tp_loader.RankCompiledLoader), against the eager rank runner.

On each rank: the compiled runner (its graphs' layout hash re-checked against this rank's own
export, `check_graphs=True`), every compiled callable wrapped in a call counter, warmed up as the
engine does (a mirrored call), then one greedy request (a 12-token prefill, eager: no prefill
graph is compiled, then DECODE_STEPS decode steps in the compiled decode-b1 graph); the same
script on an eager runner (`RankSetup` without loader). Then the agreement: a loader that loads
the graphs on rank 0 only must fail the start-up on BOTH ranks (`CompiledRanksError`), or make
both run eagerly with `fallback_eager` (the artifact cache). Last, a copy of the manifest whose
entry carries another layout hash is refused on this rank (reason graph_hash, its own export).
"""

from __future__ import annotations

from dataclasses import dataclass

DECODE_STEPS = 8
PROMPT = [11, 22, 33, 44, 55, 66, 77, 88, 99, 12, 13, 14]


@dataclass(frozen=True)
class RankZeroOnly:
    """A loader that loads on rank 0 only (a graph missing on one rank): picklable."""

    inner: object
    fallback_eager: bool = False

    def __call__(self, model, state, engine_config, ctx):
        return self.inner(model, state, engine_config, ctx) if ctx.tp_rank == 0 else {}


def _greedy(runner) -> list[int]:
    from trnrt.engine.output.outputs import RowInput

    def row(ids, start):
        return RowInput(token_ids=list(ids), start_pos=start, block_ids=[1, 2], slot_id=1, temperature=0.0,
                        top_p=1.0, top_k=-1, min_p=0.0, seed=0, num_logprobs=None, request_id="r")

    out = [runner.execute([row(PROMPT, 0)])[0].token_id]
    for i in range(DECODE_STEPS):
        out.append(runner.execute([row([out[-1]], len(PROMPT) + i)])[0].token_id)
    return out


def _refused_hash(art: str, scratch: str, model, state, ecfg, ctx) -> str:
    """A copy of the layout's manifest with another graph hash, loaded with the rank's own export
    re-checked: the CompiledArtifactError's reason."""
    import json
    import shutil
    from pathlib import Path

    from trnrt.compile.loader import CompiledArtifactError
    from trnrt.compile.tp_loader import find_layout_dir, load_rank_compiled

    dst = Path(scratch) / f"rank{ctx.tp_rank}" / "tp2ep1"
    shutil.copytree(find_layout_dir(art, ecfg, ctx, "cpu"), dst)
    man = json.loads((dst / "manifest.json").read_text())
    man["graphs"][0]["graph_hash"] = "0" * 64  # a graph of another layout (or other code)
    (dst / "manifest.json").write_text(json.dumps(man))
    try:
        load_rank_compiled(dst, model, state, ecfg, ctx, check_graphs=True)
    except CompiledArtifactError as e:
        return f"{e.reason}: {e}"
    return "loaded"


def serve_compiled(ctx, art: str, scratch: str) -> dict:
    """Rank body (see the module doc)."""
    import torch

    from trnrt.compile.tp_loader import RankCompiledLoader
    from trnrt.config.presets import read_preset
    from trnrt.engine.core.tp_build import RankSetup, build_runner
    from trnrt.engine.core.tp_compiled import CompiledRanksError, load_agreed
    from trnrt.models import kernels
    from trnrt.models.tiny import default_model_dir

    kernels.load()
    ecfg = read_preset("default").engine_config.replace(variants=())
    loader = RankCompiledLoader(art, "cpu", check_graphs=True)
    runner = build_runner(RankSetup(str(default_model_dir()), ecfg, compiled_loader=loader), ctx)
    calls: dict[str, int] = {}

    def counted(gid, fn):
        def call(*args):
            calls[gid] = calls.get(gid, 0) + 1
            return fn(*args)
        return call

    runner.compiled = {s: counted(s.graph_id, fn) for s, fn in runner.compiled.items()}
    with torch.inference_mode():
        runner.warm_up()
        warm = dict(calls)
        tokens = _greedy(runner)
        eager_runner = build_runner(RankSetup(str(default_model_dir()), ecfg), ctx)
        eager = _greedy(eager_runner)
    agree = {}
    for fallback in (False, True):
        try:
            got = load_agreed(RankZeroOnly(loader, fallback), runner.model, runner.state, ecfg, ctx)
            agree[str(fallback)] = f"loaded {len(got)}"
        except CompiledRanksError as e:
            agree[str(fallback)] = f"refused: {e}"
    refused = _refused_hash(art, scratch, runner.model, runner.state, ecfg, ctx)
    return {"ids": sorted(s.graph_id for s in runner.compiled), "warm_calls": warm, "refused_hash": refused,
            "calls": {k: v - warm.get(k, 0) for k, v in calls.items()}, "graph_calls": runner.num_graph_calls,
            "tokens": tokens, "eager_tokens": eager, "eager_compiled": bool(eager_runner.compiled), "agree": agree}
