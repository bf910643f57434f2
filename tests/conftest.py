"""Session-wide test settings."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# The graph fingerprint cache is keyed on source files, not on live objects: a test that
# monkeypatches the model and runs graph-equiv must not read (or store) fingerprints of the
# unpatched code. Only the compile fixtures (tests/compile/conftest.py) and the cache's own tests
# turn it on.
os.environ["TRNRT_GRAPH_CACHE"] = "0"
# For the same reason graph-equiv exports in the test process (a spawned export worker would import
# the unpatched source); tests/compile/test_export_pool.py runs the parallel exports on purpose.
os.environ["TRNRT_VERIFY_JOBS"] = "1"


@pytest.hookimpl(trylast=True)  # after -k / -m / --lf have deselected
def pytest_collection_modifyitems(session, config, items):
    """Start the session's compile jobs (tests/compile/compile_jobs.py: parallel `trnrt compile`
    processes, the longest part of the suite) as soon as a selected test needs the session fixture
    `compiled`, and run those tests last: a stable reorder, the same in every pytest-xdist worker.
    The jobs then compile while both workers run every other test, and the tests that need them
    come when they are (nearly) done; queued first, the waiting fixture held its worker idle."""
    def needs_compile(item) -> bool:
        return "compiled" in getattr(item, "fixturenames", ())

    items[:] = [i for i in items if not needs_compile(i)] + [i for i in items if needs_compile(i)]
    if items and needs_compile(items[-1]) and not config.option.collectonly:
        sys.path.insert(0, str(Path(__file__).parent / "compile"))
        import compile_jobs

        compile_jobs.start(config)
