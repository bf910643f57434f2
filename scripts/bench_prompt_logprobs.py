"""Per-step cost of the prompt-logprobs prefill graph vs the base prefill graph, same run.

Eager by default; with --compiled DIR (artifacts of `trnrt compile --preset batch8 FLAGS`, the
same --model and --flags) the compiled graphs; --compiled-base DIR takes the base graphs from
another artifact directory (e.g. one compiled without flags). Runs both steps alternately on the
same state for each prefill token bucket of the preset (over the full table) and prints ms/step
(median) and the ratio. --flags: the flag set (default prompt_logprobs; the prompt graph carries
the other flags' processors, fed neutral inputs here).

    python scripts/bench_prompt_logprobs.py [--preset batch8] [--model DIR] [--flags a,b]
        [--compiled DIR] [--compiled-base DIR] [--steps 30] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="batch8")
    ap.add_argument("--model", default=None)
    ap.add_argument("--compiled", default=None)
    ap.add_argument("--compiled-base", default=None)
    ap.add_argument("--flags", default="prompt_logprobs")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    from trnrt.compile.catalogue import expand
    from trnrt.compile.export import eager_callable, spec_inputs
    from trnrt.compile.pipeline import load_model_and_state
    from trnrt.config.presets import load_preset

    flags = tuple(sorted(set(a.flags.split(",")) | {"prompt_logprobs"}))
    cfg = load_preset(a.preset).replace(variants=flags)
    name = "+".join(flags)
    model, state = load_model_and_state(a.model, cfg, device="cpu")
    vocab = int(model.config.vocab_size)
    specs = [s for s in expand(cfg) if s.phase == "prefill" and s.context == 0 and s.variant in ("base", name)]
    fns = {}
    if a.compiled:
        from trnrt.compile import load_compiled

        from trnrt.compile import CompiledArtifactError

        base_cfg = load_preset(a.preset)
        for s in specs:  # a bucket without both compiled graphs is left out
            d, c = (a.compiled_base, base_cfg) if s.variant == "base" and a.compiled_base else (a.compiled, cfg)
            try:
                fns.update(load_compiled(d, model, state, c, specs=[s], check_graphs=False))
            except CompiledArtifactError as e:
                print(f"skipping {s.graph_id}: {e}")
        have = {s.tokens for s in fns if s.variant == "base"} & {s.tokens for s in fns if s.variant == name}
        specs = [s for s in specs if s.tokens in have]
    for s in specs:
        fns.setdefault(s, eager_callable(model, state, cfg, s))
    buckets = sorted({s.tokens for s in specs})
    kind = "compiled" if a.compiled else "eager"
    print(f"{a.preset}, {kind}, V={vocab}, {a.steps} steps after 3 warm-up, {a.threads} thread(s)")
    print(f"| tokens | base ms/step | {name} ms/step | ratio |")
    print("|---|---|---|---|")
    for tokens in buckets:
        pair = {s.variant: s for s in specs if s.tokens == tokens}
        base, plp = pair["base"], pair[name]
        times: dict[str, list[float]] = {"base": [], name: []}
        ins = {}
        for v, s in pair.items():
            x = list(spec_inputs(s, cfg, vocab))
            x[0][0] = torch.randint(1, vocab, (tokens,))
            x[2][0] = tokens  # num_new: one live row over the whole bucket
            x[3][0, : cfg.table_blocks(0)] = torch.arange(1, cfg.table_blocks(0) + 1)
            x[4][0] = 1
            x[10][0] = tokens
            ins[v] = x
        with torch.inference_mode():
            for i in range(a.steps + 3):
                for v, s in ((("base", base), (name, plp)) if i % 2 else ((name, plp), ("base", base))):
                    t0 = time.perf_counter()
                    fns[s](*ins[v])
                    if i >= 3:
                        times[v].append(time.perf_counter() - t0)
        b, p = statistics.median(times["base"]) * 1e3, statistics.median(times[name]) * 1e3
        print(f"| {tokens} | {b:.2f} | {p:.2f} | {p / b:.2f}x |")


if __name__ == "__main__":
    main()
