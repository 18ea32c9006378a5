"""The per-job keeper: owns one job's output and records its exit durably.

A keeper is forked by the forkserver (``motor.execution.forkserver``) and runs
``run_keeper(job_dir)``.  It never talks to the runner: everything it knows
comes from ``spec.json`` and everything it reports goes into the job directory
(see ``motor.execution.joblog`` and docs/keeper.md).  So the runner daemon can
die and be restarted while the keeper and its job keep running.

Stdlib only: it runs inside the small forkserver process.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import select
import signal
import sys
import time
from typing import Any

from motor import faults
from motor.execution.joblog import (
    KEEPER_FILE,
    OUTPUT_FILE,
    STATUS_FILE,
    STDERR,
    STDOUT,
    encode_record,
    read_spec,
    write_json_atomic,
)
from motor.isolation.join import JoinError, join_confinement

__all__ = ["HeldOutput", "abandon", "claim_job_dir", "proc_create_time", "run_keeper", "status_fields",
           "main"]

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
READ_CHUNK = 65536
#: After the job's main process exited and its process group was SIGKILLed,
#: how long to keep draining pipes that are still held open (by a process that
#: escaped the process group) before giving up on them.
DRAIN_TIMEOUT_S = 5.0
DEFAULT_KILL_GRACE_S = 10.0
SPAWN_FAILED_EXIT_CODE = 127
#: Output that cannot be written to output.log (state filesystem full) is held in memory
#: up to this many bytes and retried; beyond it new output is dropped (and counted).
OUTPUT_HOLD_BYTES = 4 * 1024 * 1024
#: Retry interval for held output; status.json retries back off up to STATUS_RETRY_MAX_S.
OUTPUT_RETRY_S = 0.5
STATUS_RETRY_MIN_S = 0.05
STATUS_RETRY_MAX_S = 2.0
#: After the job's main process exited: how long the keeper keeps killing and reaping
#: what is left of the tree (its descendants are re-parented to it: it is a subreaper).
REAP_TIMEOUT_S = 5.0
PR_SET_CHILD_SUBREAPER = 36

# Reset to default in the job (Python ignores SIGPIPE/SIGXFSZ; the keeper
# ignores SIGINT/SIGHUP and handles SIGTERM/SIGCHLD).
_SIGDEF = frozenset(
    s
    for s in (
        signal.SIGHUP,
        signal.SIGINT,
        signal.SIGQUIT,
        signal.SIGTERM,
        signal.SIGPIPE,
        signal.SIGCHLD,
        signal.SIGUSR1,
        signal.SIGUSR2,
        signal.SIGALRM,
        signal.SIGXFSZ,
        signal.SIGTSTP,
        signal.SIGTTIN,
        signal.SIGTTOU,
    )
)


_btime: float | None = None


def _boot_time() -> float:
    # psutil re-reads btime each call; it only moves when the wall clock is
    # stepped, so one read per keeper process is enough (and /proc/stat is
    # not cheap on big hosts).
    global _btime
    if _btime is not None:
        return _btime
    with open("/proc/stat", "rb") as f:
        for line in f:
            if line.startswith(b"btime"):
                _btime = float(line.strip().split()[1])
                return _btime
    raise RuntimeError("btime not found in /proc/stat")


def proc_create_time(pid: int) -> float:
    """Creation time of ``pid`` in seconds since the epoch.

    Computed exactly like ``psutil.Process(pid).create_time()`` on Linux
    (starttime ticks / CLK_TCK + btime), so the runner can compare the floats.
    Works for zombies.  Raises OSError (FileNotFoundError) if the pid is gone.
    """
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    fields = data[data.rfind(b")") + 2 :].split()
    return float(fields[19]) / CLOCK_TICKS + _boot_time()


def claim_job_dir(job_dir: str, keeper_pid: int, keeper_create_time: float,
                  kind: str | None = None) -> None:
    """Record a keeper's identity as ``<job_dir>/keeper.json``, exclusively.

    Called by the forkserver before it releases the keeper. ``link(2)`` of a fully
    written temp file: the claim appears whole or not at all, and only once per job
    directory (FileExistsError when another keeper claimed it first). Any other OSError
    (ENOSPC, no free inodes...) means the identity is not durable: the keeper must not
    start the job.
    """
    path = os.path.join(job_dir, KEEPER_FILE)
    tmp = os.path.join(job_dir, f".{KEEPER_FILE}.{keeper_pid}.claim")
    data = (
        '{"keeper_pid":%d,"keeper_create_time":%r,"job_pid":null,'
        '"job_create_time":null,"started_at_ms":null%s}' % (
            keeper_pid, keeper_create_time, ',"kind":%s' % json.dumps(kind) if kind else "")
    ).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.link(tmp, path)
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def abandon(job_dir: str) -> int:
    """A keeper whose forkserver died before releasing it: the job was never started.

    If the claim names this keeper, say so in status.json (a typed spawn failure) so the
    runner ends the job instead of calling it lost; otherwise leave the directory alone
    (another keeper may own it).
    """
    try:
        with open(os.path.join(job_dir, KEEPER_FILE), "rb") as f:
            kept = json.loads(f.read())
    except (OSError, ValueError):
        return 0
    if not isinstance(kept, dict) or kept.get("keeper_pid") != os.getpid():
        return 0
    keeper = _Keeper(job_dir)
    keeper._write_status(
        exit_code=SPAWN_FAILED_EXIT_CODE, reason="spawn_failed",
        detail="the forkserver died before releasing the job's keeper; the job was not started")
    return 0


try:  # loaded once in the forkserver, so a keeper pays nothing for it
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # pragma: no cover - not Linux/glibc
    _prctl = None


def kill_and_reap(pid: int) -> None:
    """SIGKILL a child of this process and reap it (gone already: nothing to do)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def _set_subreaper() -> bool:
    """PR_SET_CHILD_SUBREAPER: orphaned descendants of the job are re-parented to us."""
    if _prctl is None:
        return False
    try:
        return _prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except OSError:  # pragma: no cover
        return False


