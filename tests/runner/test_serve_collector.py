"""`motor serve` tunes the cyclic garbage collector once its tree is up (issue 14): what lives
then is frozen out of collections and young collections come less often; an embedded runner
(`open_runner`) leaves the embedding program's collector alone."""

from __future__ import annotations

import gc
import os
import signal

import trio

import motor
from motor import runner as runner_module
from motor.client import Client


def _config(tmp_path) -> motor.RunnerConfig:
    return motor.RunnerConfig(state_dir=str(tmp_path / "state"), isolation="none",
                              free_space_floor_bytes=0)


def test_serve_freezes_what_lives_at_start_and_raises_the_young_threshold(tmp_path):
    before = gc.get_threshold()
    gc.unfreeze()
    seen: dict = {}

    async def main():
        config = _config(tmp_path)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(runner_module.serve_forever, config)
            while not config.socket_path.exists():
                await trio.sleep(0.01)
            health = await trio.to_thread.run_sync(lambda: Client(config.socket_path).health())
            seen["health"] = health["status"]
            seen["threshold"] = gc.get_threshold()
            seen["frozen"] = gc.get_freeze_count()
            os.kill(os.getpid(), signal.SIGTERM)  # serve_forever's own signal receiver stops it

    try:
        trio.run(main)
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
    assert seen["health"] == "ok"
    assert seen["threshold"] == runner_module.GC_THRESHOLDS != before
    assert seen["frozen"] > 10_000  # the modules and everything the tree made at start


async def test_an_embedded_runner_leaves_the_collector_as_it_was(tmp_path):
    before = gc.get_threshold()
    frozen = gc.get_freeze_count()
    async with motor.open_runner(_config(tmp_path)) as runner:
        job = await runner.submit(motor.JobRequest(command=["true"], workspace="w"))
        async for _ in runner.events(job.job_id):
            pass
        assert gc.get_threshold() == before and gc.get_freeze_count() == frozen
