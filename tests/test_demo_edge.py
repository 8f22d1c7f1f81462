"""The demo's serving-site figures (:func:`gpupool.demo_edge.load_summary`) on hand-made requests and
hand-overs: the accounting (served + failed = sent, requests still in flight at the end counted
failed), which requests fall in a reclaim window (both ends included), and which reclaims were
survived; and the summary rows the demo prints from them."""

from __future__ import annotations

import pytest

from broker.kept_leases import Handover
from gpupool.demo_cli import _edge_rows
from gpupool.demo_edge import UNANSWERED, load_summary, no_load_reason
from simulator.load import RequestRecord


def _ok(t: float, ms: float) -> RequestRecord:
    return RequestRecord(t, ms / 1000, True, "127.0.0.1:1")


def _failed(t: float, error: str = "ClientConnectorError") -> RequestRecord:
    return RequestRecord(t, 0.001, False, "127.0.0.1:1", error)


def test_requests_split_into_steady_and_reclaim_windows_and_add_up() -> None:
    # reclaim 1: noticed 110, released 112 (deadline 114): early; reclaim 2: noticed 130, never
    # released, deadline 134 → window to the deadline; an at-risk hand-over with no deadline yet
    # (noticed 150) runs to the end of the load (160)
    hs = [
        Handover("a", "scheduler_preempted:1", 110.0, 114.0, "e", released_at=112.0),
        Handover("b", "scheduler_preempted:2", 130.0, 134.0, "e"),
        Handover("c", "at_risk", 150.0, None, "e", released_at=151.0),
        Handover("old", "scheduler_preempted:0", 99.0, 103.0, "e", released_at=100.0),  # before the load
    ]
    records = [
        _ok(100.0, 5),
        _ok(109.999, 6),
        _ok(110.0, 50),  # window start, included
        _ok(112.0, 40),  # window end, included
        _ok(112.001, 7),
        _failed(133.0),  # inside reclaim 2
        _ok(134.0, 30),  # its deadline, included
        _ok(134.5, 8),
        _ok(150.5, 20),
        _failed(159.0, "no_endpoint"),  # outside every window: steady
    ]
    counts = {"reclaims": 2, "expired": 1, "lost": 1, "revoked": 0, "renewals": 9}
    s = load_summary("edge-a", 50.0, 2, 1, 12, records, hs, 100.0, 160.0, counts)
    assert s.losses == {"expired": 1, "lost": 1}
    assert (s.sent, s.served, s.failed) == (12, 8, 4)
    assert s.failed_by == {"ClientConnectorError": 1, "no_endpoint": 1, UNANSWERED: 2}
    assert sum(s.failed_by.values()) == s.failed and s.served + s.failed == s.sent
    assert (s.reclaim_sent, s.reclaim_failed) == (5, 1)  # 110, 112, 133, 134, 150.5
    assert (s.steady_sent, s.steady_failed) == (5, 1)  # 100, 109.999, 112.001, 134.5, 159
    assert s.steady_sent + s.reclaim_sent == len(records)
    assert s.reclaim_p50_s == pytest.approx(0.030) and s.reclaim_p99_s == pytest.approx(0.050)
    assert s.steady_p50_s == pytest.approx(0.006) and s.steady_p99_s == pytest.approx(0.008)
    # "old" was noticed before the load began; "b" was not released and had a failure; "c", at
    # risk (no deadline yet), was released with none failed
    assert (s.reclaims, s.reclaims_with_deadline, s.released_early, s.reclaims_survived) == (3, 2, 2, 2)
    assert s.load_s == 60.0


def test_a_failed_request_inside_the_window_or_a_late_release_is_not_survived() -> None:
    h = Handover("a", "scheduler_preempted:1", 10.0, 14.0, "e", released_at=12.0)
    at_end = load_summary("s", 1.0, 1, 1, 2, [_ok(11.0, 5), _failed(12.0)], [h], 0.0, 20.0)
    assert at_end.reclaims_survived == 0 and at_end.reclaim_failed == 1
    after = load_summary("s", 1.0, 1, 1, 2, [_ok(11.0, 5), _failed(12.001)], [h], 0.0, 20.0)
    assert after.reclaims_survived == 1 and after.steady_failed == 1
    late = Handover("a", "scheduler_preempted:1", 10.0, 14.0, "e", released_at=14.0)  # at the deadline: not early
    assert load_summary("s", 1.0, 1, 1, 1, [_ok(11.0, 5)], [late], 0.0, 20.0).reclaims_survived == 0


def test_latencies_count_from_the_send_and_the_drivers_lateness_is_shown_apart() -> None:
    # due at 1.0, sent 30 ms late, answered 40 ms after its due time: 10 ms from the send
    late = RequestRecord(1.0, 0.040, True, "e", "", lag_s=0.030)
    s = load_summary("s", 1.0, 1, 1, 2, [late, _ok(2.0, 5)], [], 0.0, 3.0)
    assert s.steady_p50_s == pytest.approx(0.005) and s.steady_p99_s == pytest.approx(0.010)
    assert s.driver_lag_p99_s == pytest.approx(0.030)


def test_no_request_of_a_kind_gives_no_latency_and_more_records_than_sent_is_refused() -> None:
    s = load_summary("s", 1.0, 1, 1, 1, [_ok(1.0, 5)], [], 0.0, 2.0)
    assert s.reclaim_p50_s is None and s.reclaim_p99_s is None and s.reclaims == 0
    assert s.failed == 0 and s.failed_by == {}
    with pytest.raises(ValueError, match="2 requests finished but only 1 were sent"):
        load_summary("s", 1.0, 1, 1, 1, [_ok(1.0, 5), _ok(1.5, 5)], [], 0.0, 2.0)


def test_summary_rows_show_the_load_or_say_why_none_ran() -> None:
    h = Handover("a", "scheduler_preempted:1", 10.0, 14.0, "e", released_at=12.0)
    s = load_summary("edge-a", 50.0, 2, 2, 3, [_ok(5.0, 4), _ok(11.0, 9)], [h], 0.0, 20.0)
    rows = dict(_edge_rows({"enabled": True, **s.as_dict()}))
    assert rows["edge requests across reclaims"].startswith("edge-a: 50 requests/s over 2 kept leases of 2 GPUs")
    assert rows["  …sent / served / failed"] == f"3 / 2 / 1 ({UNANSWERED}=1)"
    assert rows["  …latency p50 / p99 (sent → answered), steady state"] == "4.0 ms / 4.0 ms (1 requests, 0 failed)"
    assert rows["  …latency p50 / p99 (sent → answered), during reclaims"] == "9.0 ms / 9.0 ms (1 requests, 0 failed)"
    assert rows["  …the load driver's own lateness (due → sent), p99"] == "0.0 ms"
    assert rows["  …reclaims survived (released early, no failed request)"] == "1 / 1 (1 with a deadline)"
    assert rows["  …leases lost without a hand-over"] == "none"
    lost = dict(_edge_rows({"enabled": True, **s.as_dict(), "losses": {"unhealthy": 2, "expired": 1}}))
    assert lost["  …leases lost without a hand-over"] == "expired=1, unhealthy=2"
    none = _edge_rows({"enabled": False, "detail": no_load_reason({"detail": "--scheduler none"})})
    assert len(none) == 1 and "no endpoint to send requests to" in str(none[0][1])
    assert "--scheduler none" in str(none[0][1])
    assert _edge_rows({}) == []
