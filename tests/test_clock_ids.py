"""Job ids (motor.clock.uuid7): strictly increasing within a process, whatever the clock."""

from __future__ import annotations

import uuid

from hypothesis import given, settings, strategies as st

from motor.clock import WallClock, uuid7, uuid7_ms


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


class _SteppedBack(WallClock):
    """A wall clock stepped back an hour behind the last id made, and standing there."""

    def __init__(self, at_ms: int):
        self.at_ms = at_ms

    def now_ms(self) -> int:
        return self.at_ms


async def test_a_runner_whose_clock_stepped_back_accepts_jobs_with_increasing_ids(
        tmp_path, monkeypatch):
    """Through the runner (its dispatcher mints the ids): the last id's counter staged near
    its end (`motor.clock._last`), the runner's wall clock an hour behind it; a batch and
    single submits across the counter's end get increasing ids, and every job runs."""
    import motor
    from motor import clock

    last_ms = clock._last[0] or 1_900_000_000_000
    monkeypatch.setattr(clock, "_last", [last_ms, 0xFFA])
    config = motor.RunnerConfig(state_dir=str(tmp_path / "state"), isolation="none",
                                free_space_floor_bytes=0, clock=_SteppedBack(last_ms - 3_600_000))
    async with motor.open_runner(config) as runner:
        batch = await runner.submit_many([{"command": ["true"], "workspace": f"w{i}"}
                                          for i in range(6)])
        ids = [r.job_id for r in batch]
        ids += [(await runner.submit({"command": ["true"], "workspace": f"v{i}"})).job_id
                for i in range(6)]
        assert ids == sorted(ids) and len(set(ids)) == 12, ids
        assert uuid7_ms(ids[-1]) == last_ms + 1  # the counter's end moved the millisecond on
        for job_id in ids:
            async for _ in runner.events(job_id):
                pass
            assert (await runner.get(job_id)).state == "succeeded"
