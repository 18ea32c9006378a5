"""keeperd's pre-placed threads: the cgroup v1 join off the job's start path (issue 14).

On cgroup v1 a process gets into a group only by a migration (a write to `cgroup.procs`, or
to `tasks` for one thread), and on a host without `favordynmods` the first migration after
an idle spell waits an RCU grace period: 10-19 ms here (docs/isolation.md, "The join"). v1
has no `clone3(CLONE_INTO_CGROUP)`, but a child is born in the groups of the thread that
creates it, and a group can be renamed within its parent. So keeperd keeps a small pool of
*spares*: per spare, a group `spare-<keeperd pid>-<start ticks>-<n>` in each hierarchy of
the job's parent (cpuset, memory, cpuacct) and a thread of keeperd that moved itself into
them ahead of time (its `tasks` write: the slow migration happens in that thread, while no
job waits for it and keeperd's loop goes on) and then waits for its orders.

A job start from the pool (`take`, `claim`, `order`): keeperd writes the job's limits
into the spare's groups (cpuset.cpus, memory.limit_in_bytes, from the spec's
`cgroup_make`), zeroes the groups' usage counters (`cpuacct.usage`,
`memory.max_usage_in_bytes`: the job's figures start here), renames each spare group to
the job's name, and gives the thread the job's exe, argv, env, cwd, CPUs, umask and
stdout/stderr pipe ends. The thread `posix_spawn`s the job (`spawn_job`, as keeperd spawns
a job with no groups): the job is in its groups before its first instruction, nothing
migrates, and it is keeperd's child (a thread's children are its process's). Then the
thread ends, which takes it out of the groups (a task's exit needs no migration); keeperd
waits for that (its loop is held for the spawn, well under a millisecond) before it
answers the start, so the job's groups never list keeperd once the runner knows the job.
keeperd makes a new spare when its loop has nothing else to do (`fill_one`), in the groups
of a job that has ended when it kept them (`recycle`: renamed to the spare's name as soon as
keeperd has read them, empty, at the job's end; no mkdir and no rmdir, the costly part of a
v1 group), else in new ones; a claim writes only the limits the spare's groups lack.

Until stop 30 a spare was a process forked from keeperd that exec'd the job: about 5 ms of
CPU per job on this host (the fork of keeperd's ~10 MiB, the pages keeperd and the spare
then copied, the spare's exec tearing the copy down) against well under 1 ms for a thread
and a `posix_spawn` (docs/performance-history.md, "Stop 30").

keeperd learns the parent groups from the first spec that has a `cgroup_make` (that job
starts the old way: fork, make its groups, join) and records them in
`<state>/keeperd.spares`, so the next keeperd of the state dir removes the spare groups a
killed one left (`clean_recorded`, at its start; its threads died with it). Spares of
another live keeperd (another state dir on the same parent) are left alone: a spare's
name carries its keeperd's pid and start time.

Stdlib only (keeperd is run by path: motor/execution/scriptboot.py).
"""

from __future__ import annotations

import json
import math
import os
import selectors
import signal
import _thread
import threading
import time
from typing import Any, Callable

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
#: An ended job's groups, empty and read, are kept as a spare's (renamed; no rmdir and no
#: mkdir, the costly part of a v1 group: `recycle`) unless its memory group still holds more
#: than this (what the job left charged there, kernel memory or page cache, which the next
#: job's `memory_peak` would include) or saw an OOM kill (`oom_kill` cannot be zeroed).
RECYCLE_MAX_USAGE = 1 << 20
#: zeroed when an ended job's groups become a spare's (the old kernels' OOM sign)
RECYCLE_RESETS = (("memory", "memory.failcnt"),)
#: how long keeperd waits for a let-go spare's thread to end (it may still be in its join:
#: an RCU grace period, 10-20 ms here; a spare that spawns its job is waited for as long
#: as that takes)
SPARE_END_S = 5.0
CLEAN_S = 2.0  # how long a leftover spare group may stay busy (what was in it exiting)


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


