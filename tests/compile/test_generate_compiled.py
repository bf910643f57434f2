"""`trnrt generate --compiled DIR`: the session's compiled batch8 graphs (the shared background
compiles of conftest.py, not a compile of its own) run, give the eager engine's greedy tokens, and
stderr says they ran compiled."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from compile_groups import SUBSET
from trnrt.cli import app

PROMPTS = json.dumps([[11, 22, 33, 44, 55], [7, 8, 9]])


def _generate(tiny_dir, *args: str):
    r = CliRunner().invoke(app, ["generate", "--model", str(tiny_dir), "--preset", "batch8", "--prompt-ids", PROMPTS,
                                 "--max-new-tokens", "6", "--temperature", "0", "--ignore-eos", "--json", *args])
    assert r.exit_code == 0, (r.output, r.exception)
    return [json.loads(x)["output_ids"] for x in r.stdout.splitlines() if x.strip()], r.stderr


@pytest.mark.skipif(SUBSET, reason="TRNRT_TEST_COMPILE=subset: batch8 is not compiled whole")
def test_generate_runs_the_compiled_graphs(tiny_dir, compiled_batch8):
    compiled_ids, err = _generate(tiny_dir, "--compiled", str(compiled_batch8))
    line = err.strip().splitlines()[-1]
    assert line.startswith("graphs: preset batch8, ") and " compiled (cpu, from " in line, err
    assert "(compiled)" in line and "(eager)" not in line, line
    eager_ids, err = _generate(tiny_dir)
    assert "graphs: preset batch8, eager;" in err, err
    assert compiled_ids == eager_ids
