"""trnrt's cache root on this machine: the embedded tiny checkpoint, the fused kernels' builds, the
compiled-artifact cache and the graph fingerprints live under it. A leaf (standard library only).
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """trnrt's cache root: $TRNRT_CACHE_DIR, else $XDG_CACHE_HOME/trnrt, else ~/.cache/trnrt."""
    if os.environ.get("TRNRT_CACHE_DIR"):
        return Path(os.environ["TRNRT_CACHE_DIR"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "trnrt"
    return Path.home() / ".cache" / "trnrt"
