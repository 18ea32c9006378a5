"""The job execution actor's blocking file work: the job directory and the workspace.

Every function here blocks (file system, a bundle's unpacking) and is called by
execution/actor.py through its injected offloader (`JobDeps.offload`: a worker thread in
production, inline in actor-level tests), never on the event loop; a start's workspace,
isolation groups and spec.json go together in one call (`set_up`: one thread hop). The
exceptions are `look`, `log_size`, `read_status`, and `set_up` and `close` when they are
light (`set_up_is_light`, `close_is_light`: no bundle, a backend with nothing to make or
remove), a few small metadata calls, mostly on the runner's own state directory (a local
file system, like the SQLite database the store writes on the event loop's behalf): the
actor calls them inline, at its start, per output poll and at its end, because a thread
hop costs more than they do, above all on a loaded host (docs/keeper.md, "The job actor").
The rules stay in execution/core.py; the on-disk format, shared with the keeper, in
execution/joblog.py.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from pathlib import Path
from typing import Any, Callable

import msgspec

from ..disk.bundles import BundleError, unpack_into
from ..isolation.base import Backend
from ..lifecycle import RETENTION_MS
from ..records import JobRecord, Output, Refusal
from ..store.files import job_umask
from . import joblog
from .core import Found, OutputDecoder, claimed_found, found, isolation_problems, job_env, job_spec

__all__ = ["Progress", "adopt_claim", "claimed", "close", "close_is_light", "kill_strays",
           "log_size", "look", "look_at_start", "prepare", "read_claim", "read_output",
           "read_status", "set_up", "set_up_is_light", "write_spec"]

log = logging.getLogger("motor.execution")
_encode = msgspec.json.Encoder().encode

#: the base backend's steps, known to touch nothing (captured at import: a replaced one is
#: not known to be light)
_BASE_PREPARE, _BASE_SETTLE = Backend.prepare, Backend.settle


def look(job_dir: Path) -> tuple[dict[str, Any] | None, bool, bool, str | None]:
    """What is in the job directory, for `core.found`: keeper.json's contents (None when
    absent), whether status.json and the directory exist, and why keeper.json cannot be
    read when it is there but corrupt (None otherwise)."""
    keeper, error = read_claim(job_dir)
    return keeper, (job_dir / joblog.STATUS_FILE).exists(), job_dir.exists(), error


def adopt_groups(backend: Any, job_id: str, job_dir: Path, who: str = "") -> None:
    """The isolation backend takes an adopted job's groups back (`adopt`). None left is
    what a job that ended while no runner ran leaves (keeperd removes an ended job's groups
    once its status.json is written): said only of a job with no status yet, which runs on
    out of its groups (before stop 58 every such adoption after a crash logged a warning)."""
    if not backend.adopt(job_id) and not (job_dir / joblog.STATUS_FILE).exists():
        log.warning("%s: its isolation group is gone; following it without one", who)


def adopt_claim(job_dir: Path, spawner: Any, job_id: str, who: str = "") -> Found:
    """A spawn found the directory claimed: adopt the keeper its claim names, or, when the
    claim names none, stop the job's processes and adopt it with no keeper to follow."""
    found_ = claimed_found(*read_claim(job_dir))
    if found_.kill_strays:
        kill_strays(spawner, job_id, who, found_.claim_error)
    return found_


def read_claim(job_dir: Path) -> tuple[dict[str, Any] | None, str | None]:
    """keeper.json's contents (None when absent), or (None, why) when it is corrupt."""
    try:
        return joblog.read_keeper(job_dir), None
    except joblog.JobDirError as exc:
        return None, str(exc)


def look_at_start(job_dir: Path, fresh: bool = False, ran: bool = False) -> Found:
    """What the job directory says when a job actor starts (`core.found` of `look`; `ran`:
    the job's record says it was spawned). Nothing is looked at for a `fresh` one: the
    first incarnation of a job this dispatcher accepted and never placed before
    (`StartJobActor.fresh`: an admit, or a job from its queue, `DispatchMachine.unplaced`),
    so it has no directory yet (issue 14: three stats off a start)."""
    return Found(adopt=False) if fresh else found(*look(job_dir), ran=ran)


