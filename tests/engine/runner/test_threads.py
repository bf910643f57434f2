"""trnrt.engine.runner.threads: the engine's torch thread count (rule, precedence, per-thread effect)."""

from __future__ import annotations

import logging
import queue
import threading

import pytest
import torch

from trnrt.engine.runner import threads as th


@pytest.fixture(autouse=True)
def _restore_threads(monkeypatch):
    monkeypatch.delenv(th.ENV_VAR, raising=False)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)  # also resets the value new threads adopt


class Worker:
    """A long-lived thread that runs callables (like the engine thread)."""

    def __init__(self):
        self._in: queue.Queue = queue.Queue()
        self._out: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name="test-worker", daemon=True)
        self.thread.start()

    def _loop(self):
        while (fn := self._in.get()) is not None:
            try:
                self._out.put((True, fn()))
            except BaseException as e:  # noqa: BLE001 - handed back to the caller
                self._out.put((False, e))

    def __call__(self, fn):
        self._in.put(fn)
        ok, v = self._out.get(timeout=60)
        if not ok:
            raise v
        return v

    def close(self):
        self._in.put(None)
        self.thread.join(timeout=60)


@pytest.fixture
def worker():
    w = Worker()
    yield w
    w.close()


# -- the rule --------------------------------------------------------------------------------


def test_default_is_one_thread_for_a_small_model_and_off_the_cpu(monkeypatch):
    monkeypatch.setattr(th, "physical_cores", lambda: 16)
    assert th.default_torch_threads("eager", "cpu", 1_002_240) == 1  # the tiny model
    assert th.default_torch_threads("compiled", "cpu", None) == 1
    assert th.default_torch_threads("eager", "cpu", th.LARGE_MODEL_PARAMS - 1) == 1
    assert th.default_torch_threads("cuda", "cuda:0", 300_000_000_000) == 1
    assert th.default_torch_threads("neuron", "xla", 300_000_000_000) == 1


def test_default_is_the_physical_cores_for_a_large_model_on_the_cpu(monkeypatch):
    monkeypatch.setattr(th, "physical_cores", lambda: 16)
    assert th.default_torch_threads("eager", "cpu", th.LARGE_MODEL_PARAMS) == 16
    assert th.default_torch_threads("cpu", "cpu", 300_000_000_000) == 16


def test_precedence_requested_then_env_then_default(monkeypatch):
    assert th.resolve_torch_threads("eager", "cpu", None, 1000) == (1, "default")
    monkeypatch.setenv(th.ENV_VAR, "3")
    assert th.resolve_torch_threads("eager", "cpu", None, 1000) == (3, th.ENV_VAR)
    assert th.resolve_torch_threads("eager", "cpu", 2, 1000) == (2, "requested")
    for v in ("auto", "", "  "):
        monkeypatch.setenv(th.ENV_VAR, v)
        assert th.resolve_torch_threads("eager", "cpu", None, 1000) == (1, "default")


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_bad_env_is_refused_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(th.ENV_VAR, value)
    with pytest.raises(ValueError, match=th.ENV_VAR):
        th.resolve_torch_threads("eager", "cpu")


@pytest.mark.parametrize("value", [0, -1, True, 1.0, "2"])
def test_bad_request_is_refused(value):
    with pytest.raises(ValueError, match="threads must be an integer >= 1"):
        th.resolve_torch_threads("eager", "cpu", value)


def _sysfs(tmp_path, cores: dict[int, tuple[int, int]]):
    for cpu, (pkg, core) in cores.items():
        d = tmp_path / "cpu" / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "physical_package_id").write_text(f"{pkg}\n")
        (d / "core_id").write_text(f"{core}\n")
    return tmp_path / "cpu"


