"""motor: a build-job runner for shared build hosts, on trio.

The embedding API (see docs/embedding.md):

    async with motor.open_runner(motor.RunnerConfig(state_dir=..., isolation="none")) as runner:
        job = await runner.submit(motor.JobRequest(command=["make"], workspace="app"))
        async for event in runner.events(job.job_id):
            ...
"""

from .clock import MockWallClock, WallClock
from .config import ConfigError, RunnerConfig
from .records import JobRecord, JobRequest, Refusal, RefusedError
from .runner import Runner, StartupError, open_runner

__all__ = [
    "ConfigError",
    "JobRecord",
    "JobRequest",
    "MockWallClock",
    "Refusal",
    "RefusedError",
    "Runner",
    "RunnerConfig",
    "StartupError",
    "WallClock",
    "open_runner",
]
