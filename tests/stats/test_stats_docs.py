"""docs/TOP.md's example snapshot stays a valid document with exactly the collector's keys."""

from __future__ import annotations

import json
import re
from pathlib import Path

from trnrt.stats import StatsCollector, validate_snapshot

DOC = Path(__file__).resolve().parents[2] / "docs" / "TOP.md"


def _key_paths(d, prefix=""):
    out = set()
    if isinstance(d, dict):
        for k, v in d.items():
            if k == "extra":  # free-form engine info
                continue
            out.add(prefix + k)
            out |= _key_paths(v, prefix + k + ".")
    elif isinstance(d, list):
        for v in d:
            out |= _key_paths(v, prefix + "[].")
    return out


def test_doc_example_matches_the_schema():
    (block,) = re.findall(r"```json\n(.*?)\n```", DOC.read_text(encoding="utf-8"), re.S)
    example = validate_snapshot(json.loads(block))
    real = StatsCollector().snapshot()
    assert _key_paths(example) == _key_paths(real)
