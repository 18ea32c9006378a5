"""keeperd's slot spares: a systemd job born in its slot's unit, with no unit started for it
(issue 14; docs/isolation.md, "Slot spares").

With systemd, a job used to get a transient scope of its own, started by PID 1 for the
job's forked child: 3-5 ms of systemd's CPU per job on this host (two cores), more than a
whole job costs with the cgroup backend, and a fork of keeperd per job besides. A job with
CPUs runs in a *slot slice* that serves one job at a time (docs/isolation.md, "The systemd
backend"), so the unit a job needs can be there before the job is: keeperd keeps, per slot
slice, one process (a *slot spare*: a fork of keeperd running `_spare_main`) in a
scope of that slice, `<slot>-p<spare pid>.scope`, started once. A job for that slot is
then spawned by the spare (`spares.spawn_job`: `posix_spawn`, its own process group, the
job's cwd, CPUs, umask and raised oom_score_adj, signals to their defaults), so it is born
in the spare's scope, in the slot's slice, under its limits and counters, from its first
instruction. No unit is started or stopped for the job: its unit is the slot's scope.

The job is the spare's child. The spare waits on its pidfd; when the job ends the spare
kills the job's process group (as keeperd does, while the leader's pid still pins the
group), reaps it and relays the wait status and CPU times to keeperd, which goes on as for
a job it reaped itself (`Keeperd._spare_exit`: left-overs by marker, output drained, the
status written). Everything else keeperd does to a job (timeouts, cancels, killing its
tree) works by process group and /proc, whoever the parent is. Orphans of the job are
re-parented to keeperd, the subreaper above the spare, as before.

The order goes over a `SOCK_SEQPACKET` pair: the orders as JSON (`spares.orders_of`) with
the job's stdout and stderr pipe ends (SCM_RIGHTS); the answer is `p<pid>` or `e<why the
job could not be spawned>`; a relayed end is `x` and the pid, wait status and CPU times packed (`EXIT`), which may
come in while keeperd waits for another order's answer (kept, handed on after: `flush`).
The spare keeps the last job's cwd, CPUs and umask (`spares.spawn_job`'s `kept`): it does
nothing else, so only what differs is changed per job. Its oom_score_adj is raised for
each spawn and put back (the job, not the spare, is what an OOM kill in the slot takes).

A runner's start names the slot slices it made in keeperd's "prepare": each gets its spare
then (`want`), and the answer waits until their scopes have started or failed
(`starting`). The first job of any other slot (no spare there yet, or its scope still
starting) is forked into a scope of its own as before, and keeperd starts the slot's spare
right after that job's spawn. A spare whose scope systemd refuses is killed, and the slot
is not tried again for `RETRY_S`. A spare that ends (its scope stopped by the runner's
`settle`, which kills what a job left behind there; an OOM kill; a signal) is seen by EOF
on its socket: its running jobs are re-parented to keeperd, which reaps them from then on
(`Keeperd._spare_gone`), and the slot's next job makes a new one. A spare dies with
keeperd (`PR_SET_PDEATHSIG`, and EOF when keeperd closes its end).

What a spare costs a job: the slot's counters grow by the spare's share of the job (the
order read, the spawn, the reap, the relay; a few hundred microseconds of CPU) as well as
by the job's own work. Its memory is keeperd's, shared copy-on-write and charged to
keeperd's group (neither v1 nor v2 moves charges with a process by default); only the pages
it copies after its move are the slot's.

Stdlib only (keeperd is run by path: motor/execution/scriptboot.py).
"""

from __future__ import annotations

import array
import ctypes
import errno
import json
import os
import select
import selectors
import signal
import socket
import struct
import time
from typing import Any, Callable

from motor.execution import spares as S

__all__ = ["ENABLE_ENV", "FAULT_ENV", "ORDER_TIMEOUT_S", "RETRY_S", "SlotSpares", "spare_scope",
           "supported"]

