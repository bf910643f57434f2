"""bf16 serving model over >= 200 decode positions (4 sequences x 100 steps, teacher-forced).

The tiny checkpoint's randomisation keeps the residual stream dominated by the token embedding
with small block updates (see trnrt.models.tiny.randomize_), as in a trained model, so bf16 stays
close to fp32: transformers' own bf16 model agrees with its fp32 argmax on ~97.5 % of positions
(it was ~42 % before, when bf16 rounding flipped indexer pools and experts from layer 1 on). The
remaining disagreements are near-tied top-2 logits (bf16 rounding of the fp32 logits alone flips
~1 %), plus occasional expert / indexer-pool flips. So the checks are:
* our bf16 DECODE path agrees with our fp32 argmax on >= 95 % of positions (measured 97 %);
* our bf16 decode path agrees with our bf16 one-shot prefill on >= 90 % of positions (path
  consistency: chunked vs recurrent KDA and different rounding order in bf16);
* transformers' bf16-vs-fp32 agreement on the same positions is reported, not asserted.
"""

from __future__ import annotations

import torch

from glm5_helpers import Driver, tokens
from trnrt.models.glm5_next.weights import load_model

P, N, SEQS = 16, 100, 4


def _agree(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.argmax(-1) == b.argmax(-1)).sum())


def test_bf16_decode(tiny_dir, model, hf_model, report):
    from transformers import Glm5NextForConditionalGeneration

    m16 = load_model(tiny_dir, dtype=torch.bfloat16)
    hf16 = Glm5NextForConditionalGeneration.from_pretrained(tiny_dir, dtype=torch.bfloat16).eval()
    seqs = [tokens(50 + i, P + N) for i in range(SEQS)]
    d16 = Driver(m16, max_blocks=16)
    for i in range(SEQS):
        d16.new_seq(i)
    dec = [d16.step([(i, s[:P].tolist()) for i, s in enumerate(seqs)]).logits]
    for p in range(P, P + N - 1):
        dec.append(d16.step([(i, [int(s[p])]) for i, s in enumerate(seqs)]).logits)
    dec16 = torch.stack(dec, 1)  # [SEQS, N, V] logits predicting positions P..P+N-1
    assert torch.isfinite(dec16).all()
    ours = theirs = path = total = 0
    window = slice(P - 1, P + N - 1)
    for i, s in enumerate(seqs):
        d32 = Driver(model, max_blocks=16)
        d32.new_seq("x")
        one32 = d32.step([("x", s.tolist())], all_logits=True).logits[0, window]
        d1 = Driver(m16, max_blocks=16)
        d1.new_seq("x")
        one16 = d1.step([("x", s.tolist())], all_logits=True).logits[0, window]
        with torch.no_grad():
            h32 = hf_model(input_ids=s[None], use_cache=False).logits[0, window].float()
            h16 = hf16(input_ids=s[None], use_cache=False).logits[0, window].float()
        ours += _agree(dec16[i], one32)
        theirs += _agree(h16, h32)
        path += _agree(dec16[i], one16)
        total += N
    report["bf16 decode vs fp32 argmax (ours)"] = ours / total
    report["bf16 vs fp32 argmax (transformers, not asserted)"] = theirs / total
    report["bf16 decode vs bf16 one-shot argmax"] = path / total
    assert total >= 200
    assert ours / total >= 0.95, (ours, total)
    assert path / total >= 0.90, (path, total)