def spawn_job(orders: dict, out_w: int, err_w: int, *, oom_bump: bool,
              kept: dict | None = None, home: frozenset[int] | None = None,
              alone: bool = True) -> int:
    """posix_spawn the job from this thread: its cwd, CPUs (this thread's affinity, which
    the child inherits), umask and, with `oom_bump`, a raised oom_score_adj are this
    process's for the moment of the spawn and restored after (the caller makes sure no
    other thread of it uses them meanwhile). The job's pid; ExecError with the detail
    keeperd records. Shared by keeperd's own spawns, the spares' threads and the slot
    spares. A process that does nothing else between spawns (a slot spare) passes `kept`
    (a dict, empty at first): its cwd, CPUs and umask stay as the last job's and change
    only when a job's differ. `home` (keeperd's own CPUs): after a pinned spawn the thread
    goes to `home`, less the job's CPUs when the job starts `alone` (keeperd's `_alone`)
    and that leaves any, instead of back to what it had (`_after_pin`)."""
    cwd, cpus, cmd0 = orders.get("cwd"), orders.get("cpus"), orders["argv"][0]
    pin = bool(orders.get("pin") and cpus)
    umask = orders.get("umask")
    old_affinity = old_umask = None
    back_to_root = pinned = False
    try:
        if kept is not None:
            _keep_as_the_jobs(kept, cwd, cpus if pin else None, umask)
        else:
            if cwd:
                back_to_root = True
                _chdir_for(cwd)
            if pin:
                old_affinity = os.sched_getaffinity(0)
                _pin_for(cpus)
                pinned = True
            old_umask = os.umask(umask) if isinstance(umask, int) else None
        restore_oom = K._raise_oom_score_for_spawn() if oom_bump else None
        try:
            return _posix_spawn_job(orders, out_w, err_w, cmd0)
        finally:
            if restore_oom is not None:
                K._set_oom_score_adj(restore_oom)
    finally:
        if old_umask is not None:
            os.umask(old_umask)
        if old_affinity is not None:  # a pin that failed leaves nothing to move away from
            os.sched_setaffinity(0, _after_pin(home, cpus, old_affinity, alone) if pinned
                                 else old_affinity)
        if back_to_root:
            os.chdir("/")


def _after_pin(home: frozenset[int] | None, cpus: Any, before: set[int],
               alone: bool) -> set[int]:
    """The spawning thread's CPUs after a pinned spawn; `before` without `home`. With
    `home`, for a job that starts `alone`: `home` less the job's CPUs, so that the thread
    leaves them at once (the kernel moves it) instead of running its answer and the runner
    it wakes there while the job starts (idle starts on 2 CPUs, submit -> running: 0.95x
    over six alternated pairs); `home` itself when the job has all of it. For a job that starts
    beside others: `home`, which holds the job's CPUs, so the thread stays where it is (a
    move at every start of a burst cost the 200-job rate about a tenth: docs/keeper.md,
    "Leaving the job's CPUs")."""
    if home is None:
        return before
    if not alone:
        return set(home)
    return set(home) - set(cpus) or set(home)


def _chdir_for(cwd: str) -> None:
    try:
        os.chdir(cwd)
    except OSError as exc:
        raise ExecError(f"cannot use cwd {cwd!r}: {exc.strerror}") from None


def _pin_for(cpus: Any) -> None:
    try:
        os.sched_setaffinity(0, cpus)
    except (OSError, ValueError, TypeError) as exc:
        raise ExecError(f"cannot pin to cpus {cpus!r}: {exc}") from None


def _keep_as_the_jobs(kept: dict, cwd: str | None, cpus: Any, umask: Any) -> None:
    """The process's cwd, affinity and umask made the job's, each only if it differs from
    what it is (`kept`: what they were set to; their first values are taken as the
    defaults a job without them gets)."""
    if not kept:
        umask_now = os.umask(0o077)
        os.umask(umask_now)
        kept.update(cwd=None, cpus=None, all_cpus=os.sched_getaffinity(0), umask=umask_now,
                    default_umask=umask_now)
    want_cwd = cwd or "/"
    if want_cwd != kept["cwd"]:
        kept["cwd"] = None  # unknown until the chdir succeeds
        _chdir_for(want_cwd)
        kept["cwd"] = want_cwd
    want_cpus = tuple(cpus) if cpus else None
    if want_cpus != kept["cpus"]:
        kept["cpus"] = "unknown"  # until the change succeeds
        if cpus:
            _pin_for(cpus)
        else:
            os.sched_setaffinity(0, kept["all_cpus"])
        kept["cpus"] = want_cpus
    want_umask = umask if isinstance(umask, int) else kept["default_umask"]
    if want_umask != kept["umask"]:
        os.umask(want_umask)
        kept["umask"] = want_umask


