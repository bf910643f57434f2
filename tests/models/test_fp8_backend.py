"""fp8/backend.py's choice of FP8 GEMM (issue #32 item 1): the CPU dequantizes (its graphs are
unchanged), the per-group activation quantizer, and `self_check`, which keeps torch's blockwise
FP8 GEMM on a device only in a scale layout that reproduces the dequant GEMM.

No GPU here: `self_check` is driven with stand-in GEMMs that follow F.scaled_mm's signature and
the blockwise recipe's arithmetic, each accepting ONE scale layout, and one with the weight scales
read transposed (a layout bug), which must be refused. The real op is exercised only on a Hopper
device (`select` logs its choice there)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trnrt.models.glm5_next.fp8 import backend
from trnrt.models.glm5_next.fp8.blocks import FP8_MAX, dequantize, quantize


def test_cpu_dequantizes_and_its_linear_is_the_reference():
    assert backend.select(torch.device("cpu")) == "dequant" == backend.matmul_kind(torch.device("cpu"))
    w, x = torch.randn(256, 256), torch.randn(3, 5, 256)
    q, s = quantize(w)
    assert torch.equal(backend.linear(x, q, s, (128, 128)), F.linear(x, dequantize(q, s, (128, 128), x.dtype)))


def test_activation_groups_are_scaled_to_fp8_max():
    x = torch.randn(4, 384) * torch.tensor([1.0, 100.0, 1e-3]).repeat_interleave(128)
    x[1, 128:256] = 0.0  # a zero group stays zero
    q, s = backend.quantize_activation(x)
    assert q.shape == x.shape and s.shape == (4, 3)
    back = q.float() * s.repeat_interleave(128, dim=1)
    assert torch.allclose(s[0], x[0].view(3, 128).abs().amax(-1) / FP8_MAX)
    assert float(q.float().abs().amax()) == FP8_MAX  # each group's largest value maps to 448
    assert float((back - x).abs().max() / x.abs().max()) < 1 / 16 and back[1, 128:256].eq(0).all()


def _stand_in(want_a: str, want_b: str, transpose_b_scales: bool = False):
    """A CPU stand-in for F.scaled_mm's blockwise mode: a [M, K] FP8 with [M, K/128] scales,
    b [K, N] FP8 with [K/128, N/128] scales; raises unless the scales come in the wanted layouts."""
    def is_layout(t, how):
        return t.is_contiguous() if how == "rows" else t.t().is_contiguous()

    def gemm(a, b, sa, ra, sb, rb, output_dtype=torch.bfloat16):
        assert ra == F.ScalingType.BlockWise1x128 and rb == F.ScalingType.BlockWise128x128
        if not (is_layout(sa, want_a) and is_layout(sb, want_b)):
            raise RuntimeError("Invalid scaling configuration")
        sb_ = sb.t().contiguous().view(sb.shape) if transpose_b_scales else sb
        A = a.float() * sa.repeat_interleave(128, dim=1)  # [M, K]
        B = b.float() * sb_.repeat_interleave(128, 0).repeat_interleave(128, 1)  # [K, N]
        return (A @ B).to(output_dtype)
    return gemm


@pytest.mark.parametrize("layouts", [("rows", "rows"), ("cols", "rows"), ("cols", "cols")])
def test_self_check_finds_the_layout_the_gemm_accepts(layouts):
    assert backend.self_check(torch.device("cpu"), gemm=_stand_in(*layouts), dtype=torch.float32) == layouts


def test_self_check_refuses_a_gemm_that_reads_the_scales_wrong():
    gemm = _stand_in("rows", "rows", transpose_b_scales=True)  # the [3, 2] grid's values read in the wrong order
    assert backend.self_check(torch.device("cpu"), gemm=gemm, dtype=torch.float32) is None


def test_a_device_without_the_op_stays_on_dequant():
    def missing(*a, **k):
        raise RuntimeError("Invalid scaling configuration")

    assert backend.self_check(torch.device("cpu"), gemm=missing, dtype=torch.float32) is None
