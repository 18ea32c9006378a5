"""A start's workspace and job directory (`jobdir.prepare`): made when missing, taken as they
are when there, and a workspace path that cannot be a directory refused with its reason."""

from __future__ import annotations

import os

from motor.execution.jobdir import prepare


def test_a_missing_workspace_and_job_directory_are_made_with_their_parents(tmp_path):
    cwd, job_dir = tmp_path / "roots" / "ws" / "w1", tmp_path / "state" / "jobs" / "j1"
    assert prepare(cwd, job_dir, None, None, "j1") is None
    assert cwd.is_dir() and job_dir.is_dir()


def test_an_existing_workspace_and_job_directory_are_kept_with_what_they_hold(tmp_path):
    cwd, job_dir = tmp_path / "w1", tmp_path / "j1"
    cwd.mkdir()
    job_dir.mkdir()
    (cwd / "build.o").write_text("kept")
    (job_dir / "output.log").write_text("kept")
    assert prepare(cwd, job_dir, None, None, "j1") is None
    assert (cwd / "build.o").read_text() == (job_dir / "output.log").read_text() == "kept"


def test_a_symlink_to_a_directory_serves_as_the_workspace(tmp_path):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "w1")
    assert prepare(tmp_path / "w1", tmp_path / "j1", None, None, "j1") is None
    assert (tmp_path / "j1").is_dir() and (tmp_path / "w1").is_symlink()


def test_a_file_in_the_workspaces_place_or_in_its_path_is_a_refusal(tmp_path):
    (tmp_path / "w1").write_text("a file")
    refusal = prepare(tmp_path / "w1", tmp_path / "j1", None, None, "j1")
    assert refusal is not None and refusal.code == "workspace_setup_failed"
    assert f"the workspace {tmp_path / 'w1'} cannot be a directory" in refusal.detail
    refusal = prepare(tmp_path / "w1" / "sub", tmp_path / "j2", None, None, "j2")
    assert refusal is not None and refusal.code == "workspace_setup_failed"
    assert not (tmp_path / "j1").exists() and not (tmp_path / "j2").exists()
