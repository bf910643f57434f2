"""`--kv-cache-dtype` and `--quantization` choices: what runs today and what is refused, naming it."""

from __future__ import annotations

import pytest
import torch
import typer

from trnrt.cli.server_args import KV_CACHE_DTYPES, QUANTIZATIONS, ServerArgs
from trnrt.models.glm5_next.config import ConfigError
from trnrt.models.glm5_next.fp8 import kv_dtype
from trnrt.models.glm5_next.fp8.load import QUANTIZATIONS as MODEL_QUANTIZATIONS


def test_kv_cache_dtype_choices():
    assert KV_CACHE_DTYPES == kv_dtype.KV_CACHE_DTYPES and (None, *QUANTIZATIONS) == MODEL_QUANTIZATIONS
    assert kv_dtype.resolve_kv_cache_dtype("auto", torch.float32) == torch.float32
    assert kv_dtype.resolve_kv_cache_dtype("bf16", torch.bfloat16) == torch.bfloat16
    assert kv_dtype.resolve_kv_cache_dtype("fp8_e4m3", torch.float32) == torch.float8_e4m3fn
    for choice, model_dtype, words in (("bf16", torch.float32, "bfloat16"),
                                       ("fp16", torch.float32, "not one of")):
        with pytest.raises(ConfigError, match=words) as e:
            kv_dtype.resolve_kv_cache_dtype(choice, model_dtype)
        assert e.value.field == "kv_cache_dtype"


def test_serve_flags_are_checked():
    args = ServerArgs.from_cli({"quantization": "fp8", "kv_cache_dtype": "auto"})
    assert (args.quantization, args.kv_cache_dtype) == ("fp8", "auto")
    assert ServerArgs.from_cli({"quantization": "none"}).quantization is None
    with pytest.raises(typer.BadParameter):
        ServerArgs.from_cli({"quantization": "awq"})
    with pytest.raises(typer.BadParameter):
        ServerArgs.from_cli({"kv_cache_dtype": "fp8"})
