"""A job that prints far more, and faster, than the runner stores: its output.log does not
fill the state file system (a real small tmpfs), the job ends with its exit status, and
other jobs are admitted meanwhile (docs/keeper.md, "A job that prints faster than it is
stored")."""

from __future__ import annotations

import pytest

from polling import json_lines
from tmpfs_helpers import needs_tmpfs, tmpfs

pytestmark = [pytest.mark.e2e, needs_tmpfs]


def test_a_job_printing_more_than_the_state_file_system_holds_ends_and_the_next_job_runs(
        serve_factory, tmp_path):
    """400 MB of output on a 96 MiB state file system, 4 MiB kept per job. Before stop 56
    output.log filled the file system: the job's status.json could not be written, so it
    stayed `running` for good, and every submit was refused `runner_disk_full`. (A job
    submitted while the flood fills the file system for a moment may still be refused;
    once the flood has ended, the next is not.)"""
    with tmpfs(tmp_path / "state", size="96m") as state:
        serve = serve_factory("--workspace-root", str(tmp_path / "ws"), "--isolation", "affinity",
                              "--max-output-bytes-per-job", "4M", state_dir=state).start()
        try:
            flood = serve.cli_json("submit", "--weight", "1", "--", "sh", "-c",
                                   "yes 0123456789abcdef0123456789abcdef | head -c 400000000; "
                                   "echo; echo the end")["job_id"]
            other = serve.cli("run", "--weight", "1", "--", "echo", "admitted", timeout=120)
            assert (other.returncode, other.stdout) == (0, b"admitted\n") or (
                other.returncode == 75 and b"runner_disk_full" in other.stderr), other
            result = serve.cli("attach", "--json", flood, timeout=60)
            record = json_lines(result.stdout)[-1]["record"]
            assert (record["state"], record["exit_code"]) == ("succeeded", 0), record
            # (its output's end is kept unless the keeper found the file system full at that
            # moment and dropped it: docs/keeper.md, "A full state filesystem")
            after = serve.cli("run", "--weight", "1", "--", "echo", "admitted", timeout=60)
            assert (after.returncode, after.stdout) == (0, b"admitted\n"), after.stderr
            log = state / "jobs" / flood / "output.log"
            # most of it skipped and freed (at moments the keeper still found the file
            # system full, held the output and dropped some: its size is under 400 MB)
            assert log.stat().st_blocks * 512 < 48 * 1024 * 1024 < log.stat().st_size
        finally:
            serve.stop()
