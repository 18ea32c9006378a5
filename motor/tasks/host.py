"""The task client's local I/O (no trio): starting detached runner processes, the project
bundle, the worktree a turn executes, a turn's output files, and the fault-injection hook.

The shells call these (in a worker thread where they block); the decisions about when to
call them are in motor.tasks.rules and motor.tasks.core.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import uuid
from pathlib import Path
from typing import Callable

import msgspec

from motor.tasks import context
from motor.tasks.records import ProcessIdentity, TaskRecord, atomic_write
from motor.tasks.store import ClientDir, identity_of

#: starts the detached runner of (task, turn) on a reserved slot's token; its identity
Spawner = Callable[[str, str, uuid.UUID], ProcessIdentity]


def fault(point: str) -> None:
    """Fault injection for tests: MOTOR_TASK_FAULT=<point> kills this process there;
    MOTOR_TASK_FAULT=<point>:raise makes the step fail with an OSError instead."""
    value = os.environ.get("MOTOR_TASK_FAULT")
    if value == point:
        os._exit(86)
    if value == f"{point}:raise":
        raise OSError(f"fault injected at {point}")


def real_spawner(cdir: ClientDir) -> Spawner:
    """Start `python -m motor worker runner TASK TURN --slot-token T` in its own session."""

    def spawn(task_id: str, turn_id: str, token: uuid.UUID) -> ProcessIdentity:
        log = cdir.logs_dir / f"runner-{task_id}-{turn_id}.log"
        env = {k: v for k, v in os.environ.items() if k != "MOTOR_TASK_FAULT"}  # the hook is per process
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "motor", "worker", "runner", task_id, turn_id,
                 "--slot-token", str(token), "--client-dir", str(cdir.root)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, close_fds=True, env=env)
        try:
            return identity_of(proc.pid)
        except Exception:
            # it already exited: report an identity that is not live
            return ProcessIdentity(pid=proc.pid, start_time_micros=0)

    return spawn


def resolve_project(cdir: ClientDir, task: TaskRecord) -> Path:
    """The worktree a turn executes (seed 001, contract 7): the task's saved context when it
    has one (checked: rooted, canonical, bound to this task and project), whatever the
    runner's cwd; a legacy task without one keeps its record's project path (relative to the
    current directory only if it was recorded relative)."""
    saved = context.task_project_path(cdir.turns_dir, task.task_id, task.project)
    return saved if saved is not None else Path(task.project)


def make_bundle(project: Path, dest_dir: Path) -> tuple[Path, str]:
    """A tar of the project's worktree (without `.git`), and its sha256."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    path = dest_dir / f"bundle-{os.getpid()}-{uuid.uuid4().hex[:8]}.tar"

    def skip_git(info: tarfile.TarInfo):
        parts = info.name.split("/")
        if ".git" in parts:
            return None
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mtime = 0
        return info

    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for entry in sorted(os.listdir(project)):
            if entry == ".git":
                continue
            tf.add(project / entry, arcname=entry, filter=skip_git)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return path, digest.hexdigest()


def bundle_project(cdir: ClientDir, task: TaskRecord) -> tuple[Path, str]:
    """The bundle of the worktree the task's turn executes, in C/bundles/ (removed by the
    caller once uploaded)."""
    return make_bundle(resolve_project(cdir, task), cdir.root / "bundles")


class TurnFiles:
    """`C/turns/<task>/<turn>/`: the event log, the output log and the terminal record.
    `echo`: write the output to this process's stdout/stderr too (attached execution)."""

    TRUNCATED = b"[motor: earlier output is no longer retained]\n"

    def __init__(self, out_dir: Path, *, echo: bool = False):
        self.out_dir = out_dir
        self.echo = echo

    def prepare(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)

    def __enter__(self) -> "TurnFiles":
        self._out = open(self.out_dir / "output.log", "wb")
        try:
            self._events = open(self.out_dir / "events.jsonl", "wb")
        except BaseException:
            self._out.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._out.close()
        self._events.close()

    def event(self, event) -> None:
        self._events.write(msgspec.json.encode(event) + b"\n")
        self._events.flush()

    def output(self, stream: str, data: bytes) -> None:
        """A piece of the turn's output, its exact bytes (`Output.raw`)."""
        self._out.write(data)
        self._out.flush()
        if self.echo:
            target = sys.stderr if stream == "stderr" else sys.stdout
            target.buffer.write(data)
            target.buffer.flush()

    def truncated(self) -> None:
        self._out.write(self.TRUNCATED)

    def record(self, record) -> None:
        atomic_write(self.out_dir / "record.json", msgspec.json.encode(record) + b"\n")


__all__ = ["Spawner", "fault", "real_spawner", "resolve_project", "make_bundle", "bundle_project", "TurnFiles"]
