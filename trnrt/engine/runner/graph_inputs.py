"""Example inputs of a graph's exact shapes that are padding rows (they write only the scratch
block and slot): what the runner's warm-up and timing calls feed a compiled graph and what
`trnrt.compile.export` exports a graph with. Here, below the speculative package, so that the plain
runner needs nothing of `trnrt.engine.spec` to warm a draft graph up.
"""

from __future__ import annotations

import torch


def draft_example_inputs(batch: int, k: int, max_blocks: int, hidden_size: int, dtype: torch.dtype,
                         device="cpu") -> tuple[torch.Tensor, ...]:
    """Padding-row inputs of the draft graph's exact shapes (they write only the scratch block and slot)."""
    i64 = dict(dtype=torch.int64, device=device)
    return (torch.zeros((batch, k + 1), **i64), torch.zeros((batch,), **i64), torch.zeros((batch,), **i64),
            torch.zeros((batch, max_blocks), **i64), torch.zeros((batch,), **i64),
            torch.zeros((batch, k + 1, hidden_size), dtype=dtype, device=device))
