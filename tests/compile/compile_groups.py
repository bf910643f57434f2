"""The compile tests' xdist groups and subset switch (see conftest.py)."""

from __future__ import annotations

import os

import pytest

SUBSET = os.environ.get("TRNRT_TEST_COMPILE", "all") == "subset"
# The full sampler over the full block table, the greedy sampler over the short one (what a greedy
# batch of short sequences runs, e.g. `trnrt bench`), and the smallest prefill graph.
FAST_SUBSET = {"batch8": ["decode-b8-t1-base", "decode-b8-t1-c128-base-greedy", "prefill-b1-t32-base"]}
GROUP_A = pytest.mark.xdist_group("compile_a")  # default's decode graphs
GROUP_B = pytest.mark.xdist_group("compile_b")  # batch8's graphs, default's prefill graphs
