"""The bounded response store behind `--enable-response-store`: eviction by size (least recently
used first) and by TTL, oversize entries, cancel hooks, and thread safety."""

from __future__ import annotations

import threading

import pytest

from trnrt.serve.http.response_store import ResponseStore, entry_size


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def resp(i: int, status: str = "completed", pad: int = 0) -> dict:
    return {"id": f"resp_{i}", "object": "response", "status": status, "output": [], "pad": "x" * pad}


def test_put_get_delete():
    s = ResponseStore(1 << 20, 60)
    assert s.put("resp_1", resp(1), [{"role": "user", "content": "hi"}])
    e = s.get("resp_1")
    assert e.response["id"] == "resp_1" and e.history == [{"role": "user", "content": "hi"}]
    assert s.get("resp_2") is None
    assert s.used_bytes == e.size == entry_size(resp(1), e.history)
    assert s.delete("resp_1") and not s.delete("resp_1")
    assert len(s) == 0 and s.used_bytes == 0


def test_size_bound_evicts_least_recently_used():
    one = entry_size(resp(0, pad=1000), None)
    s = ResponseStore(3 * one, None)
    for i in range(3):
        assert s.put(f"resp_{i}", resp(i, pad=1000))
    s.get("resp_0")  # used: resp_1 is now the oldest use
    assert s.put("resp_3", resp(3, pad=1000))
    assert s.get("resp_1") is None
    assert {k for k in ("resp_0", "resp_2", "resp_3") if s.get(k)} == {"resp_0", "resp_2", "resp_3"}
    assert s.evicted == 1 and s.used_bytes <= s.max_bytes


def test_replacing_an_entry_recharges_its_size():
    s = ResponseStore(1 << 20, None)
    s.put("resp_1", resp(1, "in_progress"))
    small = s.used_bytes
    s.put("resp_1", resp(1, pad=5000), [{"role": "user", "content": "x"}])
    assert len(s) == 1 and s.used_bytes > small + 5000


def test_entry_larger_than_the_store_is_not_kept():
    s = ResponseStore(500, None)
    assert s.put("resp_1", resp(1))
    assert not s.put("resp_1", resp(1, pad=1000))  # the new version is too big: the old one goes too
    assert s.get("resp_1") is None and s.used_bytes == 0


def test_ttl_expiry_counts_from_the_last_write():
    clock = Clock()
    s = ResponseStore(1 << 20, 10.0, clock=clock)
    s.put("resp_1", resp(1))
    s.put("resp_2", resp(2))
    clock.t += 6
    s.put("resp_2", resp(2))  # rewritten: its clock restarts
    clock.t += 5
    assert s.get("resp_1") is None and s.get("resp_2") is not None
    assert s.expired == 1
    clock.t += 11
    assert len(s) == 0 and s.used_bytes == 0


def test_cancel_runs_the_hook_once_for_in_progress_only():
    s = ResponseStore(1 << 20, None)
    calls = []
    s.put("resp_1", resp(1, "in_progress"), None, cancel=lambda: calls.append(1))
    assert s.request_cancel("resp_1").cancel_requested
    s.request_cancel("resp_1")
    assert calls == [1]
    s.put("resp_1", resp(1, "cancelled"), [])
    assert s.get("resp_1").cancel_requested  # kept across the final write
    s.put("resp_2", resp(2), [], cancel=lambda: calls.append(2))
    s.request_cancel("resp_2")
    assert calls == [1] and s.request_cancel("resp_9") is None


@pytest.mark.parametrize("bad", [dict(max_bytes=0, ttl_s=None), dict(max_bytes=10, ttl_s=0),
                                 dict(max_bytes=10, ttl_s=-1)])
def test_bad_bounds(bad):
    with pytest.raises(ValueError):
        ResponseStore(**bad)


def test_thread_safety_keeps_the_books_balanced():
    """8 threads put/get/delete/cancel on overlapping ids under a tight bound: the byte count
    always equals the sum of the live entries and never exceeds the bound."""
    s = ResponseStore(20_000, 3600)
    errors = []

    def worker(t: int):
        try:
            for i in range(400):
                k = f"resp_{(t * 7 + i) % 50}"
                op = i % 4
                if op == 0:
                    s.put(k, resp(i, "in_progress", pad=i % 300), None, cancel=lambda: None)
                elif op == 1:
                    s.get(k)
                elif op == 2:
                    s.request_cancel(k)
                else:
                    s.put(k, resp(i, pad=i % 500), [{"role": "user", "content": "x" * (i % 100)}]) if i % 8 == 3 \
                        else s.delete(k)
                assert s.used_bytes <= s.max_bytes
        except Exception as e:  # reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[:3]
    with s._lock:
        assert s._bytes == sum(e.size for e in s._entries.values())
