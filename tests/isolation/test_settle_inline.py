"""The end of a cgroup job through a real runner (issue 14): a job whose groups are empty
when its keeper reports the exit is settled on the event loop (`settle_quick`: no thread
hop), with its CPU time measured, from the facts keeperd read into its status.json (the
runner reads none of its groups); a job that leaves a process in its groups has no such
facts and goes through the full `settle` in a thread, which kills that process."""

from __future__ import annotations

import psutil
import pytest
import trio

import motor
from isolation_helpers import needs_cgroups, remove_parent
from motor.execution import jobdir, joblog
from motor.isolation import cgroup
from motor.isolation.cgroup import open_cgroup_backend
from private_cgroup import private_parent_name
from runner_helpers import terminal_of

pytestmark = needs_cgroups

SPIN = "i=0; while [ $i -lt 30000 ]; do i=$((i+1)); done"


@pytest.fixture
def parent():
    name = private_parent_name()
    yield name
    try:
        remove_parent(open_cgroup_backend(parent=name))
    except Exception:  # noqa: BLE001 - best effort: the group may never have been made
        pass


async def test_an_empty_group_settles_inline_and_a_leftover_goes_to_the_thread(
        tmp_path, parent, monkeypatch):
    offloaded: list[str] = []
    full_close = jobdir.close

    def spy(job_dir, spawner, backend, job_id, status, who=""):
        offloaded.append(job_id)
        return full_close(job_dir, spawner, backend, job_id, status, who)

    monkeypatch.setattr(jobdir, "close", spy)
    read_by_runner: list[str] = []  # the groups whose facts the runner read itself
    own_collect = cgroup.CgroupV1.collect

    def collect_spy(self, job_id, signal):
        read_by_runner.append(job_id)
        return own_collect(self, job_id, signal)

    monkeypatch.setattr(cgroup.CgroupV1, "collect", collect_spy)
    config = motor.RunnerConfig(state_dir=str(tmp_path / "state"), isolation="cgroup",
                                cgroup_parent=parent, free_space_floor_bytes=0, max_weight=1)
    leftover_file = tmp_path / "leftover.pid"
    async with motor.open_runner(config) as runner:
        plain = await runner.submit(motor.JobRequest(
            command=["sh", "-c", SPIN], workspace="w", weight_hint=1))
        ended = await terminal_of(runner, plain.job_id)
        # escapes the job's process group (setsid) and its marker (env -i), not its groups;
        # the job ends only once the leftover runs without the marker (it wrote its pid)
        script = (f"setsid env -i /bin/sh -c 'echo $$ > {leftover_file}; exec /bin/sleep 60'"
                  " </dev/null >/dev/null 2>&1 &"
                  f" while [ ! -s {leftover_file} ]; do sleep 0.01; done")
        escaping = await runner.submit(motor.JobRequest(
            command=["sh", "-c", script], workspace="w", weight_hint=1))
        escaped = await terminal_of(runner, escaping.job_id)
    assert ended["state"] == "succeeded" and ended["reservation_use"]["cpu_time_ms"] > 0
    assert escaped["state"] == "succeeded"
    assert offloaded == [escaping.job_id]  # the plain job's end never left the event loop
    jobs = tmp_path / "state" / "jobs"
    facts = joblog.read_status(jobs / plain.job_id)["isolation_facts"]
    assert facts["cpu_time_ms"] == ended["reservation_use"]["cpu_time_ms"]
    assert facts["oom_killed"] is False and facts["memory_peak"] > 0
    assert "isolation_facts" not in joblog.read_status(jobs / escaping.job_id)
    assert read_by_runner == [escaping.job_id]  # keeperd read the plain job's groups
    leftover = int(leftover_file.read_text())
    with trio.fail_after(10):  # killed by the full settle (then reaped by keeperd)
        while _running(leftover):
            await trio.sleep(0.02)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
