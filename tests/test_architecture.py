"""The layer direction of docs/ARCHITECTURE.md holds, and the light entry points never load torch."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run_py(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_help_does_not_import_torch():
    r = _run_py(
        """
        import sys
        from trnrt.cli import main
        sys.argv = ["trnrt", "--help"]
        try:
            main()
        except SystemExit as e:
            assert e.code == 0, e.code
        heavy = [m for m in ("torch", "transformers", "falcon", "textual") if m in sys.modules]
        assert not heavy, heavy
        """
    )
    assert r.returncode == 0, r.stderr
    assert "serve" in r.stdout or "make-tiny" in r.stdout


@pytest.mark.parametrize(
    "module",
    [
        "trnrt",
        "trnrt.config",
        "trnrt.engine.request",
        "trnrt.engine.output.outputs",
        "trnrt.engine.core.client",
        "trnrt.engine.sched.scheduler",
        "trnrt.engine.cache.cache_manager",
        "trnrt.engine.core.messages",
        "trnrt.engine.runner.scripted_runner",
        "trnrt.engine.core.engine",
        "trnrt.engine.core.mp_client",
        "trnrt.engine.core.core_proc",
        "trnrt.stats",
        "trnrt.top.app",
        "trnrt.cli.top",
    ],
)
def test_pure_python_modules_do_not_import_torch(module):
    r = _run_py(f"import sys, importlib; importlib.import_module({module!r}); assert 'torch' not in sys.modules")
    assert r.returncode == 0, r.stderr


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert exe, "import-linter is a test dependency"
    return subprocess.run([exe, "--no-cache"], cwd=root, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(root)})


def test_import_linter_contracts_hold():
    r = _lint_imports(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout, r.stdout


def test_a_planted_upward_import_breaks_the_engine_stages_contract(tmp_path):
    """The contracts can fail: the scheduler importing the model runner (inside a function, as a
    shortcut would) and a logits processor importing the scheduler each break the stage layers."""
    shutil.copytree(ROOT / "trnrt", tmp_path / "trnrt", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    for rel, target in [("engine/sched/scheduler.py", "trnrt.engine.runner.model_runner"),
                        ("engine/sample/penalties.py", "trnrt.engine.sched.scheduler")]:
        f = tmp_path / "trnrt" / rel
        f.write_text(f.read_text() + f"\n\ndef _planted():\n    import {target}  # noqa: F401\n")
    r = _lint_imports(tmp_path)
    assert r.returncode != 0, r.stdout
    out = " ".join(r.stdout.split())
    assert "Engine stages" in out and "BROKEN" in out, r.stdout
    assert "trnrt.engine.sched.scheduler -> trnrt.engine.runner.model_runner" in out, r.stdout
    assert "trnrt.engine.sample.penalties -> trnrt.engine.sched.scheduler" in out, r.stdout


def test_a_planted_upward_import_breaks_the_parallel_layer(tmp_path):
    """trnrt.parallel (issue #31) sits below the model: its primitives importing the model (inside
    a function, as a shortcut would) breaks the layered contract."""
    shutil.copytree(ROOT / "trnrt", tmp_path / "trnrt", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    f = tmp_path / "trnrt" / "parallel" / "layers.py"
    f.write_text(f.read_text() + "\n\ndef _planted():\n    import trnrt.models.glm5_next.model  # noqa: F401\n")
    r = _lint_imports(tmp_path)
    assert r.returncode != 0, r.stdout
    out = " ".join(r.stdout.split())
    assert "Layered architecture" in out and "BROKEN" in out, r.stdout
    assert "trnrt.parallel.layers -> trnrt.models.glm5_next.model" in out, r.stdout


def test_no_import_circle():
    """No module of trnrt imports itself back through others (imports inside functions count)."""
    from trnrt.compile.import_graph import cycles, import_graph

    found = cycles(import_graph(ROOT))
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_a_planted_import_circle_is_found(tmp_path):
    """The check above can fail: the request types importing the stop checker (the circle #30 cut,
    planted back inside a function) is reported."""
    import shutil as _sh

    from trnrt.compile.import_graph import cycles, import_graph

    _sh.copytree(ROOT / "trnrt", tmp_path / "trnrt", ignore=_sh.ignore_patterns("__pycache__"))
    req = tmp_path / "trnrt" / "engine" / "request.py"
    req.write_text(req.read_text() + "\n\ndef _planted():\n    from trnrt.engine.output import stop  # noqa: F401\n")
    found = cycles(import_graph(tmp_path))
    assert any("trnrt.engine.request" in c and "trnrt.engine.output.stop" in c for c in found), found


MAX_MODULE_LINES = 500  # issue #30: a module a reader can hold in mind; split by job beyond this


def _long_modules(package: Path, limit: int = MAX_MODULE_LINES) -> list[str]:
    out = []
    for f in sorted(package.rglob("*.py")):
        n = len(f.read_text().splitlines())
        if n > limit:
            out.append(f"{f.relative_to(package.parent)}: {n} lines")
    return out


def test_no_module_over_500_lines():
    long = _long_modules(ROOT / "trnrt")
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by job):\n" + "\n".join(long)


def test_a_planted_long_module_is_listed(tmp_path):
    pkg = tmp_path / "trnrt"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "engine" / "ok.py").write_text("x = 1\n" * MAX_MODULE_LINES)
    (pkg / "engine" / "long.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert _long_modules(pkg) == [f"trnrt/engine/long.py: {MAX_MODULE_LINES + 1} lines"]
