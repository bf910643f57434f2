"""The compile tests' xdist groups and subset switch (see conftest.py)."""

from __future__ import annotations

import os

import pytest

SUBSET = os.environ.get("TRNRT_TEST_COMPILE", "all") == "subset"
# The full sampler over the full block table, the greedy sampler over the short one (what a greedy
# batch of short sequences runs, e.g. `trnrt bench`), and the smallest prefill graph.
FAST_SUBSET = {"batch8": ["decode-b8-t1-base", "decode-b8-t1-c128-base-greedy", "prefill-b1-t32-base"]}
# Two groups of 7 compiles each. Group A compiles DEFAULT_A, then batch8, whose full-table decode-b8
# pair is the same graph as default's (equal hash) and is copied, not compiled again.
GROUP_A = pytest.mark.xdist_group("compile_a")
GROUP_B = pytest.mark.xdist_group("compile_b")
DEFAULT_A = ["decode-b8-t1-base", "decode-b8-t1-base-greedy", "prefill-b1-t16-base"]
DEFAULT_B = ["decode-b1-t1-base", "decode-b1-t1-base-greedy", "decode-b2-t1-base", "decode-b2-t1-base-greedy",
             "decode-b4-t1-base", "decode-b4-t1-base-greedy", "prefill-b1-t64-base"]
