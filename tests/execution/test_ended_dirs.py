"""An ended job's directory emptied (`jobdir.empty`, `jobdir.EndedDirs`): its files go, the
directory stays until retention, and what cannot be removed is left, never raised."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from motor.execution.jobdir import EndedDirs, empty
from motor.lifecycle import RETENTION_MS


def _job_dir(root, name="j1"):
    d = root / name
    d.mkdir()
    for f in ("output.log", "spec.json", "status.json", "keeper.json", ".spec.json.1.tmp"):
        (d / f).write_text("x")
    return d


def test_empty_unlinks_the_files_and_keeps_the_directory(tmp_path):
    d = _job_dir(tmp_path)
    (d / "sub").mkdir()
    assert empty(d) == 5
    assert [p.name for p in d.iterdir()] == ["sub"]
    assert empty(tmp_path / "gone") == 0  # no directory: nothing to do
    (tmp_path / "file").write_text("x")
    assert empty(tmp_path / "file") == 0


@pytest.mark.skipif(shutil.which("chattr") is None, reason="no chattr(1)")
def test_a_file_that_cannot_be_unlinked_is_left_not_raised(tmp_path):
    d = _job_dir(tmp_path)
    if subprocess.run(["chattr", "+i", str(d / "spec.json")], capture_output=True).returncode:
        pytest.skip("this file system takes no immutable flag")
    try:
        assert empty(d) == 4
        assert [p.name for p in d.iterdir()] == ["spec.json"]
    finally:
        subprocess.run(["chattr", "-i", str(d / "spec.json")], check=True)


def test_ended_dirs_empty_each_job_once_in_the_order_of_their_ends(tmp_path):
    ends = {"a": 1_000, "b": 2_000, "c": 2_000, "d": 9_000}
    asked = []

    def ended(after, until_ms, limit=2):
        asked.append((after, until_ms))
        rows = sorted((end + RETENTION_MS, job) for job, end in ends.items())
        return [r for r in rows if r > after and r[0] <= until_ms][:limit]

    for job in ends:
        _job_dir(tmp_path, job)
    dirs = EndedDirs(tmp_path, ended)
    assert dirs.empty_ended(now_ms=2_500, after_ms=500) == 3  # a, b, c: in pages of 2
    assert [p.name for p in (tmp_path / "c").iterdir()] == []
    assert len(list((tmp_path / "d").iterdir())) == 5
    assert dirs.emptied_to == (2_000 + RETENTION_MS, "c")
    assert dirs.empty_ended(now_ms=2_500, after_ms=500) == 0  # from where it stopped
    assert dirs.empty_ended(now_ms=9_000, after_ms=0) == 1
    assert asked[0] == ((0, ""), 2_000 + RETENTION_MS)


def test_ended_dirs_start_again_when_the_wall_clock_steps_back(tmp_path):
    """A job that ends after the wall clock stepped back has its end (and so its place in
    the order) before the mark: without a fresh start it would keep its files for the day."""
    ends = {"a": 10_000}

    def ended(after, until_ms, limit=1000):
        rows = sorted((end + RETENTION_MS, job) for job, end in ends.items())
        return [r for r in rows if r > after and r[0] <= until_ms][:limit]

    _job_dir(tmp_path, "a")
    dirs = EndedDirs(tmp_path, ended)
    assert dirs.empty_ended(now_ms=10_000, after_ms=0) == 1
    ends["b"] = 4_000  # the clock went back 6 s; b ended then
    _job_dir(tmp_path, "b")
    assert dirs.empty_ended(now_ms=4_500, after_ms=0) == 1  # b, from a fresh start
    assert list((tmp_path / "b").iterdir()) == []
