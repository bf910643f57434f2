"""`--kv-cache-dtype` (SGLang's flag): the dtype of the MLA latent cache and the indexer's pooled
key cache (and its open-pool tail).

* auto: the model's dtype (the default graphs' state);
* bf16: bfloat16; the same as auto on a bfloat16 preset, refused on another (the forward would
  write bf16 latents from fp32 activations: a cast on the traced cache write and read);
* fp8_e4m3: float8_e4m3fn, scale 1 (kv_cache.py: FP8-cache forms of MLA and the indexer, swapped
  in only then; eager only).
The KDA recurrent state stays fp32 whatever the flag (as the reference keeps it): the state is
a running sum over the whole sequence, where bf16 rounding accumulates every token.
"""

from __future__ import annotations

import torch

from ..config import ConfigError

KV_CACHE_DTYPES = ("auto", "bf16", "fp8_e4m3")


def resolve_kv_cache_dtype(choice: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache dtype for `choice` with a model of `model_dtype`; ConfigError naming
    `kv_cache_dtype` for a choice the model cannot run."""
    if choice not in KV_CACHE_DTYPES:
        raise ConfigError("kv_cache_dtype", f"{choice!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    if choice == "auto":
        return model_dtype
    if choice == "bf16":
        if model_dtype != torch.bfloat16:
            raise ConfigError("kv_cache_dtype", f"bf16 needs a bfloat16 model (this preset runs {model_dtype}); "
                              "use auto or a bfloat16 preset")
        return torch.bfloat16
    return torch.float8_e4m3fn
