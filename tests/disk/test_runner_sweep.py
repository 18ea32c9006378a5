"""The daily Cargo sweep in the embedded runner: an incomplete estimate is repaired and
measured again before the sweep decides (the seed: "the guard, daily sweep and incremental
pressure pass claim and repair that workspace, then measure again before deciding")."""

from __future__ import annotations

import os
import stat
import time

import motor
from motor.disk import cargo, sizes
from motor.disk.actor import Listing
from motor.maintenance import RunPass
from motor.records import JobRequest

from runner_helpers import embedded_config, terminal_of

from .test_trees import H1, make_target

HOUR = 3600 * 1000


def unprivileged_scandir(monkeypatch, under):
    """Fault injection: the runner reads the test's tree as an unprivileged user would, so a
    directory without owner read+search permission cannot be listed (tests run as root)."""
    def unprivileged(real):
        def listing(path="."):
            if isinstance(path, (str, bytes, os.PathLike)) and os.fsdecode(path).startswith(
                    str(under)):
                mode = os.lstat(path).st_mode
                if stat.S_ISDIR(mode) and mode & 0o500 != 0o500:
                    raise PermissionError(13, "Permission denied", os.fsdecode(path))
            return real(path)
        return listing

    # the size walk lists with os.listdir, the Cargo sweep with os.scandir
    monkeypatch.setattr(os, "scandir", unprivileged(os.scandir))
    monkeypatch.setattr(os, "listdir", unprivileged(os.listdir))
    assert sizes.os.listdir is os.listdir and cargo.os.scandir is os.scandir


async def _row(runner, name):
    for row in await runner.actor("disk").call(Listing()):
        if row["name"] == name:
            return row
    return None


async def test_daily_sweep_repairs_and_remeasures_an_incomplete_estimate_first(
        tmp_path, autojump_clock, monkeypatch):
    config = embedded_config(tmp_path, maintenance_interval_s=10**9)
    ws = tmp_path / "state" / "workspaces" / "ws"
    deps = ws / "target" / "debug" / "deps"
    async with motor.open_runner(config) as runner:
        # a job leaves stale Cargo units (72 h old) and narrows its target's permissions
        job = await runner.submit(JobRequest(command=["true"], workspace="ws"))
        assert (await terminal_of(runner, job.job_id))["state"] == "succeeded"
        make_target(ws, old_ms=time.time_ns() // 1_000_000 - 72 * HOUR)
        job = await runner.submit(JobRequest(command=["chmod", "000", str(deps)], workspace="ws"))
        assert (await terminal_of(runner, job.job_id))["state"] == "succeeded"
    assert stat.S_IMODE(deps.stat().st_mode) == 0  # (as root, the idle walk could read it)
    unprivileged_scandir(monkeypatch, tmp_path)
    async with motor.open_runner(config) as runner:  # a restart: the size cache starts empty
        # the first maintenance pass measures lazily (incomplete: deps/ is unreadable) and
        # runs the first sweep of the day: it must repair and measure again before deciding
        await runner.actor("maintenance").call(RunPass())
        assert not (deps / f"libserde-{H1}.rlib").exists()  # the stale unit behind deps/
        assert not (deps / "mytool-fedcba9876543210").exists()
        assert (deps / "README-not-a-unit").exists()  # unknown files stay
        assert (deps / "libfresh-00112233aabbccdd.rlib").exists()  # a fresh unit stays
        row = await _row(runner, "ws")
        assert row["complete"] is True, row  # measured again after the repair
