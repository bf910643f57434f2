"""What `trnrt compile` prints: no torch FutureWarning per graph, graph ids in full in the summary."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
from typer.testing import CliRunner

from trnrt.cli import app
from trnrt.cli.compile import SUMMARY_COLUMNS, summary_lines
from trnrt.compile.torch_warnings import quiet_torch_leafspec_warning
from trnrt.compile.manifest import GraphEntry

IDS = ["decode-b8-t1-c128-base", "decode-b8-t1-c128-base-greedy", "decode-b8-t1-base", "decode-b8-t1-base-greedy",
       "prefill-b1-t32-base", "prefill-b1-t128-base", "decode-b8-t1-c128-penalties+structured_outputs-greedy"]


def _entry(gid: str, **kw) -> GraphEntry:
    base = dict(id=gid, phase="decode", batch=8, tokens=1, variant="base", inputs=[], outputs=[],
                graph_hash="c97f59ccbc2476598055" + "0" * 44, status="ok", export_s=17.04, compile_s=127.5,
                bytes=3_742_105)
    return GraphEntry(**{**base, **kw})


def _leafspec_warnings(record) -> list:
    return [w for w in record if issubclass(w.category, FutureWarning) and "LeafSpec" in str(w.message)]


def test_summary_lines_keep_every_id_whole_and_aligned():
    graphs = [_entry(g) for g in IDS]
    graphs[2].reused = True
    graphs[3].status, graphs[3].graph_hash, graphs[3].bytes = "failed", "", 0
    header, *rows = summary_lines(graphs)
    assert header.split("  ")[0].strip() == "graph" and all(c in header for c in SUMMARY_COLUMNS)
    assert len(rows) == len(IDS) and len(set(rows)) == len(rows)
    for gid, row in zip(IDS, rows):
        assert row.split()[0] == gid
    # columns line up: the status column starts at the same offset on every line
    col = header.index("status")
    assert all(r[col - 2 : col] == "  " and r[col] != " " for r in rows)
    assert "ok (reused)" in rows[2] and "failed" in rows[3] and " - " in rows[3]
    assert rows[0].endswith("3.6 MB") and "c97f59ccbc247659 " in rows[0]  # 16 hash digits


def test_deepcopied_treespecs_warn_without_the_filter_and_not_with_it():
    spec = torch.utils._pytree.tree_flatten(([1, 2], {"a": 3}))[1]
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        copy.deepcopy(spec)
    if not _leafspec_warnings(rec):
        pytest.skip(f"torch {torch.__version__} does not warn on LeafSpec copies")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        with quiet_torch_leafspec_warning():
            copy.deepcopy(spec)
            warnings.warn("another FutureWarning", FutureWarning)  # still shown
    assert not _leafspec_warnings(rec)
    assert [str(w.message) for w in rec] == ["another FutureWarning"]


def test_dry_run_prints_no_future_warning_and_the_full_ids(tiny_dir, tmp_path):
    gid = "decode-b8-t1-c128-base-greedy"  # 29 characters: rich's table cut it to "decode-b8-t1-…"
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        r = CliRunner().invoke(app, ["compile", "--preset", "batch8", "--model", str(tiny_dir), "--out", str(tmp_path),
                                     "--dry-run", "--only", gid], catch_exceptions=False, terminal_width=80)
    assert r.exit_code == 0, r.output
    assert not _leafspec_warnings(rec)
    assert "FutureWarning" not in r.output
    [row] = [line for line in r.output.splitlines() if line.startswith(gid + " ")]
    assert row.split()[1] == "exported"


def test_session_compiles_printed_no_future_warning_and_full_ids(compiled_batch8, compile_log):
    """The real AOTInductor compiles of this session (`trnrt compile` processes, output in their
    log) printed no FutureWarning, and their summary tables name every graph in full."""
    from trnrt.compile.manifest import Manifest

    log = compile_log
    assert "FutureWarning" not in log, log[-3000:]
    ids = [g.id for g in Manifest.read(compiled_batch8).graphs]
    starts = {line.split()[0] for line in log.splitlines() if line.strip() and not line.startswith(" ")}
    assert set(ids) <= starts, (ids, log[-3000:])
    assert re.search(r"^graph +status +graph hash", log, re.M)
