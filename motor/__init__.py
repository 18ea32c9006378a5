"""motor: a build-job runner for shared build hosts, on trio.

The embedding API (see docs/embedding.md):

    async with motor.open_runner(motor.RunnerConfig(state_dir=..., isolation="none")) as runner:
        job = await runner.submit(motor.JobRequest(command=["make"], workspace="app"))
        async for event in runner.events(job.job_id):
            ...

`import motor` is cheap: the names below are imported on first use (PEP 562), so the
command-line client (`motor run`, `motor status`, ...) never loads the runner, trio or
hypercorn (docs/cli.md, "Start-up cost").
"""

from __future__ import annotations

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: `import typing` costs milliseconds

#: public name -> the module that defines it
_LAZY = {
    "MockWallClock": "motor.clock",
    "WallClock": "motor.clock",
    "ConfigError": "motor.config",
    "RunnerConfig": "motor.config",
    "JobRecord": "motor.records",
    "JobRequest": "motor.records",
    "Refusal": "motor.records",
    "RefusedError": "motor.records",
    "Runner": "motor.runner",
    "StartupError": "motor.runner",
    "open_runner": "motor.runner",
}

__all__ = sorted(_LAZY)

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from .clock import MockWallClock, WallClock
    from .config import ConfigError, RunnerConfig
    from .records import JobRecord, JobRequest, Refusal, RefusedError
    from .runner import Runner, StartupError, open_runner


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'motor' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
