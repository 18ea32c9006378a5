import pytest
from hypothesis import given, strategies as st

from actors import RestartBudget


def test_within_intensity_is_allowed():
    b = RestartBudget(intensity=3, period=5.0)
    assert [b.record(t) for t in (0.0, 1.0, 2.0)] == [True, True, True]


def test_exceeding_intensity_within_period_fails():
    b = RestartBudget(intensity=3, period=5.0)
    assert [b.record(t) for t in (0.0, 1.0, 2.0, 3.0)] == [True, True, True, False]


def test_restarts_spread_beyond_period_are_fine():
    b = RestartBudget(intensity=3, period=5.0)
    assert all(b.record(t * 2.0) for t in range(100))


def test_window_boundary_is_exclusive():
    b = RestartBudget(intensity=1, period=5.0)
    assert b.record(0.0)
    assert not b.record(4.999)
    b2 = RestartBudget(intensity=1, period=5.0)
    assert b2.record(0.0)
    assert b2.record(5.0)  # the first restart has aged out exactly at period


def test_intensity_zero_never_allows_restart():
    assert not RestartBudget(intensity=0, period=1.0).record(0.0)


def test_used_and_reset():
    b = RestartBudget(intensity=3, period=5.0)
    b.record(0.0)
    b.record(1.0)
    assert b.used(1.0) == 2
    assert b.used(5.5) == 1
    b.reset()
    assert b.used(5.5) == 0


def test_invalid_arguments():
    with pytest.raises(ValueError):
        RestartBudget(intensity=-1)
    with pytest.raises(ValueError):
        RestartBudget(period=0)


@given(
    intensity=st.integers(0, 5),
    period=st.floats(0.1, 10),
    gaps=st.lists(st.floats(0, 20), max_size=30),
)
def test_matches_sliding_window_model(intensity, period, gaps):
    b = RestartBudget(intensity=intensity, period=period)
    now = 0.0
    history: list[float] = []
    for gap in gaps:
        now += gap
        history.append(now)
        in_window = [t for t in history if now - t < period]
        assert b.record(now) == (len(in_window) <= intensity)