def _posix_spawn_job(orders: dict, out_w: int, err_w: int, cmd0: str) -> int:
    try:
        return os.posix_spawn(
            orders["exe"], orders["argv"], orders["env"],
            file_actions=[(os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                          (os.POSIX_SPAWN_DUP2, out_w, 1),
                          (os.POSIX_SPAWN_DUP2, err_w, 2)],
            setpgroup=0, setsigdef=K._SIGDEF, setsigmask=())
    except OSError as exc:
        raise ExecError(f"cannot execute {cmd0!r}: {exc.strerror or exc}") from None
    except (ValueError, TypeError) as exc:
        raise ExecError(f"cannot execute {cmd0!r}: {exc}") from None


def _spare_thread(spare: "Spare") -> None:
    """A spare's thread: join the spare's groups (the slow migration: here, while no job
    waits for it and keeperd's loop goes on), say so, wait for the job's orders, spawn the
    job from inside the groups, end. Its end takes it out of the groups (a thread's exit
    needs no migration), before keeperd answers the start."""
    spare.tid = threading.get_native_id()
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, K._SIGDEF)  # signals are the main thread's
        try:
            join_cgroups([os.path.join(d, "tasks") for d in spare.dirs.values()], spare.tid)
        except JoinError as exc:
            os.write(spare.note_w, b"E" + str(exc).encode(errors="replace")[:4000])
            return
        os.write(spare.note_w, READY)
        spare.go.wait()
        if spare.orders is None:  # let go: nothing to become
            return
        orders, out_w, err_w = spare.orders
        try:
            spare.result = spawn_job(orders, out_w, err_w, oom_bump=True)
        except ExecError as exc:
            spare.result = exc
        except BaseException as exc:  # noqa: BLE001 - keeperd reports it as the start's failure
            spare.result = ExecError(f"the spare failed: {type(exc).__name__}: {exc}")
    finally:
        spare.finished.release()


class Spare:
    """A thread of keeperd in a spare's groups (`_spare_thread`), and what keeperd knows
    of it: `note_r` says READY (or why it could not join); `go` releases it with `orders`
    (None: let go); `result` is the job's pid or an ExecError; `finished` is released as
    the thread's last step.

    The thread is a bare `_thread` one: `threading.Thread.start` waits until the new
    thread runs, and on a busy host that held keeperd's loop (a py-spy profile of a
    400-job cgroup burst: 14.5% of keeperd's samples in that wait, 10% in `join`)."""

    __slots__ = ("name", "dirs", "knobs", "ready", "tid", "note_r", "note_w", "go", "orders",
                 "result", "finished")

    def __init__(self, name: str, dirs: dict[str, str], knobs: dict[tuple[str, str], str]) -> None:
        #: knobs: (controller, file) -> the value last written there (a claim writes only
        #: what differs)
        self.name, self.dirs, self.knobs, self.ready = name, dirs, knobs, False
        self.tid: int | None = None
        self.note_r, self.note_w = os.pipe()
        self.go = threading.Event()
        self.orders: tuple[dict, int, int] | None = None
        self.result: int | ExecError | None = None
        self.finished = threading.Lock()
        self.finished.acquire()

    def start(self) -> None:
        """Start the thread, without waiting for it to run (it sets `tid` first thing).
        RuntimeError: no thread to be had."""
        _thread.start_new_thread(_spare_thread, (self,))

    def end(self, timeout: float | None) -> bool:
        """Release the thread and wait until it has ended, as a task too (its tid gone
        from /proc: then it is out of every group); False if it did not within `timeout`
        (None: wait as long as it takes)."""
        self.go.set()
        if not self.finished.acquire(timeout=-1 if timeout is None else timeout):
            return False
        deadline = None if timeout is None else time.monotonic() + timeout
        while os.path.exists(f"/proc/self/task/{self.tid}"):
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.00005)
        for fd in (self.note_r, self.note_w):
            os.close(fd)
        return True


