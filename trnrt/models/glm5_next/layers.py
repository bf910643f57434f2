"""Building blocks shared by every block of the glm5_next model: RMSNorm, the fused-kernel gate
(`fused_kernels`), the top-k selection (`select_topk`), bias-free linears, weight fusion and the
single state write (`write_state`).

State writes are one multi-index `index_put_` on each whole stacked state tensor (`write_state`),
never a mutation of a per-layer view: AOTInductor re-inplaces the former and copies the whole
input for the latter.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from trnrt.models import kernels


def fused_kernels(x: torch.Tensor) -> bool:
    """Whether the eager step may use trnrt's fused C++ CPU kernels (trnrt/models/kernels) for x.

    Static facts only (loaded library, device, export or not), never tensor values. Under
    torch.export / torch.compile the plain PyTorch path is traced, so graphs never hold the ops."""
    return kernels.available() and x.device.type == "cpu" and not torch.compiler.is_compiling()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalise in fp32, cast to the input dtype, then times `weight`."""
    if weight.dtype == x.dtype and fused_kernels(x):
        return torch.ops.trnrt.rms_norm(x, weight, eps)
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def select_topk(x: torch.Tensor, k: int, sorted: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(x, k, dim=-1) -> (values, indices).

    Under torch.export / torch.compile and for k <= 2 (the tiny model's router and indexer; the
    real model selects 8 experts and 128 pools), as k max passes instead: Inductor fuses them
    into the surrounding kernels, where each extern topk call of a compiled CPU step costs ~4 us
    (14 of them in a batch-8 decode step). Values best first, ties to the lowest index; a row
    needs k values above -inf (true at both call sites: a kept expert group holds more than k
    experts, non-candidate pools are finfo.min). `sorted` False: the order of the k
    picks is unspecified (topk's sorted=False); the max passes give it sorted anyway.
    """
    if k > 2 or not torch.compiler.is_compiling():
        r = x.topk(k, dim=-1, sorted=sorted)
        return r.values, r.indices
    i1 = x.argmax(-1, keepdim=True)  # [.., 1]
    v1 = x.gather(-1, i1)
    if k == 1:
        return v1, i1
    ar = torch.arange(x.shape[-1], device=x.device)
    x2 = x.masked_fill(ar == i1, float("-inf"))
    i2 = x2.argmax(-1, keepdim=True)
    return torch.cat([v1, x2.gather(-1, i2)], -1), torch.cat([i1, i2], -1)


def _linear(i: int, o: int) -> nn.Linear:
    return nn.Linear(i, o, bias=False)


def _fuse(owner: nn.Module, parts: list[tuple[nn.Module, str]]) -> torch.Tensor:
    """Concatenate weights that read the same input into one [sum(out), in] matrix, and re-point
    the original parameters at views of it (no extra memory, state_dict unchanged). One GEMM
    instead of several: decode on a small model is bound by op count, not FLOPs."""
    fused = torch.cat([getattr(m, n).detach() for m, n in parts], 0)
    off = 0
    for m, n in parts:
        rows = getattr(m, n).shape[0]
        setattr(m, n, nn.Parameter(fused[off: off + rows], requires_grad=False))
        off += rows
    return fused


def write_state(stacked: torch.Tensor, layer: int, index: tuple[torch.Tensor, ...], values: torch.Tensor) -> None:
    """stacked[layer][index] = values, as ONE index_put_ on the whole stacked state tensor.

    Why not `stacked[layer].index_copy_(...)`: that mutates a *view* of a graph input, and
    AOTInductor then clones the whole input, scatters into the clone and copies it back (measured:
    three passes over each MLA layer's entire latent pool per decode step). A multi-index
    `index_put_` on the input itself is re-inplaced: only the written rows are touched.
    Duplicate targets occur only in scratch block 0 / slot 0 (padding), whose contents are never read.
    """
    lead = torch.full_like(index[0], layer)
    stacked.index_put_((lead, *index), values)
