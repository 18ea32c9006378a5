"""Job ids (motor.clock.uuid7): strictly increasing within a process, whatever the clock."""

from __future__ import annotations

import uuid

from hypothesis import given, settings, strategies as st

from motor.clock import uuid7, uuid7_ms


def test_ten_thousand_ids_in_one_millisecond_keep_increasing():
    """Stop 58: past 4,096 ids at or before one millisecond (a runner whose wall clock was
    stepped back makes all its ids there until the clock catches up) the 12-bit counter
    wrapped, and the ids stopped increasing; now the millisecond moves on instead."""
    start = 1_800_000_000_000
    ids = [uuid7(start) for _ in range(10_000)]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert start <= uuid7_ms(ids[-1]) <= start + 3  # at most 10,000 / 4,096 ms ahead
    assert all(uuid.UUID(i).version == 7 for i in ids[::997])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(min_value=-10_000, max_value=10_000),
                          st.integers(min_value=1, max_value=3000)), max_size=8))
def test_ids_increase_through_any_steps_of_the_clock(steps):
    now, ids = 1_900_000_000_000, [uuid7(1_900_000_000_000)]
    for step, count in steps:
        now += step
        ids += [uuid7(now) for _ in range(count)]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
