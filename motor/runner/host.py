"""Start-up's reads of the host: the state dir (its directories and its one-runner lock),
the job database's presence, and the host probe (CPU topology, isolation backend, memory
ceiling). Everything here runs before the supervisor tree starts; a problem is a
`StartupError` (exit status 2) with one line saying what to do.
"""

from __future__ import annotations

import dataclasses
import errno
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import ConfigError, RunnerConfig
from ..cpu.host import read_topology
from ..cpu.topology import (
    TopologyError, allocatable, claim_limit, kept_back, parse_cpu_list, validate_linux_cpus,
)
from ..disk.fsinfo import state_filesystem
from ..isolation import HostProbe, IsolationError, choose_backend
from ..locks import flock_holder, lock_dir_and_file, release, write_pid
from ..memory.host import read_ceiling


class StartupError(ConfigError):
    """The runner cannot start with this configuration on this host (exit status 2)."""


class StateDirLock:
    """One runner per state dir: an exclusive flock on the state dir itself and on
    `<state-dir>/runner.lock`, which holds the runner's pid for operators (motor/locks.py:
    `rm runner.lock`, a "stale lock" cleaned by hand, used to let a second runner start
    beside a live one)."""

    def __init__(self, state_dir: Path):
        self.path = state_dir / "runner.lock"
        self.fds: list[int] = []

    def acquire(self) -> None:
        state = self.path.parent
        try:
            self.fds = lock_dir_and_file(state, self.path, blocking=False, mode=0o600)
        except BlockingIOError:
            raise StartupError(f"state dir {state} is in use by another runner "
                               f"(pid {_holder(state, self.path)})") from None
        write_pid(self.fds, self.path)

    def release(self) -> None:
        release(self.fds)


class WorkspaceRootLocks:
    """One runner per workspace root as well (since stop 60): each `--workspace-root`
    outside the state dir is flocked, itself and `<root>/.motor-root.lock` (the holder's
    pid for operators), for the runner's life. A runner evicts, expires and caps the
    workspaces its catalog holds when its own jobs leave them idle, so a second runner on
    the same root (its own state dir) would delete a workspace under the first one's
    running job. The default root, `<state-dir>/workspaces`, is the state dir's already."""

    FILE = ".motor-root.lock"

    def __init__(self, roots: list[Path], state_dir: Path):
        self.roots = [r for r in roots if not r.resolve().is_relative_to(state_dir.resolve())]
        self.fds: list[int] = []

    def acquire(self) -> None:
        """A root that cannot take the file (a read-only file system: a runner whose starts
        then fail says so in health, docs/operations.md) keeps its directory's lock alone;
        one that can take neither lock (read-only NFS) goes unlocked."""
        for root in self.roots:
            path = root / self.FILE
            try:
                fds = lock_dir_and_file(root, path, blocking=False, mode=0o600,
                                        file_optional=True)
            except BlockingIOError:
                self.release()
                raise StartupError(
                    f"workspace root {root} is in use by another runner (pid "
                    f"{_holder(root, path)}): a runner evicts the workspaces it finds idle "
                    "there, so two must not share a root (give each its own "
                    "--workspace-root)") from None
            except OSError:  # neither the directory nor the file can be (read-only NFS)
                continue
            write_pid(fds, path)
            self.fds += fds

    def release(self) -> None:
        release(self.fds)
        self.fds = []


def _holder(state: Path, path: Path) -> str:
    """Who holds the lock that refused us: the pid /proc/locks names for the state dir's or
    runner.lock's flock, else the pid written in runner.lock."""
    if (pid := flock_holder(state) or flock_holder(path)) is not None:
        return pid
    try:
        return path.read_text(errors="replace").strip() or "unknown"
    except OSError:
        return f"unknown: its {path.name} was removed"


def _state_dir_problem(state: Path, path: Path, exc: OSError) -> str:
    if exc.errno == errno.EROFS:
        return f"state dir {state} is on a read-only filesystem ({path}: {exc.strerror}); motor must write there"
    if isinstance(exc, (FileExistsError, NotADirectoryError)):
        return f"{path} is not a directory (a file is in the way): move it aside"
    return f"cannot use state dir {state}: {path}: {exc.strerror or exc}"