def _children_map() -> dict[int, list[int]]:
    """ppid -> [pid] for every process (one pass over /proc)."""
    out: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        fields = data[data.rfind(b")") + 2 :].split()
        try:
            out.setdefault(int(fields[1]), []).append(int(name))
        except (IndexError, ValueError):
            continue
    return out


def _descendants(root: int) -> list[int]:
    """Every live descendant of ``root`` (not ``root`` itself)."""
    children = _children_map()
    found: list[int] = []
    todo = list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


def _now_ms() -> int:
    return int(time.time() * 1000)


def _resolve_executable(cmd0: str, env: dict[str, str]) -> str:
    """Find ``cmd0`` like execvp would, but on the *job's* PATH."""
    if "/" in cmd0:
        return cmd0
    path = env.get("PATH", os.defpath)
    denied: str | None = None
    for d in path.split(os.pathsep):
        cand = os.path.join(d or ".", cmd0)
        if os.path.isfile(cand):
            if os.access(cand, os.X_OK):
                return cand
            denied = denied or cand
    if denied is not None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), denied)
    raise FileNotFoundError(errno.ENOENT, "command not found", cmd0)


#: How much more the job's processes score for the OOM killer than their keeper, when the
#: job runs in a memory cgroup. The keeper lives in the job's group, and an OOM kill there
#: must take a job process, never the keeper that records the status (a job made of many
#: small processes would otherwise lose it). Raising a score needs no privilege (lowering
#: the keeper's would need CAP_SYS_RESOURCE), so the keeper raises its own score just for
#: the spawn, which the job inherits, and restores it right after.
JOB_OOM_SCORE_BUMP = 500
_OOM_SCORE_ADJ = "/proc/self/oom_score_adj"


def _set_oom_score_adj(value: int) -> bool:
    try:
        fd = os.open(_OOM_SCORE_ADJ, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, str(value).encode())
        finally:
            os.close(fd)
    except OSError:
        return False
    return True


