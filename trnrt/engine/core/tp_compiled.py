"""Every tensor-parallel rank runs the same compiled graphs, or none (issue #31 item 5).

A compiled TP graph holds the model's collectives, which pair up across ranks in graph order:
if one rank ran a step compiled and another ran it eagerly (a graph missing, stale or refused on
one rank only), the ranks would wait on each other's collectives, or worse, pair up the wrong
ones. So after each rank has loaded its graphs (`RankSetup.compiled_loader`, called with the
rank's own model, state and ParallelContext), `load_agreed` gathers every rank's outcome (the
graph ids it loaded, or why it refused) on the world group and applies one decision on every
rank: all loaded the same ids -> run them; otherwise the start-up fails on every rank with the
same message (`--compiled DIR`), or every rank runs eagerly (the artifact cache: a stale cache
never stops a server, as at TP=1). The engine layer never imports trnrt.compile: the loader is
the CLI's (trnrt.compile.tp_loader.RankCompiledLoader), passed in.
"""

from __future__ import annotations

import logging

log = logging.getLogger("trnrt.engine.core.tp")


class CompiledRanksError(RuntimeError):
    """The ranks' compiled graphs cannot run (a rank refused them, or they loaded different ones)."""


def decide(outcomes: list[dict]) -> str | None:
    """None when every rank loaded the same graph ids without error, else why not (one line).
    `outcomes[r]`: {"ids": [graph id, ...], "error": str | None} of rank r."""
    errors = [f"rank {r}: {o['error']}" for r, o in enumerate(outcomes) if o["error"]]
    if errors:
        return "; ".join(errors)
    if len({tuple(o["ids"]) for o in outcomes}) > 1:
        return "the ranks loaded different graphs (" + "; ".join(
            f"rank {r}: {', '.join(o['ids']) or 'none'}" for r, o in enumerate(outcomes)) + ")"
    return None


def load_agreed(loader, model, state, engine_config, ctx) -> dict:
    """Call `loader(model, state, engine_config, ctx)` on this rank, then agree with the others
    (see the module doc): the rank's {GraphSpec: callable}, {} when every rank runs eagerly.
    Raises CompiledRanksError (on every rank alike) when the graphs cannot run and the loader
    does not fall back to eager (`loader.fallback_eager`)."""
    import torch.distributed as dist

    try:
        graphs = loader(model, state, engine_config, ctx)
        mine = {"ids": sorted(s.graph_id for s in graphs), "error": None}
    except Exception as e:  # reported to every rank: they all decide alike
        graphs, mine = {}, {"ids": [], "error": f"{type(e).__name__}: {e}"}
    outcomes: list = [None] * ctx.tp_size
    dist.all_gather_object(outcomes, mine, group=ctx.group)  # the world group (its timeout)
    why = decide(outcomes)
    if why is None:
        if ctx.tp_rank == 0:
            log.info("tensor-parallel ranks run %d compiled graph(s): %s", len(mine["ids"]),
                     ", ".join(mine["ids"]) or "none (eager)")
        return graphs
    if getattr(loader, "fallback_eager", False):
        if ctx.tp_rank == 0:
            log.warning("compiled tensor-parallel graphs not used, every rank runs eagerly: %s", why)
        return {}
    raise CompiledRanksError(f"compiled tensor-parallel graphs refused: {why}")
