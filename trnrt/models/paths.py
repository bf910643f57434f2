"""Where a model's files are: `--model DIR`, or the embedded tiny default. Never a hub download."""

from __future__ import annotations

import os
from pathlib import Path


def resolve_model_dir(model: str | os.PathLike | None) -> Path:
    """The checkpoint directory for `model`.

    None -> the embedded tiny checkpoint (generated into the cache on first use); a directory
    holding config.json -> that directory. Anything else (a hub id, a missing path, a directory
    without config.json) raises ValueError naming the path: trnrt never downloads a model.
    """
    if model is None:
        from trnrt.models.tiny import default_model_dir

        return default_model_dir()
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_dir():
        raise ValueError(f"model directory {str(path)!r} has no config.json")
    raise ValueError(
        f"model {str(model)!r} is not a local directory with config.json "
        "(trnrt loads local checkpoints only; run `trnrt make-tiny DIR` for a test model)"
    )
