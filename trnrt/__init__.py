"""trnrt: an inference and serving runtime for GLM-5.3-Flash (transformers `glm5_next`).

Importing `trnrt` is cheap (no torch); `trnrt.LLM` and `trnrt.SamplingParams` load lazily.
"""

from __future__ import annotations

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("trnrt")
except _metadata.PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0+src"

__all__ = ["__version__", "LLM", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from trnrt.engine.core.llm import LLM

        return LLM
    if name == "SamplingParams":
        from trnrt.engine.request import SamplingParams

        return SamplingParams
    raise AttributeError(name)
