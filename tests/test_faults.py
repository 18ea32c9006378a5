"""motor/faults.py: the `sleep:S` action of a named point, which the load probe uses."""

from __future__ import annotations

import pytest

from motor import faults


def test_a_sleep_point_sleeps_its_seconds_at_each_pass_and_no_other_point_does(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    monkeypatch.setenv(faults.ENV, "forkserver.forked=sleep:0.15,keeper.status=sleep:2")
    faults.hit("forkserver.forked")
    faults.hit("forkserver.forked")
    faults.hit("forkserver.claimed")
    assert slept == [0.15, 0.15]


async def test_a_sleep_point_in_async_code_blocks_the_loop_as_a_loaded_host_does(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    monkeypatch.setenv(faults.ENV, "setup.begin=sleep:0.5")
    await faults.ahit("setup.begin")
    await faults.ahit("setup.begin", when=False)
    assert slept == [0.5]


def test_an_unknown_action_or_a_sleep_of_no_number_is_an_error_that_names_it(monkeypatch):
    monkeypatch.setenv(faults.ENV, "forkserver.forked=nap:1,setup.begin=sleep:soon")
    with pytest.raises(ValueError, match="unknown action 'nap:1' at forkserver.forked"):
        faults.hit("forkserver.forked")
    with pytest.raises(ValueError, match="'sleep:soon' at setup.begin: not a number of seconds"):
        faults.hit("setup.begin")