def kill_strays(spawner: Any, job_id: str, who: str = "", claim_error: str | None = None) -> None:
    """Before a job is set up again over a start cut short (no keeper was released: the
    claim comes first), kill whatever still carries its marker (defence in depth); also
    when its keeper's claim names no keeper (`claim_error`, said here): nothing of the job
    may run that the runner does not follow (its end is then what status.json says)."""
    if claim_error is not None:
        log.warning("%s: its keeper's claim cannot be read (%s): its processes are stopped",
                    who, claim_error)
    if killed := spawner.kill_marked(job_id):
        log.warning("%s: killed %d %s: %s", who, len(killed), "process(es) of the job" if
                    claim_error else "stray process(es) of the job before its start", killed)


def claimed(job_dir: Path) -> bool:
    """A keeper's claim (keeper.json) is in the job directory."""
    return (job_dir / joblog.KEEPER_FILE).exists()


def prepare(cwd: Path, job_dir: Path, bundle: str | None, root: str | None,
            job_id: str) -> Refusal | None:
    """Make the workspace, its source unpacked from `bundle` if any, and the job directory.
    A bundle that cannot be unpacked is a refusal (`workspace_setup_failed`, nothing of it
    left behind); so is a workspace path that is not a directory (a file there, or a file
    on its way: before stop 49 its job was retried every 60 s for as long as it stayed); any
    other failure raises (a failed start, retried)."""
    try:
        if not os.path.isdir(cwd):  # most starts find it there: one stat(2), not two calls
            os.makedirs(cwd, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as exc:
        return Refusal(code="workspace_setup_failed", detail=(
            f"the workspace {cwd} cannot be a directory ({exc.strerror}): a file is in its "
            "place or on its way; remove it, then submit again"))
    if bundle is not None:
        try:
            unpack_into(Path(bundle), str(cwd), root, job_id)
        except BundleError as exc:
            return Refusal(code="workspace_setup_failed", detail=str(exc))
    try:  # new at a first start: one mkdir(2)
        os.mkdir(job_dir)
    except FileExistsError:
        if not os.path.isdir(job_dir):
            raise
    except FileNotFoundError:  # the jobs directory itself is gone
        os.makedirs(job_dir, exist_ok=True)
    return None


class Progress:
    """How far `set_up` got (read by the caller when it raised): whether the isolation
    backend was asked to confine the job (then its groups must be removed again)."""

    __slots__ = ("prepared",)

    def __init__(self) -> None:
        self.prepared = False


_environ: tuple[dict, dict[str, str]] = ({}, {})  # os.environ's raw bytes, and decoded


def runner_environ() -> dict[str, str]:
    """The runner's environment as text, the base of every job's (one dict, shared: never
    changed; `job_env` copies it). Decoded again only when it changed: reading os.environ
    decodes each variable on every job's start (issue 14), while a look at its raw bytes
    (CPython keeps them in `os.environ._data`) compares at C speed."""
    global _environ
    raw = getattr(os.environ, "_data", None)
    if raw is None:
        return dict(os.environ)
    if raw != _environ[0]:
        _environ = (dict(raw), dict(os.environ))
    return _environ[1]


def set_up(record: JobRecord, cwd: Path, job_dir: Path, bundle: str | None,
           root: str | None, backend: Any, config: Any, progress: Progress) -> Refusal | None:
    """A start's steps in one call (one thread hop, or none: `set_up_is_light`): `prepare`
    (workspace, bundle, job directory), the isolation backend's groups (`backend.prepare`;
    `progress.prepared` is set before it runs) and the keeper's spec.json (core.job_spec:
    the job's environment, the runner's umask, the backend's fields). A refusal (a bundle
    that cannot be unpacked) stops it before the backend is asked."""
    if refusal := prepare(cwd, job_dir, bundle, root, record.job_id):
        return refusal
    env = job_env(record, runner_environ(), getattr(config, "compile_cache", None))
    progress.prepared = True
    isolation = backend.prepare(record.job_id, record.cpus, record.memory_max_bytes)
    write_spec(job_dir, job_spec(record, str(cwd), env, job_umask(), isolation))
    return None


def set_up_is_light(backend: Any, bundle: str | None, record: JobRecord | None = None) -> bool:
    """Whether `set_up` may run inline: no bundle to unpack and the backend's `prepare` is
    the base one (`affinity`, `none`: spec fields only, no side effect). What is left is
    metadata work: the workspace and job directory made when missing (the disk actor stats
    the workspace's root on the event loop already) and spec.json written on the state
    directory. So is a backend whose `prepare` only plans (`plans_only`: cgroup v1, where
    the keeper makes the groups: three stats and one read of the parent's memory limit), and
    one whose `prepare_is_light(cpus, memory_max)` says the record's needs no call (systemd:
    a free slot slice carries its limits already; a few reads of the slice's counters). A
    backend with groups to make (cgroup v2, systemd otherwise), or any other `prepare` (a
    replaced one may block: tests/scheduling hold one at a barrier), goes to the offloader."""
    if bundle is not None:
        return False
    light = getattr(backend, "prepare_is_light", None)
    return (type(backend).prepare is _BASE_PREPARE or getattr(backend, "plans_only", False)
            or (light is not None and record is not None
                and light(record.cpus, record.memory_max_bytes)))


#: output.log growth read on the event loop (one open, one read of a few pages in the page
#: cache: cheaper than a thread hop); more goes to the offloader
INLINE_READ_BYTES = 16 * 1024


def log_size(job_dir: Path) -> int | None:
    """output.log's size (one stat on the state directory; called inline): 0 when it is
    missing (as `joblog.read_records` reads it), None when it cannot be looked at (the
    offloaded read then reports why)."""
    try:
        return os.stat(os.path.join(job_dir, joblog.OUTPUT_FILE)).st_size
    except FileNotFoundError:
        return 0
    except OSError:
        return None


def empty(job_dir: Path) -> int:
    """Unlink the files of an ended job's directory (`output.log`, `spec.json`, `status.json`,
    `keeper.json`, a temporary file left behind), keeping the directory itself until the
    job's retention: its output is in the store by then, and the directory still says that
    the job was this state dir's (the start-up sweep's `owned`). The files unlinked; a file
    that cannot be (gone already, an immutable directory) is left to the job's retention."""
    try:
        entries = os.scandir(job_dir)
    except OSError:  # gone, not a directory, unreadable: retention deals with it
        return 0
    unlinked = 0
    with entries:
        for entry in entries:
            try:
                if not entry.is_dir(follow_symlinks=False):
                    os.unlink(entry.path)
                    unlinked += 1
            except OSError:
                pass
    return unlinked


class EndedDirs:
    """The directories of ended jobs, emptied in the order their ends were saved: by the
    maintenance pass a minute after each end, and at once by the disk manager when the state
    file system needs room (docs/operations.md, "Retention"). One per runner, shared by
    both (so one mark, kept across their restarts); its work runs in worker threads."""

    def __init__(self, jobs_dir: Path, ended: Callable[[tuple[int, str], int], list]):
        #: `Database.ended_between`: (retain_until_ms, job_id) of jobs ended in a span
        self.jobs_dir, self.ended = jobs_dir, ended
        self.emptied_to: tuple[int, str] = (0, "")  # the last job emptied, in that order
        self._lock = threading.Lock()

    def empty_ended(self, now_ms: int, after_ms: int) -> int:
        """Empty the directory of every job whose end was saved at least `after_ms` before
        `now_ms` and after the last one emptied; how many jobs."""
        with self._lock:
            until_ms, jobs = now_ms + RETENTION_MS - after_ms, 0
            if until_ms < self.emptied_to[0]:  # the wall clock stepped back past the mark:
                self.emptied_to = (0, "")  # the ends saved since sort before it; from the start
            while rows := self.ended(self.emptied_to, until_ms):
                for _, job_id in rows:
                    empty(self.jobs_dir / job_id)
                jobs += len(rows)
                self.emptied_to = tuple(rows[-1])
            return jobs


def write_spec(job_dir: Path, spec: dict[str, Any]) -> None:
    """The keeper's spec.json, atomically (mode 0600: it holds the environment); encoded
    by msgspec, which the runner has loaded anyway (a job's environment through the json
    module cost 18 us a start, msgspec 2: issue 14)."""
    joblog.write_bytes_atomic(os.path.join(job_dir, joblog.SPEC_FILE), _encode(spec))


def read_output(job_dir: Path, offset: int, max_bytes: int,
                decoder: OutputDecoder) -> tuple[list[Output], int]:
    """One batch of output.log from `offset` as output events, and the offset after it
    (JobDirError or OSError when the log cannot be read). The raw bytes live only here:
    the caller holds one batch of events, never the log. `offset` is where the store's
    copy ends (the job actor saves a batch with the offset after it before it reads the
    next): past FREE_READ_AFTER_BYTES the log's blocks below it go back to the file system;
    and after a whole batch, more than the job's output cap still unread is skipped."""
    path = job_dir / joblog.OUTPUT_FILE
    if (pending := decoder.pending_skip) is not None:
        decoder.pending_skip = None
        if pending[0] == offset:
            return [decoder.skipped(pending[1] - offset)], pending[1]
    if offset >= FREE_READ_AFTER_BYTES:
        # (the reads just past the threshold punch from the start: the log's first part too)
        start = 0 if offset < FREE_READ_AFTER_BYTES + _FREE_SPAN else offset - _FREE_SPAN
        punch(path, start, offset)
    records, new = joblog.read_records(path, offset, max_bytes)
    events = decoder.events(records)
    keep = decoder.keep_bytes
    if keep is not None and new - offset >= max_bytes // 2 and (
            (size := log_size(job_dir)) or 0) - new > keep + FREE_READ_AFTER_BYTES:
        # more than the store would keep is still to be read: on to its last `keep` bytes,
        # their hole punched at once (the store may be waiting for that space to save)
        skip_to = joblog.record_at_or_after(path, new, size - keep)
        punch(path, new, skip_to)
        events.append(decoder.skipped(skip_to - new))
        new = skip_to
    return events, new


