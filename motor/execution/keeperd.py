"""keeperd: one long-lived keeper per state directory for every job (docs/keeper.md).

Started detached by the runner's spawner (``sys.executable <path to this file> STATE_DIR``,
stdout a pipe that receives one ready line) when no keeperd answers on
``<state>/keeperd.sock``. It holds ``<state>/keeperd.lock`` (flock) for its whole life, so
only one runs per state directory, and is ``PR_SET_CHILD_SUBREAPER`` for its jobs. One
event loop (epoll) watches the listening socket, the runner connections, each job's
pidfd and output pipes, and the timers (timeouts, kill grace, retries on a full disk).

Per job it does exactly what the per-job keeper (keeper.py) does, with the same files and
formats: the claim ``keeper.json`` first (exclusive link, naming keeperd, ``"kind":
"keeperd"``), the job spawned in its own process group (``posix_spawn``; fork+exec when the
job must join cgroups, so the join happens in the child before exec; on cgroup v1 a
pre-placed spare thread already in renamed groups spawns the job: spares.py), ``keeper.json``
completed with the job's pid, ``output.log`` framed records (held in memory up to 4 MiB while
the disk is full), ``status.json`` written atomically (retried without limit).

Protocol on the socket, one JSON object per line:

- on connect keeperd says ``{"keeperd": true, "pid": P, "create_time": T}``
- ``{"id": N, "op": "spawn", "job_dir": "/abs"}`` -> ``{"id": N, "pid": P, "create_time": T,
  "job_pid": J}`` (J null when the spawn failed: status.json says spawn_failed) or
  ``{"id": N, "error": "...", "code": "claimed" | "spawn_failed" | "bad_request"}``
- ``{"id": N, "op": "wait", "job_dir": "/abs"}`` -> ``{"id": N, "done": true}`` once the job's
  status.json is written (at once when keeperd does not keep that job)
- ``{"id": N, "op": "cancel", "job_dir": "/abs"}`` -> ``{"id": N, "sent": bool}``
- ``{"id": N, "op": "spares"}`` -> ``{"id": N, "size": S, "ready": [names], "joining": [names],
  "parents": {controller: dir}, "taken": T, "missed": M, "made": M2, "reused": R, "kept": K,
  "skipped_writes": W}``: the pre-placed threads (spares.py)
- ``{"id": N, "op": "prepare", "systemd_address"?: A, "slots"?: [scope], "spare_parents"?:
  {controller: dir}}`` -> ``{"id": N, "prepared": [...], "spares"?: [slices], "spare_pool"?:
  N, "error"?: "..."}``, once what it asks for is made: a runner's start. systemd: the D-Bus
  client imported and connected to A now rather than at its first job, and a slot spare made
  in each slot slice the runner made at its start; cgroup v1: the pool of spares filled in
  those parents (docs/keeper.md, "Prepared at the runner's start")

SIGTERM to keeperd cancels every job it keeps (as SIGTERM to a per-job keeper cancels its
job). It exits once it keeps no job and no runner has been connected for ``IDLE_EXIT_S``.

Stdlib only (plus the stdlib-only keeper/joblog modules).
"""

from __future__ import annotations

import os
import sys


if __name__ == "__main__" and not __package__:  # run by path: see scriptboot.py
    import scriptboot  # the script's own directory is sys.path[0] here

    scriptboot.bootstrap(__file__)

import collections  # noqa: E402
import fcntl  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import selectors  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from motor import faults  # noqa: E402
from motor.execution import keeper as K  # noqa: E402
from motor.execution import spares as S  # noqa: E402
from motor.execution.removals import GroupRemover  # noqa: E402
from motor.execution.slotspares import SlotSpares  # noqa: E402
from motor.isolation.cgroup import facts_when_empty_v1  # noqa: E402
from motor.isolation.join import (  # noqa: E402
    SCOPE_TIMEOUT_S, JoinError, fork_into_cgroup, join_confinement,
)
from motor.smallfiles import read_bytes  # noqa: E402
from motor.execution.joblog import (  # noqa: E402
    KEEPER_FILE, STATUS_FILE, STDERR, STDOUT, read_spec, write_json_atomic,
)

__all__ = ["KIND", "LOCK_NAME", "SOCKET_NAME", "START_LOCK_NAME", "main", "socket_address"]

KIND = "keeperd"
SOCKET_NAME = "keeperd.sock"
LOCK_NAME = "keeperd.lock"
#: Held (flock) by a runner while it looks for keeperd and, if none answers, starts one:
#: two runners racing for one state directory start one keeperd between them.
START_LOCK_NAME = "keeperd.start.lock"
#: keeperd exits after this long with no job and no runner connected.
IDLE_EXIT_S = 2.0
#: How long a starting keeperd waits for the lock (a predecessor may be exiting).
LOCK_WAIT_S = 3.0
#: keeper.json gets a job's pid and create time once the job has run this long; a job that
#: ends sooner never gets that rewrite (its status.json says how it ended). Nothing in motor
#: reads the pid back (the runner asks keeperd, and a job of a dead keeperd is lost
#: whatever keeper.json says); it is there for people and tools. Issue 14: reading a
#: just-spawned process's /proc/<pid>/stat and the create-and-rename of keeper.json cost
#: keeperd about a third of its time per short job.
RECORD_PID_AFTER_S = 0.1
RECORD_PID_AFTER_ENV = "MOTOR_KEEPERD_RECORD_PID_AFTER_S"  # tests: another delay

SUN_PATH_MAX = 107
JOB_MARKER = b"MOTOR_JOB_ID="


def record_pid_after_s(environ=os.environ) -> float:
    try:
        return max(0.0, float(environ.get(RECORD_PID_AFTER_ENV, RECORD_PID_AFTER_S)))
    except ValueError:
        return RECORD_PID_AFTER_S


