"""Golden scheduler traces: fabricated scenarios and the deterministic driver that plays them.

Used by two callers:
- scripts/capture_scheduler_traces.py plays every scenario against a chosen tree's scheduler (the
  pre-change one, commit 5f1d6ae) and writes tests/engine/sched/data/scheduler_traces.json, which holds
  each scenario's definition next to its trace (so a change to the builders below cannot silently
  change what the test replays);
- tests/engine/sched/test_scheduler_trace.py replays the stored definitions against the current
  scheduler and requires the same trace.

A scenario is plain JSON:

    {"name": str,
     "config": {SchedulerConfig kwargs},          # only the pre-change fields
     "cache": [num_blocks, block_size, num_slots],
     "eos": [token ids],
     "max_steps": int,
     "events": [[step, kind, ...], ...]}

Events (steps count from 1, as SchedulerOutput.step_id does):
    [s, "add", {"rid", "n", "max_new_tokens", "stop_token_ids"?, "ignore_eos"?, "prefix"?, "force"?}]
        before schedule() of step s. The prompt is n deterministic tokens; "prefix": [seed, k]
        makes its first k tokens those of `seed` (shared prefixes). "force": {output index: token}
        makes the fabricated runner sample that token at that output index (EOS, stop tokens).
    [s, "abort", rid, phase]   phase "pre" (before schedule), "mid" (between schedule() and
                               update_from_output: the scheduled entry goes stale) or "post".
    [s, "finish", rid]         after update_from_output: a stop string matched (finish_request).
    [s, "fail", rid]           the runner reports an error for rid's row in step s.

The fabricated runner samples, for every row with do_sample, `force[output index]` if given, else a
token hashed from (rid, position of the new token): a preempted request re-samples what it sampled
before. Tokens are in 10..909: never EOS (999) nor the small stop ids the scenarios use.

The trace, one record per step:
    {"n": step_id,
     "ev": outcomes of the step's "pre" events,
     "s": [[rid, num_computed_tokens, len(token_ids), crc32(token_ids), block_table, slot_id,
            is_prefill, do_sample, num_output_tokens], ...]   (batch order),
     "p": preempted_request_ids, "f": finished_request_ids,
     "u": [[rid, new_token_ids, finish_reason.to_dict() | None, error | None], ...],
     "post": outcomes of "mid"/"post" events, "q": [num_waiting, num_running, free pages, used slots]}
"""

from __future__ import annotations

import random
import zlib

from trnrt.engine.cache.cache_manager import CacheManager
from trnrt.engine.output.outputs import RunnerOutput
from trnrt.engine.request import FinishReason, GenerateRequest, InvalidRequestError, SamplingParams
from trnrt.engine.sched.scheduler import Scheduler, SchedulerConfig

EOS = 999
STOP = 5  # a stop_token_id the scenarios force


def _h(*parts) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


def prompt_tokens(spec: dict) -> list[int]:
    seed = spec.get("seed", spec["rid"])
    toks = [_h("p", seed, i) % 900 + 10 for i in range(spec["n"])]
    if "prefix" in spec:
        pseed, k = spec["prefix"]
        toks[:k] = [_h("p", pseed, i) % 900 + 10 for i in range(min(k, spec["n"]))]
    return toks


def sampled_token(rid: str, position: int) -> int:
    return _h("t", rid, position) % 900 + 10


def _crc(tokens: list[int]) -> int:
    return zlib.crc32(",".join(map(str, tokens)).encode())


# -- driver -------------------------------------------------------------------------------------


