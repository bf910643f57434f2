"""Filters for torch's own warnings around the calls that raise them (export, hashing, compile)."""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator


@contextlib.contextmanager
def quiet_torch_leafspec_warning() -> Iterator[None]:
    """Within the block, torch 2.13's FutureWarning "`isinstance(treespec, LeafSpec)` is
    deprecated" is not shown.

    Why that is safe: torch deprecated the LeafSpec class itself, so *constructing* one warns, and
    torch.export and AOTInductor deep-copy their own pytree specs (which hold LeafSpecs):
    copy.deepcopy rebuilds each one through copyreg (the warning points at copyreg.py): in
    `ExportedProgram.run_decompositions` (graph hashing, measured) and in AOTInductor's compile
    (the second warning per compiled graph). trnrt never names LeafSpec; the copies are of objects
    torch builds itself, so nothing of ours is deprecated and there is nothing to fix on our side. Only this one message and category are filtered; every other warning shows.
    (warnings.catch_warnings also resets Python's once-per-location memory when it exits, which
    is why an unfiltered copy showed once per graph instead of once per process.)
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*", category=FutureWarning)
        yield