def _raise_oom_score_for_spawn() -> int | None:
    """Raise our own oom_score_adj (the job inherits it); return the value to restore."""
    try:
        with open(_OOM_SCORE_ADJ, "rb") as f:
            old = int(f.read())
    except (OSError, ValueError):
        return None
    if not _set_oom_score_adj(min(1000, old + JOB_OOM_SCORE_BUMP)):
        return None
    return old


class _SpawnFailed(Exception):
    pass


class HeldOutput:
    """output.log of one job, and what is held while it cannot be written: up to
    OUTPUT_HOLD_BYTES of whole records in memory, the rest dropped and counted (a note
    says so once writing works again). The per-job keeper and keeperd's jobs both keep
    their output this way. Needs `job_dir`; keeps `out_fd`, `pending`, `dropped_bytes`,
    `output_error` and `retry_output_at`."""

    def init_output(self, job_dir: str) -> None:
        self.job_dir = job_dir
        self.out_fd = -1
        self.output_error: str | None = None
        #: Encoded records not yet in output.log (its filesystem refused them).
        self.pending = bytearray()
        self.dropped_bytes = 0
        self.retry_output_at: float | None = None

    def write_record(self, stream: int, data: bytes) -> None:
        """Append one record to output.log; hold it (bounded) when that fails."""
        record = encode_record(stream, data)
        if self.pending:
            self.flush_output()
        if self.pending:
            if len(self.pending) + len(record) > OUTPUT_HOLD_BYTES:
                self.dropped_bytes += len(data)
            else:
                self.pending += record
            return
        self.pending += record
        self.flush_output()

    def flush_output(self) -> bool:
        """Write held records to output.log; True when nothing is held any more.

        Whole records only ever enter ``pending`` and only written bytes leave it, so a
        partial write followed by ENOSPC leaves output.log with a trailing partial record
        that the next successful write completes (readers wait for complete records).
        """
        if not self.pending:
            return True
        try:
            if self.out_fd < 0:
                # Created on first output: a silent job costs no file creation
                # (readers treat a missing output.log as empty).
                self.out_fd = os.open(
                    os.path.join(self.job_dir, OUTPUT_FILE),
                    os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                    0o600,  # private, like all state (the job may print secrets)
                )
            while self.pending:
                n = os.write(self.out_fd, self.pending)
                del self.pending[:n]
        except OSError as exc:
            # Keep draining the pipes (the job must never block on us); retry later.
            if self.output_error is None:
                self.output_error = f"writing {OUTPUT_FILE} failed for a while: {exc}"
            self.retry_output_at = time.monotonic() + OUTPUT_RETRY_S
            return False
        self.retry_output_at = None
        if self.dropped_bytes:
            note = (
                f"motor keeper: {self.dropped_bytes} bytes of output were dropped while "
                f"{OUTPUT_FILE} could not be written\n"
            )
            self.output_error = (
                f"{self.dropped_bytes} bytes of output dropped while {OUTPUT_FILE} could not "
                f"be written ({self.output_error})"
            )
            self.dropped_bytes = 0
            self.pending += encode_record(STDERR, note.encode())
            return self.flush_output()
        return True


def status_fields(started_at_ms: int, **fields: Any) -> dict[str, Any]:
    """status.json's content for a job that started at `started_at_ms` and ended now."""
    ended = _now_ms()
    status = {"exit_code": None, "signal": None, "reason": None, "detail": None,
              "started_at_ms": started_at_ms, "ended_at_ms": ended,
              "wall_time_ms": max(0, ended - started_at_ms), "cpu_time_ms": 0}
    status.update(fields)
    return status


