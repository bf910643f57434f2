"""Session-wide test settings."""

from __future__ import annotations

import os

# The graph fingerprint cache is keyed on source files, not on live objects: a test that
# monkeypatches the model and runs graph-equiv must not read (or store) fingerprints of the
# unpatched code. Only the compile fixtures (tests/compile/conftest.py) and the cache's own tests
# turn it on.
os.environ["TRNRT_GRAPH_CACHE"] = "0"


def pytest_collection_modifyitems(session, config, items):
    """Run the tests of xdist group "compile" last (a stable reorder, the same in every worker).

    With `--dist loadgroup` the group is one unit of work that waits on the session's compile
    fixture (two `trnrt compile` processes, minutes). Queued first, it held back the tests queued
    behind it on its worker while the other worker ran dry; queued last, the other worker keeps
    taking tests while the compile processes use the cores."""
    def in_compile_group(item) -> bool:
        m = item.get_closest_marker("xdist_group")
        return m is not None and (m.args[:1] == ("compile",) or m.kwargs.get("name") == "compile")

    items[:] = [i for i in items if not in_compile_group(i)] + [i for i in items if in_compile_group(i)]
