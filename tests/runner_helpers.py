"""Helpers for tests that run the runner in-process (`motor.open_runner`) under MockClock."""

from __future__ import annotations

import inspect
import math
import time
from contextlib import aclosing, contextmanager

import trio

import motor
from motor.records import JobRequest


def embedded_config(tmp_path, **kw) -> motor.RunnerConfig:
    """A runner on a temporary state dir: no pinning, no disk floor, mock wall clock."""
    base = dict(state_dir=str(tmp_path / "state"), isolation="none", free_space_floor_bytes=0,
                clock=motor.MockWallClock())
    base.update(kw)
    return motor.RunnerConfig(**base)


#: A queue-wait budget for the queued jobs of a test that does not test budgets. Under
#: MockClock(autojump_threshold=0) the virtual clock runs from deadline to deadline while
#: the host does real work (a spawn through keeperd), so behind a few spawns on a loaded
#: host the default 30 minutes ran out (stop 81: each spawn held 0.15-0.5 s real by a
#: probe, five tests found their queued jobs `refused_before_start`).
PATIENT_S = 30 * 24 * 3600.0


@contextmanager
def at_real_speed(clock: trio.testing.MockClock):
    """For the block, the virtual clock runs at real speed and does not jump: real work in
    it (a start's spawn through keeperd) takes its own time, not the minutes of virtual
    time the jumps from deadline to deadline make of it on a loaded host (docs/actors.md,
    "Real work under autojump"). After it, the clock is still again and jumps as before."""
    threshold, rate = clock.autojump_threshold, clock.rate
    clock.autojump_threshold, clock.rate = math.inf, 1.0
    try:
        yield
    finally:
        clock.rate, clock.autojump_threshold = rate, threshold


def barrier_job(path, *, exit_code: int = 0, say: bool = False, **kw) -> JobRequest:
    """A job that waits until `path` exists (the test's barrier), then exits."""
    wait = f"while [ ! -e {path} ]; do sleep 0.02; done"
    script = f"echo waiting; {wait}; echo released; exit {exit_code}" if say else f"{wait}; exit {exit_code}"
    return JobRequest(command=["sh", "-c", script], **kw)


async def event_of(runner, job_id: str, tag: str):
    """The first event of kind `tag` in the job's stream (fails if it ends first)."""
    async with aclosing(runner.events(job_id)) as events:
        async for event in events:
            if event.__struct_config__.tag == tag:
                return event
            assert event.__struct_config__.tag != "terminal", event
    raise AssertionError(f"no {tag} event")


async def terminal_of(runner, job_id: str) -> dict:
    """The job's terminal record (follows the job until it ends)."""
    return (await event_of(runner, job_id, "terminal")).record


#: The real seconds `bounded` also waits for. Under MockClock(autojump_threshold=0)
#: virtual time jumps from deadline to deadline while every task waits, and a job actor's
#: set-up runs in a worker thread (JobDeps.offload): a bound of virtual seconds alone ran
#: out during one thread hop (the budget test of tests/scheduling/test_runner_rules.py:
#: TooSlowError in 1 run of 20-70, its job actor found in `to_thread_run_sync`).
REAL_BOUND_S = 60.0


async def bounded(fn, timeout: float):
    """`await fn()`, given up (TooSlowError) once `timeout` seconds of trio's clock and
    REAL_BOUND_S real ones have both passed; `fn` is called again after each virtual
    bound, so it must be safe to repeat (a follow from the first event, a poll)."""
    start = time.monotonic()
    while True:
        with trio.move_on_after(timeout):
            return await fn()
        if time.monotonic() - start > REAL_BOUND_S:
            raise trio.TooSlowError


async def in_state(runner, job_id: str, state: str) -> bool:
    return (await runner.get(job_id)).state == state


async def poll_until(predicate, timeout: float, interval: float = 0.02):
    """Poll `predicate` (async, or plain) every `interval` seconds until it holds, within
    `bounded(timeout)`: its value."""
    async def poll():
        while not (value := await _value(predicate())):
            await trio.sleep(interval)
        return value

    return await bounded(poll, timeout)


async def _value(result):
    return await result if inspect.isawaitable(result) else result
