"""The sliced per-rank reader (`sharded_load.read_rank_state_dict`) against the full read cut by
the same rules: bit-equal shards for every layout and both checkpoint namings, the vision tower
never read, the union of the ranks' shards the full tensor, and the refusals naming the tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from trnrt.models.glm5_next.config import Glm5NextConfig
from trnrt.models.glm5_next.reshard import write_shards
from trnrt.models.glm5_next.sharded_load import read_rank_state_dict
from trnrt.models.glm5_next.sharding import rule_for, shard_state_dict
from trnrt.models.glm5_next.weights import CheckpointError, read_safetensors, to_serving_names
from trnrt.parallel.context import ParallelContext
from trnrt.parallel.shard import unshard

LAYOUTS = ((2, 1), (2, 2), (4, 1), (4, 4), (4, 2))


@pytest.fixture(scope="module")
def release_dir(tmp_path_factory) -> Path:
    """The tiny checkpoint as released (save_pretrained naming: per-expert, q/k/v convs, hc_*, the
    vision tower, the MTP layer) in 3 shards with an index."""
    from trnrt.models.tiny.checkpoint import write_tiny_checkpoint

    d = write_tiny_checkpoint(tmp_path_factory.mktemp("sharded") / "tiny")
    write_shards(d, 3)
    return d


@pytest.fixture(scope="module")
def merged_dir(tmp_path_factory, release_dir) -> Path:
    """The same weights in transformers' state-dict naming (merged experts and conv), 2 shards."""
    from safetensors.torch import save_file

    from trnrt.models.tiny import build_hf_model

    d = tmp_path_factory.mktemp("merged")
    shutil.copyfile(release_dir / "config.json", d / "config.json")
    sd = {k: v.contiguous() for k, v in build_hf_model(seed=0).state_dict().items()}
    save_file(sd, str(d / "model.safetensors"))
    write_shards(d, 2)
    return d


def _cfg(d: Path) -> Glm5NextConfig:
    return Glm5NextConfig.from_pretrained(d)


def _check_equal(d: Path, load_mtp: bool) -> int:
    cfg = _cfg(d)
    full = to_serving_names(read_safetensors(d), cfg, load_mtp=load_mtp)
    checked = 0
    for tp, ep in LAYOUTS:
        shards = []
        for r in range(tp):
            ctx = ParallelContext.for_rank(tp, r, ep)
            want = shard_state_dict(full, cfg, ctx)
            got = read_rank_state_dict(d, cfg, ctx, load_mtp)
            assert sorted(got) == sorted(want)
            for k in want:
                assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), (tp, ep, r, k)
                checked += 1
            shards.append((ctx, got))
        for k in ("layers.1.mlp.experts.gate_up_proj", "layers.0.self_attn.conv1d.weight", "embed_tokens.weight"):
            if k in full:
                assert torch.equal(unshard([(c, s[k]) for c, s in shards], rule_for(k, cfg), full[k].shape, k), full[k])
    return checked


@pytest.mark.parametrize("load_mtp", [False, True])
def test_release_naming_rank_reads_equal_the_full_read_cut(release_dir, load_mtp):
    assert len(json.loads((release_dir / "model.safetensors.index.json").read_text())["weight_map"]) > 300
    assert _check_equal(release_dir, load_mtp) > 500


def test_transformers_naming_rank_reads_equal_the_full_read_cut(merged_dir):
    assert _check_equal(merged_dir, False) > 500


def test_tp1_read_is_the_full_read(release_dir):
    cfg = _cfg(release_dir)
    full = to_serving_names(read_safetensors(release_dir), cfg, load_mtp=True)
    got = read_rank_state_dict(release_dir, cfg, ParallelContext.single(), True)
    assert sorted(got) == sorted(full) and all(torch.equal(got[k], full[k]) for k in full)


