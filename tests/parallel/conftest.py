"""tests/parallel: the parallel layer's one-process tests and its 2-process gloo checks."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # launcher, tp_checks (the spawned ranks import them too)