#: how long keeperd waits for a spare's answer to an order (it answers within a millisecond
#: unless it is stopped or dying)
ORDER_TIMEOUT_S = 5.0
#: a slot whose spare's scope systemd refused is not tried again for this long
RETRY_S = 30.0
_PR_SET_PDEATHSIG = 1
#: a relayed end: b"x", the job's pid, its wait status, its user and system CPU seconds
EXIT = struct.Struct("=cqqdd")


#: `MOTOR_KEEPERD_SLOT_SPARES=0` in keeperd's environment (so the runner's): no slot
#: spares, every systemd job in a transient scope of its own (`motor-jobs-j<id>.scope`),
#: for hosts that want a unit per job and pay PID 1's work per job for it
ENABLE_ENV = "MOTOR_KEEPERD_SLOT_SPARES"

#: a fault probe for the tests, never set in service: `MOTOR_KEEPERD_FAULT=spare-drops-exit`
#: in keeperd's environment makes each slot spare die right after reaping a job, before it
#: relays the job's end (the window in which a spare killed with its scope loses an exit
#: status, which keeperd must still conclude)
FAULT_ENV = "MOTOR_KEEPERD_FAULT"


def supported(environ=os.environ) -> bool:
    """Whether keeperd makes slot spares: not turned off (`ENABLE_ENV`), and a spare can
    wait for its jobs here (pidfds: Linux 5.3 and later)."""
    return environ.get(ENABLE_ENV, "1").strip() != "0" and hasattr(os, "pidfd_open")


def spare_scope(slice_name: str, pid: int) -> str:
    """The scope of the slot spare `pid` in slot slice `slice_name`."""
    return f"{slice_name.removesuffix('.slice')}-p{pid}.scope"


class SlotSpare:
    __slots__ = ("pid", "sock", "slice", "scope", "ready")

    def __init__(self, pid: int, sock: socket.socket, slice_name: str) -> None:
        self.pid = pid
        self.sock = sock
        self.slice = slice_name
        self.scope = spare_scope(slice_name, pid)
        self.ready = False  # its scope started


