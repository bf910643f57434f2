"""Which linear weights trnrt stores in FP8 when it quantizes (online `--quantization fp8`, and
`trnrt make-tiny --fp8`): the DeepSeek-V3 release's choice carried over to glm5_next.

FP8: the attention projections (MLA q_a/q_b/kv_a/kv_b/o, KDA q/k/v/o and its low-rank gate
projections f_a/f_b/g_a/g_b), the indexer's wq_b / wk, every MLP projection (dense, shared and
routed experts) and the MTP layer's eh_proj. Kept bf16/fp32: embeddings, lm_head and the MTP
shared head, norms, the router (`mlp.gate`), the indexer's weights_proj and k-pool gate, KDA's
b_proj (one row per head), convs, mHC and every 1-D parameter. A loaded FP8 checkpoint needs no
policy: its `weight_scale_inv` tensors say which weights are FP8.
"""

from __future__ import annotations

import re

FP8_MODULES = frozenset({
    "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
    "q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj",
    "wq_b", "wk", "gate_proj", "up_proj", "down_proj", "eh_proj",
})
_LAYER = re.compile(r"(^|\.)(layers\.\d+|decoder|mtp)\.")


def quantizes(name: str) -> bool:
    """Whether weight `name` (checkpoint or serving naming, `<module>.weight`) is FP8 under the
    policy. Per-expert release names (`mlp.experts.3.gate_proj.weight`) count as their proj."""
    if not name.endswith(".weight") or not _LAYER.search(name) or "shared_head" in name:
        return False
    return name[: -len(".weight")].rsplit(".", 1)[-1] in FP8_MODULES
