"""The FP8 rank readers (issue #31 item 3, #32) against the whole read cut afterwards, in one process
(a ParallelContext per rank, no group): fp8/rank_read.py on a 3-shard FP8 tiny checkpoint
(16 x 16 scale blocks, as the TP FP8 tests) and fp8/rank_quantize.py (online FP8 of the bf16 one)
give every rank of every layout the same state dict, tensor by tensor, bit for bit; a rank reads
no element outside its share; a layout that splits a scale block is refused, naming the same
tensor, before any weight is read."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from trnrt.models.glm5_next.fp8.load import _configs
from trnrt.models.glm5_next.fp8.qconfig import QuantConfig
from trnrt.models.glm5_next.fp8.rank_load import read_fp8_parts
from trnrt.models.glm5_next.fp8.rank_quantize import quantize_rank_state_dict
from trnrt.models.glm5_next.fp8.rank_read import read_fp8_rank_state_dict
from trnrt.models.glm5_next.fp8.shard import shard_fp8_tensors
from trnrt.parallel.context import ParallelContext
from trnrt.parallel.shard import ShardingError

BLOCK = (16, 16)
LAYOUTS = ((2, 1), (2, 2))  # the tiny dims leave whole 16-blocks at TP 2 only
REFUSED = (4, 4)  # the shared expert's 32 rows / 4 = 8 rows of a 16-block


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory) -> Path:
    """The tiny checkpoint in the FP8 release layout (16 x 16 blocks) in 3 shards with an index."""
    from trnrt.models.glm5_next.fp8.checkpoint import convert_dir
    from trnrt.models.glm5_next.reshard import write_shards
    from trnrt.models.tiny import default_model_dir

    d = tmp_path_factory.mktemp("fp8read") / "ckpt"
    shutil.copytree(default_model_dir(), d)
    convert_dir(d, QuantConfig(block=BLOCK))
    write_shards(d, 3)
    return d


def _cfg(d: Path):
    return _configs(d)[0]  # the config without quantization_config


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.itemsize == 1 and t.is_floating_point() else t


def _assert_same(got: dict, want: dict, where) -> None:
    assert sorted(got) == sorted(want), where
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(_bits(g), _bits(w)), (where, k)


@pytest.mark.parametrize("load_mtp", [False, True])
def test_sliced_fp8_read_equals_the_whole_read_cut(fp8_dir, load_mtp):
    cfg = _cfg(fp8_dir)
    parts, qc = read_fp8_parts(fp8_dir, cfg, load_mtp, None)
    assert qc.block == BLOCK and parts.linears and parts.experts
    checked = 0
    for tp, ep in LAYOUTS:
        for r in range(tp):
            ctx = ParallelContext.for_rank(tp, r, ep)
            want = shard_fp8_tensors(parts, cfg, ctx, qc.block)
            _assert_same(read_fp8_rank_state_dict(fp8_dir, cfg, qc, ctx, load_mtp), want, (tp, ep, r))
            checked += len(want)
    assert checked > 400


def test_online_fp8_rank_quantizes_its_slices_as_the_whole_is_quantized_then_cut():
    """Block quantization of a block-aligned slice is the slice of the quantized whole."""
    from trnrt.models.tiny import default_model_dir

    d = default_model_dir()
    cfg = _cfg(d)
    parts, qc = read_fp8_parts(d, cfg, True, "fp8", online_block=BLOCK)
    for tp, ep in LAYOUTS:
        for r in range(tp):
            ctx = ParallelContext.for_rank(tp, r, ep)
            got = quantize_rank_state_dict(d, cfg, qc, ctx, True)
            _assert_same(got, shard_fp8_tensors(parts, cfg, ctx, qc.block), ("online", tp, ep, r))


def test_quantizing_an_aligned_slice_equals_slicing_the_quantized_whole():
    from trnrt.models.glm5_next.fp8.blocks import quantize

    w = torch.randn(3, 48, 40, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)  # [E, O, I]
    q, s = quantize(w, BLOCK)  # 40 columns: a partial last 8-column block
    for rows, cols in ((slice(16, 48), slice(None)), (slice(None), slice(16, 40)), (slice(0, 16), slice(32, 40))):
        qs, ss = quantize(w[:, rows, cols], BLOCK)
        srows = slice((rows.start or 0) // 16, None if rows.stop is None else -(-rows.stop // 16))
        scols = slice((cols.start or 0) // 16, None if cols.stop is None else -(-cols.stop // 16))
        assert torch.equal(_bits(qs), _bits(q[:, rows, cols].contiguous())) and torch.equal(ss, s[:, srows, scols])


def test_a_rank_reads_only_its_share(fp8_dir, monkeypatch):
    """Every element a rank reads (weights, scale grids, the rest) is one of its shard's: the
    elements read equal the shard's (A_log aside: read whole, it is tiny); EP 2 rank 1 reads
    only its experts' FP8 weights and scales, and never the vision tower."""
    from trnrt.models.glm5_next import sharded_load

    reads: dict[str, int] = {}
    real = sharded_load.SafetensorsFile.get_slice

    def counting(self, key):
        s = real(self, key)
        get = s.__getitem__

        class Counted:
            dtype = s.dtype

            def get_shape(self):
                return s.get_shape()

            def __getitem__(self, idx):
                t = get(idx)
                reads[key] = reads.get(key, 0) + t.numel()
                return t
        return Counted()

    monkeypatch.setattr(sharded_load.SafetensorsFile, "get_slice", counting)
    cfg = _cfg(fp8_dir)
    qc = QuantConfig(block=BLOCK)
    for tp, ep, r in ((2, 1, 0), (2, 2, 1)):
        reads.clear()
        sd = read_fp8_rank_state_dict(fp8_dir, cfg, qc, ParallelContext.for_rank(tp, r, ep), False)
        share = sum(t.numel() for k, t in sd.items() if not k.endswith("A_log"))
        assert sum(n for k, n in reads.items() if not k.endswith("A_log")) == share, (tp, ep, r)
        assert not [k for k in reads if ".visual." in k]
        if ep == 2:
            experts = {int(k.split(".mlp.experts.")[1].split(".")[0]) for k in reads if ".mlp.experts." in k}
            assert experts == set(range(cfg.n_routed_experts // 2, cfg.n_routed_experts))
            assert any(k.endswith("up_proj.weight_scale_inv") for k in reads)


def test_a_layout_that_splits_a_scale_block_is_refused_before_any_read(fp8_dir, monkeypatch):
    from trnrt.models.glm5_next import sharded_load

    cfg = _cfg(fp8_dir)
    parts, qc = read_fp8_parts(fp8_dir, cfg, False, None)
    ctx = ParallelContext.for_rank(*REFUSED[:1], 0, REFUSED[1])
    with pytest.raises(ShardingError) as want:
        shard_fp8_tensors(parts, cfg, ctx, qc.block)

    def no_read(*a, **k):
        raise AssertionError("a weight was read before the layout was checked")

    monkeypatch.setattr(sharded_load.SliceOpener, "__call__", no_read)
    with pytest.raises(ShardingError) as got:
        read_fp8_rank_state_dict(fp8_dir, cfg, qc, ctx, False)
    assert got.value.tensor == want.value.tensor and "16-blocks" in str(got.value)
