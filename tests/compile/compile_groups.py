"""Which graphs the compile tests compile (see conftest.py), by TRNRT_TEST_COMPILE:

- "buckets" (default, CI): every bucket of `default` and `batch8` (each decode batch x context
  and each prefill token bucket) with the full sampler, plus batch8's short-context greedy graph
  (the greedy sampler, what `trnrt bench` runs): 11 graphs, 10 compiles (batch8's full-table
  decode-b8 graph is default's, copied). The other greedy twins differ from a checked graph only
  in the sampler; graph-equiv pins their hashes. A fresh-clone `.ci/run` with it: 8 min 50 s on
  2 cores (measured; it took 16 min while every xdist worker compiled its own copy, see conftest).
- "every": all 16 graphs (14 compiles).
- "subset": three of batch8's graphs (FAST_SUBSET), for a quick local run.
"""

from __future__ import annotations

import os

MODE = os.environ.get("TRNRT_TEST_COMPILE", "buckets")
if MODE not in ("buckets", "every", "subset"):
    raise ValueError(f"TRNRT_TEST_COMPILE must be buckets, every or subset, got {MODE!r}")
SUBSET = MODE == "subset"

# The full sampler over the full block table, the greedy sampler over the short one (what a greedy
# batch of short sequences runs, e.g. `trnrt bench`), and the smallest prefill graph.
FAST_SUBSET = {"batch8": ["decode-b8-t1-base", "decode-b8-t1-c128-base-greedy", "prefill-b1-t32-base"]}


def _full_sampler_plus(ids: list[str], keep_greedy: set[str]) -> list[str]:
    return [g for g in ids if not g.endswith("-greedy") or g in keep_greedy or MODE == "every"]


# Two compile jobs of about equal cost, run as parallel processes. Job A compiles its default
# graphs first, then batch8 into the same --out, so batch8's full-table decode-b8 graphs (equal
# hashes to default's) are copied instead of compiled.
DEFAULT_A = _full_sampler_plus(["decode-b8-t1-base", "decode-b8-t1-base-greedy"], set())
DEFAULT_B = _full_sampler_plus(["decode-b1-t1-base", "decode-b1-t1-base-greedy", "decode-b2-t1-base",
                                "decode-b2-t1-base-greedy", "decode-b4-t1-base", "decode-b4-t1-base-greedy",
                                "prefill-b1-t16-base", "prefill-b1-t64-base"], set())
BATCH8 = (FAST_SUBSET["batch8"] if SUBSET else
          _full_sampler_plus(["decode-b8-t1-c128-base", "decode-b8-t1-c128-base-greedy", "decode-b8-t1-base",
                              "decode-b8-t1-base-greedy", "prefill-b1-t32-base", "prefill-b1-t128-base"],
                             {"decode-b8-t1-c128-base-greedy"}))