def relieve(run: Any, offset: int) -> None:
    """The store cannot save the batch of output.log that ends at `offset` (the state file
    system is full), and the next read would start there: when what is unread of the log
    passes twice `min(cap, FREE_READ_AFTER_BYTES)`, skip it to its last that-much now, its
    hole punched at once, so that the save finds the space it waits for (the next read
    goes on after the skip: `OutputDecoder.pending_skip`). Where the log is not what fills
    the file system, nothing is skipped that the store could have kept."""
    decoder, keep = run.output, run.output.keep_bytes
    if run.job_dir is None or keep is None:
        return
    after = offset  # skipped to already, at an earlier retry (the job printing on)
    if (pending := decoder.pending_skip) is not None:
        if pending[0] != offset:
            return
        after = pending[1]
    keep = min(keep, FREE_READ_AFTER_BYTES)
    path = Path(run.job_dir) / joblog.OUTPUT_FILE
    if (size := log_size(run.job_dir) or 0) - after <= 2 * keep:
        return
    try:
        skip_to = joblog.record_at_or_after(path, after, size - keep)
    except (joblog.JobDirError, OSError):
        return  # the next read says what is wrong
    if skip_to > after:
        decoder.pending_skip = (offset, skip_to)
        punch(path, after, skip_to)


#: output.log holds a job's output until the runner has stored it; a job that prints
#: faster than that (or gigabytes in all) would fill the state file system with a copy of
#: what the store holds, or has evicted past its cap, and keep it there for the day the
#: job directory is retained. So once the log has passed this much, each read first
#: punches a hole over the two batches before it (stored: `read_output`; those before
#: were punched by the reads before; the first reads past it punch from the log's start):
#: the file keeps its size and offsets, its blocks
#: there are freed (FALLOC_FL_PUNCH_HOLE; ext4, xfs, btrfs, tmpfs). Stop 56: a job
#: printing `yes` filled a 2 GiB state file system in 8 s with a 1.7 GB output.log; its
#: status.json could then not be written, and nothing else could be admitted, for good.
FREE_READ_AFTER_BYTES = 16 * 1024 * 1024
_FREE_SPAN = 2 * (joblog.READ_MAX_BYTES + joblog.RECORD_HEADER.size + 65536)
_PUNCH_HOLE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
_fallocate = None  # libc's, loaded at the first punch
_punch_said: set[int] = set()  # errnos logged once


