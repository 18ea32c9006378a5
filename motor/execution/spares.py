"""keeperd's pre-placed processes: the cgroup v1 join off the job's start path (issue 14).

On cgroup v1 a process gets into a group only by a migration (a write to `cgroup.procs`),
and on a host without `favordynmods` the first migration after an idle spell waits an RCU
grace period: 10-19 ms here (docs/isolation.md, "The join"). v1 has no
`clone3(CLONE_INTO_CGROUP)`, but it lets a group be renamed within its parent. So keeperd
keeps a small pool of *spares*: per spare, a group `spare-<keeperd pid>-<start ticks>-<n>`
in each hierarchy of the job's parent (cpuset, memory, cpuacct) and a process forked from
keeperd that joined them ahead of time (the slow write happens in that process, while no
job waits for it) and then waits, idle, on a socketpair for its orders.

A job start from the pool (`take`, `claim`, `order`): keeperd writes the job's limits
into the spare's groups (cpuset.cpus, memory.limit_in_bytes, from the spec's
`cgroup_make`), zeroes the groups' usage counters (`cpuacct.usage`,
`memory.max_usage_in_bytes`: the job's figures start here), renames each spare group to
the job's name, and sends the order: the job's exe, argv, env, cwd, CPUs, umask as JSON
and its stdout/stderr pipe ends as SCM_RIGHTS. The spare sets up its fds and execs: the
job is in its groups before its first instruction and nothing migrates. The socketpair is
close-on-exec in the spare: EOF tells keeperd the exec happened, bytes say why it did not
(the same protocol as keeperd's fork+exec error pipe). keeperd then makes a new spare when
its loop has nothing else to do (`fill_one`).

keeperd learns the parent groups from the first spec that has a `cgroup_make` (that job
starts the old way: fork, make its groups, join) and records them in
`<state>/keeperd.spares`, so the next keeperd of the state dir removes the spares a
killed one left (`clean_recorded`, at its start). Spares of another live keeperd (another
state dir on the same parent) are left alone: a spare's name carries its keeperd's pid and
start time. A spare whose keeperd dies reads EOF and exits.

Stdlib only (keeperd is run by path: motor/execution/scriptboot.py).
"""

from __future__ import annotations

import gc
import json
import math
import os
import selectors
import signal
import socket
import struct
import time
from typing import Any, Callable

from motor import faults
from motor.execution import keeper as K
from motor.execution.joblog import write_json_atomic
from motor.isolation.join import JoinError, join_cgroups, rmdir_retry, write_knob

__all__ = ["DEFAULT_SIZE", "PREFIX", "RECORD_FILE", "REFILL_IDLE_ENV", "SIZE_ENV", "SparePool",
           "become_job", "pool_size", "refill_idle_s", "tell_failure"]

PREFIX = "spare-"
RECORD_FILE = "keeperd.spares"
#: spares kept ready per keeperd (`MOTOR_KEEPERD_SPARES` in keeperd's environment; 0: none,
#: every job joins its groups by a migration as before)
DEFAULT_SIZE = 4
SIZE_ENV = "MOTOR_KEEPERD_SPARES"
#: A spare's join (its migration) stalls every fork and exit on the host for an RCU grace
#: period unless another migration came shortly before. So after a lone job's start (none
#: within this long before it) a pool above half its size is topped up only once no job has
#: started for this long: the stall does not fall on the job just started. In a burst of
#: starts the pool is topped up at once, keeping the migrations close together (cheap).
#: (docs/isolation.md, "Spares")
REFILL_IDLE_S = 0.05
REFILL_IDLE_ENV = "MOTOR_KEEPERD_REFILL_IDLE_S"  # seconds; tests set it long
READY = b"R"
#: counters zeroed when a spare becomes a job (what the spare did before is not the job's)
RESETS = (("cpuacct", "cpuacct.usage"), ("memory", "memory.max_usage_in_bytes"))
CLEAN_S = 2.0  # how long a leftover spare group may stay busy (its process exiting)
_LEN = struct.Struct("<Q")


def pool_size(environ=os.environ) -> int:
    try:
        return max(0, int(environ.get(SIZE_ENV, DEFAULT_SIZE)))
    except ValueError:
        return DEFAULT_SIZE


def refill_idle_s(environ=os.environ) -> float:
    try:
        return max(0.0, float(environ.get(REFILL_IDLE_ENV, REFILL_IDLE_S)))
    except ValueError:
        return REFILL_IDLE_S


def _start_ticks(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2:].split()
    return None if fields[0] in (b"Z", b"X") else fields[19].decode()  # a zombie is gone


