"""Subprocess of `trnrt verify graph-equiv --base-ref`: fingerprints with another tree's model code.

`trnrt.models` and `trnrt.engine` are imported from --base-tree (the worktree of the reference
revision); every other trnrt module, the hasher included, from this checkout. So the comparison
measures the model and step code of the two revisions with one and the same hash function.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.abc
import importlib.machinery
import json
import sys
from pathlib import Path

_REDIRECT = ("trnrt.models", "trnrt.engine")


class _BaseTreeFinder(importlib.abc.MetaPathFinder):
    def __init__(self, base: Path):
        self.base = base

    def find_spec(self, fullname, path, target=None):
        if fullname in _REDIRECT:
            parent = self.base / "trnrt"
            return importlib.machinery.PathFinder.find_spec(fullname, [str(parent)])
        return None  # submodules follow their package's __path__, i.e. the base tree


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-tree", required=True)
    ap.add_argument("--preset", required=True)
    ap.add_argument("--dims", default="tiny")
    ap.add_argument("--flag", action="append", default=[])
    ap.add_argument("--only", action="append", default=None)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    sys.meta_path.insert(0, _BaseTreeFinder(Path(a.base_tree)))
    from trnrt.verify.graph_equiv import fingerprints_for

    # No fingerprint cache here: its key digests THIS checkout's source, not the base tree's models.
    res = fingerprints_for(a.preset, a.flag, a.dims, a.only, use_cache=False)
    res["graphs"] = {k: dataclasses.asdict(v) for k, v in res["graphs"].items()}
    Path(a.out).write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
