"""The keeper on a full job-directory filesystem (a real tiny tmpfs): it holds output and
the exit status in memory and retries, and neither it nor the job dies of it."""

from __future__ import annotations

import pytest
from keeper_helpers import stream_bytes, wait_until
from keeper_tracking import tracked_keepers, write_job_dir

from motor.execution import process_alive, read_keeper, read_status
from tmpfs_helpers import Filler, needs_tmpfs, tmpfs

pytestmark = needs_tmpfs


@pytest.mark.parametrize("mode", ["forkserver", "keeperd"])
async def test_output_and_status_wait_for_space_and_nothing_is_lost(mode, tmp_path, workspace):
    with tmpfs(tmp_path / "state", size="1m", nr_inodes=64) as state:
        filler = Filler(state)
        try:
            async with tracked_keepers(mode, state) as jobs:
                job_dir = write_job_dir(
                    state / "jobs" / "full", "full",
                    ["sh", "-c", "echo first; while [ ! -e go ]; do sleep 0.01; done; "
                                 "head -c 100000 /dev/zero | tr '\\0' x; echo; exit 0"], workspace, timeout_s=15.0)
                handle = await jobs.spawn(job_dir)
                await wait_until(lambda: (read_keeper(job_dir) or {}).get("job_pid"))
                await wait_until(lambda: stream_bytes(job_dir, "stdout") == b"first\n")
                kept = read_keeper(job_dir)
                filler.blocks()
                filler.inodes()
                (workspace / "go").touch()
                # the job writes 100 kB nobody can store, exits; the keeper outlives it, holding both
                await wait_until(lambda: not process_alive(kept["job_pid"], kept["job_create_time"]))
                assert process_alive(handle.pid, handle.create_time)
                assert read_status(job_dir) is None
                filler.free()
                await wait_until(lambda: read_status(job_dir))
                status = read_status(job_dir)
                assert status["exit_code"] == 0 and status["reason"] is None, status
                assert stream_bytes(job_dir, "stdout") == b"first\n" + b"x" * 100000 + b"\n"
                assert "output.log" in status["detail"]  # it says the log was held up
        finally:
            filler.free()