def run_scenario(sc: dict, *, check_integrity: bool = True, scheduler_factory=None) -> list[dict]:
    """Play `sc`; return its trace. Calls scheduler.check_integrity() after every step.

    scheduler_factory(config, cache, eos_token_ids) builds the Scheduler (default: the plain
    constructor, no prefix cache).
    """
    cfg = SchedulerConfig(**sc["config"])
    cache = CacheManager(*sc["cache"])
    ticks = iter(range(1, 10**9))
    if scheduler_factory is None:
        sched = Scheduler(cfg, cache, eos_token_ids=sc["eos"], clock=lambda: float(next(ticks)))
    else:
        sched = scheduler_factory(cfg, cache, sc["eos"])
    by_step: dict[int, list] = {}
    for ev in sc["events"]:
        by_step.setdefault(ev[0], []).append(ev)
    last_event_step = max(by_step, default=0)
    forced: dict[str, dict[int, int]] = {}
    trace: list[dict] = []

    def do_abort(rid: str) -> list:
        seq = sched.get_sequence(rid)
        prior = seq.status.value if seq is not None else None
        return ["abort", rid, prior, sched.abort(rid, message="trace abort") is not None]

    for step in range(1, sc["max_steps"] + 1):
        if step > last_event_step and not sched.has_unfinished_requests():
            break
        events = by_step.get(step, [])
        pre = []
        for ev in events:
            kind = ev[1]
            if kind == "add":
                spec = ev[2]
                forced[spec["rid"]] = {int(k): v for k, v in spec.get("force", {}).items()}
                params = SamplingParams(
                    max_new_tokens=spec["max_new_tokens"],
                    temperature=0.0,
                    stop_token_ids=list(spec.get("stop_token_ids", [])),
                    ignore_eos=spec.get("ignore_eos", False),
                )
                try:
                    seq = sched.add_request(GenerateRequest(prompt_tokens(spec), params, spec["rid"]))
                    pre.append(["add", spec["rid"], seq.status.value,
                                seq.finish_reason.to_dict() if seq.finish_reason else None])
                except InvalidRequestError as e:
                    pre.append(["add", spec["rid"], "invalid", e.field])
            elif kind == "abort" and ev[3] == "pre":
                pre.append(do_abort(ev[2]))
        so = sched.schedule()
        rec = {
            "n": so.step_id,
            "ev": pre,
            "s": [[e.request_id, e.num_computed_tokens, len(e.token_ids), _crc(e.token_ids), list(e.block_table),
                   e.slot_id, int(e.is_prefill), int(e.do_sample), e.num_output_tokens] for e in so.scheduled],
            "p": list(so.preempted_request_ids),
            "f": list(so.finished_request_ids),
        }
        post = []
        for ev in events:
            if ev[1] == "abort" and ev[3] == "mid":
                post.append(do_abort(ev[2]))
        failed = {ev[2]: "trace failure" for ev in events if ev[1] == "fail"}
        tokens = []
        for e in so.scheduled:
            if not e.do_sample:
                tokens.append(None)
                continue
            pos = e.num_computed_tokens + len(e.token_ids)
            tokens.append(forced.get(e.request_id, {}).get(e.num_output_tokens, sampled_token(e.request_id, pos)))
        updates = sched.update_from_output(so, RunnerOutput(sampled_token_ids=tokens, failed=failed))
        rec["u"] = [[u.request_id, list(u.new_token_ids), u.finish_reason.to_dict() if u.finish_reason else None,
                     u.error] for u in updates]
        for ev in events:
            if ev[1] == "abort" and ev[3] == "post":
                post.append(do_abort(ev[2]))
            elif ev[1] == "finish":
                seq = sched.finish_request(ev[2], FinishReason("stop", matched="</s>"))
                post.append(["finish", ev[2], seq is not None])
        rec["post"] = post
        rec["q"] = [sched.num_waiting, sched.num_running, cache.num_free_blocks, cache.num_used_slots]
        if check_integrity:
            sched.check_integrity()
        trace.append(rec)
    return trace


# -- scenario builders ----------------------------------------------------------------------------


def _req(rid, n, max_new_tokens=6, step=1, **kw) -> list:
    spec = {"rid": rid, "n": n, "max_new_tokens": max_new_tokens, **kw}
    return [step, "add", spec]


def _sc(name, events, *, cache=(64, 4, 9), eos=(EOS,), max_steps=300, **config) -> dict:
    config.setdefault("max_num_seqs", 4)
    config.setdefault("max_num_batched_tokens", 64)
    config.setdefault("max_model_len", 128)
    return {"name": name, "config": config, "cache": list(cache), "eos": list(eos), "max_steps": max_steps,
            "events": events}


