"""FP8 block quantization (trnrt.models.glm5_next.fp8.blocks): dequantization is exact against a
block-by-block reference, partial last blocks included, and a wrong block size is caught."""

from __future__ import annotations

import math

import pytest
import torch

from trnrt.models.glm5_next.fp8 import blocks, qconfig
from trnrt.models.glm5_next.config import ConfigError

SHAPES = [(576, 300), (64, 32), (128, 256), (3, 200, 130)]  # 576 = 4 x 128 + 64: the release's kv_a


def reference_dequant(q: torch.Tensor, s: torch.Tensor, block, dtype) -> torch.Tensor:
    """One block at a time: out[block] = (fp32(q[block]) * s[i, j]) rounded once to dtype."""
    if q.dim() == 3:
        return torch.stack([reference_dequant(q[e], s[e], block, dtype) for e in range(q.shape[0])])
    bo, bi = block
    out = torch.empty(q.shape, dtype=dtype)
    for i in range(math.ceil(q.shape[0] / bo)):
        for j in range(math.ceil(q.shape[1] / bi)):
            blk = q[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi].to(torch.float32) * s[i, j].item()
            out[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi] = blk.to(dtype)
    return out


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_is_the_reference_block_dequantization(shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(*shape, generator=g) * torch.logspace(-3, 1, shape[-1])  # blocks of very different ranges
    q, s = blocks.quantize(w, (128, 128))
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert tuple(s.shape) == (*shape[:-2], math.ceil(shape[-2] / 128), math.ceil(shape[-1] / 128))
    got = blocks.dequantize(q, s, (128, 128), dtype)
    assert torch.equal(got, reference_dequant(q, s, (128, 128), dtype))  # bit for bit
    # and it is a quantization of w: e4m3 keeps 3 mantissa bits (relative error <= 2^-4), plus
    # the absolute floor of the block's subnormals
    err = (got.float() - w).abs()
    tol = w.abs() / 16 + blocks.expand_scale(s, tuple(shape), (128, 128)) * 2.0 ** -9
    assert (err <= tol * 1.01).all()


def test_a_wrong_block_size_is_caught():
    w = torch.randn(300, 200)
    q, s = blocks.quantize(w, (128, 128))  # grid [3, 2]
    with pytest.raises(ValueError, match=r"weight_block_size \[64, 64\]"):
        blocks.dequantize(q, s, (64, 64))  # grid [5, 4]: refused by shape
    # [110, 110] gives the same grid [3, 2]: the shapes cannot tell, the values can
    # (dequantizing with it is not the reference)
    wrong = blocks.dequantize(q, s, (110, 110), torch.float32)
    assert not torch.equal(wrong, reference_dequant(q, s, (128, 128), torch.float32))


def test_zero_blocks_and_extremes():
    w = torch.zeros(130, 130)
    w[0, 0], w[129, 129] = 1e4, -3e-4  # two blocks with values, two all-zero ones
    q, s = blocks.quantize(w)
    assert torch.isfinite(s).all() and s[0, 1] == 1.0  # an all-zero block: scale 1
    d = blocks.dequantize(q, s, (128, 128), torch.float32)
    assert d[0, 0] == 1e4 and d[0, 1:].abs().max() == 0
    assert abs(d[129, 129].item() + 3e-4) < 3e-4 / 16


def test_quantization_config_fields():
    qc = qconfig.parse({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic",
                        "fmt": "e4m3", "modules_to_not_convert": ["lm_head"]})
    assert qc.block == (128, 128) and qc.keeps_bf16("lm_head.weight")
    assert qconfig.parse(None) is None
    bad = [
        ({"quant_method": "gptq"}, "quantization_config.quant_method"),
        ({"quant_method": "fp8"}, "quantization_config.weight_block_size"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "quantization_config.weight_block_size"),
        ({"quant_method": "fp8", "weight_block_size": [128, 0]}, "quantization_config.weight_block_size"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
         "quantization_config.activation_scheme"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "bits": 8}, "quantization_config.bits"),
    ]
    for d, field in bad:
        with pytest.raises(ConfigError) as e:
            qconfig.parse(d)
        assert e.value.field == field, (d, e.value)
