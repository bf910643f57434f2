"""The embedded tiny GLM-5.3-Flash checkpoint (`trnrt make-tiny`).

A config that exercises every path of the architecture (KDA and indexed layers, a full and a
shared indexer layer, dense and sparse MLPs, grouped top-k routing, hc_mult 4, sparse selection
within 32 tokens, a SwiGLU clamp that bites) with weights scaled so activations are O(1).
Same seed, byte-identical files. See ../shared/reference/glm5_next.md §4 for why each value.
"""

from trnrt.models.tiny.build import (  # noqa: F401  (the package's public names)
    RESIDUAL_OUT_SCALE,
    ROUTER_BIAS_STD,
    TINY_MTP_CONFIG,
    TINY_MTP_SEED_OFFSET,
    TINY_TEXT_CONFIG,
    TINY_VISION_CONFIG,
    TINY_VOCAB_SIZE,
    add_mtp_layer,
    build_hf_model,
    mtp_tensors,
    randomize_,
    tiny_text_config,
)
from trnrt.models.tiny.checkpoint import (  # noqa: F401
    TINY_CHECKPOINT_VERSION,
    cache_dir,
    default_model_dir,
    write_tiny_checkpoint,
)
