"""`trnrt make-tiny DIR --fp8`: the tiny checkpoint in the FP8 release layout.

The bf16 tiny checkpoint of the same seed, quantized per 128 x 128 block by the policy of
trnrt.models.glm5_next.fp8.policy (float8_e4m3fn `weight` + fp32 `weight_scale_inv`), the other
tensors in bf16 (fp32 where transformers keeps them so) and config.json's `quantization_config`
as the releases write it: {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
"weight_block_size": [128, 128]}. The tiny dims (hidden 64, experts' 32) are below 128, so every
scale block is a partial block, exactly as the release's partial last blocks (ceil division).
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path


def write_tiny_fp8_checkpoint(out_dir: str | os.PathLike, seed: int = 0, train_steps: int = 0) -> Path:
    """Write the FP8 tiny checkpoint for `seed` into `out_dir` (replace rules and atomic rename
    as write_tiny_checkpoint); return its path."""
    from trnrt.models.glm5_next.fp8.checkpoint import convert_dir
    from trnrt.models.tiny.checkpoint import _check_replaceable, _replace_dir, write_tiny_checkpoint

    out = Path(out_dir).absolute()
    _check_replaceable(out)
    tmp = out.parent / f".{out.name}.fp8-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        write_tiny_checkpoint(tmp, seed=seed, train_steps=train_steps)
        convert_dir(tmp)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
