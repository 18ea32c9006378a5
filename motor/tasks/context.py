"""A task's saved project context (seed 001, contract 6): `C/turns/<task_id>/project.json`.

The originating worktree path, as Unix path bytes in base64, bound to the task id and to
opaque ids of the project, the worktree and the repository.  Public task and queue JSON keep
only opaque ids; the path lives here, owner-only (file 0600 in a 0700 directory).

Reads are rooted (every component opened relative to the client dir with O_NOFOLLOW),
bounded (at most MAX_CONTEXT_BYTES), and canonical (the bytes must be exactly what we would
write), and the context must still describe what is on disk: the path is absolute and
canonical (no symlinked component: a redirected worktree is refused), and the recomputed
worktree and repository ids match.  Any failure is a ContextError with a code and a detail.

Blocking I/O: call from a worker thread (the QueueLock critical section is one).
"""

from __future__ import annotations

import base64
import hashlib
import os
import stat
from pathlib import Path

import msgspec

__all__ = ["TaskContext", "ContextError", "write_task_project_path", "task_project_path",
           "read_task_context", "remove_task_context", "make_context", "repository_root",
           "MAX_CONTEXT_BYTES", "CONTEXT_INVALID", "CONTEXT_REDIRECTED", "CONTEXT_MISMATCH"]

MAX_CONTEXT_BYTES = 16 * 1024
CONTEXT_INVALID = "TASK_CONTEXT_INVALID"
CONTEXT_REDIRECTED = "TASK_CONTEXT_REDIRECTED"
CONTEXT_MISMATCH = "TASK_CONTEXT_MISMATCH"


class ContextError(Exception):
    def __init__(self, code: str, detail: str):
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail


class TaskContext(msgspec.Struct, kw_only=True, frozen=True):
    version: int = 1
    task_id: str
    project_id: str
    worktree_id: str
    repository_id: str
    path_b64: str

    @property
    def path(self) -> Path:
        return Path(os.fsdecode(base64.b64decode(self.path_b64, validate=True)))


def _id(kind: str, data: bytes) -> str:
    return hashlib.sha256(kind.encode() + b"\0" + data).hexdigest()[:32]


def repository_root(worktree: Path) -> Path:
    """The repository a worktree belongs to: the git common dir (a linked worktree's `.git`
    file points into `<repo>/.git/worktrees/<name>`, whose `commondir` names the common
    dir); the worktree itself when it is not a git checkout."""
    dotgit = worktree / ".git"
    try:
        if dotgit.is_dir():
            return Path(os.path.realpath(dotgit))
        if dotgit.is_file():
            text = dotgit.read_text(errors="surrogateescape").strip()
            if text.startswith("gitdir:"):
                gitdir = Path(text[len("gitdir:"):].strip())
                if not gitdir.is_absolute():
                    gitdir = worktree / gitdir
                common = gitdir / "commondir"
                if common.is_file():
                    c = Path(common.read_text(errors="surrogateescape").strip())
                    return Path(os.path.realpath(c if c.is_absolute() else gitdir / c))
                return Path(os.path.realpath(gitdir))
    except OSError:
        pass
    return worktree


def make_context(task_id: str, project: str, worktree: Path) -> TaskContext:
    raw = os.fsencode(str(worktree))
    return TaskContext(task_id=task_id, project_id=_id("project", os.fsencode(project)),
                       worktree_id=_id("worktree", raw),
                       repository_id=_id("repository", os.fsencode(str(repository_root(worktree)))),
                       path_b64=base64.b64encode(raw).decode())


