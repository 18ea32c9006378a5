"""A probe for load-sensitive tests: `MOTOR_TEST_SLOW_SPAWN_S=0.15 python -m pytest ...`
holds every keeperd spawn of an in-process runner that many real seconds first, in a worker
thread, as a loaded host's slow spawn would (docs/actors.md, "Real work under autojump").

Under MockClock(autojump_threshold=0) the virtual clock runs from deadline to deadline
while a spawn is awaited, so a test that assumes little virtual time passes during real
work fails under the probe where a loaded CI host would fail it now and then. It changes
nothing unless the variable is set; runs of `motor serve` in a subprocess are not slowed
(`MOTOR_FAULTS=forkserver.forked=sleep:S` slows keeperd itself, theirs too), nor the spawns
of a test marked `spawner_itself` (one that tests the spawner's own sending)."""

from __future__ import annotations

import os
import time

import trio

VARIABLE = "MOTOR_TEST_SLOW_SPAWN_S"
MARKER = "spawner_itself"
held = True  # off for the duration of a test marked MARKER (tests/conftest.py)


def install() -> float | None:
    """Slow `KeeperdSpawner.spawn` by the variable's seconds; the delay, or None if unset."""
    if not (value := os.environ.get(VARIABLE)):
        return None
    from motor.execution.keeperd_client import KeeperdSpawner

    delay, real = float(value), KeeperdSpawner.spawn

    async def slow_spawn(self, job_dir):
        if held:
            await trio.to_thread.run_sync(time.sleep, delay)
        return await real(self, job_dir)

    KeeperdSpawner.spawn = slow_spawn
    return delay
