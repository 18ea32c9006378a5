"""Helpers for tests that run the runner in-process (`motor.open_runner`) under MockClock."""

from __future__ import annotations

from contextlib import aclosing

import motor
from motor.records import JobRequest


def embedded_config(tmp_path, **kw) -> motor.RunnerConfig:
    """A runner on a temporary state dir: no pinning, no disk floor, mock wall clock."""
    base = dict(state_dir=str(tmp_path / "state"), isolation="none", free_space_floor_bytes=0,
                clock=motor.MockWallClock())
    base.update(kw)
    return motor.RunnerConfig(**base)


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