class SparePool:
    """keeperd's spares, for one parent (the last one a job's spec named)."""

    def __init__(self, state_dir: str, sel: selectors.BaseSelector, size: int,
                 log: Callable[[str], None]) -> None:
        self.state_dir, self.sel, self.size, self.log = state_dir, sel, size, log
        pid = os.getpid()
        self.owner = f"{pid}-{_start_ticks(pid)}"
        self.parents: dict[str, str] = {}  # controller -> parent group dir
        self.spares: dict[str, Spare] = {}  # by name
        self.serial = 0
        self.paused = False  # no thread could be started: none made until the next job's start
        self.taken = self.missed = 0  # job starts from a spare / with none ready
        #: ended jobs' groups, renamed, waiting to become spares: (name, dirs, knobs)
        self.recycled: list[tuple[str, dict[str, str], dict[tuple[str, str], str]]] = []
        self.made = self.reused = 0  # spares made with new groups / with an ended job's
        self.skipped = 0  # a claim's writes left out: the spare's groups had that value
        self.last_take = -math.inf  # when a job last started from the pool (monotonic)
        self.burst = False  # that start came within `idle_s` of the one before
        self.idle_s = refill_idle_s()

    @property
    def refill_due(self) -> bool:
        """Spares to make now: the pool is short and at half its size or below, or in a
        burst of starts, or no job has started for `idle_s` (REFILL_IDLE_S). keeperd makes
        the missing ones one per turn of its loop while nothing else is ready
        (`fill_one`): one right after the other, so their joins fall within one grace
        period."""
        return (bool(self.parents) and not self.paused and len(self.spares) < self.size
                and (len(self.spares) <= self.size // 2 or self.burst
                     or time.monotonic() - self.last_take >= self.idle_s))

    def refill_deadline(self) -> float | None:
        """When a short pool becomes due for its refill (keeperd's select timeout)."""
        if not self.parents or self.paused or len(self.spares) >= self.size:
            return None
        return self.last_take + self.idle_s

    def describe(self) -> dict:
        """The pool for the `spares` request: spares by name (their groups' name)."""
        return {"size": self.size, "parents": self.parents, "taken": self.taken,
                "missed": self.missed, "made": self.made, "reused": self.reused,
                "kept": len(self.recycled), "skipped_writes": self.skipped,
                "ready": sorted(n for n, s in self.spares.items() if s.ready),
                "joining": sorted(n for n, s in self.spares.items() if not s.ready)}

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
        self.use({c: os.path.dirname(d) for c, d in make["dirs"].items()})

    def use(self, parents: dict[str, str]) -> None:
        """Keep spares in these parent groups (by controller) from now on: a job's, or the
        ones a runner's start names (keeperd's "prepare")."""
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

    @property
    def settled(self) -> bool:
        """Nothing more to wait for: no parents (none named yet, or given up), no thread to
        be had, or every spare joined its groups and no refill is due (a full pool, or one
        a lone start left short until `idle_s` passes: a restarted runner does not wait
        for that)."""
        return (not self.parents or self.paused
                or (all(s.ready for s in self.spares.values()) and not self.refill_due))

    def take(self, make: dict) -> Spare | None:
        """A ready spare for the job: one whose groups already have the job's limits (an
        ended job's with the same CPUs and memory limit: its claim writes nothing), else
        the first ready one. None: none ready, or the job's parents are not the pool's."""
        if {c: os.path.dirname(d) for c, d in make["dirs"].items()} != self.parents:
            return None
        wanted = [((c, knob), value) for c, knob, value in make.get("writes", ())]
        found = None
        for spare in self.spares.values():
            if spare.ready:
                if all(spare.knobs.get(key) == value for key, value in wanted):
                    found = spare
                    break
                found = found or spare
        if found is None:
            self.missed += 1
            return None
        del self.spares[found.name]
        self.sel.unregister(found.note_r)
        self.taken += 1
        now = time.monotonic()
        self.burst, self.last_take = now - self.last_take < self.idle_s, now
        return found

    def claim(self, spare: Spare, make: dict) -> bool:
        """The job's limits into the spare's groups, its counters zeroed, the groups
        renamed to the job's. False (the spare discarded, the groups named as before):
        the job starts the old way."""
        renamed: list[tuple[str, str]] = []
        try:
            for controller, knob, value in make.get("writes", ()):
                if spare.knobs.get((controller, knob)) == value:
                    self.skipped += 1  # (a cpuset.cpus write moves the spare's thread:
                    continue  # 0.2 ms here)
                write_knob(os.path.join(spare.dirs[controller], knob), value)
            for controller, knob in RESETS:
                if controller in spare.dirs:
                    write_knob(os.path.join(spare.dirs[controller], knob), "0")
            for controller, job_dir in make["dirs"].items():
                os.rename(spare.dirs[controller], job_dir)
                renamed.append((job_dir, spare.dirs[controller]))
            return True
        except (JoinError, OSError) as exc:
            self.log(f"spare {spare.name} not used: {exc}")
            for new, old in renamed:
                try:
                    os.rename(new, old)
                except OSError:
                    pass
            self._discard(spare)
            return False

    def order(self, spare: Spare, orders: dict, out_w: int, err_w: int) -> int:
        """The claimed spare spawns the job from inside its groups and ends; the job's pid
        once the spare's thread is out of the groups. ExecError: the job could not be
        spawned (the spare ends all the same). keeperd's loop waits meanwhile (a
        posix_spawn: well under a millisecond), so nothing else of keeperd runs while
        the spawn holds the process's cwd, umask and oom_score_adj."""
        spare.orders = (orders, out_w, err_w)
        spare.end(None)  # its few steps, then a task's exit: never long
        if isinstance(spare.result, int):
            return spare.result
        raise spare.result or ExecError("the spare ended without a result")

    # -- filling ------------------------------------------------------------------------

    def recycle(self, dirs: dict[str, str], writes: Any, facts: Any) -> bool:
        """An ended job's groups (empty, their facts read: `isolation_released`) kept for
        the pool's next spare (`fill_one`) rather than removed: renamed to that spare's name
        at once (they are keeperd's from then on) and their `RECYCLE_RESETS` zeroed. True
        when taken (kept, or removed here after a failed rename), False when the caller
        removes them. Taken only for the pool's parents, at most the pool's size of them
        waiting at a time, when the job saw no OOM kill (`oom_kill` cannot be zeroed; the
        old kernels' `failcnt` is) and its memory group holds at most
        `RECYCLE_MAX_USAGE`."""
        if (not self.parents or self.paused or set(dirs) != set(self.parents)
                or any(os.path.dirname(d) != self.parents[c] for c, d in dirs.items())
                or len(self.recycled) >= self.size
                or not isinstance(facts, dict) or facts.get("oom_kills") not in (0, None)
                or facts.get("oom_killed")):
            return False
        try:
            with open(os.path.join(dirs["memory"], "memory.usage_in_bytes")) as f:
                if int(f.read()) > RECYCLE_MAX_USAGE:
                    return False
        except (OSError, ValueError):
            return False
        name, new = self._next_name()
        where = dict(dirs)
        try:
            for c, d in dirs.items():
                os.rename(d, new[c])
                where[c] = new[c]
            for controller, knob in RECYCLE_RESETS:
                write_knob(os.path.join(new[controller], knob), "0")
        except (OSError, JoinError) as exc:
            self.log(f"an ended job's groups not kept for a spare: {exc}")
            self._remove_dirs(where)
            return True
        knobs = {(c, knob): value for c, knob, value in writes or () if isinstance(value, str)}
        self.recycled.append((name, new, knobs))
        return True

    def _next_name(self) -> tuple[str, dict[str, str]]:
        """A new spare's name and its groups (controller -> dir)."""
        self.serial += 1
        name = f"{PREFIX}{self.owner}-{self.serial}"
        return name, {c: os.path.join(p, name) for c, p in self.parents.items()}

    def fill_one(self) -> None:
        """Make one spare: its groups (an ended job's that `recycle` kept; else new ones:
        mkdir, cpuset.mems/cpus), then its thread, which joins them (the slow part) and
        says when it is ready."""
        if self.recycled:
            name, dirs, knobs = self.recycled.pop(0)
            self.reused += 1
        else:
            name, dirs = self._next_name()
            knobs = self._make(dirs)
            if knobs is None:
                return
            self.made += 1
        spare = Spare(name, dirs, knobs)
        try:
            spare.start()
        except RuntimeError as exc:  # no thread to be had
            self.log(f"cannot start a spare: {exc}")
            for fd in (spare.note_r, spare.note_w):
                os.close(fd)
            self._remove_dirs(dirs)
            self.paused = True  # none made until the next job's start
            return
        self.spares[name] = spare
        self.sel.register(spare.note_r, selectors.EVENT_READ, lambda ev, s=spare: self._on_event(s))

    def _make(self, dirs: dict[str, str]) -> dict[tuple[str, str], str] | None:
        """New groups for a spare, with the parent's CPUs and memory nodes: their knobs."""
        made: list[str] = []
        knobs = {}
        try:
            for d in dirs.values():
                os.mkdir(d)
                made.append(d)
            cs, parent_cs = dirs["cpuset"], self.parents["cpuset"]
            for knob in ("cpuset.mems", "cpuset.cpus"):  # mems first: else no task may join
                with open(os.path.join(parent_cs, knob)) as f:
                    knobs["cpuset", knob] = f.read().strip()
                write_knob(os.path.join(cs, knob), knobs["cpuset", knob])
            return knobs
        except (OSError, JoinError) as exc:
            self.log(f"no spares under {self.parents['cpuset']}: {exc}")
            for d in made:
                try:
                    os.rmdir(d)
                except OSError:
                    pass
            self.parents = {}  # (a parent gone: the next job's spec may bring it back)
            return None

    def _on_event(self, spare: Spare) -> None:
        data = os.read(spare.note_r, 4096)
        if data == READY and not spare.ready:
            spare.ready = True
            return
        self.log(f"spare {spare.name}: {data.decode(errors='replace')}")
        del self.spares[spare.name]
        self.sel.unregister(spare.note_r)
        self._discard(spare)
        self.parents = {}  # it could not join: make no more (the log says why)

    # -- letting go ---------------------------------------------------------------------

    def _remove_dirs(self, dirs: dict[str, str]) -> None:
        deadline = time.monotonic() + CLEAN_S
        for d in dirs.values():
            error = _remove_group(d, deadline)
            if error:
                self.log(error)

    def _discard(self, spare: Spare) -> None:
        """A spare out of the pool: its thread let go and ended, its groups removed."""
        spare.orders = None
        if not spare.end(SPARE_END_S):
            self.log(f"spare {spare.name} did not end within {SPARE_END_S:g}s")
        self._remove_dirs(spare.dirs)

    def drop(self) -> None:
        """No runner connected: no spare kept (the next job's spec brings them back)."""
        self.close()
        self.parents = {}

    def close(self) -> None:
        """Every spare let go (keeperd exits, or the parent changed), and the ended jobs'
        groups kept for them removed."""
        while self.recycled:
            self._remove_dirs(self.recycled.pop()[1])
        for spare in list(self.spares.values()):
            del self.spares[spare.name]
            self.sel.unregister(spare.note_r)
            self._discard(spare)


def orders_of(spec: dict[str, Any], exe: str, argv: list[str], env: dict) -> dict:
    return {"exe": exe, "argv": argv, "env": env, "cwd": spec.get("cwd"),
            "cpus": spec.get("cpus"), "pin": bool(spec.get("pin")), "umask": spec.get("umask")}
