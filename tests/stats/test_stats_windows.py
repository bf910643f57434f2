"""Time-bucketed counters, latency windows and percentiles, on fabricated times."""

from __future__ import annotations

import pytest

from trnrt.stats.windows import BucketedCounter, LatencyWindow, percentile, summarize


def test_rate_over_window_uses_covered_time():
    c = BucketedCounter(horizon_s=900, bucket_s=1.0)
    # 10 events per second from t=1000 to t=1599 (one add per second, mid-bucket).
    for s in range(1000, 1600):
        c.add(10, s + 0.5)
    now = 1599.9
    # 60 s window = buckets 1540..1599, covering [1540, 1599.9]: 600 events over 59.9 s.
    total, covered = c.sum_window(60, now)
    assert total == 600 and covered == pytest.approx(59.9)
    assert c.rate(60, now, elapsed_s=600) == pytest.approx(600 / 59.9)
    assert c.rate(300, now, elapsed_s=600) == pytest.approx(3000 / 299.9)
    # The 15-minute window is longer than the time counted: divide by elapsed, not by 900 s.
    assert c.rate(900, now, elapsed_s=599.9) == pytest.approx(6000 / 599.9)
    assert c.total == 6000


def test_rate_decays_after_traffic_stops():
    c = BucketedCounter(horizon_s=900, bucket_s=1.0)
    for s in range(0, 600):
        c.add(10, s + 0.5)
    now = 660.0  # a silent minute
    assert c.rate(60, now, elapsed_s=660) == 0.0
    # 5 m window covers buckets 361..660: traffic in 361..599 = 239 s of 10/s.
    assert c.rate(300, now, elapsed_s=660) == pytest.approx(2390 / 299.0)
    assert c.rate(900, now, elapsed_s=660) == pytest.approx(6000 / 660)


def test_stale_ring_slots_from_an_earlier_lap_are_ignored():
    c = BucketedCounter(horizon_s=10, bucket_s=1.0)  # 10 slots
    c.add(5, 3.5)
    # 10 s later bucket 13 reuses slot 3: the old 5 must neither count in the window nor
    # be added to the new bucket.
    c.add(1, 13.2)
    assert c.sum_window(10, 13.5)[0] == 1
    # A read long after, with no writes: every slot is stale.
    assert c.sum_window(10, 100.0)[0] == 0
    assert c.total == 6


def test_bucket_width_and_window_validation():
    with pytest.raises(ValueError):
        BucketedCounter(horizon_s=1, bucket_s=2)
    c = BucketedCounter(horizon_s=60, bucket_s=5)
    c.add(1, 0.0)
    c.add(1, 59.0)
    # A window longer than the horizon is clamped to the horizon (12 buckets of 5 s).
    total, covered = c.sum_window(600, 59.0)
    assert total == 2 and covered == pytest.approx(59.0)
    assert c.rate(60, 0.0, elapsed_s=0.0) == 0.0  # no time elapsed: no division by zero


@pytest.mark.parametrize(
    "values,q,expected",
    [
        ([], 50, None),
        ([7.0], 99, 7.0),
        ([1.0, 2.0], 50, 1.5),
        ([1.0, 2.0, 3.0, 4.0, 5.0], 50, 3.0),
        ([1.0, 2.0, 3.0, 4.0, 5.0], 90, 4.6),
        (list(range(1, 101)), 99, 99.01),
        (list(range(1, 101)), 0, 1.0),
        (list(range(1, 101)), 100, 100.0),
    ],
)
def test_percentile_linear_interpolation(values, q, expected):
    got = percentile(values, q)
    assert got == (None if expected is None else pytest.approx(expected))


def test_latency_window_time_cutoff_and_cap():
    w = LatencyWindow(window_s=60, max_samples=4)
    for i in range(6):
        w.add(float(i), now=100.0 + i)
    # The cap keeps the last 4 samples (2..5); totals still count all 6.
    assert w.recent(now=105.0) == [2.0, 3.0, 4.0, 5.0]
    assert (w.total_count, w.total_sum) == (6, 15.0)
    # 62 s later only samples newer than now - 60 remain.
    assert w.recent(now=164.5) == [5.0]
    assert w.recent(now=500.0) == []


def test_summarize_scales_and_reports_empty_as_none():
    s = summarize([0.010, 0.020, 0.030], scale=1000.0)
    assert s["p50"] == pytest.approx(20.0) and s["count"] == 3 and s["mean"] == pytest.approx(20.0)
    empty = summarize([])
    assert empty == {"p50": None, "p90": None, "p99": None, "count": 0, "mean": None}
