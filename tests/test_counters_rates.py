"""contracts.counters: counters → deltas and rates (first, ok, reset, saturated, clock_step,
missing), integers end to end, and link utilisation; property tests with hypothesis."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.counters import CounterTracker, RateResult, link_utilisation

K, C = "0x0002c90300a1b2c3/1", "PortXmitData"
U64 = (1 << 64) - 1


def test_first_then_ok_gives_exact_delta_and_rate() -> None:
    t = CounterTracker()
    assert t.update(K, C, 1000, 10.0) == RateResult(None, None, "first")
    r = t.update(K, C, 1600, 12.0)
    assert r == RateResult(600, 300.0, "ok", 2.0)
    assert type(r.delta) is int
    assert t.previous(K, C) == (1600, 12.0)


def test_counters_of_different_keys_and_names_are_independent() -> None:
    t = CounterTracker()
    t.update(K, C, 10, 0.0)
    assert t.update(K, "PortRcvData", 5, 1.0).event == "first"
    assert t.update("other/1", C, 5, 1.0).event == "first"
    assert t.update(K, C, 15, 1.0) == RateResult(5, 5.0, "ok", 1.0)
    assert len(t) == 3
    t.forget(K)
    assert len(t) == 1
    assert t.update(K, C, 20, 2.0).event == "first"
    t.forget("never-seen")  # no error


def test_drop_is_a_reset_without_rate_and_rebaselines() -> None:
    t = CounterTracker()
    t.update(K, C, 5_000, 0.0)
    assert t.update(K, C, 40, 5.0) == RateResult(None, None, "reset", 5.0)  # perfquery -R
    assert t.update(K, C, 140, 10.0) == RateResult(100, 20.0, "ok", 5.0)


def test_saturated_value_gives_no_rate_then_clear_is_a_reset() -> None:
    t = CounterTracker()
    t.update(K, "SymbolErrorCounter", 65_000, 0.0, bits=16)
    assert t.update(K, "SymbolErrorCounter", 65_535, 5.0, bits=16) == RateResult(None, None, "saturated", 5.0)
    assert t.update(K, "SymbolErrorCounter", 65_535, 10.0, bits=16).event == "saturated"
    assert t.update(K, "SymbolErrorCounter", 3, 15.0, bits=16).event == "reset"
    assert t.update(K, "SymbolErrorCounter", 7, 20.0, bits=16).delta == 4


def test_saturated_flag_from_the_source_is_honoured() -> None:
    t = CounterTracker()
    t.update(K, "PortXmitWait", 10, 0.0, bits=32)
    assert t.update(K, "PortXmitWait", 20, 1.0, bits=32, saturated=True).event == "saturated"
    assert t.update(K, "PortXmitData", U64, 0.0).event == "saturated"  # first read already at the top


def test_legacy_32_bit_data_counter_saturates_at_2_pow_32_minus_1() -> None:
    t = CounterTracker()
    t.update(K, C, (1 << 32) - 10, 0.0, bits=32)
    assert t.update(K, C, (1 << 32) - 1, 1.0, bits=32).event == "saturated"
    with pytest.raises(ValueError, match="outside"):
        t.update(K, C, 1 << 32, 2.0, bits=32)


@pytest.mark.parametrize("ts2", [100.0, 99.0, 100.0 + 301.0])
def test_clock_step_backwards_equal_or_long_gap_gives_no_rate(ts2: float) -> None:
    t = CounterTracker(max_gap_s=300.0)
    t.update(K, C, 1, 100.0)
    assert t.update(K, C, 50, ts2) == RateResult(None, None, "clock_step")
    assert t.previous(K, C) == (50, ts2)  # the new read is the baseline


def test_gap_at_the_limit_still_gives_a_rate() -> None:
    t = CounterTracker(max_gap_s=300.0)
    t.update(K, C, 0, 0.0)
    assert t.update(K, C, 600, 300.0) == RateResult(600, 2.0, "ok", 300.0)


def test_missing_read_keeps_the_baseline() -> None:
    t = CounterTracker()
    t.update(K, C, 100, 0.0)
    assert t.update(K, C, None, 5.0) == RateResult(None, None, "missing")
    assert t.update(K, C, 300, 10.0) == RateResult(200, 20.0, "ok", 10.0)
    assert t.update("new", C, None, 1.0).event == "missing"
    assert t.previous("new", C) is None


@pytest.mark.parametrize(
    ("value", "ts", "bits", "exc"),
    [
        (1.0, 1.0, 64, TypeError),
        (True, 1.0, 64, TypeError),
        (-1, 1.0, 64, ValueError),
        (1 << 64, 1.0, 64, ValueError),
        (1, math.nan, 64, ValueError),
        (1, math.inf, 64, ValueError),
        (0, 1.0, 0, ValueError),
    ],
)
def test_bad_reads_raise_and_leave_the_state_alone(value: object, ts: float, bits: int, exc: type) -> None:
    t = CounterTracker()
    t.update(K, C, 7, 0.0)
    with pytest.raises(exc):
        t.update(K, C, value, ts, bits=bits)  # type: ignore[arg-type]
    assert t.previous(K, C) == (7, 0.0)


def test_bad_max_gap() -> None:
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            CounterTracker(max_gap_s=bad)


def test_huge_values_stay_exact_where_float64_would_not() -> None:
    t = CounterTracker()
    base = (1 << 62) + 1
    t.update(K, C, base, 0.0)
    r = t.update(K, C, base + 3, 1.0)
    assert r.delta == 3
    assert float(base + 3) - float(base) != 3  # what a float64 pipeline would have computed


# --- properties ------------------------------------------------------------------------------------
_steps = st.lists(
    st.tuples(st.integers(min_value=0, max_value=1 << 40), st.floats(min_value=0.001, max_value=60.0)),
    min_size=1,
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(start=st.integers(min_value=0, max_value=(1 << 63)), steps=_steps)
def test_monotone_sequences_give_exact_deltas_summing_to_last_minus_first(
    start: int, steps: list[tuple[int, float]]
) -> None:
    t = CounterTracker()
    value, ts = start, 1_000.0
    assert t.update(K, C, value, ts).event == "first"
    total = 0
    for inc, dt in steps:
        value += inc
        ts += dt
        r = t.update(K, C, value, ts)
        if value == U64:
            assert r.event == "saturated"
            return
        assert r.event == "ok"
        assert r.delta == inc and type(r.delta) is int
        assert r.rate_per_s is not None and math.isclose(r.rate_per_s, inc / (r.dt_s or 1.0))
        total += r.delta
    assert total == value - start


@settings(max_examples=300, deadline=None)
@given(
    values=st.lists(st.one_of(st.none(), st.integers(min_value=0, max_value=U64)), min_size=1, max_size=60)
)
def test_arbitrary_sequences_never_give_negative_deltas(values: list[int | None]) -> None:
    t = CounterTracker()
    prev: int | None = None
    for i, v in enumerate(values):
        r = t.update(K, C, v, float(i))
        if r.delta is not None:
            assert r.delta >= 0 and r.event == "ok"
            assert prev is not None and r.delta == v - prev  # type: ignore[operator]
        if v is not None and prev is not None and v < prev:
            assert r.event == "reset" and r.rate_per_s is None
        if v is not None:
            prev = v


@settings(max_examples=200, deadline=None)
@given(
    start=st.integers(min_value=(1 << 53) + 1, max_value=(1 << 63)),
    incs=st.lists(st.integers(min_value=1, max_value=7), min_size=1, max_size=20),
)
def test_values_past_2_pow_53_keep_unit_deltas(start: int, incs: list[int]) -> None:
    t = CounterTracker()
    t.update(K, C, start, 0.0)
    v = start
    for i, inc in enumerate(incs, 1):
        v += inc
        assert t.update(K, C, v, float(i)).delta == inc


# --- link utilisation -------------------------------------------------------------------------------
def test_link_utilisation_full_edr_link_is_one() -> None:
    rate = 100 * 125_000_000  # "100 Gb/sec (4X EDR)" → bytes/s
    words_per_s = rate // 4
    assert link_utilisation(words_per_s * 5, 5.0, rate) == 1.0
    assert link_utilisation(0, 5.0, rate) == 0.0


@settings(max_examples=200, deadline=None)
@given(
    words=st.integers(min_value=0, max_value=1 << 62),
    dt=st.floats(min_value=0.01, max_value=3600.0),
    gbps=st.sampled_from([10, 20, 40, 56, 100, 200, 400, 800]),
)
def test_link_utilisation_equals_design_formula_in_bits(words: int, dt: float, gbps: int) -> None:
    rate_bytes = gbps * 125_000_000
    design = 32 * words / (dt * rate_bytes * 8)  # DESIGN.md: 32·ΔPortXmitData/(Δt·link rate in bits)
    assert math.isclose(link_utilisation(words, dt, rate_bytes), design, rel_tol=1e-12)


@pytest.mark.parametrize(
    ("words", "dt", "rate", "exc"),
    [
        (-1, 1.0, 1, ValueError),
        (1, 0.0, 1, ValueError),
        (1, math.nan, 1, ValueError),
        (1, 1.0, 0, ValueError),
        (1.0, 1.0, 1, TypeError),
        (1, 1.0, 1.5, TypeError),
    ],
)
def test_link_utilisation_rejects_bad_input(words: object, dt: float, rate: object, exc: type) -> None:
    with pytest.raises(exc):
        link_utilisation(words, dt, rate)  # type: ignore[arg-type]
