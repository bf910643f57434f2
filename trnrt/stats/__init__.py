"""Serving statistics: the `/v1/stats` schema, the engine-side collector, Prometheus rendering.

Pure Python (no torch, no engine or model imports): `trnrt top` and the server both use it.
`trnrt.stats.prometheus` (which imports prometheus_client) is loaded only when asked for.
"""

from __future__ import annotations

from trnrt.stats.collector import StatsCollector
from trnrt.stats.schema import (
    FINISH_TYPES,
    LATENCY_KEYS,
    LIVE_KEYS,
    RATE_KEYS,
    RATE_WINDOWS,
    SCHEMA_VERSION,
    SchemaError,
    merge_snapshots,
    validate_snapshot,
)

__all__ = [
    "FINISH_TYPES",
    "LATENCY_KEYS",
    "LIVE_KEYS",
    "RATE_KEYS",
    "RATE_WINDOWS",
    "SCHEMA_VERSION",
    "SchemaError",
    "StatsCollector",
    "merge_snapshots",
    "validate_snapshot",
]