def test_physical_cores_counts_smt_siblings_once_and_honours_a_cgroup_quota(tmp_path):
    # 8 logical CPUs: 2 packages x 2 cores x 2 hyper-threads
    sysfs = _sysfs(tmp_path, {c: (c // 4, (c // 2) % 2) for c in range(8)})
    cg = tmp_path / "cg"
    cg.mkdir()
    assert th.physical_cores(set(range(8)), sysfs, cg) == 4  # no cgroup files: no quota
    assert th.physical_cores({0, 1}, sysfs, cg) == 1  # the affinity mask holds one core's two threads
    assert th.physical_cores({0, 2, 4}, sysfs, cg) == 3
    (cg / "cpu.max").write_text("max 100000\n")
    assert th.physical_cores(set(range(8)), sysfs, cg) == 4
    (cg / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs: rounded up
    assert th.physical_cores(set(range(8)), sysfs, cg) == 2
    (cg / "cpu.max").unlink()
    (cg / "cpu").mkdir()
    (cg / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")  # cgroup v1
    (cg / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert th.physical_cores(set(range(8)), sysfs, cg) == 1
    (cg / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert th.physical_cores(set(range(8)), sysfs, cg) == 4
    # no topology files: each CPU counts
    assert th.physical_cores({0, 1, 2}, tmp_path / "nowhere", cg) == 3


def test_physical_cores_of_this_process_is_sane():
    import os

    assert 1 <= th.physical_cores() <= (os.cpu_count() or 1)


def test_count_params():
    assert th.count_params(torch.nn.Linear(3, 2)) == 8
    assert th.count_params(None) is None
    assert th.count_params(object()) is None


# -- the effect, on the calling thread -----------------------------------------------------


def test_configure_sets_the_calling_threads_count_and_logs_one_line(worker, caplog):
    torch.set_num_threads(2)
    with caplog.at_level(logging.INFO, logger="trnrt.engine.runner.threads"):
        n = worker(lambda: th.configure_engine_threads("eager", "cpu", None, model_params=1_002_240))
    assert n == 1
    assert worker(torch.get_num_threads) == 1
    lines = [r for r in caplog.records if r.name == "trnrt.engine.runner.threads"]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    msg = lines[0].getMessage()
    assert "test-worker" in msg and "1 intra-op" in msg and "default" in msg and "inter-op" in msg


def test_configure_honours_the_env_and_a_request(worker, monkeypatch):
    monkeypatch.setenv(th.ENV_VAR, "2")
    assert worker(lambda: th.configure_engine_threads("eager", "cpu", None)) == 2
    assert worker(torch.get_num_threads) == 2
    assert worker(lambda: th.configure_engine_threads("eager", "cpu", 1)) == 1
    assert worker(torch.get_num_threads) == 1


def test_apply_none_does_nothing(worker):
    before = worker(torch.get_num_threads)
    assert worker(lambda: th.apply_torch_threads(None)) is None
    assert worker(torch.get_num_threads) == before


def test_torch_thread_counts_are_per_thread_once_a_thread_has_run(worker):
    """What the module doc says about torch (2.13, OpenMP): a thread adopts the last global count
    when it first runs torch work, then keeps its own; so the engine sets its own count in its
    thread, and a main-thread call after the engine started does not reach it."""
    torch.set_num_threads(2)
    assert worker(torch.get_num_threads) == 2  # adopted on first use
    torch.set_num_threads(1)  # main thread, after the worker has run
    assert torch.get_num_threads() == 1
    assert worker(torch.get_num_threads) == 2  # unchanged
    worker(lambda: th.apply_torch_threads(2))
    assert worker(torch.get_num_threads) == 2 and torch.get_num_threads() == 1  # main unchanged
    # a thread started later adopts the last value set anywhere
    fresh: list[int] = []
    t = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert fresh == [2]


def test_interop_threads_are_left_alone(worker):
    before = torch.get_num_interop_threads()
    worker(lambda: th.configure_engine_threads("eager", "cpu", 1))
    assert torch.get_num_interop_threads() == before
