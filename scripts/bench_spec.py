"""Speculative decoding benchmark: output tokens per second of the engine with speculative decode
steps (the oracle drafter at a chosen acceptance rate) against plain decoding, same run, same
prompts, batch 1 and 8, greedy, on the embedded tiny checkpoint (eager, both sides).

The oracle drafter replays each request's plain greedy output (recorded first) and corrupts a
chosen share of the draft positions, so the acceptance rate is set by the script: 100 % (nothing
corrupted), 50 % (every other position) and 0 % (every position). It drafts for free, so the
numbers bound what a drafter of that acceptance rate can give; the MTP drafter's own cost is
measured as a separate row (its random tiny layer accepts ~0 %).

    python scripts/bench_spec.py [--k 3] [--new 64] [--rounds 2] [--threads 1]
"""

from __future__ import annotations

import argparse
import random
import time


def _engine(k: int | None, drafter=None, batch: int = 8, min_accept: float = 0.0):
    from trnrt.engine.engine import Engine
    from trnrt.engine.spec.config import SpeculativeConfig

    kw = {}
    if k is not None:
        kw = dict(speculative=SpeculativeConfig(num_steps=k, min_accept_length=min_accept),
                  drafter_factory=(lambda runner: drafter) if drafter is not None else None)
    return Engine.from_model_dir(None, max_running_requests=batch, **kw)


def _run(engine, prompts, new: int, batch: int) -> tuple[float, dict]:
    from trnrt.engine.request import GenerateRequest, SamplingParams

    outs = {}
    t0 = time.perf_counter()
    for g in range(0, len(prompts), batch):
        reqs = [GenerateRequest(prompt_token_ids=p, request_id=f"r{g + i}",
                                sampling_params=SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True))
                for i, p in enumerate(prompts[g: g + batch])]
        for s in engine.submit_many(reqs):
            ids = []
            for o in s:
                ids.extend(o.new_token_ids)
            outs[s.request_id] = ids
    dt = time.perf_counter() - t0
    return sum(len(v) for v in outs.values()) / dt, outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dynamic", type=float, default=2.5,
                    help="min tokens per verify of the dynamic rows (--speculative-min-accept-length)")
    a = ap.parse_args()

    import torch

    from trnrt.engine.spec.oracle import OracleDrafter

    torch.set_num_threads(a.threads)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 4000) for _ in range(rng.randrange(16, 64))] for _ in range(16)]
    plain = _engine(None)
    _run(plain, prompts[:2], 4, 8)  # warm-up
    _, ref = _run(plain, prompts, a.new, 8)
    recorded = {rid: prompts[int(rid[1:])] + out for rid, out in ref.items()}
    # Every configuration's engine is built first; each round then runs every configuration once,
    # interleaved, so a slow moment of the box hits all of them alike (best round per config).
    configs = [("plain", None)]
    for rate in (1.0, 0.5, 0.0):
        corrupt = {}
        for rid, seq in recorded.items():
            L = len(prompts[int(rid[1:])])
            step = {1.0: 0, 0.5: 2, 0.0: 1}[rate]
            corrupt[rid] = set(range(L, len(seq) + a.k + 2, step)) if step else set()
        for mode, min_accept in (("always", 0.0), ("dynamic", a.dynamic)):
            oracle = OracleDrafter(recorded, 4096, corrupt, check=False)
            configs.append((f"{mode} {int(rate * 100)}%", _engine(a.k, oracle, batch=8, min_accept=min_accept)))
    configs.append(("MTP drafter", _engine(a.k, None, batch=8)))
    rows = []
    for batch in (1, 8):
        best: dict[str, float] = {}
        for _ in range(a.rounds):
            for name, eng in configs:
                tps, outs = _run(eng or plain, prompts[: 2 * batch], a.new, batch)
                if name != "MTP drafter":
                    assert all(outs[r] == ref[r] for r in outs), f"{name}: output differs from plain decoding"
                best[name] = max(best.get(name, 0.0), tps)
        for name, eng in configs:
            acc = None if eng is None else eng.stats()["speculative"]["accept_rate"]
            rows.append((batch, name, acc, best[name]))
    for _, eng in configs:
        if eng is not None:
            eng.shutdown()
    plain.shutdown()
    print(f"k={a.k}, {a.new} new tokens, {a.rounds} rounds (best), torch threads {a.threads}")
    print(f"oracle drafts corrupted at 0 / every other / every position (always: speculate every step; "
          f"dynamic: --speculative-min-accept-length {a.dynamic})")
    print(f"{'batch':>5}  {'drafter':<14} {'accept':>7} {'tok/s':>8} {'vs plain':>9}")
    for batch, name, acc, tps in rows:
        base = next(t for b, n, _, t in rows if b == batch and n == "plain")
        acc_s = "-" if acc is None else f"{acc:.0%}"
        print(f"{batch:>5}  {name:<14} {acc_s:>7} {tps:>8.1f} {tps / base:>8.2f}x")


if __name__ == "__main__":
    main()
