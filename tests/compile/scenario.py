"""A serving-like sequence of step calls that uses every given graph spec at least once.

Prefills prompts of lengths that need each prefill bucket (one prompt is split into chunks, so
a chunk starts at start_pos > 0) and the bucket-defining prompts again over each prefill context
bucket's shorter block table, then runs decode steps at each decode batch bucket with a
padding row where the bucket allows one, mixing greedy and seeded sampled rows. Each call's
sampled tokens feed the next call, so the same scenario run through two step implementations
gives comparable outputs only if every call agrees.
"""

from __future__ import annotations

import torch

VOCAB = 4096


def run(call, cfg, specs, vocab: int = VOCAB) -> list[tuple]:
    """call(spec, inputs) -> outputs. Returns (outputs, live rows) of every call, in order.

    Rows past `live rows` are padding: their outputs are unspecified (they read the scratch
    block and slot, which padded tokens of both implementations write in unspecified order).
    """
    MB = cfg.max_blocks_per_seq
    prefill = sorted({s.tokens for s in specs if s.phase == "prefill"})  # token buckets (once per context)
    decode = sorted(s.batch for s in specs if s.phase == "decode")
    spec_of = {(s.phase, s.batch if s.phase == "decode" else s.tokens, s.sampling, s.context): s for s in specs}
    g = torch.Generator().manual_seed(1234)
    live = max([b - 1 if b > 1 else 1 for b in decode] + [1])
    outs: list[tuple] = []
    seqs = []  # dicts: slot, pos, last token

    def block_row(slot: int) -> torch.Tensor:
        row = torch.zeros(MB, dtype=torch.int64)
        row[:] = torch.arange(1 + (slot - 1) * MB, 1 + slot * MB)
        return row

    def sampling(rows: list[int], B: int, greedy: bool = False):
        temp = torch.zeros(B)
        top_p = torch.ones(B)
        top_k = torch.full((B,), vocab, dtype=torch.int64)
        seeds = torch.zeros(B, dtype=torch.int64)
        for i, r in enumerate(rows):
            if r % 2 and not greedy:  # odd sequences sample (all greedy for the greedy graphs)
                temp[i], top_p[i], top_k[i], seeds[i] = 0.9, 0.9, 50, 1000 + r
        return temp, top_p, top_k, torch.zeros(B), seeds

    # prompt lengths: one per prefill bucket (needing exactly that bucket), the rest small
    lengths = []
    for i, t in enumerate(prefill):
        lo = prefill[i - 1] if i else 0
        lengths.append(max(lo + 1, t - 3))
    while len(lengths) < live:
        lengths.append(3 + 2 * len(lengths))
    lengths.append(prefill[0] + 5 if prefill else 0)  # split into two chunks of the smallest bucket
    for n, length in enumerate(lengths):
        if not prefill:
            break
        slot = n + 1
        prompt = torch.randint(5, vocab, (length,), generator=g)
        pos = 0
        while pos < length:
            chunk = min(length - pos, prefill[-1] if n < len(lengths) - 1 else prefill[0])
            t = next(b for b in prefill if b >= chunk)
            ids = torch.zeros(1, t, dtype=torch.int64)
            ids[0, :chunk] = prompt[pos: pos + chunk]
            temp, top_p, top_k, min_p, seeds = sampling([n], 1)
            inputs = (ids, torch.tensor([pos]), torch.tensor([chunk]), block_row(slot)[None], torch.tensor([slot]),
                      temp, top_p, top_k, min_p, seeds, torch.tensor([pos + chunk]))
            o = call(spec_of[("prefill", t, "full", 0)], inputs)
            outs.append((o, 1))
            pos += chunk
        seqs.append({"slot": slot, "pos": length, "last": int(o[0][0]), "row": n})
    # prefill over each shorter prefill context (block table cut to it): the bucket-defining
    # prompts again, in one chunk each, where the context holds them
    for c in sorted({s.context for s in specs if s.phase == "prefill" and s.context}):
        for length in lengths[:len(prefill)]:
            t = next(b for b in prefill if b >= length)
            if length > c or ("prefill", t, "full", c) not in spec_of:
                continue
            n = len(seqs)
            slot = n + 1
            ids = torch.zeros(1, t, dtype=torch.int64)
            ids[0, :length] = torch.randint(5, vocab, (length,), generator=g)
            temp, top_p, top_k, min_p, seeds = sampling([n], 1)
            inputs = (ids, torch.tensor([0]), torch.tensor([length]), block_row(slot)[None, :cfg.table_blocks(c)],
                      torch.tensor([slot]), temp, top_p, top_k, min_p, seeds, torch.tensor([length]))
            o = call(spec_of[("prefill", t, "full", c)], inputs)
            outs.append((o, 1))
            seqs.append({"slot": slot, "pos": length, "last": int(o[0][0]), "row": n})
    decode_runs = sorted({(s.batch, s.context, s.sampling) for s in specs if s.phase == "decode"})
    for b, context, kind in decode_runs:
        mb = cfg.table_blocks(context)
        # a shorter-context graph takes the sequences that stay inside it for the 3 steps
        fits = [s for s in seqs if not context or s["pos"] + 3 <= context]
        rows = fits[: (b - 1 if b > 1 else 1)]
        assert rows, f"no sequence fits decode context {context}"
        for _ in range(3):
            B = b
            ids = torch.zeros(B, 1, dtype=torch.int64)
            start = torch.zeros(B, dtype=torch.int64)
            num_new = torch.zeros(B, dtype=torch.int64)
            bt = torch.zeros(B, mb, dtype=torch.int64)
            slots = torch.zeros(B, dtype=torch.int64)
            for i, s in enumerate(rows):
                ids[i, 0], start[i], num_new[i], bt[i], slots[i] = s["last"], s["pos"], 1, block_row(s["slot"])[:mb], s["slot"]
            temp, top_p, top_k, min_p, seeds = sampling([s["row"] for s in rows], B, greedy=kind == "greedy")
            inputs = (ids, start, num_new, bt, slots, temp, top_p, top_k, min_p, seeds, start + 1)
            o = call(spec_of[("decode", b, kind, context)], inputs)
            outs.append((o, len(rows)))
            for i, s in enumerate(rows):
                s["pos"] += 1
                s["last"] = int(o[0][i])
    return outs