def _random_scenario(seed: int) -> dict:
    rng = random.Random(seed)
    block = rng.choice([2, 4, 8])
    max_model_len = rng.choice([32, 48, 64])
    chunked = rng.random() < 0.8
    budget = rng.choice([8, 16, 24, 40]) if chunked else max_model_len + rng.choice([0, 16])
    config = dict(
        max_num_seqs=rng.randint(1, 6),
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        chunked_prefill=chunked,
        decode_first=rng.random() < 0.6,
    )
    if chunked and rng.random() < 0.4:
        config["max_prefill_chunk_tokens"] = rng.choice([4, 6, 12])
    min_blocks = -(-max_model_len // block) + 1
    num_blocks = min_blocks + rng.randint(0, 3 * min_blocks)
    num_slots = rng.randint(2, 8)
    events = []
    n_req = rng.randint(3, 10)
    for i in range(n_req):
        spec = dict(rid=f"r{i}", n=rng.randint(1, max_model_len - 1), max_new_tokens=rng.randint(0, 24))
        if rng.random() < 0.3:
            spec["force"] = {str(rng.randint(0, 10)): EOS}
        if rng.random() < 0.2:
            spec["stop_token_ids"] = [STOP]
            spec["force"] = {**spec.get("force", {}), str(rng.randint(0, 10)): STOP}
        if rng.random() < 0.1:
            spec["ignore_eos"] = True
        if i > 0 and rng.random() < 0.3:
            spec["prefix"] = ["shared", rng.randint(1, spec["n"])]
        events.append([rng.randint(1, 12), "add", spec])
    for _ in range(rng.randint(0, 3)):
        events.append([rng.randint(1, 30), "abort", f"r{rng.randrange(n_req)}", rng.choice(["pre", "mid", "post"])])
    if rng.random() < 0.3:
        events.append([rng.randint(2, 20), "finish", f"r{rng.randrange(n_req)}"])
    if rng.random() < 0.2:
        events.append([rng.randint(2, 20), "fail", f"r{rng.randrange(n_req)}"])
    events.sort(key=lambda e: e[0])  # stable: same-step events keep their generation order
    return {"name": f"random_{seed}", "config": config, "cache": [num_blocks, block, num_slots], "eos": [EOS],
            "max_steps": 400, "events": events}


def build_scenarios() -> list[dict]:
    S = []
    # -- plain admission
    S.append(_sc("single", [_req("a", 8)]))
    S.append(_sc("three_fcfs", [_req("a", 8), _req("b", 12), _req("c", 3)]))
    S.append(_sc("eight_fit", [_req(f"r{i}", 4 + i, 3 + i % 4) for i in range(8)], max_num_seqs=8, max_num_batched_tokens=256,
                 cache=(128, 4, 9)))
    S.append(_sc("one_token_prompts", [_req(f"r{i}", 1, 5) for i in range(5)]))
    S.append(_sc("prompt_at_context_limit", [_req("a", 127, 10), _req("b", 128, 1)], max_num_batched_tokens=256))
    S.append(_sc("invalid_and_duplicate", [_req("a", 8), _req("a", 4), _req("b", 0), _req("c", 4, step=3),
                                           _req("c", 4, step=3)]))
    S.append(_sc("zero_max_new_tokens", [_req("a", 8, 0), _req("b", 8, 1), _req("c", 8, 0, step=2)]))
    # -- chunked prefill
    S.append(_sc("chunk_budget_16", [_req("a", 50, 4)], max_num_batched_tokens=16))
    S.append(_sc("chunk_cap_8", [_req("a", 40, 4), _req("b", 20, 4)], max_prefill_chunk_tokens=8))
    S.append(_sc("chunk_exact_budget", [_req("a", 32, 3), _req("b", 33, 3)], max_num_batched_tokens=32))
    S.append(_sc("chunk_mixed_decode", [_req("old", 4, 30), _req("new", 40, 5, step=3), _req("new2", 25, 5, step=4)],
                 max_num_batched_tokens=16))
    S.append(_sc("chunk_many_long", [_req(f"r{i}", 30 + 7 * i, 4) for i in range(4)], max_num_batched_tokens=24,
                 max_prefill_chunk_tokens=10, cache=(160, 4, 9)))
    S.append(_sc("chunk_budget_1", [_req("a", 6, 3), _req("b", 3, 3)], max_num_batched_tokens=1))
    S.append(_sc("decode_first_false", [_req("old", 4, 20), _req("new", 40, 4, step=2)], max_num_batched_tokens=16,
                 decode_first=False))
    S.append(_sc("decode_first_false_many", [_req(f"r{i}", 10 + 9 * i, 8, step=1 + i) for i in range(5)],
                 max_num_batched_tokens=20, decode_first=False, max_prefill_chunk_tokens=12, cache=(100, 4, 9)))
    S.append(_sc("decode_first_false_budget_tight", [_req(f"r{i}", 6, 10) for i in range(4)] + [_req("late", 30, 3, step=4)],
                 max_num_batched_tokens=5, decode_first=False))
    # -- chunked_prefill=False
    S.append(_sc("no_chunk_head_waits", [_req("a", 100, 4), _req("b", 50, 4)], max_num_batched_tokens=128,
                 chunked_prefill=False, cache=(80, 4, 9)))
    S.append(_sc("no_chunk_decodes_block_head", [_req("a", 10, 12), _req("b", 10, 12), _req("c", 120, 2, step=2)],
                 max_num_batched_tokens=128, chunked_prefill=False, cache=(80, 4, 9)))
    S.append(_sc("no_chunk_many", [_req(f"r{i}", 20 + 5 * i, 5) for i in range(6)], max_num_batched_tokens=64,
                 max_model_len=64, chunked_prefill=False, cache=(40, 4, 9)))
    S.append(_sc("no_chunk_cap", [_req("a", 40, 4), _req("b", 30, 4)], max_num_batched_tokens=96,
                 max_prefill_chunk_tokens=64, max_model_len=64, chunked_prefill=False, decode_first=False,
                 cache=(40, 4, 9)))
    # -- preemption under page pressure (8 usable pages of 4 tokens = 32 tokens)
    S.append(_sc("preempt_newest", [_req(f"r{i}", 8, 12) for i in range(3)], max_model_len=32, cache=(9, 4, 9)))
    S.append(_sc("preempt_repeated", [_req(f"r{i}", 6, 20) for i in range(4)], max_model_len=32, cache=(9, 4, 9)))
    S.append(_sc("preempt_chunk_in_progress", [_req("a", 4, 20), _req("b", 20, 6, step=2)], max_num_batched_tokens=8,
                 max_model_len=32, cache=(9, 4, 9)))
    S.append(_sc("preempt_self", [_req("a", 12, 20), _req("b", 12, 20)], max_model_len=28, cache=(8, 4, 9)))
    S.append(_sc("preempt_decode_first_false", [_req(f"r{i}", 5 + i, 15) for i in range(4)], max_model_len=32,
                 decode_first=False, max_num_batched_tokens=10, cache=(9, 4, 9)))
    S.append(_sc("preempt_block2", [_req(f"r{i}", 3 + 2 * i, 14) for i in range(5)], max_model_len=24, cache=(13, 2, 9)))
    S.append(_sc("preempt_then_arrivals", [_req(f"r{i}", 8, 10) for i in range(3)]
                 + [_req(f"late{i}", 4, 4, step=5 + 3 * i) for i in range(3)], max_model_len=32, cache=(9, 4, 9)))
    S.append(_sc("preempt_big_pages", [_req(f"r{i}", 9, 16) for i in range(3)], max_model_len=40, cache=(6, 8, 9),
                 max_num_batched_tokens=12))
    # -- slot pressure
    S.append(_sc("slots_2", [_req(f"r{i}", 6, 5) for i in range(5)], cache=(64, 4, 3)))
    S.append(_sc("slots_1", [_req(f"r{i}", 6, 3) for i in range(3)], cache=(64, 4, 2)))
    S.append(_sc("slots_and_pages", [_req(f"r{i}", 7, 9) for i in range(5)], max_model_len=32, cache=(10, 4, 4)))
    S.append(_sc("slots_with_chunks", [_req(f"r{i}", 20, 4) for i in range(4)], max_num_batched_tokens=12,
                 cache=(64, 4, 3)))
    # -- aborts
    S.append(_sc("abort_waiting", [_req(f"r{i}", 6, 6) for i in range(4)] + [[1, "abort", "r3", "pre"]], max_num_seqs=2))
    S.append(_sc("abort_running", [_req("a", 6, 10), _req("b", 6, 10), [3, "abort", "a", "pre"]]))
    S.append(_sc("abort_preempted", [_req(f"r{i}", 8, 12) for i in range(3)] + [[7, "abort", "r2", "pre"],
                                                                             [9, "abort", "r1", "pre"]],
                 max_model_len=32, cache=(9, 4, 9)))
    S.append(_sc("abort_mid_step", [_req("a", 6, 8), _req("b", 20, 4), [2, "abort", "a", "mid"], [1, "abort", "b", "mid"]],
                 max_num_batched_tokens=8))
    S.append(_sc("abort_post_step", [_req("a", 6, 8), _req("b", 6, 8), [2, "abort", "b", "post"]]))
    S.append(_sc("abort_unknown_and_finished", [_req("a", 4, 2), [1, "abort", "zzz", "pre"], [4, "abort", "a", "pre"]]))
    S.append(_sc("abort_then_reuse_id", [_req("a", 10, 6), [2, "abort", "a", "pre"], _req("a", 5, 3, step=2)]))
    S.append(_sc("abort_mid_then_reuse_id", [_req("a", 30, 6), [1, "abort", "a", "mid"], _req("a", 5, 3, step=2)],
                 max_num_batched_tokens=8))
    S.append(_sc("abort_chunking", [_req("a", 40, 6), _req("b", 8, 6), [2, "abort", "a", "pre"]], max_num_batched_tokens=10))
    # -- finishes
    S.append(_sc("finish_eos", [_req("a", 6, 20, force={"3": EOS}), _req("b", 6, 20, force={"0": EOS})]))
    S.append(_sc("finish_max_new_tokens", [_req("a", 6, 1), _req("b", 6, 7)]))
    S.append(_sc("finish_stop_token", [_req("a", 6, 20, stop_token_ids=[STOP], force={"2": STOP}),
                                       _req("b", 6, 20, stop_token_ids=[STOP, 7], force={"4": 7})]))
    S.append(_sc("finish_ignore_eos", [_req("a", 6, 6, ignore_eos=True, force={"1": EOS}),
                                       _req("b", 6, 9, ignore_eos=True, stop_token_ids=[STOP], force={"1": EOS, "3": STOP})]))
    S.append(_sc("finish_max_model_len", [_req("a", 28, 50), _req("b", 31, 50)], max_model_len=32, max_num_batched_tokens=64))
    S.append(_sc("finish_stop_string", [_req("a", 6, 20), _req("b", 6, 20), [3, "finish", "a"], [5, "finish", "b"],
                                        [6, "finish", "b"]]))
    S.append(_sc("finish_eos_and_length_same_step", [_req("a", 6, 3, force={"2": EOS}), _req("b", 6, 3)]))
    S.append(_sc("runner_failure", [_req("a", 6, 10), _req("b", 6, 10), _req("c", 20, 4), [3, "fail", "a"],
                                    [1, "fail", "c"]], max_num_batched_tokens=16))
    # -- arrivals at different steps
    S.append(_sc("staggered", [_req(f"r{i}", 5 + 3 * i, 6, step=1 + 2 * i) for i in range(6)]))
    S.append(_sc("idle_gap", [_req("a", 4, 2), _req("b", 4, 2, step=10)]))
    S.append(_sc("burst_late", [_req("a", 8, 12)] + [_req(f"r{i}", 6, 4, step=6) for i in range(6)],
                 max_num_batched_tokens=20))
    S.append(_sc("arrival_during_chunking", [_req("long", 60, 3), _req("short", 4, 3, step=2), _req("s2", 4, 3, step=3)],
                 max_num_batched_tokens=16))
    # -- max_num_seqs
    S.append(_sc("max_seqs_1", [_req(f"r{i}", 4, 3) for i in range(4)], max_num_seqs=1))
    S.append(_sc("max_seqs_2", [_req(f"r{i}", 4 + i, 4) for i in range(5)], max_num_seqs=2))
    S.append(_sc("max_seqs_3_budget", [_req(f"r{i}", 10, 6) for i in range(7)], max_num_seqs=3, max_num_batched_tokens=12))
    S.append(_sc("shared_prefixes", [_req(f"r{i}", 24, 5, prefix=["sys", 16], step=1 + i) for i in range(5)]))
    # -- randomized mixes (definitions are stored in the JSON: the RNG never runs at test time)
    S.extend(_random_scenario(seed) for seed in range(16))
    names = [s["name"] for s in S]
    assert len(names) == len(set(names)), "scenario names must be unique"
    return S