def socket_address(state_dir: str) -> tuple[str, int | None]:
    """The address of ``<state_dir>/keeperd.sock`` to bind/connect, and a directory fd
    to close afterwards: a path longer than sun_path allows goes through
    ``/proc/self/fd/<dirfd>/keeperd.sock``."""
    path = os.path.join(state_dir, SOCKET_NAME)
    if len(os.fsencode(path)) <= SUN_PATH_MAX:
        return path, None
    dfd = os.open(state_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    return f"/proc/self/fd/{dfd}/{SOCKET_NAME}", dfd


#: a start this long after the previous one, with no other job running, is `_alone`
ALONE_AFTER_S = 0.05


def _now_ms() -> int:
    return int(time.time() * 1000)


def _children(pid: int) -> list[int]:
    """The direct children of ``pid`` (single-threaded: its main task's list)."""
    try:
        return [int(x) for x in read_bytes(f"/proc/{pid}/task/{pid}/children").split()]
    except OSError:
        return []


def _carries_marker(pid: int, job_id: bytes) -> bool:
    return _marker_of(pid) == job_id


def _marker_of(pid: int) -> bytes | None:
    """The job id in the process's marker (MOTOR_JOB_ID), or None."""
    try:
        env = read_bytes(f"/proc/{pid}/environ")
    except OSError:
        return None
    return next((v[len(JOB_MARKER):] for v in env.split(b"\0") if v.startswith(JOB_MARKER)), None)


def _kill_trees(roots: list[int]) -> None:
    """SIGKILL each of `roots` and every process below it (one pass over /proc): what an
    escapee started dies with it, not re-parented to keeperd after it, still running."""
    children = K._children_map()
    faults.hit("keeperd.kill_trees")  # tests: a process forked after the map was read
    _signal_down(list(roots), signal.SIGKILL, children)


def _signal_down(todo: list[int], sig: int, children: dict[int, list[int]]) -> None:
    """`sig` to each process of `todo` and to every process below it in `children`."""
    seen = set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass
        todo.extend(children.get(p, ()))


#: a job's CPU times as a slot spare relays them (the fields of a wait4 rusage keeperd reads)
_Times = collections.namedtuple("_Times", "ru_utime ru_stime")


class _SpawnFailed(Exception):
    pass


class Job(K.HeldOutput):
    """One job keeperd keeps: the same state the per-job keeper holds on its stack."""

    def __init__(self, job_dir: str) -> None:
        self.job_dir = job_dir
        self.job_id = os.path.basename(job_dir).encode()
        self.pid: int | None = None
        self.pidfd = -1
        self.streams: dict[int, int] = {}
        self.started_at_ms = _now_ms()
        self.start = time.monotonic()
        self.timeout_s: float | None = None
        self.timeout_at: float | None = None
        self.grace = K.DEFAULT_KILL_GRACE_S
        self.cancel_requested = False
        self.reason: str | None = None
        self.kill_at: float | None = None
        self.exited = False
        self.record_pid_at: float | None = None  # when keeper.json gets the job's pid
        self.wait_status = 0
        self.rusage: Any = None
        self.spare: Any = None  # the slot spare whose child the job is (slotspares.py)
        self.drain_until = 0.0
        self.init_output(job_dir)  # output.log and its hold while the disk is full
        self.keeper_json_error: str | None = None
        # the status, once known; retried until it lands
        self.status: dict[str, Any] | None = None
        self.status_retry_at: float | None = None
        self.status_delay = K.STATUS_RETRY_MIN_S
        self.status_fault_passed = False
        self.gone = False  # its directory was removed: its status could not be written
        self.watchers: list[tuple[Conn, Any]] = []
        self.watched_by_spawn = False  # the spawn request reserved the id of the end's word
        # a forked job on its way to exec: its error pipe, and the rest of its start
        self.exec_fd = -1
        self.exec_error = b""
        self.exec_rest: tuple[int, int, Any] | None = None
        self.reply_to: tuple[Conn, Any] | None = None
        #: a v1 cgroup job's groups (its spec's `cgroup_make` dirs): their facts go into
        #: status.json when the job ends (`_conclude`)
        self.cgroup_dirs: dict[str, str] | None = None
        self.cgroup_writes: Any = None  # and the limits written there (`cgroup_make`'s)
        #: a systemd job's scope in a slot slice (its spec's `systemd_scope`): the slice's
        #: counters go into status.json when the job ends (`_conclude`)
        self.slot_scope: dict | None = None
        #: when keeperd read the spawn request and saw the job's main process end
        #: (CLOCK_MONOTONIC, shared by every process of the host): the answers carry them
        #: (`"at"`: docs/keeper.md, "Timings in the answers"; bench/slot_cycle.py)
        self.asked = self.start
        self.exit_seen: float | None = None

    def set_status(self, **fields: Any) -> None:
        self.status = K.status_fields(self.started_at_ms, **fields)
        self.status_retry_at = time.monotonic()

    def try_write_status(self) -> bool:
        """One attempt: held output first, then status.json. False: retry later. A job
        whose directory is gone (removed under keeperd: its state dir deleted) is given up
        on at once: nobody can read its status any more, and retrying for ever would keep
        keeperd (and its spares) alive for ever."""
        if not self.status_fault_passed:
            faults.hit("keeper.status")  # tests: the job ended, status.json not written
            self.status_fault_passed = True
        if self.flush_output():
            try:
                write_json_atomic(os.path.join(self.job_dir, STATUS_FILE), self.status)
                self.status_retry_at = None
                return True
            except OSError:
                pass
        if not os.path.isdir(self.job_dir):
            self.status_retry_at = None
            self.gone = True
            return True
        self.status_retry_at = time.monotonic() + self.status_delay
        self.status_delay = min(K.STATUS_RETRY_MAX_S, self.status_delay * 2)
        return False

    def deadline(self) -> float | None:
        ds = [d for d in (self.retry_output_at, self.kill_at, self.status_retry_at) if d is not None]
        if not self.exited and self.reason is None and self.timeout_at is not None:
            ds.append(self.timeout_at)
        if self.exited and self.streams:
            ds.append(self.drain_until)
        if self.record_pid_at is not None and not self.exited:
            ds.append(self.record_pid_at)
        return min(ds) if ds else None


class Conn:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.inbuf = b""
        self.outbuf = bytearray()
        self.closed = False


class Keeperd:
    def __init__(self, state_dir: str, listener: socket.socket, lock_fd: int) -> None:
        self.state_dir = state_dir
        self.listener = listener
        self.lock_fd = lock_fd
        self.pid = os.getpid()
        self.create_time = K.proc_create_time(self.pid)
        self.sel = selectors.EpollSelector()
        self.jobs: dict[str, Job] = {}  # by job_dir
        self.mains: dict[int, Job] = {}  # by pid, until reaped
        # processes re-parented to us (`_strangers`): the job id each carries (None: none),
        # read once per process, until it is reaped (`_reap_orphans`)
        self.stranger_jobs: dict[int, bytes | None] = {}
        self.conns: list[Conn] = []
        self.idle_since: float | None = time.monotonic()
        self.terminate = False
        self.relisten = False  # SIGUSR1: listen on keeperd.sock again (`_relisten`)
        self.record_pid_after_s = record_pid_after_s()
        # its own CPUs: after spawning a pinned job that starts alone it goes to those the
        # job has not (`_alone`, spares.py `_after_pin`)
        self.home_cpus = frozenset(os.sched_getaffinity(0))
        self.last_start = -math.inf  # `_alone`
        # pre-placed threads for v1 cgroup jobs (motor/execution/spares.py)
        self.spares = S.SparePool(state_dir, self.sel, S.pool_size(), self._log)
        # ended v1 jobs' empty groups, removed in a thread (removals.py)
        self.removals = GroupRemover(self._log)
        # systemd jobs' scopes, over one long-lived connection to the manager (sdscopes.py),
        # made for the first systemd job: its D-Bus client is then imported (issue 14:
        # keeperd forks every job that joins its groups itself, and a smaller process forks
        # faster)
        self.scopes: Any = None
        # per slot slice, a process of keeperd's in a scope there that spawns the slot's
        # jobs in it: no unit per job (motor/execution/slotspares.py)
        self.slot_spares = SlotSpares(self.sel, self._log, self._scope_starter,
                                      self._spare_exit, self._spare_gone)
        #: "prepare" requests whose answer waits for what they asked for (`_answer_prepares`)
        self.preparing: list[tuple[Conn, dict]] = []

    # -- event loop ---------------------------------------------------------------------

    def run(self, wake_r: int) -> int:
        self.sel.register(self.listener, selectors.EVENT_READ, self._on_accept)
        self.sel.register(wake_r, selectors.EVENT_READ, lambda ev: self._on_signal(wake_r))
        while True:
            now = time.monotonic()
            if self.scopes is not None:  # a scope systemd did not start in time: its job fails
                self.scopes.tick(now)
            for job in list(self.jobs.values()):
                self._tick(job, now)
            if self.jobs or self.conns:
                self.idle_since = None
            elif self.idle_since is None:
                self.idle_since = now
            elif now - self.idle_since >= IDLE_EXIT_S:
                break
            deadlines = [d for d in (j.deadline() for j in self.jobs.values()) if d is not None]
            if self.idle_since is not None:
                deadlines.append(self.idle_since + IDLE_EXIT_S)
            for extra in (self.scopes and self.scopes.deadline(), self.spares.refill_deadline()):
                if extra is not None:
                    deadlines.append(extra)
            timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            if self.slot_spares.deferred:  # ends relayed during an order: handled now
                timeout = 0
            # Spares are made once nothing else is ready, one per turn (a request or an exec
            # that comes in between is served first; docs/isolation.md, "Spares").
            refill = self.spares.refill_due
            ready = self.sel.select(0 if refill else timeout)
            for key, events in ready:
                try:
                    key.data(events)
                except Exception:  # a keeperd bug must not take every job down with it
                    self._log_exception()
            self.slot_spares.flush()
            if refill and not ready:
                try:
                    self.spares.fill_one()
                except Exception:
                    self._log_exception()
            if self.preparing:
                self._answer_prepares()
        self.slot_spares.close()
        if self.scopes is not None:
            self.scopes.close()
        self._shutdown()
        return 0

    def _log(self, line: str) -> None:
        try:
            with open(os.path.join(self.state_dir, "keeperd.log"), "a") as f:
                f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} keeperd {self.pid}: {line}\n")
        except OSError:
            pass

    def _log_exception(self) -> None:
        import traceback

        try:
            with open(os.path.join(self.state_dir, "keeperd.log"), "a") as f:
                f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} keeperd {self.pid}: "
                        f"{traceback.format_exc()}\n")
        except OSError:
            pass

    def _shutdown(self) -> None:
        """Stop answering: remove our socket (only if it is still ours), then exit (the
        lock goes with the process). The spares go first."""
        self.spares.close()
        self.removals.close()
        path = os.path.join(self.state_dir, SOCKET_NAME)
        try:
            if os.stat(path).st_ino == self.sock_ino:
                os.unlink(path)
        except (OSError, AttributeError):
            pass
        self.listener.close()

    def _on_signal(self, wake_r: int) -> None:
        try:
            while os.read(wake_r, 512):
                pass
        except BlockingIOError:
            pass
        if self.terminate:
            self.terminate = False
            for job in self.jobs.values():
                job.cancel_requested = True
        if self.relisten:
            self.relisten = False
            self._relisten()
        self._reap_orphans()

    def _relisten(self) -> None:
        """SIGUSR1 (a runner found the lock held and no socket): listen again when
        ``keeperd.sock`` is not ours any more (removed, say by a clean-up of old files), so
        the jobs kept here are reached again (docs/keeper.md, "A socket gone")."""
        path = os.path.join(self.state_dir, SOCKET_NAME)
        try:
            if os.stat(path).st_ino == self.sock_ino:
                return
        except FileNotFoundError:
            pass
        except OSError:
            self._log_exception()
            return
        try:
            listener, self.sock_ino = _listen(self.state_dir)
        except OSError:
            self._log_exception()
            return
        self.sel.unregister(self.listener)
        self.listener.close()
        self.listener = listener
        self.sel.register(listener, selectors.EVENT_READ, self._on_accept)
        self._log(f"{path} was not this keeperd's socket any more: listening on it again")

    def _strangers(self) -> list[int]:
        """Our children that are no job's main process: processes re-parented to us (we
        are the jobs' subreaper)."""
        spares = self.slot_spares.pids()
        return [p for p in _children(self.pid) if p not in self.mains and p not in spares]

    def _reap_orphans(self, strangers: list[int] | None = None) -> None:
        """Reap exited processes re-parented to us (`strangers`, if just read); never a
        job's main process (its pidfd handler reaps it with its rusage). One still alive
        whose job's main process has exited (or whose job is not ours any more) is killed
        with what runs below it: a process of the job that was orphaned after the job's end
        (`_exited` kills those orphaned before it)."""
        late = []
        for pid in self._strangers() if strangers is None else strangers:
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    self.stranger_jobs.pop(pid, None)
                    continue
            except ChildProcessError:
                self.stranger_jobs.pop(pid, None)
                continue
            if pid not in self.stranger_jobs:
                self.stranger_jobs[pid] = _marker_of(pid)
            if (job_id := self.stranger_jobs[pid]) is not None and not self._job_runs(job_id):
                late.append(pid)
        if late:
            _kill_trees(late)

    def _job_runs(self, job_id: bytes) -> bool:
        """Whether the job's main process is still running here."""
        return any(j.job_id == job_id and not j.exited for j in self.jobs.values())

    # -- connections --------------------------------------------------------------------

    def _on_accept(self, events: int) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            sock.setblocking(False)
            conn = Conn(sock)
            self.conns.append(conn)
            self.sel.register(sock, selectors.EVENT_READ, lambda ev, c=conn: self._on_conn(c, ev))
            self._send(conn, {"keeperd": True, "pid": self.pid, "create_time": self.create_time})

    def _on_conn(self, conn: Conn, events: int) -> None:
        if events & selectors.EVENT_WRITE:
            self._flush_conn(conn)
        if conn.closed or not events & selectors.EVENT_READ:
            return
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close_conn(conn)
            return
        conn.inbuf += data
        while not conn.closed:
            nl = conn.inbuf.find(b"\n")
            if nl < 0:
                break
            line, conn.inbuf = conn.inbuf[:nl], conn.inbuf[nl + 1:]
            if line.strip():
                self._request(conn, line)

    def _close_conn(self, conn: Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        try:
            self.sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        self.conns.remove(conn)
        if not self.conns:  # spares serve a runner's starts: none without a runner
            self.spares.drop()
        for job in self.jobs.values():
            job.watchers = [w for w in job.watchers if w[0] is not conn]

    def _send(self, conn: Conn, obj: dict) -> None:
        if conn.closed:
            return
        conn.outbuf += json.dumps(obj, separators=(",", ":")).encode() + b"\n"
        self._flush_conn(conn)

    def _flush_conn(self, conn: Conn) -> None:
        try:
            while conn.outbuf:
                n = conn.sock.send(conn.outbuf)
                del conn.outbuf[:n]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._close_conn(conn)
            return
        mask = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.outbuf else 0)
        try:
            self.sel.modify(conn.sock, mask, self.sel.get_key(conn.sock).data)
        except (KeyError, ValueError):
            pass

    def _request(self, conn: Conn, line: bytes) -> None:
        req_id = None
        try:
            req = json.loads(line)
            req_id = req.get("id")
            op = req["op"]
            if op == "spares":  # operators and tests: the pre-placed processes (spares.py)
                self._send(conn, {"id": req_id, **self.spares.describe()})
                return
            if op == "prepare":  # a runner's start: what its first jobs would make
                self.preparing.append((conn, {"id": req_id, **self._prepare(req)}))
                self._answer_prepares()
                return
            job_dir = req["job_dir"]
            if not isinstance(job_dir, str) or not os.path.isabs(job_dir):
                raise ValueError(f"job_dir must be an absolute path, got {job_dir!r}")
            job_dir = os.path.normpath(job_dir)
        except Exception as exc:
            self._send(conn, {"id": req_id, "code": "bad_request", "error": f"bad request: {exc}"})
            return
        if op == "spawn":
            answer = self._spawn(job_dir, conn, req_id, req.get("watch"))
            if answer is not None:
                self._send(conn, {"id": req_id, **answer})
        elif op == "wait":
            job = self.jobs.get(job_dir)
            if job is None:
                self._send(conn, {"id": req_id, "done": True})
            else:
                job.watchers.append((conn, req_id))
        elif op == "cancel":
            job = self.jobs.get(job_dir)
            if job is not None and job.status is None:
                job.cancel_requested = True
            self._send(conn, {"id": req_id, "sent": job is not None})
        else:
            self._send(conn, {"id": req_id, "code": "bad_request", "error": f"unknown op {op!r}"})

    # -- a job's start ------------------------------------------------------------------

    def _spawn(self, job_dir: str, conn: Conn, req_id: Any, watch: Any = None) -> dict | None:
        """Claim and start the job. A refusal is returned (the caller sends it); otherwise
        the answer is sent here once the job runs (a forked job still on its way to exec:
        later, from _on_exec); keeper.json gets the job's pid if it still runs
        `RECORD_PID_AFTER_S` later (`_record_pid`, from `_tick`).
        `watch`: a second request id the spawner reserved for the job's end; it is told
        `{"id": watch, "done": true}` as a `wait` would be, and the answer says
        `"watching": true` (one request less per job)."""
        asked = time.monotonic()
        if job_dir in self.jobs:
            return {"code": "claimed", "error": f"{job_dir} already has a keeper (keeperd keeps it)"}
        # The start steps keep the forkserver's point names (motor/faults.py): the same
        # step of the start protocol, in the process that spawns.
        faults.hit("forkserver.forked")  # tests: the request is in, the claim not written
        try:
            K.claim_job_dir(job_dir, self.pid, self.create_time, kind=KIND)
        except FileExistsError:
            return {"code": "claimed", "error": f"{job_dir} already has a keeper (keeper.json exists)"}
        except OSError as exc:
            return {"code": "spawn_failed", "error": "cannot record the keeper's identity in "
                    f"{os.path.join(job_dir, KEEPER_FILE)}: {exc}"}
        faults.hit("forkserver.claimed")  # tests: claimed, the job not yet spawned
        job = Job(job_dir)
        job.asked = asked
        self.jobs[job_dir] = job
        if watch is not None:
            job.watchers.append((conn, watch))
            job.watched_by_spawn = True
        job.reply_to = (conn, req_id)
        try:
            self._start(job)
        except _SpawnFailed as exc:
            self._spawn_failed(job, str(exc))
        if job.exec_fd >= 0:
            return None
        job.reply_to = None
        self._send(conn, self._answer(job, req_id))
        return None

    def _answer(self, job: Job, req_id: Any) -> dict:
        answer = {"id": req_id, "pid": self.pid, "create_time": self.create_time,
                  "job_pid": job.pid, "at": [job.asked, time.monotonic()]}
        if job.watched_by_spawn:
            answer["watching"] = True
        return answer

    def _spawn_failed(self, job: Job, detail: str) -> None:
        job.write_record(STDERR, f"motor keeper: {detail}\n".encode(errors="replace"))
        job.exited = True
        job.set_status(exit_code=K.SPAWN_FAILED_EXIT_CODE, reason="spawn_failed", detail=detail)
        self._tick(job, time.monotonic())

    def _on_exec(self, job: Job) -> None:
        """The forked job exec'd (its close-on-exec error pipe hit EOF) or reported why it
        could not (then it exits 127 and is reaped here): finish its start, answer."""
        chunk = os.read(job.exec_fd, 4096)
        if chunk:
            job.exec_error += chunk
            return  # until EOF: the child writes its reason, then exits
        self.sel.unregister(job.exec_fd)
        os.close(job.exec_fd)
        job.exec_fd = -1
        out_r, err_r, timeout_s = job.exec_rest
        job.exec_rest = None
        pid = job.pid
        assert pid is not None
        if job.exec_error:
            for fd in (out_r, err_r):
                os.close(fd)
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
            del self.mains[pid]
            job.pid = None
            self._spawn_failed(job, job.exec_error.decode(errors="replace"))
        else:
            self._started(job, pid, out_r, err_r, timeout_s)
        if job.reply_to is not None:
            conn, req_id = job.reply_to
            job.reply_to = None
            self._send(conn, self._answer(job, req_id))

    def _start(self, job: Job) -> None:
        try:
            spec = read_spec(job.job_dir)
        except Exception as exc:
            raise _SpawnFailed(f"bad spec: {exc}") from None
        if spec is None:
            raise _SpawnFailed(f"missing {os.path.join(job.job_dir, 'spec.json')}")
        if isinstance(spec.get("job_id"), str):
            job.job_id = spec["job_id"].encode()
        command = spec.get("command")
        if not isinstance(command, list) or not command or not all(isinstance(a, str) for a in command):
            raise _SpawnFailed(f"bad spec: command must be a non-empty list of strings, got {command!r}")
        env = spec.get("env")
        if env is None:
            env = dict(os.environ)
        timeout_s = spec.get("timeout_s")
        grace = spec.get("kill_grace_s")
        job.grace = K.DEFAULT_KILL_GRACE_S if grace is None else float(grace)
        job.cgroup_dirs = _cgroup_dirs(spec)
        if job.cgroup_dirs:
            job.cgroup_writes = _cgroup_writes(spec)
        if isinstance(scope := spec.get("systemd_scope"), dict) and scope.get("slot") is True:
            job.slot_scope = scope
        cmd0 = command[0]
        try:
            exe = K._resolve_executable(cmd0, env)
        except OSError as exc:
            raise _SpawnFailed(f"cannot execute {cmd0!r}: {exc.strerror or exc}") from None
        argv = command
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        job.started_at_ms = _now_ms()
        try:
            # a spare's thread already in the job's groups spawns it, or the job joins its
            # groups (or systemd scope) before exec, or nothing to join
            pid, exec_fd = self._from_spare(spec, exe, argv, env, out_w, err_w), -1
            if pid is None and (scope := spec.get("systemd_scope")):
                # born in its slot's scope, or forked into a scope of its own (and the
                # slot's spare made after that)
                pid = self._from_slot_spare(job, spec, scope, exe, argv, env, out_w, err_w)
                if pid is None:
                    pid, exec_fd = self._fork_exec(spec, exe, argv, env, out_w, err_w, cmd0)
                    self.slot_spares.want(scope)
            elif pid is None and spec.get("cgroup_procs"):
                pid, exec_fd = self._fork_exec(spec, exe, argv, env, out_w, err_w, cmd0)
            elif pid is None:
                pid = self._posix_spawn(spec, exe, argv, env, out_w, err_w,
                                        alone=self._alone(job))
        except BaseException:
            for fd in (out_r, err_r):
                os.close(fd)
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        job.pid = pid
        self.mains[pid] = job  # ours to reap, never the orphan reaper's
        if exec_fd >= 0:  # forked: joining its groups may take a while, others go on
            job.exec_fd = exec_fd
            job.exec_rest = (out_r, err_r, timeout_s)
            self.sel.register(exec_fd, selectors.EVENT_READ, lambda ev, j=job: self._on_exec(j))
            return
        self._started(job, pid, out_r, err_r, timeout_s)

    def _alone(self, job: Job) -> bool:
        """Whether `job` starts alone: after `ALONE_AFTER_S` without a start, and with no
        other job of keeperd's still running (a start in a stream of starts is not: its
        CPUs are busy whatever keeperd does)."""
        now, before = time.monotonic(), self.last_start
        self.last_start = now
        return (now - before >= ALONE_AFTER_S
                and not any(other is not job and not other.exited for other in self.jobs.values()))

    def _started(self, job: Job, pid: int, out_r: int, err_r: int, timeout_s: Any) -> None:
        job.start = time.monotonic()
        job.record_pid_at = job.start + self.record_pid_after_s
        if timeout_s is not None:
            job.timeout_s = float(timeout_s)
            job.timeout_at = job.start + job.timeout_s
        if job.spare is None:  # else the spare reaps the job and relays its end
            self._watch_exit(job)
        for fd, stream in ((out_r, STDOUT), (err_r, STDERR)):
            os.set_blocking(fd, False)
            job.streams[fd] = stream
            self.sel.register(fd, selectors.EVENT_READ, lambda ev, j=job, f=fd: self._on_output(j, f))

    def _record_pid(self, job: Job) -> None:
        """keeper.json gets the job's pid, `RECORD_PID_AFTER_S` after the spawn's answer
        (which carries it), if the job still runs: the claim already names keeperd, and a
        keeper.json without the job's pid is a state adoption knows (`keeper.spawned`);
        the write (a create and a rename on the state directory) and the read of the new
        process's /proc/<pid>/stat are off the start's round trip and off short jobs."""
        if job.pid is None:  # it could not be spawned: the claim stays as it is
            return
        faults.hit("keeper.spawned")  # tests: the job runs, keeper.json lacks its pid
        try:
            write_json_atomic(os.path.join(job.job_dir, KEEPER_FILE), {
                "keeper_pid": self.pid, "keeper_create_time": self.create_time,
                "job_pid": job.pid, "job_create_time": K.proc_create_time(job.pid),
                "started_at_ms": job.started_at_ms, "kind": KIND})
        except OSError as exc:
            job.keeper_json_error = f"cannot add the job's pid to {KEEPER_FILE}: {exc}"

    def _from_spare(self, spec, exe, argv, env, out_w, err_w) -> int | None:
        """A v1 job whose groups keeperd makes (`cgroup_make`): a spare's groups become the
        job's, and the spare's thread (already inside them) spawns the job there. None
        when no spare is ready (the first job of a parent, a burst): the job forks and
        joins as before."""
        make = spec.get("cgroup_make")
        if not make:
            return None
        self.spares.learn(make)
        spare = self.spares.take(make)
        if spare is None or not self.spares.claim(spare, make):
            return None
        try:
            return self.spares.order(spare, S.orders_of(spec, exe, argv, env), out_w, err_w)
        except S.ExecError as exc:
            raise _SpawnFailed(str(exc)) from None

    def _from_slot_spare(self, job: Job, spec, scope, exe, argv, env, out_w,
                         err_w) -> int | None:
        """A systemd job in a slot slice whose spare is ready: the spare spawns it in its
        scope and relays its end (motor/execution/slotspares.py). None when the slot has
        no ready spare."""
        spare = self.slot_spares.ready(scope)
        if spare is None:
            return None
        try:
            pid = self.slot_spares.order(spare, S.orders_of(spec, exe, argv, env), out_w, err_w)
        except S.ExecError as exc:
            raise _SpawnFailed(str(exc)) from None
        if pid is not None:
            job.spare = spare
        return pid

    def _prepare(self, req: dict) -> dict:
        """A runner's start (op "prepare"): what its first jobs would make, made now; the
        answer waits until it is made (`_answer_prepares`). A failure is only logged: the
        first job tries again and says why.

        - A systemd runner names its manager (`systemd_address`): the D-Bus client is
          imported and its connection opened (35 ms of keeperd's first systemd job before,
          the import alone). The slot slices it made at its start (`slots`, their scopes as
          in a spec's `systemd_scope`) get their spares now, not after their first jobs
          (docs/isolation.md, "Slots made at the start"); the answer waits until their
          scopes have started or failed (`"spares"`: the slots whose spare is ready).
        - A cgroup v1 runner names its parent groups (`spare_parents`, by controller): the
          pool of spares fills there now, not at the first job (which then had no spare and
          joined its groups itself); the answer waits until no spare is still joining and
          no refill is due (`SparePool.settled`; `"spare_pool"`: how many are ready).
        """
        prepared: dict = {"prepared": []}
        parents = req.get("spare_parents")
        if (isinstance(parents, dict) and "cpuset" in parents
                and all(isinstance(d, str) and os.path.isabs(d) for d in parents.values())):
            self.spares.use({str(c): os.path.normpath(d) for c, d in parents.items()})
            prepared = {"prepared": ["cgroup"], "spare_pool": None}
        address = req.get("systemd_address")
        if not isinstance(address, str):
            return prepared
        try:
            self._scope_starter().connect(address)
        except Exception as exc:
            self._log(f"keeperd: cannot prepare the connection to systemd ({address}): {exc}")
            return {**prepared, "error": str(exc)}
        slots = req.get("slots")
        wanted = [scope for scope in (slots if isinstance(slots, list) else ())
                  if isinstance(scope, dict) and scope.get("slot") is True
                  and scope.get("address") == address and isinstance(scope.get("slice"), str)
                  and scope["slice"].endswith(".slice")]
        for scope in wanted:
            self.slot_spares.want(scope)
        return {**prepared, "prepared": [*prepared["prepared"], "systemd"],
                "spares": [scope["slice"] for scope in wanted]}

    def _answer_prepares(self) -> None:
        """Answer each waiting "prepare" whose slot spares have started or failed and whose
        pool of spares has settled (`SparePool.settled`); forget those whose runner left."""
        for entry in list(self.preparing):
            conn, answer = entry
            slots = answer.get("spares", [])
            pool = "spare_pool" in answer
            if not conn.closed and (self.slot_spares.starting(slots)
                                    or (pool and not self.spares.settled)):
                continue
            self.preparing.remove(entry)
            if slots:
                answer["spares"] = self.slot_spares.ready_of(slots)
            if pool:
                answer["spare_pool"] = sum(s.ready for s in self.spares.spares.values())
            self._send(conn, answer)

    def _scope_starter(self):
        """The ScopeStarter, made for the first systemd job (its D-Bus client imported then)."""
        if self.scopes is None:
            from motor.execution.sdscopes import ScopeStarter

            self.scopes = ScopeStarter(self.sel, self._log)
        return self.scopes

    def _posix_spawn(self, spec, exe, argv, env, out_w, err_w, *, alone: bool) -> int:
        """No cgroup to join: keeperd takes the job's cwd, affinity and umask for the
        moment of the spawn (the child inherits them), then goes back: to `/` and its umask,
        and to its own CPUs (`home_cpus`), less the job's when it starts `alone`."""
        try:
            return S.spawn_job(S.orders_of(spec, exe, argv, env), out_w, err_w, oom_bump=False,
                               home=self.home_cpus, alone=alone)
        except S.ExecError as exc:
            raise _SpawnFailed(str(exc)) from None

    def _fork_exec(self, spec, exe, argv, env, out_w, err_w, cmd0) -> tuple[int, int]:
        """The job joins its cgroups before exec (posix_spawn cannot): fork, and in the
        child join (one call: motor/isolation/join.py join_confinement), chdir, pin, umask,
        exec. A job with one v2 group is born in it instead (clone3 with CLONE_INTO_CGROUP:
        no migration, nothing to join). Errors come back over a close-on-exec pipe, so a
        failed exec is a spawn failure.

        A systemd job's scope is keeperd's to start (sdscopes.py: one connection for all
        jobs): the child waits on a pipe for keeperd's word (b"g", or b"e" and why not)
        before it execs, and keeperd asks systemd for the scope with the child's pid."""
        scope = spec.get("systemd_scope")
        if scope:  # the first systemd job: its D-Bus client made before the fork
            self._scope_starter()
        err_r, err_w2 = os.pipe()
        go_r = go_w = -1
        if scope:
            go_r, go_w = os.pipe()
            spec = {k: v for k, v in spec.items() if k != "systemd_scope"}
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGCHLD})
        procs = spec.get("cgroup_procs") or ()
        born_inside = False
        try:
            if len(procs) == 1 and not spec.get("systemd_scope"):
                try:  # one group: a v2 group (a v1 job has one per hierarchy)
                    pid = fork_into_cgroup(os.path.dirname(procs[0]))
                    born_inside = True
                except OSError:  # not v2, or no clone3 here: fork, and the child joins
                    pid = os.fork()
            else:
                pid = os.fork()
        except OSError as exc:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
            for fd in (err_r, err_w2, go_r, go_w):
                if fd >= 0:
                    os.close(fd)
            raise _SpawnFailed(f"cannot execute {cmd0!r}: fork failed: {exc}") from None
        if pid == 0:  # the child: never returns
            msg = "exec failed"
            try:
                signal.set_wakeup_fd(-1)
                for s in K._SIGDEF:
                    signal.signal(s, signal.SIG_DFL)
                os.setpgid(0, 0)
                try:  # the job's groups / systemd scope (motor/isolation/join.py)
                    if not born_inside:
                        join_confinement(spec)
                    if go_r >= 0:
                        os.close(go_w)
                        _wait_for_scope(go_r, scope["scope"])
                except JoinError as exc:
                    msg = str(exc)
                    raise
                try:  # cwd, CPUs, oom_score_adj, umask, stdio, execve
                    S.become_job(S.orders_of(spec, exe, argv, env), out_w, err_w)
                except S.ExecError as exc:
                    msg = str(exc)
                    raise
            except BaseException:
                S.tell_failure(err_w2, msg)
            finally:
                os._exit(K.SPAWN_FAILED_EXIT_CODE)
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        os.close(err_w2)
        if go_r >= 0:
            os.close(go_r)
            self.scopes.start(scope, pid, lambda why: _tell_child(go_w, why))
        return pid, err_r  # EOF on err_r: exec'd (see _on_exec)

    # -- a running job ------------------------------------------------------------------

    def _on_output(self, job: Job, fd: int) -> None:
        try:
            data = os.read(fd, K.READ_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        if data:
            job.write_record(job.streams[fd], data)
            return
        self.sel.unregister(fd)
        os.close(fd)
        del job.streams[fd]
        if job.exited and not job.streams:
            self._tick(job, time.monotonic())

    def _orphans_of(self, job: Job, strangers: list[int] | None = None) -> list[int]:
        """Processes re-parented to keeperd (`strangers`, if just read) that carry the job's
        marker (a child that left the job's process group, e.g. with setsid, whose parent
        exited)."""
        return [p for p in (self._strangers() if strangers is None else strangers)
                if _carries_marker(p, job.job_id)]

    def _signal_tree(self, job: Job, sig: int) -> None:
        """The job's process group, its main process's descendants, and its orphans (with
        theirs): what the per-job keeper reaches as "every descendant of mine"."""
        assert job.pid is not None
        try:
            os.killpg(job.pid, sig)
        except ProcessLookupError:
            pass
        children = K._children_map()
        _signal_down([*self._orphans_of(job), *children.get(job.pid, ())], sig, children)

    def _watch_exit(self, job: Job) -> None:
        job.pidfd = os.pidfd_open(job.pid)
        self.sel.register(job.pidfd, selectors.EVENT_READ, lambda ev, j=job: self._on_exit(j))

    def _spare_exit(self, pid: int, status: int, utime: float, stime: float) -> None:
        """A job a slot spare spawned ended; the spare killed its group and reaped it."""
        job = self.mains.get(pid)
        if job is None or job.spare is None:
            return
        del self.mains[pid]
        job.wait_status, job.rusage = status, _Times(utime, stime)
        self._exited(job)

    def _spare_gone(self, spare: Any) -> None:
        """A slot spare ended (killed with its scope, say): its running jobs were re-parented
        to keeperd, their subreaper, and are reaped here from now on; one it reaped but
        whose end it did not relay is concluded without an exit status."""
        for pid, job in list(self.mains.items()):
            if job.spare is not spare:
                continue
            job.spare = None
            try:
                self._watch_exit(job)
            except ProcessLookupError:
                del self.mains[pid]
                job.wait_status, job.rusage = None, None
                job.output_error = ((job.output_error + "; ") if job.output_error else "") + (
                    "the job's exit status was lost with its slot's spare process")
                self._exited(job)

    def _on_exit(self, job: Job) -> None:
        """The main process exited (pidfd readable; not reaped yet, so its process group
        id is still pinned): kill the group, reap it with its rusage, kill what is left."""
        assert job.pid is not None
        pid = job.pid
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _, job.wait_status, job.rusage = os.wait4(pid, 0)
        del self.mains[pid]
        self.sel.unregister(job.pidfd)
        os.close(job.pidfd)
        job.pidfd = -1
        self._exited(job)

    def _exited(self, job: Job) -> None:
        """The job's main process is reaped: kill what is left of it, drain its output."""
        job.exit_seen = time.monotonic()
        # left-overs that escaped the group: re-parented to us, found by the job marker
        # (only looked for when we have a child that is no job's main process); our
        # children are read once for both this and the reaping below
        strangers = self._strangers()
        if strangers and (orphans := self._orphans_of(job, strangers)):
            _kill_trees(orphans)  # with what runs below them (before stop 56: not)
        job.exited = True
        job.drain_until = time.monotonic() + K.DRAIN_TIMEOUT_S
        self._reap_orphans(strangers)
        self._tick(job, time.monotonic())

    def _tick(self, job: Job, now: float) -> None:
        if job.record_pid_at is not None and (job.exited or now >= job.record_pid_at):
            job.record_pid_at = None
            if not job.exited:
                self._record_pid(job)
        if job.status is None and not job.exited and job.exec_fd < 0:  # (not while exec'ing)
            if job.reason is None:
                if job.cancel_requested:
                    job.reason = "cancelled"
                elif job.timeout_at is not None and now >= job.timeout_at:
                    job.reason = "timed_out"
                if job.reason is not None:
                    self._signal_tree(job, signal.SIGTERM)
                    job.kill_at = now + job.grace
            if job.kill_at is not None and now >= job.kill_at:
                self._signal_tree(job, signal.SIGKILL)
                job.kill_at = None
        if job.retry_output_at is not None and now >= job.retry_output_at:
            job.flush_output()
        if job.status is None and job.exited and (not job.streams or now >= job.drain_until):
            self._conclude(job)
        if job.status is not None and job.status_retry_at is not None and now >= job.status_retry_at:
            if job.try_write_status():
                self._done(job)

    def _conclude(self, job: Job) -> None:
        """Output drained (or given up on): the status to record."""
        details = []
        if job.streams:
            details.append(
                "output pipes still open %.0fs after the job exited (a process escaped "
                "the job's process tree); output may be truncated" % K.DRAIN_TIMEOUT_S)
            for fd in list(job.streams):
                self.sel.unregister(fd)
                os.close(fd)
            job.streams.clear()
        if job.keeper_json_error:
            details.append(job.keeper_json_error)
        if job.output_error:
            details.append(job.output_error)
        if job.reason == "timed_out":
            details.insert(0, f"timed out after {job.timeout_s:g}s")
        ws = job.wait_status
        job.kill_at = None
        sig = os.WTERMSIG(ws) if ws is not None and os.WIFSIGNALED(ws) else None
        # the facts of its v1 groups, or its systemd slot slice's counters, read here (one
        # process, beside the runner's event loop) when nothing is left there: the runner
        # then reads no group at the job's end; a v1 job's groups, read and empty, are
        # removed by keeperd after the status (`_done`, removals.py), so the runner has
        # none to remove either (issue 14)
        facts = (_facts_when_empty(job.cgroup_dirs, sig) if job.cgroup_dirs
                 else _slot_counters(job.slot_scope) if job.slot_scope else None)
        job.set_status(
            exit_code=os.WEXITSTATUS(ws) if ws is not None and os.WIFEXITED(ws) else None,
            signal=sig, reason=job.reason, detail="; ".join(details) or None,
            cpu_time_ms=round((job.rusage.ru_utime + job.rusage.ru_stime) * 1000) if job.rusage else 0,
            **({} if facts is None else {"isolation_facts": facts}),
            **({"isolation_released": True} if facts is not None and job.cgroup_dirs else {}))

    def _done(self, job: Job) -> None:
        if job.gone:
            self._log(f"job directory {job.job_dir} is gone: its status is not written"
                      f" (exit status {job.status and job.status.get('exit_code')})")
        if job.out_fd >= 0:
            os.close(job.out_fd)
            job.out_fd = -1
        del self.jobs[job.job_dir]
        done = {"done": True} if job.exit_seen is None else {
            "done": True, "at": [job.exit_seen, time.monotonic()]}
        for conn, req_id in job.watchers:
            self._send(conn, {"id": req_id, **done})
        job.watchers = []
        if job.status is not None and job.status.get("isolation_released") and job.cgroup_dirs:
            # kept (renamed) for a spare, or removed in the remover's thread: after the
            # runners are told (a rename may wait for the cgroup mutex: "The join")
            if not self.spares.recycle(job.cgroup_dirs, job.cgroup_writes,
                                       job.status.get("isolation_facts")):
                self.removals.remove(job.cgroup_dirs)


def _cgroup_dirs(spec: dict) -> dict[str, str] | None:
    """The v1 groups a spec has keeperd make (`cgroup_make`'s dirs: controller -> group),
    None for any other job or a spec whose dirs are not that shape."""
    make = spec.get("cgroup_make")
    dirs = make.get("dirs") if isinstance(make, dict) else None
    if (isinstance(dirs, dict) and set(dirs) >= {"cpuacct", "memory"}
            and all(isinstance(d, str) for d in dirs.values())):
        return dirs
    return None


def _cgroup_writes(spec: dict) -> list[tuple[str, str, str]]:
    """The limits a spec has keeperd write into the job's v1 groups (`cgroup_make`'s
    writes: controller, file, value), those of that shape."""
    writes = spec["cgroup_make"].get("writes")
    return [tuple(w) for w in writes if isinstance(w, list) and len(w) == 3
            and all(isinstance(x, str) for x in w)] if isinstance(writes, list) else []


def _facts_when_empty(dirs: dict[str, str], sig: int | None) -> dict | None:
    try:
        return facts_when_empty_v1(dirs, sig)
    except Exception:  # noqa: BLE001 - the runner reads the groups itself then
        return None


def _slot_counters(scope: dict) -> dict | None:
    try:  # loaded for a systemd host's first slot job only (its D-Bus client is keeperd's)
        from motor.isolation.systemd import slot_counters_when_empty

        return slot_counters_when_empty(scope)
    except Exception:  # noqa: BLE001 - the runner reads the slice itself then
        return None


def _tell_child(go_w: int, why: str | None) -> None:
    """keeperd's word to a forked systemd job waiting for its scope (_wait_for_scope)."""
    try:
        os.write(go_w, b"g" if why is None else b"e" + why.encode(errors="replace")[:4000])
    except OSError:  # the child is gone (cancelled): its exit is reaped as any other
        pass
    finally:
        os.close(go_w)


def _wait_for_scope(go_r: int, scope: str) -> None:
    """In the forked child: wait until keeperd says the scope holds us (JoinError if not)."""
    import select

    poll = select.poll()
    poll.register(go_r, select.POLLIN)
    # keeperd fails the scope after SCOPE_TIMEOUT_S; this bounds a child whose keeperd died
    if not poll.poll((SCOPE_TIMEOUT_S + 20) * 1000):
        raise JoinError(f"systemd: no word from keeperd on scope {scope}")
    word = os.read(go_r, 4096)
    if word[:1] == b"g":
        return
    raise JoinError(word[1:].decode(errors="replace") if word
                    else f"keeperd went away before scope {scope} started")


def _take_lock(state_dir: str) -> int:
    fd = os.open(os.path.join(state_dir, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise
            time.sleep(0.01)


def _say(obj: dict) -> None:
    try:
        os.write(1, json.dumps(obj).encode() + b"\n")
    except OSError:
        pass


def _listen(state_dir: str) -> tuple[socket.socket, int]:
    """Bind and listen on ``<state_dir>/keeperd.sock`` (the caller holds the lock, so a file
    there is no live keeperd's: it is replaced); the listener and the socket file's inode."""
    path = os.path.join(state_dir, SOCKET_NAME)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        addr, dfd = socket_address(state_dir)
        try:
            listener.bind(addr)
        finally:
            if dfd is not None:
                os.close(dfd)
        os.chmod(path, 0o600)  # owner-only (the umask already says so)
        sock_ino = os.stat(path).st_ino
        listener.listen(128)
        listener.setblocking(False)
    except BaseException:
        listener.close()
        raise
    return listener, sock_ino


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: keeperd.py STATE_DIR", file=sys.stderr)
        return 2
    state_dir = os.path.abspath(argv[0])
    os.umask(0o077)
    try:
        lock_fd = _take_lock(state_dir)
    except BlockingIOError:
        _say({"error": f"another keeperd holds {os.path.join(state_dir, LOCK_NAME)}"})
        return 1
    except OSError as exc:
        _say({"error": f"cannot lock {os.path.join(state_dir, LOCK_NAME)}: {exc}"})
        return 1
    try:
        listener, sock_ino = _listen(state_dir)
    except OSError as exc:
        _say({"error": f"cannot listen on {os.path.join(state_dir, SOCKET_NAME)}: {exc}"})
        return 1
    # Detach: not the runner's child, not in its session (terminal signals never reach us).
    if os.fork() > 0:
        os._exit(0)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    os.chdir("/")
    for s in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(s, signal.SIG_IGN)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    daemon = Keeperd(state_dir, listener, lock_fd)
    try:  # who holds the lock, for operators and tests (the flock is what counts)
        os.ftruncate(lock_fd, 0)
        os.pwrite(lock_fd, b"%d\n" % daemon.pid, 0)
    except OSError:
        pass
    daemon.sock_ino = sock_ino

    def on_term(signum: int, frame: Any) -> None:
        daemon.terminate = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGUSR1, lambda signum, frame: setattr(daemon, "relisten", True))
    if not K._set_subreaper():
        _say({"error": "cannot become the jobs' subreaper (PR_SET_CHILD_SUBREAPER)"})
        return 1
    daemon.spares.clean_recorded()  # spare groups a killed keeperd left (spares.py)
    _say({"ready": True, "pid": daemon.pid, "create_time": daemon.create_time})
    devnull = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
    return daemon.run(wake_r)


if __name__ == "__main__":
    sys.exit(main())
