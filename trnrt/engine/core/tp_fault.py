"""A test hook: make a rank's `execute` raise for chosen requests, on chosen ranks only.

$TRNRT_TP_TEST_FAULT = "SEED:RANKS[;SEED:RANKS...]", e.g. "7001:0,1;7002:1": a step whose rows
include a request sampled with seed 7001 raises on ranks 0 and 1 (a failure every rank shares),
one with seed 7002 raises on rank 1 alone (a worker's lone failure, as an OOM of its shard would).
It raises before the runner runs, so before any collective. The seed picks the request because it
travels in the rows to every rank and a client sets it (`"seed": 7002`).

Unset (always, outside tests) nothing is installed: the runners keep their own `execute`, and the
hot path pays nothing. Set, the rank logs a warning at start.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("trnrt.engine.core.tp")

TEST_FAULT_ENV = "TRNRT_TP_TEST_FAULT"


class InjectedFault(RuntimeError):
    """The error an injected fault raises."""


def parse_faults(spec: str) -> dict[int, frozenset[int]]:
    """"7001:0,1;7002:1" -> {7001: {0, 1}, 7002: {1}}."""
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        seed, _, ranks = part.partition(":")
        out[int(seed)] = frozenset(int(r) for r in ranks.split(",") if r.strip())
    return out


def install_test_fault(runner, rank: int) -> None:
    """Wrap `runner.execute` (an instance attribute over the class's method) when
    $TRNRT_TP_TEST_FAULT names a seed for `rank`; else do nothing."""
    spec = os.environ.get(TEST_FAULT_ENV, "").strip()
    if not spec:
        return
    seeds = {s for s, ranks in parse_faults(spec).items() if rank in ranks}
    if not seeds:
        return
    log.warning("rank %d: test fault armed (%s=%r): execute raises for seeds %s", rank, TEST_FAULT_ENV, spec,
                sorted(seeds))
    execute = runner.execute

    def faulty_execute(rows):
        hit = [r.seed for r in rows if r.seed in seeds]
        if hit:
            raise InjectedFault(f"injected test fault on rank {rank} (seed {hit[0]})")
        return execute(rows)

    runner.execute = faulty_execute
