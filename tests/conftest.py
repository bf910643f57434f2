"""Session-wide test settings."""

from __future__ import annotations

import os

# The graph fingerprint cache is keyed on source files, not on live objects: a test that
# monkeypatches the model and runs graph-equiv must not read (or store) fingerprints of the
# unpatched code. Only the compile fixtures (tests/compile/conftest.py) and the cache's own tests
# turn it on.
os.environ["TRNRT_GRAPH_CACHE"] = "0"


def pytest_collection_modifyitems(session, config, items):
    """Run the tests that need compiled artifacts (the session fixture `compiled`,
    tests/compile/conftest.py: two `trnrt compile` processes, minutes) last: a stable reorder, the
    same in every pytest-xdist worker. Queued first, the waiting fixture held its worker while the
    other ran dry at the end; queued last, both workers run the quick tests while nothing compiles."""
    def needs_compile(item) -> bool:
        return "compiled" in getattr(item, "fixturenames", ())

    items[:] = [i for i in items if not needs_compile(i)] + [i for i in items if needs_compile(i)]
