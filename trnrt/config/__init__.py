"""Graph-shaping configuration (EngineConfig). Pure Python.

Everything a compiled graph depends on lives in EngineConfig (dtype, block size, max_model_len,
buckets). Scheduling policy and server settings live elsewhere, so a host-only feature can never
change a graph.
"""

from trnrt.config.engine_config import EngineConfig, EngineConfigError

__all__ = ["EngineConfig", "EngineConfigError"]