def test_only_the_ranks_slices_are_read(release_dir, monkeypatch):
    """Every get_slice read is counted: no vision tensor is touched, and an EP 4 rank reads
    exactly a quarter of the routed experts' bytes."""
    from trnrt.models.glm5_next import sharded_load

    reads: dict[str, int] = {}
    real_open = sharded_load.SafetensorsFile

    class Counting:
        def __init__(self, *a, **k):
            self.f = real_open(*a, **k)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_slice(self, key):
            s = self.f.get_slice(key)

            class Slice:
                def get_shape(self):
                    return s.get_shape()

                def __getitem__(self, idx):
                    t = s[idx]
                    reads[key] = reads.get(key, 0) + t.numel()
                    return t
            return Slice()

    monkeypatch.setattr(sharded_load, "SafetensorsFile", Counting)
    cfg = _cfg(release_dir)
    read_rank_state_dict(release_dir, cfg, ParallelContext.for_rank(4, 1, 4), False)
    assert not [k for k in reads if ".visual." in k]
    experts = {k: v for k, v in reads.items() if ".mlp.experts." in k}
    owned = {int(k.split(".mlp.experts.")[1].split(".")[0]) for k in experts}
    assert owned == set(range(cfg.n_routed_experts // 4, 2 * cfg.n_routed_experts // 4))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_shard_file_is_named(release_dir, tmp_path):
    d = _copy(release_dir, tmp_path / "c")
    (d / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00003.safetensors"):
        read_rank_state_dict(d, _cfg(d), ParallelContext.for_rank(2, 0), False)


def _rewrite_without(d: Path, drop: str, replace: dict | None = None) -> None:
    from safetensors.torch import load_file, save_file

    index = json.loads((d / "model.safetensors.index.json").read_text())
    fname = index["weight_map"].pop(drop)
    sd = load_file(str(d / fname))
    sd.pop(drop)
    if replace:
        sd.update(replace)
        index["weight_map"].update({k: fname for k in replace})
    save_file(sd, str(d / fname), metadata={"format": "pt"})
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def test_missing_expert_and_conv_are_named(release_dir, tmp_path):
    d = _copy(release_dir, tmp_path / "c")
    key = "model.language_model.layers.1.mlp.experts.5.up_proj.weight"
    _rewrite_without(d, key)
    with pytest.raises(CheckpointError, match=r"layers\.1\.mlp\.experts\.5\.up_proj\.weight.*missing"):
        read_rank_state_dict(d, _cfg(d), ParallelContext.for_rank(2, 1, 2), False)
    d2 = _copy(release_dir, tmp_path / "c2")
    _rewrite_without(d2, "model.language_model.layers.0.self_attn.k_conv1d.weight")
    with pytest.raises(CheckpointError, match=r"layers\.0\.self_attn\.k_conv1d\.weight.*missing"):
        read_rank_state_dict(d2, _cfg(d2), ParallelContext.for_rank(2, 0), False)


def test_misshaped_expert_is_named(release_dir, tmp_path):
    d = _copy(release_dir, tmp_path / "c")
    key = "model.language_model.layers.1.mlp.experts.0.down_proj.weight"
    _rewrite_without(d, key, {key: torch.zeros(3, 3, dtype=torch.float32)})
    with pytest.raises(CheckpointError, match=r"experts\.0\.down_proj\.weight.*shape \(3, 3\)"):
        read_rank_state_dict(d, _cfg(d), ParallelContext.for_rank(2, 0), False)


def test_rank_model_loads_from_the_sliced_read(release_dir):
    """load_rank_model's default read step is this reader, and its TP 2 shard builds a rank model."""
    from trnrt.models.glm5_next import rank_model

    ctx = ParallelContext.for_rank(2, 0, 2)
    cfg = _cfg(release_dir)
    assert torch.equal(rank_model.read_rank_state_dict(release_dir, cfg, ctx, True)["embed_tokens.weight"],
                       read_rank_state_dict(release_dir, cfg, ctx, True)["embed_tokens.weight"])


@pytest.mark.parametrize("chunk", [8 << 20, 40])
def test_pread_reader_equals_safetensors(tmp_path, monkeypatch, chunk):
    """SafetensorsFile's slices equal safe_open's, whole rows and column cuts, in small chunks too."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from trnrt.models.glm5_next import safetensors_pread

    monkeypatch.setattr(safetensors_pread, "CHUNK_BYTES", chunk)
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(7, 5, generator=g).to(torch.bfloat16), "b": torch.randn(3, 4, 6, generator=g),
               "c": torch.randn(9, generator=g).to(torch.float8_e4m3fn), "d": torch.arange(12).reshape(4, 3)}
    save_file(tensors, str(tmp_path / "x.safetensors"), metadata={"format": "pt"})
    cuts = [(slice(0, 7),), (slice(2, 5), slice(1, 4)), (slice(0, 3), slice(1, 3), slice(2, 5)), (slice(3, 8),),
            (slice(1, 3), slice(0, 3))]
    with safetensors_pread.SafetensorsFile(tmp_path / "x.safetensors") as f, \
            safe_open(str(tmp_path / "x.safetensors"), framework="pt") as ref:
        assert sorted(f.keys()) == sorted(ref.keys()) and f.metadata() == {"format": "pt"}
        for name, cut in zip("abbcd", cuts):
            want = ref.get_slice(name)[cut]
            got = f.get_slice(name)[cut]
            assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8))
        assert torch.equal(f.get_slice("b")[:], tensors["b"])