class SlotSpares:
    """keeperd's slot spares, by slot slice, driven by keeperd's selector."""

    def __init__(self, sel, log: Callable[[str], None], scopes: Callable[[], Any],
                 exited: Callable[[int, int, float, float], None],
                 orphaned: Callable[[SlotSpare], None]) -> None:
        self.sel = sel
        self.log = log
        self.scopes = scopes  # keeperd's ScopeStarter, made on first use
        self.exited = exited  # (pid, wait status, user s, system s): a job's end, relayed
        self.orphaned = orphaned  # a spare is gone: its jobs are keeperd's children now
        self.by_slice: dict[str, SlotSpare] = {}
        self.retry_at: dict[str, float] = {}
        self.deferred: list[tuple[Callable, tuple]] = []
        self.enabled = supported()

    def pids(self) -> set[int]:
        return {spare.pid for spare in self.by_slice.values()}

    def ready(self, scope: dict) -> SlotSpare | None:
        """The slot's spare, if its scope holds it."""
        spare = self.by_slice.get(scope.get("slice")) if scope.get("slot") else None
        return spare if spare is not None and spare.ready else None

    def want(self, scope: dict) -> None:
        """Make the slot's spare, unless there is one (or the slot's last one was refused
        a moment ago)."""
        slice_name = scope.get("slice")
        if (not scope.get("slot") or not self.enabled or slice_name in self.by_slice
                or self.retry_at.get(slice_name, 0.0) > time.monotonic()):
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # a fork of keeperd: about 1 ms, against 63.6 ms of CPU for a fresh interpreter and
        # its imports here; its size costs nothing per job (posix_spawn shares the address
        # space until the exec)
        keeperd = os.getpid()
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGCHLD})
        try:
            pid = os.fork()
        except OSError as exc:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
            ours.close()
            theirs.close()
            self.log(f"slot spare for {slice_name}: cannot fork it: {exc}")
            return
        if pid == 0:  # the spare: never returns
            try:
                _spare_main(theirs, keeperd)
            finally:
                os._exit(0)
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        theirs.close()
        spare = SlotSpare(pid, ours, slice_name)
        self.by_slice[slice_name] = spare
        self.sel.register(ours, selectors.EVENT_READ, lambda ev, s=spare: self._on_readable(s))
        self.scopes().start({"address": scope["address"], "scope": spare.scope,
                             "slice": slice_name, "description": f"motor slot spare {slice_name}"},
                            pid, lambda why, s=spare: self._on_scope(s, why))

    def starting(self, slices: list[str]) -> bool:
        """Whether a spare of these slots is still starting (its scope not yet started nor
        refused): a runner's start waits for the spares it asked for (keeperd's "prepare")."""
        return any((spare := self.by_slice.get(name)) is not None and not spare.ready
                   for name in slices)

    def ready_of(self, slices: list[str]) -> list[str]:
        """Those of `slices` whose spare is ready."""
        return [name for name in slices
                if (spare := self.by_slice.get(name)) is not None and spare.ready]

    def _on_scope(self, spare: SlotSpare, why: str | None) -> None:
        if self.by_slice.get(spare.slice) is not spare:
            return  # dropped meanwhile
        if why is None:
            spare.ready = True
            return
        self.log(f"slot spare {spare.pid} for {spare.slice}: {why}; the slot's jobs get "
                 f"scopes of their own for {RETRY_S:g}s")
        self.retry_at[spare.slice] = time.monotonic() + RETRY_S
        self._drop(spare, kill=True)

    def _on_readable(self, spare: SlotSpare) -> None:
        """A job of the spare's ended (its exit relayed), or the spare did (EOF)."""
        while True:
            try:
                data = spare.sock.recv(4096, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            except OSError:
                data = b""
            if not data:
                self._drop(spare)
                break
            self._heard(spare, data)
        self.flush()

    def _heard(self, spare: SlotSpare, data: bytes) -> None:
        if data[:1] == b"x" and len(data) == EXIT.size:
            self.deferred.append((self.exited, EXIT.unpack(data)[1:]))

    def flush(self) -> None:
        """Hand the relayed exits, and then the spares' ends, on to keeperd, in the order
        they came (from keeperd's loop, not from inside an order's wait)."""
        while self.deferred:
            call, args = self.deferred.pop(0)
            call(*args)

    def _drop(self, spare: SlotSpare, kill: bool = False) -> None:
        if self.by_slice.get(spare.slice) is spare:
            del self.by_slice[spare.slice]
        try:
            self.sel.unregister(spare.sock)
        except (KeyError, ValueError):
            pass
        spare.sock.close()  # the spare exits on EOF; keeperd reaps it as any stranger
        if kill:
            try:
                os.kill(spare.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:  # dead already: its SIGCHLD came while keeperd's reaping still passed it over
            os.waitpid(spare.pid, os.WNOHANG)
        except ChildProcessError:
            pass
        # its running jobs are keeperd's children now (after the ends it relayed before)
        self.deferred.append((self.orphaned, (spare,)))

    def order(self, spare: SlotSpare, orders: dict, out_w: int, err_w: int) -> int | None:
        """The job's pid, spawned by the spare in its scope. None when the order could not
        be sent (nothing was made: the caller starts the job the other way). S.ExecError
        when the spare could not spawn it (the detail), or did not answer (then the spare
        and whatever is in its scope are killed)."""
        try:
            spare.sock.sendmsg([json.dumps(orders).encode()], [(
                socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [out_w, err_w]))])
        except OSError as exc:  # too big an order (EMSGSIZE), or the spare is gone
            self.log(f"slot spare {spare.pid}: cannot send an order: {exc}")
            if exc.errno != errno.EMSGSIZE:
                self._drop(spare, kill=True)
            return None
        deadline = time.monotonic() + ORDER_TIMEOUT_S
        while True:
            answer = b""
            try:
                ready, _, _ = select.select([spare.sock], [], [],
                                            max(0.0, deadline - time.monotonic()))
                answer = spare.sock.recv(4096) if ready else b""
            except OSError:
                pass
            if answer[:1] == b"x":  # an earlier job's exit, relayed meanwhile
                self._heard(spare, answer)
                continue
            if answer[:1] == b"p":
                return int(answer[1:])
            if not answer:  # a job's process may have been made: all in the scope go
                _kill_group_of(spare.pid)
                self._drop(spare, kill=True)
                raise S.ExecError(f"the slot's spare process {spare.pid} did not answer "
                                  f"within {ORDER_TIMEOUT_S:g}s")
            raise S.ExecError(answer[1:].decode(errors="replace"))

    def close(self) -> None:
        for spare in list(self.by_slice.values()):
            self._drop(spare)


def _kill_group_of(pid: int) -> None:
    """SIGKILL every process in `pid`'s systemd group (its scope), `pid` included."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return
    paths = {line.split(":", 2)[1]: line.split(":", 2)[2] for line in lines if line.count(":") >= 2}
    for base, key in (("/sys/fs/cgroup/systemd", "name=systemd"), ("/sys/fs/cgroup/unified", ""),
                      ("/sys/fs/cgroup", "")):
        if key not in paths:
            continue
        try:
            with open(os.path.join(base + paths[key], "cgroup.procs")) as f:
                procs = [int(x) for x in f.read().split()]
        except (OSError, ValueError):
            continue
        for p in procs:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return


def _spare_main(sock: socket.socket, keeperd: int) -> None:
    """The spare's loop: an order in, a job spawned (the spare's child, in its scope) and
    its pid out; a job's end: its group killed, the job reaped, its exit relayed."""
    keep = sock.fileno()  # nothing else of keeperd's: its lock, listener, jobs' pipes
    for fd in [int(x) for x in os.listdir("/proc/self/fd")]:
        if fd > 2 and fd != keep:
            try:
                os.close(fd)
            except OSError:
                pass
    signal.set_wakeup_fd(-1)  # keeperd's handlers and wake-up pipe are not the spare's
    for s in (signal.SIGTERM, signal.SIGCHLD):
        signal.signal(s, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    # (the job's signals: spawn_job's setsigdef, as keeperd's own spawns)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != keeperd:  # keeperd died before the prctl
        return
    sel = selectors.EpollSelector()
    sel.register(sock, selectors.EVENT_READ)
    jobs: dict[int, int] = {}  # pidfd -> pid
    drops_exit = os.environ.get(FAULT_ENV) == "spare-drops-exit"
    kept: dict = {}  # the cwd, CPUs and umask of the last job (spares.spawn_job)
    while True:
        for key, _ in sel.select():
            if key.fileobj is sock:
                if not _take_order(sock, sel, jobs, kept):
                    return
                continue
            fd = key.fd
            pid = jobs.pop(fd)
            sel.unregister(fd)
            os.close(fd)
            try:  # as keeperd does: the group, while the leader's pid still pins it
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _, status, ru = os.wait4(pid, 0)
            if drops_exit:
                os._exit(0)
            sock.send(EXIT.pack(b"x", pid, status, ru.ru_utime, ru.ru_stime))


def _take_order(sock: socket.socket, sel, jobs: dict[int, int], kept: dict) -> bool:
    """One order: False at EOF (keeperd closed its end)."""
    fds = array.array("i")
    try:
        msg, anc, _, _ = sock.recvmsg(1 << 20, socket.CMSG_SPACE(2 * fds.itemsize),
                                      socket.MSG_CMSG_CLOEXEC)
    except InterruptedError:
        return True
    if not msg:
        return False
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    try:
        if len(fds) != 2:
            raise S.ExecError(f"slot spare: an order with {len(fds)} descriptors, not 2")
        pid = S.spawn_job(json.loads(msg), fds[0], fds[1], oom_bump=True, kept=kept)
    except S.ExecError as exc:
        sock.send(b"e" + str(exc).encode(errors="replace")[:4000])
        return True
    finally:
        for fd in fds:
            os.close(fd)
    pidfd = os.pidfd_open(pid)
    jobs[pidfd] = pid
    sel.register(pidfd, selectors.EVENT_READ)
    sock.send(b"p%d" % pid)
    return True
