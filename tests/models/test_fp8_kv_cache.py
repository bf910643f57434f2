"""`--kv-cache-dtype fp8_e4m3`: the MLA latent cache and the indexer's key pool / tail in
float8_e4m3fn, against the same model with its cache in the model's dtype (bf16), over a chunked
prefill and decode steps (the paths that write and read the cache)."""

from __future__ import annotations

import torch

from glm5_helpers import Driver, tokens
from trnrt.models.glm5_next.fp8.kv_cache import Fp8KvIndexer, Fp8KvMLAttention, to_fp8_kv_state, use_fp8_kv_cache
from trnrt.models.glm5_next.weights import load_model

P, N, SEQS = 24, 24, 4


def _run(model, seqs, fp8: bool):
    d = Driver(model, max_blocks=8)
    if fp8:
        d.state = to_fp8_kv_state(d.state)
    for i in range(len(seqs)):
        d.new_seq(i)
    logits = [d.step([(i, s[:16].tolist()) for i, s in enumerate(seqs)]).logits]  # two prefill chunks
    logits.append(d.step([(i, s[16:P].tolist()) for i, s in enumerate(seqs)]).logits)
    for p in range(P, P + N):
        logits.append(d.step([(i, [int(s[p])]) for i, s in enumerate(seqs)]).logits)
    return torch.stack(logits, 1).float(), d.state  # [SEQS, 2 + N, V]


def test_fp8_kv_cache_against_the_bf16_cache(tiny_dir, report):
    ref = load_model(tiny_dir, dtype=torch.bfloat16)
    m = load_model(tiny_dir, dtype=torch.bfloat16)
    use_fp8_kv_cache(m)
    assert isinstance(m.layers[1].self_attn, Fp8KvMLAttention) and isinstance(m.layers[1].self_attn.indexer, Fp8KvIndexer)
    assert type(ref.layers[1].self_attn).__name__ == "MLAttention"  # the default model keeps its forms
    seqs = [tokens(300 + i, P + N + 1) for i in range(SEQS)]
    a, _ = _run(ref, seqs, fp8=False)
    b, st = _run(m, seqs, fp8=True)
    assert st.latent.dtype == st.pooled.dtype == st.tail.dtype == torch.float8_e4m3fn
    assert st.kda.dtype == torch.float32  # the KDA recurrent state stays fp32
    assert st.latent.float().abs().sum() > 0 and torch.isfinite(b).all()
    agree = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    dlp = float((a.log_softmax(-1) - b.log_softmax(-1)).abs().max(-1).values.mean())
    report["fp8 KV cache vs bf16 cache argmax agreement"] = agree
    report["fp8 KV cache vs bf16 cache mean max |dlogprob|"] = dlp
    assert agree >= 0.85, agree