def _owner_alive(name: str) -> bool:
    """Whether the keeperd named in `spare-<pid>-<ticks>-<n>` still runs."""
    parts = name[len(PREFIX):].split("-")
    if len(parts) != 3 or not parts[0].isdigit():
        return False
    return _start_ticks(int(parts[0])) == parts[1]


def _remove_group(path: str, deadline: float) -> str | None:
    """SIGKILL what is in one group and rmdir it, retrying until the deadline."""
    try:
        with open(os.path.join(path, "cgroup.procs")) as f:
            for pid in f.read().split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except OSError:
                    pass
    except OSError:
        pass
    return rmdir_retry(path, deadline, 0.005)


class ExecError(Exception):
    """Why a job could not be exec'd (the spawn_failed detail)."""


def become_job(orders: dict, out_w: int, err_w: int) -> None:
    """In the process that becomes the job (already in its process group and its groups):
    cwd, CPUs, oom_score_adj, umask, stdio, signal mask, execve. Never returns; raises
    ExecError with the detail keeperd records. Shared by keeperd's fork+exec child and
    the spares."""
    cwd, cpus, cmd0 = orders.get("cwd"), orders.get("cpus"), orders["argv"][0]
    if cwd:
        try:
            os.chdir(cwd)
        except OSError as exc:
            raise ExecError(f"cannot use cwd {cwd!r}: {exc.strerror}") from None
    if orders.get("pin") and cpus:
        try:
            os.sched_setaffinity(0, cpus)
        except (OSError, ValueError, TypeError) as exc:
            raise ExecError(f"cannot pin to cpus {cpus!r}: {exc}") from None
    # the job, not keeperd, is what an OOM kill in the job's group must take
    K._raise_oom_score_for_spawn()  # this process becomes the job: nothing to restore
    if isinstance(orders.get("umask"), int):
        os.umask(orders["umask"])
    devnull = os.open("/dev/null", os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    for fd in {devnull, out_w, err_w} - {0, 1, 2}:
        os.close(fd)
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    try:
        os.execve(orders["exe"], orders["argv"], orders["env"])
    except OSError as exc:
        raise ExecError(f"cannot execute {cmd0!r}: {exc.strerror or exc}") from None
    except (ValueError, TypeError) as exc:
        raise ExecError(f"cannot execute {cmd0!r}: {exc}") from None


def tell_failure(fd: int, msg: str) -> None:
    """In a child that will not exec: why, to keeperd over the error pipe (best effort:
    the child exits with SPAWN_FAILED_EXIT_CODE either way)."""
    try:
        os.write(fd, msg.encode(errors="replace")[:4000])
    except BaseException:
        pass


def _spare_main(fd: int, procs: list[str]) -> None:
    """The spare, right after the fork: never returns."""
    msg = "the spare failed"
    try:
        gc.disable()  # no finaliser may close an fd number that is reused below
        signal.set_wakeup_fd(-1)
        for s in K._SIGDEF:
            signal.signal(s, signal.SIG_DFL)
        os.setpgid(0, 0)
        os.closerange(3, fd)  # keeperd's fds (its lock, socket, the jobs' pipes) are not ours
        os.closerange(fd + 1, 1 << 20)
        sock = socket.socket(fileno=fd)
        try:
            join_cgroups(procs)  # the slow migration: here, while no job waits for it
        except JoinError as exc:
            msg = str(exc)
            raise
        sock.sendall(READY)
        buf, fds = b"", []
        while len(buf) < _LEN.size or len(buf) < _LEN.size + _LEN.unpack_from(buf)[0]:
            data, got, _, _ = socket.recv_fds(sock, 1 << 16, 2)
            fds += got
            if not data:  # keeperd let us go (or died): nothing to become
                os._exit(0)
            buf += data
        orders = json.loads(buf[_LEN.size:])
        faults.hit("spare.ordered")  # tests: the spare has the job's orders, not yet exec'd
        try:
            become_job(orders, fds[0], fds[1])
        except ExecError as exc:
            msg = str(exc)
            raise
    except BaseException:
        tell_failure(fd, msg)
    finally:
        os._exit(K.SPAWN_FAILED_EXIT_CODE)


class Spare:
    __slots__ = ("pid", "sock", "dirs", "ready")

    def __init__(self, pid: int, sock: socket.socket, dirs: dict[str, str]) -> None:
        self.pid, self.sock, self.dirs, self.ready = pid, sock, dirs, False


class SparePool:
    """keeperd's spares, for one parent (the last one a job's spec named)."""

    def __init__(self, state_dir: str, sel: selectors.BaseSelector, size: int,
                 log: Callable[[str], None]) -> None:
        self.state_dir, self.sel, self.size, self.log = state_dir, sel, size, log
        pid = os.getpid()
        self.owner = f"{pid}-{_start_ticks(pid)}"
        self.parents: dict[str, str] = {}  # controller -> parent group dir
        self.spares: dict[int, Spare] = {}  # by pid
        self.serial = 0
        self.paused = False  # a spare died unasked: none made until the next job's start
        self.taken = self.missed = 0  # job starts from a spare / with none ready
        self.last_take = -math.inf  # when a job last started from the pool (monotonic)
        self.burst = False  # that start came within `idle_s` of the one before
        self.idle_s = refill_idle_s()

    @property
    def refill_due(self) -> bool:
        """Spares to make now: the pool is short and at half its size or below, or in a
        burst of starts, or no job has started for `idle_s` (REFILL_IDLE_S). keeperd makes
        the missing ones one per turn of its loop while nothing else is ready (`fill_one`,
        and while a start waits for its exec only when `low`): one right after the other,
        so their joins fall within one grace period."""
        return (bool(self.parents) and not self.paused and len(self.spares) < self.size
                and (len(self.spares) <= self.size // 2 or self.burst
                     or time.monotonic() - self.last_take >= self.idle_s))

    @property
    def low(self) -> bool:
        """Fewer than two spares (ready or joining): refill even while a start waits."""
        return len(self.spares) < 2

    def refill_deadline(self) -> float | None:
        """When a short pool becomes due for its refill (keeperd's select timeout)."""
        if not self.parents or self.paused or len(self.spares) >= self.size:
            return None
        return self.last_take + self.idle_s

    def describe(self) -> dict:
        return {"size": self.size, "parents": self.parents, "taken": self.taken,
                "missed": self.missed,
                "ready": sorted(p for p, s in self.spares.items() if s.ready),
                "joining": sorted(p for p, s in self.spares.items() if not s.ready)}

    def is_spare(self, pid: int) -> bool:
        return pid in self.spares

    # -- start-up: what a killed keeperd left -----------------------------------------

    def clean_recorded(self) -> None:
        try:
            with open(os.path.join(self.state_dir, RECORD_FILE)) as f:
                parents = json.load(f).get("parents") or {}
        except (OSError, ValueError, AttributeError):
            return
        self.clean_dead(list(parents.values()))

    def clean_dead(self, parents: list[str]) -> None:
        """Remove the spare groups (and their processes) of keeperds no longer running."""
        deadline = time.monotonic() + CLEAN_S
        for parent in parents:
            try:
                names = os.listdir(parent)
            except OSError:
                continue
            for name in names:
                if name.startswith(PREFIX) and not _owner_alive(name):
                    error = _remove_group(os.path.join(parent, name), deadline)
                    if error:
                        self.log(f"leftover spare: {error}")

    # -- the job's side -----------------------------------------------------------------

    def learn(self, make: dict) -> None:
        """A job's spec names its groups: keep spares in their parents from now on."""
        parents = {c: os.path.dirname(d) for c, d in make["dirs"].items()}
        self.paused = False
        if parents == self.parents or self.size <= 0 or "cpuset" not in parents:
            return
        self.close()
        self.parents = parents
        try:
            write_json_atomic(os.path.join(self.state_dir, RECORD_FILE), {"parents": parents})
        except OSError as exc:
            self.log(f"cannot record the spares' parents: {exc}")
        self.clean_dead(list(parents.values()))

    def take(self, make: dict) -> Spare | None:
        if {c: os.path.dirname(d) for c, d in make["dirs"].items()} != self.parents:
            return None
        for spare in self.spares.values():
            if spare.ready:
                del self.spares[spare.pid]
                self.sel.unregister(spare.sock)
                self.taken += 1
                now = time.monotonic()
                self.burst, self.last_take = now - self.last_take < self.idle_s, now
                return spare
        self.missed += 1
        return None

    def claim(self, spare: Spare, make: dict) -> bool:
        """The job's limits into the spare's groups, its counters zeroed, the groups
        renamed to the job's. False (the spare discarded, the groups named as before):
        the job starts the old way."""
        renamed: list[tuple[str, str]] = []
        try:
            for controller, knob, value in make.get("writes", ()):
                write_knob(os.path.join(spare.dirs[controller], knob), value)
            for controller, knob in RESETS:
                if controller in spare.dirs:
                    write_knob(os.path.join(spare.dirs[controller], knob), "0")
            for controller, job_dir in make["dirs"].items():
                os.rename(spare.dirs[controller], job_dir)
                renamed.append((job_dir, spare.dirs[controller]))
            return True
        except (JoinError, OSError) as exc:
            self.log(f"spare {spare.pid} not used: {exc}")
            for new, old in renamed:
                try:
                    os.rename(new, old)
                except OSError:
                    pass
            self._discard(spare)
            return False

    def order(self, spare: Spare, orders: dict, fds: list[int]) -> int:
        """Send the claimed spare its orders; the fd whose EOF says it exec'd. OSError:
        it is gone (reaped here; its groups, now the job's, stay for the old way)."""
        data = json.dumps(orders, separators=(",", ":")).encode()
        msg = _LEN.pack(len(data)) + data
        try:
            spare.sock.setblocking(True)
            n = socket.send_fds(spare.sock, [msg], fds)
            if n < len(msg):
                spare.sock.sendall(msg[n:])
        except OSError:
            spare.sock.close()
            self._reap(spare.pid)
            raise
        return spare.sock.detach()

    # -- filling ------------------------------------------------------------------------

    def fill_one(self) -> None:
        """Make one spare: its groups (cheap: mkdir, cpuset.mems/cpus), then fork it; the
        spare itself joins them (the slow part) and says when it is ready."""
        self.serial += 1
        name = f"{PREFIX}{self.owner}-{self.serial}"
        dirs = {c: os.path.join(p, name) for c, p in self.parents.items()}
        made: list[str] = []
        try:
            for d in dirs.values():
                os.mkdir(d)
                made.append(d)
            cs, parent_cs = dirs["cpuset"], self.parents["cpuset"]
            for knob in ("cpuset.mems", "cpuset.cpus"):  # mems first: else no task may join
                with open(os.path.join(parent_cs, knob)) as f:
                    write_knob(os.path.join(cs, knob), f.read().strip())
        except (OSError, JoinError) as exc:
            self.log(f"no spares under {self.parents['cpuset']}: {exc}")
            for d in made:
                try:
                    os.rmdir(d)
                except OSError:
                    pass
            self.parents = {}  # (a parent gone: the next job's spec may bring it back)
            return
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGCHLD})
        try:
            pid = os.fork()
        except OSError as exc:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
            mine.close()
            theirs.close()
            self.log(f"cannot fork a spare: {exc}")
            self._remove_dirs(dirs)
            self.paused = True  # none made until the next job's start
            return
        if pid == 0:
            _spare_main(theirs.fileno(), [os.path.join(d, "cgroup.procs") for d in dirs.values()])
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        theirs.close()
        mine.setblocking(False)
        spare = Spare(pid, mine, dirs)
        self.spares[pid] = spare
        self.sel.register(mine, selectors.EVENT_READ, lambda ev, s=spare: self._on_event(s))

    def _on_event(self, spare: Spare) -> None:
        try:
            data = spare.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data == READY and not spare.ready:
            spare.ready = True
            return
        if data:
            self.log(f"spare {spare.pid}: {data.decode(errors='replace')}")
        del self.spares[spare.pid]
        self.sel.unregister(spare.sock)
        self._discard(spare)
        if data:  # it could not join: make no more (the log says why)
            self.parents = {}
        else:  # killed by someone (e.g. the parent group being removed): wait for a job
            self.paused = True

    # -- letting go ---------------------------------------------------------------------

    def _reap(self, pid: int) -> None:
        K.kill_and_reap(pid)

    def _remove_dirs(self, dirs: dict[str, str]) -> None:
        deadline = time.monotonic() + CLEAN_S
        for d in dirs.values():
            error = _remove_group(d, deadline)
            if error:
                self.log(error)

    def _discard(self, spare: Spare) -> None:
        """A spare out of the pool: closed, killed, reaped, its groups removed."""
        spare.sock.close()
        self._reap(spare.pid)
        self._remove_dirs(spare.dirs)

    def drop(self) -> None:
        """No runner connected: no spare kept (the next job's spec brings them back)."""
        self.close()
        self.parents = {}

    def close(self) -> None:
        """Every spare let go (keeperd exits, or the parent changed)."""
        for spare in list(self.spares.values()):
            del self.spares[spare.pid]
            self.sel.unregister(spare.sock)
            self._discard(spare)


def orders_of(spec: dict[str, Any], exe: str, argv: list[str], env: dict) -> dict:
    return {"exe": exe, "argv": argv, "env": env, "cwd": spec.get("cwd"),
            "cpus": spec.get("cpus"), "pin": bool(spec.get("pin")), "umask": spec.get("umask")}