def punch(path: Path, start: int, end: int) -> None:
    """Give the blocks of `path` in [start, end) back to the file system (reads there
    return zeros). Where the file system cannot, the file stays whole (logged once)."""
    global _fallocate
    if _fallocate is None:
        _fallocate = ctypes.CDLL(None, use_errno=True).fallocate
        _fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    if end <= start:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    except OSError:
        return  # the read says why
    try:
        if _fallocate(fd, _PUNCH_HOLE, start, end - start) != 0 and (
                (err := ctypes.get_errno()) not in _punch_said):
            _punch_said.add(err)
            log.warning("the stored part of %s cannot be given back to its file system (%s): "
                        "a job's whole output stays there until its job directory's "
                        "retention ends", path, os.strerror(err))
    finally:
        os.close(fd)


def read_status(job_dir: Path, who: str = "", given: dict[str, Any] | None = None,
                ) -> tuple[dict[str, Any] | None, str | None]:
    """The keeper's status.json (`given`: that, already in hand), and why there is none:
    (None, None) when it is absent, (None, what is wrong) when it cannot be read or the
    job directory itself is gone (logged). Either way the keeper is lost; the terminal
    record says which."""
    if given is not None:
        return given, None
    try:
        status = joblog.read_status(job_dir)
    except joblog.JobDirError as exc:
        why = str(exc)
    else:
        if status is not None or job_dir.exists():
            return status, None
        why = (f"{job_dir} was removed while the job ran, so its keeper could not record "
               "the job's exit status there")
    log.warning("%s: %s", who, why)
    return None, why


