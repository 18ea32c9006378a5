"""One runner per state dir (motor/runner/host.py `StateDirLock`; docs/architecture.md):
the state dir itself is flocked as well as `runner.lock`, so removing that file by hand lets
no second runner in; where a directory cannot be locked (NFS), the file's lock alone holds.
Through `motor serve`: tests/e2e/test_serve_jobs.py."""

from __future__ import annotations

import errno
import fcntl
import os
import stat

import pytest

from motor import locks
from motor.runner.host import StartupError, StateDirLock


def test_a_removed_runner_lock_lets_no_second_holder_in_and_the_refusal_names_the_first(tmp_path):
    first = StateDirLock(tmp_path)
    first.acquire()
    (tmp_path / "runner.lock").unlink()
    with pytest.raises(StartupError, match=rf"in use by another runner \(pid {os.getpid()}\)"):
        StateDirLock(tmp_path).acquire()
    first.release()
    second = StateDirLock(tmp_path)
    second.acquire()  # free again once the first lets go
    assert (tmp_path / "runner.lock").read_text() == f"{os.getpid()}\n"
    second.release()


def test_where_a_directory_cannot_be_locked_the_files_lock_alone_holds(tmp_path, monkeypatch):
    real = fcntl.flock

    def flock(fd, op):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.ENOLCK, "No locks available")
        return real(fd, op)

    monkeypatch.setattr(locks.fcntl, "flock", flock)
    first = StateDirLock(tmp_path)
    first.acquire()
    assert len(first.fds) == 1  # runner.lock's alone
    with pytest.raises(StartupError, match=rf"\(pid {os.getpid()}\)"):
        StateDirLock(tmp_path).acquire()
    first.release()
    assert first.fds == []


def test_a_workspace_root_takes_one_runner_and_the_state_dirs_own_root_needs_no_lock(tmp_path):
    """Stop 60 (motor/runner/host.py `WorkspaceRootLocks`): a --workspace-root outside the
    state dir is locked for the runner's life, the refusal names the holder; the default
    root under the state dir is the state dir's lock's already."""
    from motor.runner.host import WorkspaceRootLocks

    root, state = tmp_path / "root", tmp_path / "state"
    root.mkdir()
    (state / "workspaces").mkdir(parents=True)
    first = WorkspaceRootLocks([root, state / "workspaces"], state)
    assert first.roots == [root]
    first.acquire()
    assert (root / ".motor-root.lock").read_text() == f"{os.getpid()}\n"
    (root / ".motor-root.lock").unlink()  # the directory's own lock still holds
    with pytest.raises(StartupError, match=rf"workspace root {root} is in use by another "
                                           rf"runner \(pid {os.getpid()}\)"):
        WorkspaceRootLocks([root], state).acquire()
    first.release()
    second = WorkspaceRootLocks([root], state)
    second.acquire()
    second.release()
