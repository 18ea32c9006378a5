"""The state directory's file system (motor/disk/fsinfo.py, issue 14): its type and mount
read from /proc, and for ext4 whether a journal runs; a runner whose state directory is on
ext4 without a journal says so at start-up and in `GET /v1/health` (`disk.state_filesystem`),
one on a journaled ext4 says nothing. Real file systems: images loop-mounted with and
without a journal, and findmnt(8) as the independent reading."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess

import pytest

import motor
from motor.disk.fsinfo import journal_warning, mount_of, state_filesystem
from tests.tmpfs_helpers import ext4, needs_ext4


@pytest.mark.skipif(shutil.which("findmnt") is None, reason="no findmnt(8)")
def test_the_type_and_mount_point_are_what_findmnt_says(tmp_path):
    found = subprocess.run(["findmnt", "-n", "-o", "FSTYPE,TARGET", "-T", str(tmp_path)],
                           capture_output=True, text=True, check=True).stdout.split()
    info = state_filesystem(str(tmp_path))
    assert info is not None and [info["type"], info["mount_point"]] == found[:2]


def test_the_longest_mount_point_on_the_paths_device_wins_and_escapes_are_read(tmp_path):
    """A mountinfo where the same device is mounted twice: the entry whose mount point holds
    the path, the longest one, with `\\040` read as a space."""
    holder = tmp_path / "a b"
    holder.mkdir()
    st = os.stat(holder)
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    escaped = str(holder).replace(" ", "\\040")
    info = tmp_path / "mountinfo"
    info.write_text(
        f"1 0 {dev} / / rw - ext4 /dev/root rw\n"
        f"2 1 {dev} / {escaped} rw shared:1 - xfs /dev/other rw\n"
        f"3 1 {dev} / {escaped}x rw - btrfs /dev/third rw\n"
        f"4 1 9:99 / {escaped}/deeper rw - tmpfs tmpfs rw\n")
    assert mount_of(str(holder / "."), str(info)) == ("xfs", str(holder), "/dev/other")
    assert mount_of(str(tmp_path), str(info)) == ("ext4", "/", "/dev/root")


@needs_ext4
@pytest.mark.parametrize("journal", [True, False], ids=["journal", "no-journal"])
def test_an_ext4_with_or_without_a_journal_is_told_apart(tmp_path, journal):
    with ext4(tmp_path / "fs", journal=journal) as mnt:
        info = state_filesystem(str(mnt))
        assert info["type"] == "ext4" and info["mount_point"] == str(mnt)
        assert info["device"].startswith("loop") and info["source"] == f"/dev/{info['device']}"
        assert info["journal"] is journal
        warning = journal_warning(str(mnt), info)
        assert (warning is not None) is (not journal)
        if warning:
            assert "without a journal" in warning and info["source"] in warning


def test_no_journal_field_where_none_is_meant_and_no_warning_then(tmp_path):
    info = {"type": "tmpfs", "mount_point": "/dev/shm", "source": "tmpfs"}
    assert journal_warning("/dev/shm/x", info) is None
    assert journal_warning("/x", None) is None
    if os.path.isdir("/dev/shm"):
        shm = state_filesystem("/dev/shm")
        assert shm is not None and "journal" not in shm


@needs_ext4
@pytest.mark.parametrize("journal", [True, False], ids=["journal", "no-journal"])
async def test_the_runner_says_so_at_start_and_in_health(tmp_path, caplog, journal):
    with ext4(tmp_path / "fs", journal=journal, size_mb=32) as mnt:
        config = motor.RunnerConfig(state_dir=str(mnt / "state"), isolation="none",
                                    free_space_floor_bytes=0)
        with caplog.at_level(logging.WARNING, logger="motor.runner"):
            async with motor.open_runner(config) as runner:
                health = await runner.health()
                job = await runner.submit(motor.JobRequest(command=["true"], workspace="w"))
                async for _ in runner.events(job.job_id):
                    pass
                assert (await runner.get(job.job_id)).state == "succeeded"
    fs = health["disk"]["state_filesystem"]
    assert fs["type"] == "ext4" and fs["journal"] is journal
    assert fs["mount_point"] == str(mnt)
    warned = [r.getMessage() for r in caplog.records if "without a journal" in r.getMessage()]
    if journal:
        assert warned == []
    else:
        assert len(warned) == 1 and str(mnt / "state") in warned[0]
