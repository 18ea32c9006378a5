"""Pure accounting: reservation use, per-repository totals, hourly queue wait, underuse.

Plain data in, figures out: no trio, no I/O, no clock reads (every time is passed in as
wall-clock milliseconds). The accounting actor (actor.py) owns one `Ledger` and feeds it
the facts other actors cast to it; see ../../docs/accounting.md.

Indexes (so a health probe never scans retained records):
- `RepositoryWindow`: one entry per job that ended in the last 24 h, kept sorted by end
  time, plus running totals per repository; a probe drops the entries that left the window
  (subtracting them from the totals) and copies the totals.
- `UnderusedIndex`: only the jobs that qualified as underused, each with its retention
  deadline; a probe drops the expired ones.
- `HourlyQueueWait`: 24 sixty-minute buckets of capacity waits of started jobs and refusals.
- `Ledger.active`: jobs setting up or running, by job id.
- `Ledger.retained`: a heap of the retention deadlines of terminal records (their count).
"""

from __future__ import annotations

import bisect
import heapq
import math
import posixpath
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

import msgspec

from ..lifecycle import REFUSED_BEFORE_START, RUNNING, retain_until
from ..records import JobRecord, ReservationUse

HOUR_MS = 3600 * 1000
DAY_MS = 24 * HOUR_MS
HOURLY_BUCKETS = 24
UNDERUSED_MIN_WALL_MS = 10 * 60 * 1000  # "ran over ten minutes"
UNDERUSED_BELOW_PPM = 250_000  # "below 25% of their reservation"
NO_REPOSITORY = "(none)"
QUEUE_WAIT_REFUSAL = "queue_wait_exceeded"


# --- reservation use ---------------------------------------------------------------------


