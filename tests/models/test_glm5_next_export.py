"""The decode graph exports with torch.export (tensors only, state mutated in place) and the
exported program computes what eager does: bit for bit on the plain PyTorch path (the fused
eager kernels are compared with that path to fp32 rounding in test_kernels.py)."""

from __future__ import annotations

import torch

from trnrt.models import kernels
from trnrt.models.glm5_next.model import TensorForward


def test_decode_graph_exports(model, monkeypatch):
    monkeypatch.setattr(kernels, "available", lambda: False)
    B, MB = 3, 6
    wrap = TensorForward(model, block_size=8)
    st = model.allocate_state(24, 8, 5)
    ex_args = (torch.zeros(B, 1, dtype=torch.long), torch.zeros(B, dtype=torch.long), torch.ones(B, dtype=torch.long),
               torch.zeros(B, MB, dtype=torch.int32), torch.zeros(B, dtype=torch.long))
    ep = torch.export.export(wrap, ex_args + st.tensors(), strict=False)
    # a real step: two sequences mid-way (one completes a pool) and a padding row
    s_eager, s_export = model.allocate_state(24, 8, 5), model.allocate_state(24, 8, 5)
    g = torch.Generator().manual_seed(0)
    for s in (s_eager, s_export):
        for t in s.tensors():
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(t.numel())).to(t.dtype))
    args = (torch.randint(0, 4096, (B, 1), generator=g), torch.tensor([11, 20, 0]), torch.tensor([1, 1, 0]),
            torch.tensor([[1, 2, 3, 0, 0, 0], [4, 5, 6, 7, 0, 0], [0] * 6], dtype=torch.int32), torch.tensor([1, 2, 0]))
    le, he = wrap(*args, *s_eager.tensors())
    lx, hx = ep.module()(*args, *s_export.tensors())
    # Live rows only, and the state without scratch block 0 / slot 0 (dim 1, index 0): the padding
    # row selects among all-equal indexer scores, where topk (eager) and the exported max passes
    # (select_topk) may pick different pools; its output is never read.
    assert torch.equal(le[:2], lx[:2]) and torch.equal(he[:2], hx[:2])
    assert all(torch.equal(a[:, 1:], b[:, 1:]) for a, b in zip(s_eager.tensors(), s_export.tensors()))
