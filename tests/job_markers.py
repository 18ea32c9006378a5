"""Finding a job's processes from outside: the MOTOR_JOB_ID marker in their environment."""

from __future__ import annotations

import psutil


def marked_processes(job_id: str) -> list[psutil.Process]:
    """Live (non-zombie) processes whose environment says MOTOR_JOB_ID=<job_id>."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("MOTOR_JOB_ID") == job_id and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def child_named(pid: int, word: str) -> psutil.Process | None:
    """The child of `pid` whose command line mentions `word` (e.g. the forkserver)."""
    for child in psutil.Process(pid).children():
        if any(word in part for part in child.cmdline()):
            return child
    return None


def kill_marked(job_id: str) -> None:
    """Test cleanup: SIGKILL whatever still carries the job's marker."""
    for p in marked_processes(job_id):
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