class _Keeper(HeldOutput):
    def __init__(self, job_dir: str) -> None:
        self.init_output(os.path.abspath(job_dir))
        self.cancel_requested = False
        self.keeper_json_error: str | None = None
        self.started_at_ms = _now_ms()
        self.subreaper = False

    # -- plumbing ---------------------------------------------------------

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.cancel_requested = True

    def _write_status(self, **fields: Any) -> None:
        status = status_fields(self.started_at_ms, **fields)
        faults.hit("keeper.status")  # tests: the job ended, status.json not written
        # Atomic (tmp + rename), not fsynced: it must survive the runner
        # dying, not the host (which takes the job down with it).
        # A full state filesystem must not turn a finished job into a lost one: hold
        # the status (and the held output, which goes first) and retry until it lands.
        delay = STATUS_RETRY_MIN_S
        while True:
            if self.flush_output():
                try:
                    write_json_atomic(os.path.join(self.job_dir, STATUS_FILE), status)
                    return
                except OSError:
                    pass
            time.sleep(delay)
            delay = min(STATUS_RETRY_MAX_S, delay * 2)

    def _flush_output_until_done(self) -> None:
        """Before the status: every held record reaches output.log (retried, backing off)."""
        delay = STATUS_RETRY_MIN_S
        while not self.flush_output():
            time.sleep(delay)
            delay = min(STATUS_RETRY_MAX_S, delay * 2)

    def _spawn_failed(self, detail: str) -> int:
        self.write_record(STDERR, f"motor keeper: {detail}\n".encode(errors="replace"))
        self._flush_output_until_done()
        self._write_status(
            exit_code=SPAWN_FAILED_EXIT_CODE, reason="spawn_failed", detail=detail
        )
        return 0

    # -- main -------------------------------------------------------------

    def run(self) -> int:
        try:
            os.setsid()
        except OSError:
            pass  # already a session/group leader (e.g. run by hand)
        for s in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
            signal.signal(s, signal.SIG_IGN)
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        signal.signal(signal.SIGTERM, self._on_sigterm)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        # The forkserver blocks SIGTERM around fork() so that a SIGTERM sent
        # as soon as our pid is known is not lost; handlers are in place now.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGCHLD})
        # Whatever the job double-forks or setsid()s away is re-parented to us, so
        # cancel, timeout and the end of the job reach it under any isolation backend.
        self.subreaper = _set_subreaper()

        try:
            pid, out_r, err_r, spec = self._spawn()
        except _SpawnFailed as exc:
            return self._spawn_failed(str(exc))
        if pid is None:  # cancelled before spawning
            self._write_status(reason="cancelled", detail="cancelled before the job was spawned")
            return 0
        try:
            return self._supervise(pid, out_r, err_r, wake_r, spec)
        except Exception as exc:  # keeper bug: never leave the job unattended
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
            self._end_tree(pid)
            self._write_status(detail=f"keeper error: {exc!r}")
            return 1

    def _spawn(self) -> tuple[int | None, int, int, dict[str, Any]]:
        try:
            spec = read_spec(self.job_dir)
        except Exception as exc:
            raise _SpawnFailed(f"bad spec: {exc}") from None
        if spec is None:
            raise _SpawnFailed(f"missing {os.path.join(self.job_dir, 'spec.json')}")
        command = spec.get("command")
        if (
            not isinstance(command, list)
            or not command
            or not all(isinstance(a, str) for a in command)
        ):
            raise _SpawnFailed(f"bad spec: command must be a non-empty list of strings, got {command!r}")
        env = spec.get("env")
        if env is None:
            env = dict(os.environ)
        cwd = spec.get("cwd")
        if cwd:
            try:
                os.chdir(cwd)
            except OSError as exc:
                raise _SpawnFailed(f"cannot use cwd {cwd!r}: {exc.strerror}") from None
        cpus = spec.get("cpus")
        if spec.get("pin") and cpus:
            try:
                os.sched_setaffinity(0, cpus)
            except (OSError, ValueError, TypeError) as exc:
                raise _SpawnFailed(f"cannot pin to cpus {cpus!r}: {exc}") from None
        try:  # the job's groups / systemd scope (motor/isolation/join.py)
            joined = join_confinement(spec)
        except JoinError as exc:
            raise _SpawnFailed(str(exc)) from None
        if self.cancel_requested:
            return None, -1, -1, spec

        cmd0 = command[0]
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        self.started_at_ms = _now_ms()
        restore_oom = _raise_oom_score_for_spawn() if joined else None
        try:
            exe = _resolve_executable(cmd0, env)
            argv = command
            job_umask = spec.get("umask")  # the job runs with the operator's umask, we keep 077
            keeper_umask = os.umask(job_umask) if isinstance(job_umask, int) else None
            try:
                pid = os.posix_spawn(
                    exe,
                    argv,
                    env,
                    file_actions=[
                        (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                        (os.POSIX_SPAWN_DUP2, out_w, 1),
                        (os.POSIX_SPAWN_DUP2, err_w, 2),
                    ],
                    setpgroup=0,
                    setsigdef=_SIGDEF,
                    setsigmask=(),
                )
            finally:
                if keeper_umask is not None:
                    os.umask(keeper_umask)
        except OSError as exc:
            for fd in (out_r, out_w, err_r, err_w):
                os.close(fd)
            what = exc.strerror or str(exc)
            raise _SpawnFailed(f"cannot execute {cmd0!r}: {what}") from None
        except (ValueError, TypeError) as exc:  # e.g. NUL bytes, non-str env
            for fd in (out_r, out_w, err_r, err_w):
                os.close(fd)
            raise _SpawnFailed(f"cannot execute {cmd0!r}: {exc}") from None
        finally:
            if restore_oom is not None:
                _set_oom_score_adj(restore_oom)
        os.close(out_w)
        os.close(err_w)
        faults.hit("keeper.spawned")  # tests: the job runs, keeper.json lacks its pid
        me_pid = os.getpid()
        try:
            # The claim (written by the forkserver) already names us; now add the job.
            write_json_atomic(
                os.path.join(self.job_dir, KEEPER_FILE),
                {
                    "keeper_pid": me_pid,
                    "keeper_create_time": proc_create_time(me_pid),
                    "job_pid": pid,
                    "job_create_time": proc_create_time(pid),
                    "started_at_ms": self.started_at_ms,
                },
            )
        except OSError as exc:  # e.g. disk full: the claim stands, still supervise the job
            self.keeper_json_error = f"cannot add the job's pid to {KEEPER_FILE}: {exc}"
        return pid, out_r, err_r, spec

    def _signal_tree(self, pid: int, sig: int) -> None:
        """Signal the job's process group and every other descendant of the keeper."""
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass
        for other in _descendants(os.getpid()):
            try:
                os.kill(other, sig)
            except ProcessLookupError:
                pass

    def _reap_orphans(self, main_pid: int) -> None:
        """Reap exited orphans re-parented to us; stop at the job's main process (its
        exit is handled, and everything left reaped, by the main loop)."""
        while True:
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if info is None or info.si_pid == main_pid:
                return
            try:
                os.waitpid(info.si_pid, 0)
            except ChildProcessError:
                pass

    def _end_tree(self, main_pid: int) -> bool:
        """After the main process was reaped: SIGKILL and reap everything left below us.

        Cheap in the common case: once the job's process group is empty and we have no
        child left, nothing of the tree can remain (a survivor outside the group
        would have been re-parented to us). Only while children remain is /proc scanned.
        Returns False when something was still there after REAP_TIMEOUT_S (a process
        stuck in the kernel).
        """
        deadline = time.monotonic() + REAP_TIMEOUT_S
        group_gone = False  # once empty, a group never comes back (and its id may be reused)
        while True:
            if not group_gone:
                try:
                    os.killpg(main_pid, signal.SIGKILL)
                except ProcessLookupError:
                    group_gone = True
            children = True
            while True:  # reap what is ours (re-parented orphans)
                try:
                    reaped, _ = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    children = False
                    break
                if reaped == 0:
                    break
            if group_gone and not children:
                return True
            if children:
                for other in _descendants(os.getpid()):
                    try:
                        os.kill(other, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.002)

    def _supervise(
        self, pid: int, out_r: int, err_r: int, wake_r: int, spec: dict[str, Any]
    ) -> int:
        start = time.monotonic()
        timeout_s = spec.get("timeout_s")
        grace = spec.get("kill_grace_s")
        grace = DEFAULT_KILL_GRACE_S if grace is None else float(grace)
        timeout_at = start + float(timeout_s) if timeout_s is not None else None
        streams = {out_r: STDOUT, err_r: STDERR}
        reason: str | None = None
        kill_at: float | None = None
        exited = False
        wait_status = 0
        rusage = None
        drain_until = 0.0
        tree_ended = True

        while True:
            now = time.monotonic()
            if not exited:
                # Peek without reaping: while the zombie leader exists its
                # process group id cannot be reused, so killpg is safe.
                info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                if info is not None:
                    exited = True
                    # leftover background processes: the group now, the rest (re-parented
                    # to us) once the main process is reaped
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    _, wait_status, rusage = os.wait4(pid, 0)
                    tree_ended = self._end_tree(pid)
                    drain_until = now + DRAIN_TIMEOUT_S
            if not exited:
                if reason is None:
                    if self.cancel_requested:
                        reason = "cancelled"
                    elif timeout_at is not None and now >= timeout_at:
                        reason = "timed_out"
                    if reason is not None:
                        self._signal_tree(pid, signal.SIGTERM)
                        kill_at = now + grace
                if kill_at is not None and now >= kill_at:
                    self._signal_tree(pid, signal.SIGKILL)
                    kill_at = None
            elif not streams or now >= drain_until:
                break
            if self.retry_output_at is not None and now >= self.retry_output_at:
                self.flush_output()

            deadlines = []
            if self.retry_output_at is not None:
                deadlines.append(self.retry_output_at)
            if exited:
                deadlines.append(drain_until)
            else:
                if reason is None and timeout_at is not None:
                    deadlines.append(timeout_at)
                if kill_at is not None:
                    deadlines.append(kill_at)
            wait = max(0.0, min(deadlines) - now) if deadlines else None
            ready, _, _ = select.select([*streams, wake_r], [], [], wait)
            for fd in ready:
                if fd == wake_r:
                    try:
                        while os.read(wake_r, 512):
                            pass
                    except BlockingIOError:
                        pass
                    if not exited and self.subreaper:
                        self._reap_orphans(pid)
                    continue
                data = os.read(fd, READ_CHUNK)
                if data:
                    self.write_record(streams[fd], data)
                else:
                    os.close(fd)
                    del streams[fd]

        details = []
        if streams:
            details.append(
                "output pipes still open %.0fs after the job exited (a process escaped "
                "the job's process tree); output may be truncated" % DRAIN_TIMEOUT_S
            )
            for fd in streams:
                os.close(fd)
        if not tree_ended:
            details.append(
                "processes of the job were still alive %.0fs after it ended" % REAP_TIMEOUT_S
            )
        self._flush_output_until_done()
        if self.keeper_json_error:
            details.append(self.keeper_json_error)
        if self.output_error:
            details.append(self.output_error)
        if reason == "timed_out":
            details.insert(0, f"timed out after {float(timeout_s):g}s")
        exit_code = os.WEXITSTATUS(wait_status) if os.WIFEXITED(wait_status) else None
        sig = os.WTERMSIG(wait_status) if os.WIFSIGNALED(wait_status) else None
        cpu_ms = round((rusage.ru_utime + rusage.ru_stime) * 1000) if rusage else 0
        self._write_status(
            exit_code=exit_code,
            signal=sig,
            reason=reason,
            detail="; ".join(details) or None,
            cpu_time_ms=cpu_ms,
        )
        return 0


def run_keeper(job_dir: str) -> int:
    """Run one job described by ``<job_dir>/spec.json`` to completion.

    Calls ``os.setsid()``, installs its signal handlers, spawns the job, writes
    ``keeper.json``, ``output.log`` and finally ``status.json``.  Returns the
    keeper's exit code (0 once status.json is written).  Meant to be called in
    a freshly forked process whose stdio points at /dev/null.
    """
    return _Keeper(job_dir).run()


def main(argv: list[str] | None = None) -> int:
    """``python -m motor.execution.keeper JOB_DIR``: run a keeper by hand (debugging)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m motor.execution.keeper JOB_DIR", file=sys.stderr)
        return 2
    return run_keeper(argv[0])


if __name__ == "__main__":
    sys.exit(main())