def _make_dir(path: Path, state: Path) -> None:
    """mkdir -p (0700 under the runner's umask); a problem is one start-up line."""
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise StartupError(_state_dir_problem(state, path, exc)) from None
    if not path.is_dir():
        raise StartupError(f"{path} is not a directory (a file is in the way): move it aside")


def check_database_present(db_path: Path, jobs_dir: Path) -> None:
    """Refuse to start with no job records while job directories exist: those jobs may
    still run under their keepers, and starting empty would leave them unsupervised and
    their records lost without a word."""
    try:
        if db_path.exists() and db_path.stat().st_size > 0:
            return
        job_dirs = [p for p in jobs_dir.iterdir() if p.is_dir()]
    except OSError as exc:
        raise StartupError(f"cannot read {jobs_dir}: {exc.strerror}") from None
    if not job_dirs:
        return
    problem = "is missing" if not db_path.exists() else "is empty"
    n = len(job_dirs)
    raise StartupError(
        f"the job database {db_path} {problem} but {jobs_dir} holds {n} job"
        f" director{'y' if n == 1 else 'ies'} (jobs that may still be running under their"
        f" keepers): restore motor.db (with motor.db-wal) from a backup, or move {jobs_dir}"
        f" aside to start with no history")


@dataclass
class Host:
    """What start-up learned about the host: topology, CPUs, isolation backend."""

    topology: Any
    allowed: tuple[int, ...]
    kept_back: tuple[int, ...]
    claim_limit: int
    backend: Any
    windows: tuple[int, ...] = ()  # --windows-cpus
    slice_limit: Any = None  # () -> int | None: the jobs group's live memory limit
    ceiling: Any = None  # MemoryCeiling read at start-up
    #: the state directory's file system (disk/fsinfo.py), shown in health
    state_fs: dict | None = None


def probe_host(config: RunnerConfig) -> Host:
    try:
        topology = read_topology(config.sysfs_root)
    except TopologyError as exc:
        raise StartupError(f"cannot read CPU topology: {exc}") from None
    linux = None
    if config.linux_cpus is not None:
        try:
            linux = parse_cpu_list(config.linux_cpus)
            validate_linux_cpus(topology, linux, config.max_weight)
        except ValueError as exc:
            raise StartupError(f"--linux-cpus: {exc}") from None
    windows: tuple[int, ...] = ()
    if config.windows_cpus:
        try:
            windows = parse_cpu_list(config.windows_cpus)
        except ValueError as exc:
            raise StartupError(f"--windows-cpus: {exc}") from None
        offline = [c for c in windows if not topology.is_online(c)]
        if offline:
            raise StartupError(f"--windows-cpus: CPU {offline[0]} is not online")
    allowed = allocatable(topology, linux)
    if not allowed:
        raise StartupError("no allocatable CPUs on this host")
    try:
        backend = choose_backend(config.isolation, probe=HostProbe(config.cgroup_parent))
    except IsolationError as exc:
        raise StartupError(str(exc)) from None
    if getattr(backend, "name", None) == "cgroup" and getattr(backend, "version", 0) == 1:
        # v1: the keeper makes the job's groups from the spec, keeperd by renaming a
        # spare group its pre-placed process already sits in (docs/isolation.md, "The join")
        backend = dataclasses.replace(backend, keeper_makes_groups=True)
    slice_limit = getattr(backend, "parent_memory_limit", None) or (lambda: None)
    state_fs = state_filesystem(str(config.state_path))
    return Host(
        topology=topology, allowed=tuple(allowed),
        kept_back=() if linux is not None else tuple(kept_back(topology)),
        claim_limit=claim_limit(allowed, config.max_weight, confined=linux is not None),
        backend=backend, slice_limit=slice_limit, windows=windows,
        ceiling=read_ceiling(config.capacity_file, slice_limit), state_fs=state_fs,
    )
