"""The runner reads the memory ceiling at start-up and at each maintenance pass."""

from __future__ import annotations

import json
import pytest

import motor
from motor.maintenance import RunPass
from motor.records import JobRequest, RefusedError
from runner_helpers import terminal_of as finish

GiB = 1024**3


def config(tmp_path, **kw):
    # maintenance passes only when the test asks for one (RunPass)
    return motor.RunnerConfig(state_dir=str(tmp_path / "state"), isolation="none",
                              free_space_floor_bytes=0, clock=motor.MockWallClock(),
                              maintenance_interval_s=10**9, **kw)


async def test_maintenance_picks_up_a_changed_declaration_without_changing_the_slice(
        tmp_path, autojump_clock):
    capacity = tmp_path / "capacity.json"
    capacity.write_text(json.dumps({"jobs_min_bytes": 32 * GiB}))
    async with motor.open_runner(config(tmp_path, capacity_file=str(capacity))) as runner:
        before = runner.host.ceiling
        ok = await runner.submit(JobRequest(command=["true"], weight_hint=1))
        assert (await finish(runner, ok.job_id))["state"] == "succeeded"

        capacity.write_text(json.dumps({"jobs_min_bytes": 8 * GiB}))
        # not re-read on admission: the next job is still decided with the old declaration
        still = await runner.submit(JobRequest(command=["true"], weight_hint=1))
        await finish(runner, still.job_id)

        result = await runner.actor("maintenance").call(RunPass())
        assert result["ceiling_changed"] is True
        with pytest.raises(RefusedError) as info:
            await runner.submit(JobRequest(command=["true"], weight_hint=1))
        assert info.value.refusal.code == "workspace_setup_failed"
        assert "jobs_min_bytes" in info.value.refusal.detail
        health = await runner.health()
        assert health["admission_refusals"] == {"workspace_setup_failed": 1}
        # the slice figure did not change with the declaration
        assert runner.host.ceiling.slice_max_bytes == before.slice_max_bytes
        assert runner.host.ceiling.declared_min_bytes == 8 * GiB

        capacity.write_text(json.dumps({"jobs_min_bytes": 16 * GiB}))
        await runner.actor("maintenance").call(RunPass())
        again = await runner.submit(JobRequest(command=["true"], weight_hint=1))
        assert (await finish(runner, again.job_id))["state"] == "succeeded"


async def test_an_unreadable_or_malformed_capacity_file_is_a_warning_not_a_crash(
        tmp_path, autojump_clock, caplog):
    capacity = tmp_path / "capacity.json"
    capacity.write_text("{not json")
    async with motor.open_runner(config(tmp_path, capacity_file=str(capacity))) as runner:
        job = await runner.submit(JobRequest(command=["true"], weight_hint=1))
        assert (await finish(runner, job.job_id))["state"] == "succeeded"
    assert "treating jobs_min_bytes as undeclared" in caplog.text


def _cgroups_unavailable() -> str | None:
    import os

    from motor.isolation import IsolationError
    from motor.isolation.cgroup import detect

    if os.geteuid() != 0:
        return "needs root to create cgroups"
    try:
        detect()
    except IsolationError as exc:
        return f"no writable cgroups on this host: {exc}"
    return None


@pytest.mark.skipif(_cgroups_unavailable() is not None, reason=_cgroups_unavailable() or "")
async def test_maintenance_picks_up_a_changed_ceiling_before_the_next_job_is_decided(
        tmp_path, autojump_clock):
    """The jobs group (a private cgroup parent here) gets a lower memory limit: the next
    job after a maintenance pass is decided with it, not any job before the pass."""
    import itertools
    import os

    parent = f"motor-test-{os.getpid()}-ceiling-{next(itertools.count())}"
    capacity = tmp_path / "capacity.json"
    capacity.write_text(json.dumps({"jobs_min_bytes": 32 * GiB}))
    cfg = config(tmp_path, capacity_file=str(capacity))
    cfg.isolation = "cgroup"
    cfg.cgroup_parent = parent
    try:
        async with motor.open_runner(cfg) as runner:
            limit_file = next(p for p in runner.host.backend.flavour.parent_paths()
                              if "/memory/" in p) + "/memory.limit_in_bytes"
            first = await runner.submit(JobRequest(command=["true"], weight_hint=1))
            assert (await finish(runner, first.job_id))["state"] == "succeeded"

            with open(limit_file, "w") as f:
                f.write(str(8 * GiB))
            before_pass = await runner.submit(JobRequest(command=["true"], weight_hint=1))
            assert (await finish(runner, before_pass.job_id))["state"] == "succeeded"

            await runner.actor("maintenance").call(RunPass())
            with pytest.raises(RefusedError) as info:
                await runner.submit(JobRequest(command=["true"], weight_hint=1))
            assert info.value.refusal.code == "workspace_setup_failed"
            assert "memory limit" in info.value.refusal.detail

            with open(limit_file, "w") as f:
                f.write(str(20 * GiB))
            await runner.actor("maintenance").call(RunPass())
            big = await runner.submit(JobRequest(command=["true"], weight_hint=1,
                                                 memory_max_bytes=32 * GiB))
            assert big.memory_max_bytes == 20 * GiB  # clamped to the group, never above it
            assert (await finish(runner, big.job_id))["state"] == "succeeded"
    finally:  # (keeperd's spare groups may still hold their processes: kill, then remove)
        from private_cgroup import remove_private_parent

        remove_private_parent(parent)
