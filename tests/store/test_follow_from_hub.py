"""A follower takes the events committed after it caught up from the ChangeHub, not from
the events table (issue 14), and gets exactly what is stored, in order, once: also when it
fell behind what the hub keeps (then it reads the database again), and a second follower
that comes later gets the same."""

from __future__ import annotations

from contextlib import aclosing

import trio

import motor
from motor.records import JobRequest, Output, Terminal, decode_event
from motor.store import hub as store_hub
from motor.store.hub import ChangeHub
from runner_helpers import barrier_job, embedded_config


def _stored(runner, job_id: str) -> list:
    return [decode_event(raw) for raw in runner.db.events_from(job_id, 0)]


def _gated_job(gate, lines: int) -> JobRequest:
    """Says `first`, waits for `gate`, then writes `lines` lines a few ms apart."""
    wait = f"while [ ! -e {gate} ]; do sleep 0.01; done"
    return JobRequest(command=["sh", "-c", f"echo first; {wait}; i=0; while [ $i -lt {lines} ];"
                               " do i=$((i+1)); echo line$i; sleep 0.02; done"], workspace="w")


async def _until(predicate) -> None:
    with trio.fail_after(60):
        while not predicate():
            await trio.sleep(0.01)


async def test_a_caught_up_follower_reads_no_events_from_the_database(tmp_path):
    gate = tmp_path / "gate"
    async with motor.open_runner(embedded_config(tmp_path, clock=None)) as runner:
        job = await runner.submit(_gated_job(gate, 5))
        statements: list[str] = []
        got = []
        async with aclosing(runner.events(job.job_id)) as events:
            async for event in events:
                got.append(event)
                if isinstance(event, Output) and "first" in event.data:
                    break
            runner.db.conn.set_trace_callback(statements.append)
            gate.touch()
            async for event in events:
                got.append(event)
            runner.db.conn.set_trace_callback(None)
        stored = _stored(runner, job.job_id)
    assert isinstance(got[-1], Terminal) and got[-1].record["state"] == "succeeded"
    assert got == stored
    assert "".join(e.data for e in got if isinstance(e, Output)).split() == [
        "first", *(f"line{i}" for i in range(1, 6))]
    reads = [s for s in statements if "FROM events" in s]
    assert reads == [], reads  # the output and the terminal event came from the hub


async def test_a_follower_behind_what_the_hub_keeps_reads_the_database_and_misses_nothing(
        tmp_path, monkeypatch):
    monkeypatch.setattr(store_hub, "RECENT_MAX", 1)
    gate = tmp_path / "gate"
    async with motor.open_runner(embedded_config(tmp_path, clock=None)) as runner:
        job = await runner.submit(_gated_job(gate, 6))
        got, late = [], []
        async with aclosing(runner.events(job.job_id)) as events:
            async for event in events:
                got.append(event)
                if isinstance(event, Output) and "first" in event.data:
                    break
            gate.touch()  # the job writes on while this follower reads nothing
            await _until(lambda: runner.db.get(job.job_id).state == "succeeded")
            async for event in events:
                got.append(event)
        async with aclosing(runner.events(job.job_id)) as events:  # a later follower
            async for event in events:
                late.append(event)
        stored = _stored(runner, job.job_id)
    assert got == stored == late
    assert [e.seq for e in got] == list(range(1, len(got) + 1))
    assert "".join(e.data for e in got if isinstance(e, Output)).split()[-1] == "line6"


async def test_two_followers_of_one_job_get_the_same_events(tmp_path):
    barrier = tmp_path / "go"
    async with motor.open_runner(embedded_config(tmp_path, clock=None)) as runner:
        job = await runner.submit(barrier_job(barrier, say=True, workspace="w"))
        seen: dict[str, list] = {"a": [], "b": []}

        async def follow(name: str) -> None:
            async with aclosing(runner.events(job.job_id)) as events:
                async for event in events:
                    seen[name].append(event)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(follow, "a")
            await _until(lambda: any(isinstance(e, Output) for e in seen["a"]))
            nursery.start_soon(follow, "b")
            await _until(lambda: any(isinstance(e, Output) for e in seen["b"]))
            barrier.touch()
        stored = _stored(runner, job.job_id)
        assert runner.hub._recent == {}  # every follower gone: nothing kept
    assert seen["a"] == seen["b"] == stored


def test_the_hub_keeps_events_only_while_followed_and_trims_the_oldest(monkeypatch):
    monkeypatch.setattr(store_hub, "RECENT_MAX_BYTES", 200)
    hub = ChangeHub()
    out = [Output(seq=i, stream="stdout", data=f"{i}" * 40) for i in range(1, 6)]
    hub.committed("j", out[:1])
    assert hub.recent("j", 1) is None  # not followed: nothing kept
    hub.follow("j")
    hub.follow("j")
    assert hub.recent("j", 2) == []
    hub.committed("j", out[1:3])
    assert [decode_event(raw) for raw in hub.recent("j", 2)] == out[1:3]
    assert [decode_event(raw) for raw in hub.recent("j", 3)] == out[2:3]
    hub.committed("j", out[3:])  # over 200 bytes: the oldest go, the newest two stay
    assert hub.recent("j", 3) is None
    assert [decode_event(raw) for raw in hub.recent("j", 4)] == out[3:]
    hub.unfollow("j")
    assert hub.recent("j", 5) is not None
    hub.unfollow("j")
    assert hub.recent("j", 5) is None
