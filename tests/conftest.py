"""Session-wide test settings."""

from __future__ import annotations

import os

# The graph fingerprint cache is keyed on source files, not on live objects: a test that
# monkeypatches the model and runs graph-equiv must not read (or store) fingerprints of the
# unpatched code. Only the compile fixtures (tests/compile/conftest.py) and the cache's own tests
# turn it on.
os.environ["TRNRT_GRAPH_CACHE"] = "0"