def close_is_light(backend: Any, status: dict[str, Any] | None) -> bool:
    """Whether `close` may run inline: the keeper's status is in hand (read inline: one
    small file on the state directory) and the backend's `settle` is the base one
    (`affinity`, `none`: it touches nothing). A lost keeper (its leftovers are looked for in
    /proc) or a backend with groups to read and remove goes through the offloader."""
    return status is not None and type(backend).settle is _BASE_SETTLE


def close_quick(backend: Any, job_id: str, status: dict[str, Any] | None,
                who: str = "") -> dict[str, Any] | None:
    """`close` on the event loop for a keeper whose status is in hand and a backend whose
    groups are already empty (`settle_quick`: a few reads, no wait): the backend's facts;
    None when `close` must go through the offloader (issue 14: one thread hop less at the
    end of a cgroup job)."""
    quick = getattr(backend, "settle_quick", None)  # a test's stand-in may have none
    if status is None or quick is None:
        return None
    # status.json's isolation_facts: keeperd's reading of a v1 cgroup job's groups
    facts = quick(job_id, status.get("signal"), status.get("isolation_facts"))
    if facts is not None:
        _log_problems(facts, who)
    return facts


def _log_problems(facts: dict[str, Any], who: str) -> None:
    for problem, text in isolation_problems(facts):
        log.warning("%s: isolation %s: %s", who, problem, text)


def close(job_dir: Path, spawner: Any, backend: Any, job_id: str, status: dict[str, Any] | None,
          who: str = "") -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """After the keeper exited: its status (as the caller read status.json; None: lost) and
    the isolation backend's facts. A keeper lost without a status leaves nothing of its job
    behind (whatever carries the job's marker is killed; the cgroup backends drain their
    groups in `settle`); the backend's findings (OOM kill, CPU time) are collected, and what
    it could not do is logged, never fatal. Its groups or units stay: `release` removes
    them after the terminal record (messages.release_isolation)."""
    if status is None and (killed := spawner.kill_marked(job_id)):
        log.warning("%s: keeper lost; killed %d leftover process(es): %s", who, len(killed), killed)
    signal = (status or {}).get("signal")
    needs_spec = getattr(backend, "needs_spec", None)  # systemd: an adopted job's counters
    if needs_spec is not None and needs_spec(job_id):
        try:
            spec = joblog.read_spec(job_dir)
        except joblog.JobDirError as exc:
            log.warning("%s: %s", who, exc)
            spec = None
        facts = backend.settle(job_id, signal, spec=spec)
    else:
        facts = backend.settle(job_id, signal)
    _log_problems(facts, who)
    return status, facts