def _open_task_dir(turns_dir: Path, task_id: str, create: bool) -> int:
    if not task_id or "/" in task_id or task_id in (".", "..") or "\0" in task_id:
        raise ContextError(CONTEXT_INVALID, f"bad task id {task_id!r}")
    root = os.open(turns_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        if create:
            try:
                os.mkdir(task_id, 0o700, dir_fd=root)
            except FileExistsError:
                pass
        try:
            fd = os.open(task_id, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=root)
        except FileNotFoundError:
            raise
        except OSError as exc:  # ELOOP / ENOTDIR: a symlink or a file where the directory is
            raise ContextError(CONTEXT_REDIRECTED, f"turns/{task_id} is not a plain directory: {exc}") from None
    finally:
        os.close(root)
    if create:
        os.fchmod(fd, 0o700)
    return fd


def write_task_project_path(turns_dir: Path, task_id: str, project: str, project_path: Path) -> TaskContext:
    """Write `turns/<task_id>/project.json` (0600 in a 0700 directory), atomically."""
    path = Path(os.path.realpath(project_path))
    ctx = make_context(task_id, project, path)
    data = msgspec.json.encode(ctx)
    dfd = _open_task_dir(turns_dir, task_id, create=True)
    tmp = f".project.json.{os.getpid()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600, dir_fd=dfd)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, "project.json", src_dir_fd=dfd, dst_dir_fd=dfd)
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return ctx


def read_task_context(turns_dir: Path, task_id: str) -> TaskContext | None:
    """The saved context, verified (see the module doc); None when the task has none (a
    legacy task).  Usable while the QueueLock is held (reads only)."""
    try:
        dfd = _open_task_dir(turns_dir, task_id, create=False)
    except FileNotFoundError:
        return None
    try:
        try:
            fd = os.open("project.json", os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dfd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ContextError(CONTEXT_REDIRECTED, f"turns/{task_id}/project.json: {exc}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ContextError(CONTEXT_REDIRECTED, f"turns/{task_id}/project.json is not a regular file")
            if st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise ContextError(CONTEXT_INVALID, f"turns/{task_id}/project.json is not owner-only "
                                                    f"(mode {stat.S_IMODE(st.st_mode):o})")
            if st.st_size > MAX_CONTEXT_BYTES:
                raise ContextError(CONTEXT_INVALID, f"turns/{task_id}/project.json is larger than "
                                                    f"{MAX_CONTEXT_BYTES} bytes")
            data = os.read(fd, MAX_CONTEXT_BYTES + 1)
        finally:
            os.close(fd)
    finally:
        os.close(dfd)
    try:
        ctx = msgspec.json.decode(data, type=TaskContext)
        raw = base64.b64decode(ctx.path_b64, validate=True)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        raise ContextError(CONTEXT_INVALID, f"turns/{task_id}/project.json: {exc}") from None
    if msgspec.json.encode(ctx) != data:
        raise ContextError(CONTEXT_INVALID, f"turns/{task_id}/project.json is not canonical")
    if ctx.version != 1 or ctx.task_id != task_id:
        raise ContextError(CONTEXT_MISMATCH, f"turns/{task_id}/project.json is bound to task {ctx.task_id}")
    path = os.fsdecode(raw)
    if not os.path.isabs(path) or os.path.realpath(path) != path:
        raise ContextError(CONTEXT_REDIRECTED, f"task {task_id}: the saved worktree is redirected "
                                               f"(not canonical any more)")
    if not os.path.isdir(path):
        raise ContextError(CONTEXT_MISMATCH, f"task {task_id}: the saved worktree is gone")
    again = make_context(task_id, "", Path(path))
    if again.worktree_id != ctx.worktree_id or again.repository_id != ctx.repository_id:
        raise ContextError(CONTEXT_MISMATCH, f"task {task_id}: the saved worktree no longer belongs to "
                                             f"the recorded repository")
    return ctx


def task_project_path(turns_dir: Path, task_id: str, project: str) -> Path | None:
    """The saved worktree of a task, checked against its task record's project."""
    ctx = read_task_context(turns_dir, task_id)
    if ctx is None:
        return None
    if ctx.project_id != _id("project", os.fsencode(project)):
        raise ContextError(CONTEXT_MISMATCH, f"task {task_id}: the saved context belongs to another project")
    return ctx.path


def remove_task_context(turns_dir: Path, task_id: str) -> None:
    """Submission rollback: remove `turns/<task_id>/` (only project.json and the directory)."""
    try:
        dfd = _open_task_dir(turns_dir, task_id, create=False)
    except (FileNotFoundError, ContextError):
        return
    try:
        try:
            os.unlink("project.json", dir_fd=dfd)
        except FileNotFoundError:
            pass
    finally:
        os.close(dfd)
    try:
        os.rmdir(turns_dir / task_id)
    except OSError:
        pass