def _figure(value: Any) -> float | None:
    """A finite, non-negative number of milliseconds, or None (missing or garbage)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not math.isfinite(value) or value < 0:
        return None
    return value


def reservation_use(claim: Any, cpu_time_ms: Any, wall_time_ms: Any) -> ReservationUse | None:
    """CPU time over the reserved CPU time, from the OS's own figures.

    average_use_ppm = cpu_time / (wall * claim) * 1e6, rounded; 1,000,000 is 100%.
    None when a figure is missing or invalid (absent, never zero): a non-number, negative,
    NaN/inf, a wall time of zero, or a claim below 1.
    """
    cpu = _figure(cpu_time_ms)
    wall = _figure(wall_time_ms)
    if cpu is None or wall is None:
        return None
    cpu, wall = int(round(cpu)), int(round(wall))  # whole milliseconds, as recorded
    if wall <= 0:
        return None
    if isinstance(claim, bool) or not isinstance(claim, int) or claim < 1:
        return None
    ppm = round(cpu / (wall * claim) * 1_000_000)
    return ReservationUse(cpu_time_ms=cpu, wall_time_ms=wall, average_use_ppm=ppm)


def with_reservation_use(record: JobRecord, status: Any) -> JobRecord:
    """`record` with reservation_use from the keeper's status.json figures, when measured.

    Never raises and never touches anything but `reservation_use`: missing or garbage
    accounting leaves the terminal record exactly as it was.
    """
    try:
        if not isinstance(status, dict) or status.get("reason") == "spawn_failed":
            return record
        use = reservation_use(record.claim, status.get("cpu_time_ms"), status.get("wall_time_ms"))
        if use is None:
            return record
        return msgspec.structs.replace(record, reservation_use=use)
    except Exception:  # accounting must never cost a terminal record
        return record


def is_underused(record: JobRecord) -> bool:
    use = record.reservation_use
    return (use is not None and use.wall_time_ms > UNDERUSED_MIN_WALL_MS
            and use.average_use_ppm < UNDERUSED_BELOW_PPM)


# --- repositories ------------------------------------------------------------------------


def repository_name(path: str | None) -> str:
    """The basename of the main checkout a repository path names, from the text alone.

    `/x/app`, `/x/app/`, `/x/app/.git`, `/x/app/.git/worktrees/w` -> `app`; a bare
    `/x/app.git` (or its `worktrees/w`) -> `app`; no path -> "(none)".
    (actor.py first follows a linked worktree's `.git` file when the path exists.)
    """
    if not path or not path.strip():
        return NO_REPOSITORY
    p = posixpath.normpath(path.strip().replace("\\", "/"))
    parts = [x for x in p.split("/") if x]
    for i in range(len(parts) - 1, 0, -1):  # .../<gitdir>/worktrees/<name>
        if parts[i - 1] == "worktrees" and i >= 2 and (
                parts[i - 2] == ".git" or parts[i - 2].endswith(".git")):
            parts = parts[: i - 1]
            break
    if parts and parts[-1] == ".git":
        parts = parts[:-1]
    if not parts:
        return NO_REPOSITORY
    name = parts[-1]
    if name.endswith(".git") and len(name) > 4:
        name = name[:-4]
    return name


def main_checkout_from_gitdir(gitdir: str, commondir: str | None) -> str:
    """The main checkout (or bare repository) of a worktree's gitdir.

    `gitdir` is an absolute path (`/src/app/.git/worktrees/w`); `commondir` is the content of
    its `commondir` file (`../..`) when there is one.
    """
    gitdir = posixpath.normpath(gitdir)
    if commondir:
        common = commondir.strip()
        common = posixpath.normpath(common if posixpath.isabs(common)
                                    else posixpath.join(gitdir, common))
        return common
    return gitdir


# --- hourly queue wait ---------------------------------------------------------------------


def nearest_rank(sorted_values: list[int], pct: float) -> int:
    """The nearest-rank percentile of an ascending list (0 for an empty one)."""
    if not sorted_values:
        return 0
    rank = max(1, math.ceil(pct / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


@dataclass
class _Hour:
    waits: list[int] = field(default_factory=list)  # kept sorted
    refusals: int = 0


class HourlyQueueWait:
    """Sixty-minute buckets (aligned to the hour of wall time) of the last 24 hours.

    `started` adds a started job's capacity wait; `refused` a queue-wait refusal. The
    report lists all 24 hours oldest first; hours without events report zeros. Lives in
    memory only: it resets when the runner (or the accounting actor) restarts.
    """

    def __init__(self, hours: int = HOURLY_BUCKETS):
        self.hours = hours
        self.buckets: dict[int, _Hour] = {}

    @staticmethod
    def hour_of(ms: int) -> int:
        return ms - ms % HOUR_MS

    def _bucket(self, at_ms: int) -> _Hour:
        hour = self.hour_of(at_ms)
        bucket = self.buckets.get(hour)
        if bucket is None:
            bucket = self.buckets[hour] = _Hour()
        return bucket

    def started(self, at_ms: int, queue_wait_ms: int) -> None:
        bisect.insort(self._bucket(at_ms).waits, max(0, int(queue_wait_ms)))

    def refused(self, at_ms: int) -> None:
        self._bucket(at_ms).refusals += 1

    def expire(self, now_ms: int) -> None:
        first = self.hour_of(now_ms) - (self.hours - 1) * HOUR_MS
        for hour in [h for h in self.buckets if h < first]:
            del self.buckets[hour]

    def report(self, now_ms: int) -> list[dict]:
        self.expire(now_ms)
        current = self.hour_of(now_ms)
        out = []
        for i in range(self.hours - 1, -1, -1):
            hour = current - i * HOUR_MS
            bucket = self.buckets.get(hour) or _Hour()
            out.append({
                "hour_start_ms": hour,
                "started": len(bucket.waits),
                "p50_ms": nearest_rank(bucket.waits, 50),
                "p90_ms": nearest_rank(bucket.waits, 90),
                "refusals": bucket.refusals,
            })
        return out


# --- per-repository rolling 24 h -------------------------------------------------------


@dataclass(frozen=True, order=True)
class WindowEntry:
    ended_at_ms: int
    job_id: str
    repository: str = field(compare=False)
    claim: int = field(compare=False)
    reserved_ms: int = field(compare=False)  # claim x wall milliseconds (0 when it never ran)
    finished: bool = field(compare=False)  # it ran and ended
    queue_wait_refusal: bool = field(compare=False)


def _totals() -> dict:
    return {"reserved_vcpu_ms": 0, "finished_jobs": 0, "jobs_by_vcpus": Counter(),
            "queue_wait_refusals": 0}


class RepositoryWindow:
    """Per repository: reserved vCPU-seconds, finished jobs, jobs by vCPUs, queue-wait
    refusals of the jobs that ended in the rolling 24 hours."""

    def __init__(self, window_ms: int = DAY_MS):
        self.window_ms = window_ms
        self.entries: list[WindowEntry] = []  # sorted by (ended_at_ms, job_id)
        self.ids: set[str] = set()
        self.totals: dict[str, dict] = {}

    def add(self, entry: WindowEntry, now_ms: int | None = None) -> None:
        if entry.job_id in self.ids:
            return
        if now_ms is not None and entry.ended_at_ms <= now_ms - self.window_ms:
            return
        if not entry.finished and not entry.queue_wait_refusal:
            return  # e.g. cancelled before start: nothing to account
        self.ids.add(entry.job_id)
        if not self.entries or entry >= self.entries[-1]:
            self.entries.append(entry)
        else:
            bisect.insort(self.entries, entry)
        self._apply(entry, +1)

    def rebuild(self, entries: list[WindowEntry]) -> None:
        """Replace the contents with `entries`, already sorted."""
        self.entries, self.ids, self.totals = [], set(), {}
        for entry in entries:
            if entry.job_id in self.ids or not (entry.finished or entry.queue_wait_refusal):
                continue
            self.ids.add(entry.job_id)
            self.entries.append(entry)
            self._apply(entry, +1)

    def _apply(self, e: WindowEntry, sign: int) -> None:
        t = self.totals.get(e.repository)
        if t is None:
            t = self.totals[e.repository] = _totals()
        if e.finished:
            t["reserved_vcpu_ms"] += sign * e.reserved_ms
            t["finished_jobs"] += sign
            t["jobs_by_vcpus"][e.claim] += sign
            if t["jobs_by_vcpus"][e.claim] <= 0:
                del t["jobs_by_vcpus"][e.claim]
        if e.queue_wait_refusal:
            t["queue_wait_refusals"] += sign
        if t["finished_jobs"] <= 0 and t["queue_wait_refusals"] <= 0:
            del self.totals[e.repository]

    def expire(self, now_ms: int) -> None:
        cutoff = now_ms - self.window_ms
        n = 0
        while n < len(self.entries) and self.entries[n].ended_at_ms <= cutoff:
            e = self.entries[n]
            self._apply(e, -1)
            self.ids.discard(e.job_id)
            n += 1
        if n:
            del self.entries[:n]

    def report(self, now_ms: int) -> dict:
        self.expire(now_ms)
        out = {}
        for repo in sorted(self.totals):
            t = self.totals[repo]
            out[repo] = {
                "reserved_vcpu_seconds": round(t["reserved_vcpu_ms"] / 1000, 3),
                "finished_jobs": t["finished_jobs"],
                "jobs_by_vcpus": {str(k): v for k, v in sorted(t["jobs_by_vcpus"].items())},
                "queue_wait_refusals": t["queue_wait_refusals"],
            }
        return out


def wall_ms_of(record: JobRecord) -> int | None:
    if record.reservation_use is not None:
        return record.reservation_use.wall_time_ms
    if record.started_at_ms and record.ended_at_ms:
        return max(0, record.ended_at_ms - record.started_at_ms)
    return None


def window_entry(record: JobRecord, repository: str) -> WindowEntry:
    wall = wall_ms_of(record)
    finished = bool(record.started_at_ms) and record.state != REFUSED_BEFORE_START
    return WindowEntry(
        ended_at_ms=record.ended_at_ms or 0, job_id=record.job_id, repository=repository,
        claim=record.claim, reserved_ms=(wall or 0) * record.claim if finished else 0,
        finished=finished,
        queue_wait_refusal=(record.state == REFUSED_BEFORE_START
                            and record.reason == QUEUE_WAIT_REFUSAL),
    )


# --- underused reservations ------------------------------------------------------------------


class UnderusedIndex:
    """Retained jobs that ran over ten minutes below 25% of their reservation.

    Rows by job id, plus a heap of (retain_until_ms, job_id) so a probe drops expired rows
    without looking at the others.
    """

    def __init__(self) -> None:
        self.jobs: dict[str, dict] = {}  # job_id -> row
        self.expiry: list[tuple[int, str]] = []  # heap

    def add(self, record: JobRecord, repository: str) -> None:
        if not is_underused(record):
            return
        use = record.reservation_use
        self.jobs[record.job_id] = {
            "job_id": record.job_id, "repository": repository, "workspace": record.workspace,
            "claim": record.claim, "state": record.state, "ended_at_ms": record.ended_at_ms,
            "wall_time_ms": use.wall_time_ms, "cpu_time_ms": use.cpu_time_ms,
            "average_use_ppm": use.average_use_ppm,
        }
        heapq.heappush(self.expiry, (retain_until(record), record.job_id))

    def report(self, now_ms: int) -> list[dict]:
        while self.expiry and self.expiry[0][0] <= now_ms:
            _, job_id = heapq.heappop(self.expiry)
            self.jobs.pop(job_id, None)
        return list(self.jobs.values())


# --- the ledger ----------------------------------------------------------------------------------


@dataclass
class ActiveJob:
    job_id: str
    repository: str
    workspace: str
    claim: int
    started_at_ms: int | None


@dataclass
class Ledger:
    """What accounting knows: refusals and ends since start-up, and the indexes above.

    admission_refusals: {code: count} of requests refused before any record was accepted.
    finished: {terminal state: count} of jobs that ended while this runner was up.
    """

    admission_refusals: Counter = field(default_factory=Counter)
    finished: Counter = field(default_factory=Counter)
    hourly: HourlyQueueWait = field(default_factory=HourlyQueueWait)
    repositories: RepositoryWindow = field(default_factory=RepositoryWindow)
    underused: UnderusedIndex = field(default_factory=UnderusedIndex)
    active: dict[str, ActiveJob] = field(default_factory=dict)
    retained: list[int] = field(default_factory=list)  # heap of retain_until_ms

    def refused(self, code: str) -> None:
        self.admission_refusals[code] += 1

    def started(self, job_id: str, *, repository: str, workspace: str, claim: int,
                started_at_ms: int, queue_wait_ms: int) -> None:
        """Setup finished: the job runs now. Counts its capacity wait in its start hour."""
        if job_id in self.active:
            return  # already counted (e.g. a job actor restarted in adopt mode)
        self.active[job_id] = ActiveJob(job_id, repository, workspace, claim, started_at_ms)
        self.hourly.started(started_at_ms, queue_wait_ms)

    def running(self, record: JobRecord, repository: str) -> None:
        """Rebuild: a job recorded as running when accounting (re)started; no hourly count."""
        self.active.setdefault(record.job_id, ActiveJob(
            record.job_id, repository, record.workspace, record.claim, record.started_at_ms))

    def ended(self, record: JobRecord, repository: str, *, live: bool = True) -> None:
        """A terminal record (live: it just ended; else: rebuilt from the store)."""
        self.active.pop(record.job_id, None)
        if live:
            self.finished[record.state] += 1
            if record.state == REFUSED_BEFORE_START and record.reason == QUEUE_WAIT_REFUSAL:
                self.hourly.refused(record.ended_at_ms or 0)
        self.repositories.add(window_entry(record, repository))
        self.underused.add(record, repository)
        heapq.heappush(self.retained, retain_until(record))

    def rebuild(self, terminal: Iterable[tuple[JobRecord, str]],
                live: Iterable[tuple[JobRecord, str]]) -> None:
        """Once, from the retained records (any order): sorted in bulk, not one by one."""
        entries = []
        for record, repository in terminal:
            entries.append(window_entry(record, repository))
            self.underused.add(record, repository)
            self.retained.append(retain_until(record))
        heapq.heapify(self.retained)
        entries.sort()
        self.repositories.rebuild(entries)
        for record, repository in live:
            if record.state == RUNNING:
                self.running(record, repository)
        for record, repository in live:
            if record.state == RUNNING:
                self.running(record, repository)

    def report(self, now_ms: int) -> dict:
        while self.retained and self.retained[0] <= now_ms:
            heapq.heappop(self.retained)
        per_repo: dict[str, dict] = {}
        vcpus = 0
        for job in self.active.values():
            vcpus += job.claim
            r = per_repo.setdefault(job.repository, {"jobs": 0, "vcpus": 0})
            r["jobs"] += 1
            r["vcpus"] += job.claim
        return {
            "admission_refusals": dict(sorted(self.admission_refusals.items())),
            "finished": dict(sorted(self.finished.items())),
            "underused": self.underused.report(now_ms),
            "repositories": self.repositories.report(now_ms),
            "queue_wait_hourly": self.hourly.report(now_ms),
            "active": {"jobs": len(self.active), "vcpus": vcpus,
                       "by_repository": dict(sorted(per_repo.items()))},
            "retained_terminal_jobs": len(self.retained),
        }


# --- host sample (/proc parsers) -----------------------------------------------------------


def parse_loadavg(text: str) -> dict:
    """/proc/loadavg: `0.52 0.58 0.59 2/1234 56789` -> load1/5/15 and runnable/total threads."""
    fields = text.split()
    out: dict[str, Any] = {
        "load1": float(fields[0]), "load5": float(fields[1]), "load15": float(fields[2])}
    if len(fields) >= 4 and "/" in fields[3]:
        runnable, total = fields[3].split("/", 1)
        out["runnable_threads"] = int(runnable)
        out["total_threads"] = int(total)
    return out


def parse_cpuinfo(text: str) -> int | None:
    """/proc/cpuinfo: the number of logical CPUs (`processor` entries), None if none."""
    n = sum(1 for line in text.splitlines()
            if line.split(":", 1)[0].strip() == "processor")
    return n or None


def parse_meminfo(text: str) -> int | None:
    """/proc/meminfo: MemAvailable in bytes (None on kernels without it)."""
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key.strip() == "MemAvailable":
            parts = rest.split()
            value = int(parts[0])
            unit = parts[1].lower() if len(parts) > 1 else ""
            return value * 1024 if unit == "kb" else value
    return None


def host_sample(loadavg: str | None, cpuinfo: str | None, meminfo: str | None,
                cpu_count: int | None = None) -> dict | None:
    """The health report's `host` from /proc texts (each None when unreadable).

    Fields that cannot be read are left out; None when nothing could be read.
    """
    out: dict[str, Any] = {}
    try:
        if loadavg:
            out.update(parse_loadavg(loadavg))
    except (ValueError, IndexError):
        pass
    logical = None
    try:
        logical = parse_cpuinfo(cpuinfo) if cpuinfo else None
    except ValueError:
        pass
    if logical is None:
        logical = cpu_count
    if logical:
        out["logical_cpus"] = logical
    try:
        available = parse_meminfo(meminfo) if meminfo else None
    except (ValueError, IndexError):
        available = None
    if available is not None:
        out["available_memory_bytes"] = available
    return out or None

