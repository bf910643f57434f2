"""Rewrite a checkpoint's safetensors as N shard files plus `model.safetensors.index.json`
(the layout every large release uses), names and bytes unchanged: the multi-shard test
checkpoints of the sharded loader (`trnrt make-tiny DIR --shards N`)."""

from __future__ import annotations

import json
from pathlib import Path


def write_shards(model_dir: str | Path, num_shards: int) -> list[Path]:
    """Split every tensor of `model_dir`'s *.safetensors (or its index) into `num_shards` files of
    about equal bytes, `model-0000i-of-0000N.safetensors`, and write the index; the old files go."""
    import torch
    from safetensors.torch import load_file, save_file

    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    d = Path(model_dir)
    old = sorted(d.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    metadata = None
    for p in old:
        tensors.update(load_file(str(p)))
        if metadata is None:
            from safetensors import safe_open

            with safe_open(str(p), framework="pt") as f:
                metadata = f.metadata()
    names = sorted(tensors)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    target = total / num_shards
    groups: list[list[str]] = [[]]
    acc = 0
    for name in names:  # greedy: close a shard once it holds its share (names in order)
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if groups[-1] and acc + nbytes / 2 > target * len(groups) and len(groups) < num_shards:
            groups.append([])
        groups[-1].append(name)
        acc += nbytes
    for p in old:
        p.unlink()
    (d / "model.safetensors.index.json").unlink(missing_ok=True)
    files, weight_map = [], {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in group}, str(d / fname), metadata=metadata or {"format": "pt"})
        weight_map.update({n: fname for n in group})
        files.append(d / fname)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return files
