"""THE REFERENCE SCHEDULER -- used by tests only (tests/scheduling/test_differential.py).

This file is the Scheduler of motor/scheduling/core.py as it was before the core became
incremental (issue 14): the straightforward implementation of the rules, with a whole-queue
pass (`_reclassify`) after every event and at every head's aging point or retry end, and a
scan of every head for the next breakpoint.  It is slow at scale (O(queued jobs) per event)
and obviously follows docs/scheduling.md; the incremental core must give exactly the same
decisions, clocks, wake-ups and blockers.  The runner never imports it.  Do not optimise it;
when a rule changes, change it here the same way (and the differential test shows whether
the incremental core agrees).

The original module docstring follows.

The pure scheduling core of the runner: claims, capacity, queue order and queue wait.

Sans-IO, in the style of h11 and dask's worker state machine: one object (`Scheduler`)
holds all scheduling state; the dispatcher actor feeds it plain data (job specs, job ids,
the current time) and acts on the decisions it returns (`Start`s, `Refusal`s, withdraw
answers, expired job ids, the next wake-up time).  Nothing here imports trio or does I/O;
time is always an argument: `now`, float seconds on a monotonic clock
(`trio.current_time()` in the runner, explicit floats in tests).

Theory of operation
===================

Job life in the core::

    accept() -> awaiting_bundles --ready()--> queued --decide()--> setup --setup_done()--> running
                     |                         ^  |                    |                            |
                     | cancel()/withdraw()     |  | cancel()/withdraw() | start_failed()            | finished()
                     v                         |  v                    v                            v
                   (ended)                     +-- requeued at its place (retry delay)           (ended)
                                                                       finished() also ends a setting-up job

A job is *active* while setting up or running: it holds `claim` permits, owns its workspace
and uses its sibling workspaces.  A job is *pending* while awaiting bundles or queued; the
queue-depth limit counts every job accepted and not yet running: pending jobs and jobs
setting up ("accepted but not yet running, including those still uploading").

State fields of `Scheduler`
---------------------------

``_jobs``            job_id -> `_Job` for every live (pending or active) job.
``_ended``           bounded (``ENDED_MEMORY``) record of recently ended jobs: outcome and story.
``_queues``          workspace -> deque of queued job ids in FIFO order (ready() order; a job
                     requeued after a failed start goes back to the front).  Only non-empty
                     deques are kept.  The front of each deque is that workspace's *head*.
``_head_of``         workspace -> job id of its head (the same as ``_queues[ws][0]``).
``_gate_heads``      sorted [(accept_seq, job_id)] of heads that are gate jobs (class 1).
``_ready_heads``     sorted [(ready_at, ready_seq, job_id)] of ordinary heads (not gate, not
                     background).  The aged heads (class 2) are exactly a prefix of it.
``_rot_heads``       sorted [(last_dispatch of its workspace, ready_at, ready_seq, job_id)] of
                     the same ordinary heads: class 3 rotation, least recent dispatch first.
``_bg_heads``        sorted [(ready_at, ready_seq, job_id)] of warm_build/cache_fill heads (class 4).
``_last_dispatch``   workspace -> value of ``_dispatch_counter`` when it last started a job.
``_owner``           workspace -> the active job running in (or setting up) that workspace.
``_sib_user``        workspace -> the active job that checks that workspace out as a sibling.
``_held``            sum of claims of active jobs (running + setting up).
``_setup_held``      sum of claims of setting-up jobs.
``_n_awaiting``, ``_n_queued``, ``_n_setup``, ``_n_running``   counters.
``_enforced``        ids of queued jobs with ``runner_enforces_budget`` (for `expired`).
``_t``               the latest time the core has been told about; clocks are settled to it.

Invariants (checked by tests/scheduling/test_state_machine.py)
--------------------------------------------------------------

* ``_held <= max_weight``, always (a claim above max_weight never starts).
* The *touched set* of an active job is its workspace plus its siblings.  Touched sets of
  active jobs are pairwise disjoint: ``_owner`` and ``_sib_user`` never share a key and
  each key maps to exactly one active job.
* Each queued job is in exactly one workspace deque; each deque's front is filed in
  exactly one head index (gate, ordinary = ready+rotation, or background).
* A job's queue-wait clock is ``clock_acc + (now - clock_since)`` while it advances
  (``clock_since`` set) and ``clock_acc`` while paused; it never decreases, and it stops
  (keeping its value) while the job is active, so a requeued job resumes from it.

How ``decide()`` chooses
------------------------

It walks the heads in order -- gate heads by arrival; ordinary heads that have waited 60 s
or more since ready(), oldest first; the other ordinary heads by least recent dispatch of
their workspace; background heads oldest first -- and for each head:

* cleanup pending, or a touched workspace in use (own workspace owned or used as a sibling,
  a sibling workspace owned or used as a sibling): skipped, fences no one;
* out of its retry delay and it fits: started at once (moved to setting up, permits and
  workspaces recorded, indexes updated) before the next head is looked at;
* otherwise it waits for permits: if it is a gate or has waited 60 s (and its claim is at
  most max_weight) the walk stops there (a *fence*: no backfill past it); otherwise the
  walk goes on and smaller heads behind it may start (backfill).

"Fits" means ``claim <= max_weight - held``.  max_weight is a hard bound: a claim above it
(accepted because it is within the claim limit) never fits and never fences; it waits, its
clock advances, and its budget applies.

The walk touches only heads (never every queued job of every workspace) and stops at the
first fence.  Queue-wait clock bookkeeping is a separate pass (`_reclassify`) over queued
jobs; it is needed because a pause/advance decision depends on held permits, which any
event changes.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from ..queue_wait import LocalDeadline  # noqa: F401 - the old core's name, kept
from ..lifecycle import QUEUED, RUNNING, SETUP
from ..records import Refusal
from .core import (  # noqa: F401 - re-exported: the reference's module offers the same names
    _EPS_S, AWAITING_BUNDLES, BACKGROUND_KINDS, DEFAULT_QUEUE_WAIT_S, ENDED_MEMORY,
    GATE_QUEUE_WAIT_S, GRACE_S, STORY_LINES,
    JobSpec, SchedulerStats, Start, WaitStatus, claim_for, gate_honoured, queue_wait_budget_s,
    retry_delay_s,
)

__all__ = [
    "BACKGROUND_KINDS",
    "GATE_QUEUE_WAIT_S",
    "DEFAULT_QUEUE_WAIT_S",
    "GRACE_S",
    "JobSpec",
    "LocalDeadline",
    "Refusal",
    "Scheduler",
    "SchedulerStats",
    "Start",
    "WaitStatus",
    "claim_for",
    "gate_honoured",
    "queue_wait_budget_s",
    "retry_delay_s",
]

# The constants, the plain data in and out and the pure helpers are the core's own (one
# definition: the differential test compares the two Schedulers on the same types); only the
# straightforward Scheduler below is the reference.


# --- internal job record ----------------------------------------------------------------


@dataclass(eq=False)
class _Job:
    spec: JobSpec
    accept_seq: int
    accepted_at: float
    budget_s: float
    touched: tuple[str, ...]  # (workspace, *siblings), deduplicated
    state: str = AWAITING_BUNDLES  # | QUEUED | SETUP | RUNNING
    ready_at: float = math.nan
    ready_seq: int = 0
    clock_acc: float = 0.0
    clock_since: float | None = None
    failures: int = 0
    retry_at: float = -math.inf
    prev_dispatch: int | None = None  # its workspace's last dispatch before this job's start
    cleanup_pending: bool = False
    waiting_on: str | None = None
    waiting_on_job: str | None = None
    fenced_by: str | None = None
    told_advancing: bool | None = None  # last clock state written to the story
    head_keys: list = field(default_factory=list)  # [(index list name, key)] while filed as head
    story: deque = field(default_factory=lambda: deque(maxlen=STORY_LINES))

    @property
    def job_id(self) -> str:
        return self.spec.job_id

    @property
    def claim(self) -> int:
        return self.spec.claim

    @property
    def background(self) -> bool:
        return (not self.spec.gate) and self.spec.kind in BACKGROUND_KINDS

    def queue_wait_s(self, now: float) -> float:
        if self.clock_since is None:
            return self.clock_acc
        return self.clock_acc + max(0.0, now - self.clock_since)


# --- the state machine -----------------------------------------------------------------


class Scheduler:
    """All scheduling state of one runner; see the module docstring for the theory."""

    def __init__(
        self,
        *,
        max_weight: int,
        max_queue_depth: int,
        claim_limit: int,
        confined_cpu_list: str | None = None,
        default_spill_s: float = 300.0,
    ):
        if max_weight < 1:
            raise ValueError("max_weight must be at least 1")
        if claim_limit < 1:
            raise ValueError("claim_limit must be at least 1")
        if max_queue_depth < 0:
            raise ValueError("max_queue_depth must not be negative")
        if confined_cpu_list is not None and claim_limit != max_weight:
            raise ValueError("with a confined CPU list the claim limit is max_weight")
        self.max_weight = max_weight
        self.max_queue_depth = max_queue_depth
        self.claim_limit = claim_limit
        self.confined_cpu_list = confined_cpu_list
        self.default_spill_s = default_spill_s

        self._jobs: dict[str, _Job] = {}
        self._ended: OrderedDict[str, tuple[str, list[str]]] = OrderedDict()
        self._queues: dict[str, deque[str]] = {}
        self._head_of: dict[str, str] = {}
        self._gate_heads: list[tuple] = []
        self._ready_heads: list[tuple] = []
        self._rot_heads: list[tuple] = []
        self._bg_heads: list[tuple] = []
        self._last_dispatch: dict[str, int] = {}
        self._dispatch_counter = itertools.count(1)
        self._accept_seq = itertools.count(1)
        self._ready_seq = itertools.count(1)
        self._owner: dict[str, str] = {}
        self._sib_user: dict[str, str] = {}
        self._held = 0
        self._setup_held = 0
        self._n_awaiting = 0
        self._n_queued = 0
        self._n_setup = 0
        self._n_running = 0
        self._enforced: dict[str, None] = {}
        self._t = -math.inf

    # --- admission ------------------------------------------------------------------

    def check_claim(self, claim: int) -> Refusal | None:
        """runner_full for a claim of 0 (or less) or above the claim limit, naming the limit."""
        limit = f"this runner's claim limit of {self.claim_limit} vCPUs"
        if self.confined_cpu_list is not None:
            limit += f" (--linux-cpus {self.confined_cpu_list})"
        if claim < 1:
            return Refusal(code="runner_full",
                           detail=f"claim {claim} vCPUs is below 1 vCPU; {limit}")
        if claim > self.claim_limit:
            return Refusal(code="runner_full", detail=f"claim {claim} vCPUs exceeds {limit}")
        return None

    def accept(self, spec: JobSpec, now: float, *, force: bool = False) -> Refusal | None:
        """Admit a job (it then awaits its bundles) or refuse it before anything is recorded.

        `force=True` re-admits a job accepted before a restart: no claim or depth check
        (the runner's options may have changed since; an accepted job is never dropped).
        """
        if spec.job_id in self._jobs or spec.job_id in self._ended:
            raise ValueError(f"job {spec.job_id!r} is already known")
        refusal = None if force else self.check_claim(spec.claim)
        if refusal is not None:
            return refusal
        pending = self._n_awaiting + self._n_queued + self._n_setup
        if pending >= self.max_queue_depth and not force:
            return Refusal(
                code="runner_full",
                detail=(f"queue is full: {pending} jobs accepted and not yet running "
                        f"(max_queue_depth {self.max_queue_depth})"),
            )
        now = self._refresh(now)
        touched = tuple(dict.fromkeys((spec.workspace, *spec.siblings)))
        job = _Job(
            spec=spec,
            accept_seq=next(self._accept_seq),
            accepted_at=now,
            budget_s=queue_wait_budget_s(spec, default_spill_s=self.default_spill_s),
            touched=touched,
        )
        self._jobs[spec.job_id] = job
        self._n_awaiting += 1
        self._tell(job, now, f"accepted: claim {spec.claim}, workspace {spec.workspace}"
                   + (f", siblings {','.join(touched[1:])}" if len(touched) > 1 else "")
                   + (", gate" if spec.gate else "")
                   + (f", {spec.kind}" if spec.kind != "job" else "")
                   + f", queue-wait budget {job.budget_s:g}s")
        return None

    def ready(self, job_id: str, now: float, *, waited_s: float = 0.0,
              ready_age_s: float = 0.0) -> bool:
        """Bundles verified and pinned: the job joins its workspace queue, its clock starts.

        After a restart the dispatcher passes what it persisted: ``waited_s`` (the queue
        wait already accumulated) and ``ready_age_s`` (how long ago the job became ready),
        so the clock and the 60 s aging resume instead of restarting from zero.
        Returns False when the job is no longer known (cancelled or withdrawn meanwhile).
        """
        job = self._jobs.get(job_id)
        if job is None:
            return False
        if job.state != AWAITING_BUNDLES:
            raise ValueError(f"ready({job_id!r}) in state {job.state}")
        now = self._refresh(now)
        self._n_awaiting -= 1
        self._n_queued += 1
        job.state = QUEUED
        job.ready_at = now - max(0.0, ready_age_s)
        job.clock_acc = max(0.0, waited_s)
        job.ready_seq = next(self._ready_seq)
        ws = job.spec.workspace
        dq = self._queues.get(ws)
        if dq is None:
            dq = self._queues[ws] = deque()
        dq.append(job_id)
        if len(dq) == 1:
            self._file_head(ws)
        if job.spec.runner_enforces_budget:
            self._enforced[job_id] = None
        self._tell(job, now, "ready: joined the queue of workspace "
                   f"{ws} at position {len(dq)}"
                   + (f", resuming at {waited_s:.3f}s waited, ready {ready_age_s:.3f}s ago"
                      if waited_s or ready_age_s else ""))
        self._reclassify(now)
        return True

    def set_runner_enforced(self, job_id: str, enforced: bool) -> None:
        """Who enforces a pending job's queue-wait budget: the runner (`expired`) or a client
        that follows it. A follower that goes away hands enforcement back to the runner."""
        job = self._jobs.get(job_id)
        if job is None or job.state not in (AWAITING_BUNDLES, QUEUED):
            return
        job.spec = dataclasses.replace(job.spec, runner_enforces_budget=enforced)
        if job.state == QUEUED:
            if enforced:
                self._enforced[job_id] = None
            else:
                self._enforced.pop(job_id, None)
        self._tell(job, self._t, "budget enforced by the " + ("runner" if enforced else "client"))

    def adopt_running(self, spec: JobSpec, now: float) -> None:
        """Count a job that was setting up or running before a restart as running now.

        It holds its claim and its workspace (and siblings) exactly as if `decide()` had
        started it; running jobs are never stopped or moved (scheduling.md).
        """
        self.accept(spec, now, force=True)
        job = self._jobs[spec.job_id]
        now = self._refresh(now)
        self._n_awaiting -= 1
        self._n_running += 1
        job.state = RUNNING
        job.ready_at = now
        self._held += job.claim
        self._owner[spec.workspace] = job.job_id
        for s in job.touched[1:]:
            self._sib_user[s] = job.job_id
        self._tell(job, now, f"adopted after restart: running, held permits now {self._held}")
        self._reclassify(now)

    # --- dispatch -------------------------------------------------------------------

    def decide(self, now: float) -> list[Start]:
        """The heads to start now, in order; each is already counted as setting up."""
        now = self._refresh(now)
        starts, _ = self._walk(now, commit=True)
        if starts:
            self._reclassify(now)
        return starts

    def setup_done(self, job_id: str, now: float) -> None:
        job = self._get(job_id, SETUP)
        now = self._refresh(now)
        job.state = RUNNING
        job.failures = 0
        self._n_setup -= 1
        self._n_running += 1
        self._setup_held -= job.claim
        self._tell(job, now, "setup done: running")

    def start_failed(self, job_id: str, now: float, *, cleanup_pending: bool = False) -> None:
        """A start attempt failed: requeue the job at its place after a retry delay."""
        job = self._get(job_id, SETUP)
        now = self._refresh(now)
        self._release(job)
        self._n_setup -= 1
        self._setup_held -= job.claim
        self._n_queued += 1
        job.state = QUEUED
        job.failures += 1
        delay = retry_delay_s(job.failures)
        job.retry_at = now + delay
        job.cleanup_pending = cleanup_pending
        ws = job.spec.workspace
        self._unfile_head(ws)
        # It keeps its place in the rotation: its workspace's last dispatch is what it was
        # before this failed attempt (nothing else could dispatch there meanwhile).
        if job.prev_dispatch is None:
            self._last_dispatch.pop(ws, None)
        else:
            self._last_dispatch[ws] = job.prev_dispatch
        dq = self._queues.get(ws)
        if dq is None:
            dq = self._queues[ws] = deque()
        dq.appendleft(job_id)
        self._file_head(ws)
        if job.spec.runner_enforces_budget:
            self._enforced[job_id] = None
        self._tell(job, now, f"start failed (#{job.failures}): requeued at its place, "
                   f"retry in {delay:g}s" + (", cleanup pending" if cleanup_pending else ""))
        self._reclassify(now)

    def cleanup_done(self, job_id: str, now: float) -> bool:
        """The failed start attempt's cleanup finished; False if there was none pending."""
        job = self._jobs.get(job_id)
        if job is None or job.state != QUEUED or not job.cleanup_pending:
            return False
        now = self._refresh(now)
        job.cleanup_pending = False
        self._tell(job, now, "cleanup of the failed start done")
        self._reclassify(now)
        return True

    def finished(self, job_id: str, now: float) -> None:
        """A running (or setting-up) job ended: its permits and workspaces are free."""
        job = self._jobs.get(job_id)
        if job is None or job.state not in (SETUP, RUNNING):
            raise ValueError(f"finished({job_id!r}): not setting up or running")
        now = self._refresh(now)
        self._release(job)
        if job.state == SETUP:
            self._n_setup -= 1
            self._setup_held -= job.claim
        else:
            self._n_running -= 1
        self._forget(job, now, "finished")
        self._reclassify(now)

    def cancel(self, job_id: str, now: float) -> bool:
        """Remove a queued or awaiting-bundle job.  False (no error) when there is none."""
        job = self._jobs.get(job_id)
        if job is None or job.state not in (AWAITING_BUNDLES, QUEUED):
            return False
        now = self._refresh(now)
        self._remove_pending(job, now, "cancelled")
        self._reclassify(now)
        return True

    def withdraw(self, job_id: str, now: float) -> str:
        """"withdrawn" (removed; the runner ends it refused_before_start/queue_wait_exceeded),
        "started" (already setting up or running, or it ran: too late), "already_ended"
        (it ended before starting: withdrawn or cancelled earlier), or "unknown"."""
        job = self._jobs.get(job_id)
        if job is None:
            ended = self._ended.get(job_id)
            if ended is None:
                return "unknown"
            return "started" if ended[0] == "finished" else "already_ended"
        if job.state in (SETUP, RUNNING):
            self._tell(job, now, "withdraw asked: already started")
            return "started"
        now = self._refresh(now)
        self._remove_pending(job, now, "withdrawn")
        self._reclassify(now)
        return "withdrawn"

    # --- queries --------------------------------------------------------------------

    def wait_status(self, job_id: str, now: float) -> WaitStatus:
        """Blocker and queue-wait clock of a live job (KeyError if not live)."""
        job = self._jobs[job_id]
        now = self._refresh(now)
        ms = int(job.queue_wait_s(self._t) * 1000.0 + _EPS_S * 1000.0)  # no 29999 for 30 s
        if job.state != QUEUED:
            return WaitStatus(None, None, ms)
        detail = None
        if job.claim > self.max_weight:
            detail = (f"claim {job.claim} vCPUs exceeds max_weight {self.max_weight}: "
                      "it waits until it fits (serve --max-weight)")
        return WaitStatus(job.waiting_on, job.waiting_on_job, ms, detail)

    def clock_state(self, job_id: str, now: float) -> tuple[float, bool, float]:
        """(queue wait so far in s, whether the clock advances now, seconds since ready())
        of a queued job: what the dispatcher persists so a restart resumes the clock."""
        job = self._jobs[job_id]
        now = self._refresh(now)
        age = 0.0 if math.isnan(job.ready_at) else max(0.0, now - job.ready_at)
        return job.queue_wait_s(now), job.clock_since is not None, age

    def job_state(self, job_id: str) -> str | None:
        """AWAITING_BUNDLES, or lifecycle.QUEUED, SETUP ("setup"), RUNNING; None when not live."""
        job = self._jobs.get(job_id)
        return None if job is None else job.state

    def budget_s(self, job_id: str) -> float:
        return self._jobs[job_id].budget_s

    def expired(self, now: float) -> list[str]:
        """Queued runner-enforced jobs whose observed queue wait reached their budget."""
        now = self._refresh(now)
        out = []
        for job_id in self._enforced:
            job = self._jobs[job_id]
            if job.queue_wait_s(self._t) + _EPS_S >= job.budget_s:
                out.append(job_id)
        return out

    def next_wakeup(self, now: float) -> float | None:
        """The earliest time at which decide()/expired() could change on their own: a head
        aging or leaving its retry delay, or a runner-enforced budget running out.  A budget
        that is already due (a zero budget, or one reached exactly now) answers ``now``, so
        the dispatcher acts on it at once instead of at the next breakpoint."""
        now = self._refresh(now)
        best = self._next_breakpoint(self._t)
        for job_id in self._enforced:
            job = self._jobs[job_id]
            remaining = job.budget_s - job.queue_wait_s(self._t)
            if remaining <= _EPS_S:
                return self._t  # due now (paused or not): expired() lists it
            if job.clock_since is None:
                continue  # paused: its budget cannot run out until the clock advances again
            at = self._t + remaining
            if best is None or at < best:
                best = at
        return best

    def statistics(self) -> SchedulerStats:
        return SchedulerStats(
            held_permits=self._held,
            setup_permits=self._setup_held,
            running=self._n_running,
            setup=self._n_setup,
            pending=self._n_awaiting + self._n_queued + self._n_setup,
            awaiting_bundles=self._n_awaiting,
            queued=self._n_queued,
            queued_heads=len(self._head_of),
            max_weight=self.max_weight,
            max_queue_depth=self.max_queue_depth,
            claim_limit=self.claim_limit,
        )

    def story(self, job_id: str) -> list[str]:
        """Bounded log of why this job waited and started (live or recently ended)."""
        job = self._jobs.get(job_id)
        if job is not None:
            return list(job.story)
        ended = self._ended.get(job_id)
        return list(ended[1]) if ended else []

    # --- internals: bookkeeping -----------------------------------------------------

    def _get(self, job_id: str, state: str) -> _Job:
        job = self._jobs.get(job_id)
        if job is None or job.state != state:
            raise ValueError(f"job {job_id!r} is not {state}")
        return job

    def _tell(self, job: _Job, now: float, line: str) -> None:
        job.story.append(f"t={now:.3f} {line}")

    def _forget(self, job: _Job, now: float, outcome: str) -> None:
        self._tell(job, now, outcome)
        del self._jobs[job.job_id]
        self._ended[job.job_id] = (outcome, list(job.story))
        while len(self._ended) > ENDED_MEMORY:
            self._ended.popitem(last=False)

    def _remove_pending(self, job: _Job, now: float, outcome: str) -> None:
        if job.state == AWAITING_BUNDLES:
            self._n_awaiting -= 1
        else:
            ws = job.spec.workspace
            dq = self._queues[ws]
            was_head = dq[0] == job.job_id
            if was_head:
                self._unfile_head(ws)
            dq.remove(job.job_id)
            if not dq:
                del self._queues[ws]
            elif was_head:
                self._file_head(ws)
            self._n_queued -= 1
            self._enforced.pop(job.job_id, None)
            self._stop_clock(job, now)
            self._tell(job, now, f"queue wait {job.clock_acc:.3f}s")
        self._forget(job, now, outcome)

    def _release(self, job: _Job) -> None:
        ws = job.spec.workspace
        if self._owner.get(ws) == job.job_id:
            del self._owner[ws]
        for s in job.touched[1:]:
            if self._sib_user.get(s) == job.job_id:
                del self._sib_user[s]
        self._held -= job.claim

    def _stop_clock(self, job: _Job, now: float) -> None:
        if job.clock_since is not None:
            job.clock_acc += max(0.0, now - job.clock_since)
            job.clock_since = None

    def _start(self, job: _Job, now: float) -> Start:
        ws = job.spec.workspace
        dq = self._queues[ws]
        assert dq[0] == job.job_id
        self._unfile_head(ws)
        dq.popleft()
        job.prev_dispatch = self._last_dispatch.get(ws)
        self._last_dispatch[ws] = next(self._dispatch_counter)
        if dq:
            self._file_head(ws)
        else:
            del self._queues[ws]
        self._n_queued -= 1
        self._n_setup += 1
        self._enforced.pop(job.job_id, None)
        self._stop_clock(job, now)
        job.state = SETUP
        job.waiting_on = job.waiting_on_job = job.fenced_by = None
        self._held += job.claim
        self._setup_held += job.claim
        self._owner[ws] = job.job_id
        for s in job.touched[1:]:
            self._sib_user[s] = job.job_id
        self._tell(job, now, f"started: claim {job.claim}, held permits now {self._held}"
                   f"/{self.max_weight}, queue wait {job.clock_acc:.3f}s")
        return Start(job.job_id, job.claim)

    # --- internals: head indexes ----------------------------------------------------

    def _file_head(self, ws: str) -> None:
        job = self._jobs[self._queues[ws][0]]
        self._head_of[ws] = job.job_id
        ready_key = (job.ready_at, job.ready_seq, job.job_id)
        if job.spec.gate:
            keys = [(self._gate_heads, (job.accept_seq, job.job_id))]
        elif job.background:
            keys = [(self._bg_heads, ready_key)]
        else:
            keys = [(self._ready_heads, ready_key),
                    (self._rot_heads, (self._last_dispatch.get(ws, 0), *ready_key))]
        for lst, key in keys:
            bisect.insort(lst, key)
        job.head_keys = keys

    def _unfile_head(self, ws: str) -> None:
        job_id = self._head_of.pop(ws, None)
        if job_id is None:
            return
        job = self._jobs[job_id]
        for lst, key in job.head_keys:
            i = bisect.bisect_left(lst, key)
            assert lst[i] == key
            del lst[i]
        job.head_keys = []

    def _ordered_heads(self, now: float):
        """Heads in dispatch order (classes 1-4); tolerant of index changes while iterating."""
        for _, job_id in list(self._gate_heads):
            yield job_id
        for ready_at, _, job_id in list(self._ready_heads):
            if ready_at + GRACE_S > now:
                break
            yield job_id
        for _, ready_at, _, job_id in list(self._rot_heads):
            if ready_at + GRACE_S > now:
                yield job_id
        for _, _, job_id in list(self._bg_heads):
            yield job_id

    # --- internals: the rules -------------------------------------------------------

    def _fits(self, claim: int, held: int) -> bool:
        # max_weight is a hard bound: a claim above it (accepted within the claim limit)
        # never fits, it waits (its budget applies) and blocks no one.
        return claim <= self.max_weight - held

    def _aged(self, job: _Job, now: float) -> bool:
        # At or after its aging point, computed as its breakpoint is (`ready_at + GRACE_S`):
        # `now - ready_at >= GRACE_S` can be false at that very point in floats (readied at
        # 4.07 s: 64.07 - 4.07 is 59.99999999999999), and the head then fenced only from
        # the next event on.
        return job.ready_at + GRACE_S <= now

    def _fences(self, job: _Job, now: float) -> bool:
        """A head waiting for permits that stops backfill behind it."""
        return job.claim <= self.max_weight and (job.spec.gate or self._aged(job, now))

    def _order_key(self, job: _Job, now: float) -> tuple:
        if job.spec.gate:
            return (1, job.accept_seq)
        if job.background:
            return (4, job.ready_at, job.ready_seq)
        if self._aged(job, now):
            return (2, job.ready_at, job.ready_seq)
        return (3,)

    def _conflict(self, job: _Job, extra: set[str] | None = None) -> bool:
        for w in job.touched:
            if w in self._owner or w in self._sib_user or (extra and w in extra):
                return True
        return False

    def _walk(self, now: float, *, commit: bool) -> tuple[list[Start], _Job | None]:
        """Walk the heads in order; start (commit) or pretend to start (dry run) those that
        may start; return the starts and the fence the walk stopped at, if any."""
        held = self._held
        extra: set[str] = set()
        starts: list[Start] = []
        seen: set[str] = set()
        for job_id in self._ordered_heads(now):
            job = self._jobs.get(job_id)
            if job is None or job.state != QUEUED or job_id in seen:
                continue
            seen.add(job_id)
            if job.cleanup_pending or self._conflict(job, extra):
                continue  # blocked by its own workspace: stops no one
            if now >= job.retry_at and self._fits(job.claim, held):
                if commit:
                    starts.append(self._start(job, now))
                else:
                    extra.update(job.touched)
                    starts.append(Start(job_id, job.claim))
                held += job.claim
                continue
            if self._fences(job, now):
                return starts, job
        return starts, None

    def _blockers(self, job: _Job, dq: deque[str], is_head: bool
                  ) -> tuple[str, str | None, list[str], bool]:
        """(waiting_on, waiting_on_job, pausing holders, may pause) for a queued job.

        Only the seed's two blockers may pause a clock: an earlier job that owns this job's
        workspace (running or setting up in it), or a job in another workspace that checks
        this workspace out as a sibling.  Waiting behind a queued head of the workspace (which
        itself waits for capacity, its own siblings or a cleanup), or for one of this job's own
        sibling workspaces to be free, is a shared-scheduler wait: the clock advances.
        """
        ws = job.spec.workspace
        if not is_head:
            owner = self._owner.get(ws)
            if owner is not None:
                return "workspace_owner", owner, [owner], True
            user = self._sib_user.get(ws)
            if user is not None:
                return "sibling_user", user, [user], True
            return "workspace_owner", dq[0], [], False
        if job.cleanup_pending:
            return "workspace_setup", None, [], False
        first: tuple[str, str] | None = None
        holders: list[str] = []
        pausable = True
        for w in job.touched:
            for kind, table in (("workspace_owner", self._owner), ("sibling_user", self._sib_user)):
                h = table.get(w)
                if h is not None:
                    if first is None:
                        first = (kind, h)
                    if w != ws:
                        pausable = False  # its own sibling is busy: not a pausing blocker
                    if h not in holders:
                        holders.append(h)
        if first is None:
            return "permits", None, [], False
        return first[0], first[1], holders, pausable

    def _reclassify(self, now: float) -> None:
        """Recompute every queued job's blocker and whether its clock advances, as of now.

        Clock rule: the clock pauses only when the job's blockers are the seed's two (an
        earlier job owning its workspace, or a sibling user of its workspace; see
        `_blockers`) AND it would fit once those holders free their permits AND no fence
        stands ahead of it in order AND it is not in a start-retry delay.  Otherwise it
        advances.
        """
        _, fence = self._walk(now, commit=False)
        for ws, dq in self._queues.items():
            for i, job_id in enumerate(dq):
                job = self._jobs[job_id]
                waiting_on, on_job, holders, pausable = self._blockers(job, dq, i == 0)
                advancing = True
                behind = None
                if fence is not None and fence is not job and \
                        self._order_key(fence, now) < self._order_key(job, now):
                    behind = fence.job_id
                if pausable and now >= job.retry_at and behind is None:
                    freed = sum(self._jobs[h].claim for h in holders
                                if self._jobs[h].state in (SETUP, RUNNING))
                    if self._fits(job.claim, self._held - freed):
                        advancing = False
                if advancing and job.clock_since is None:
                    job.clock_since = now
                elif not advancing and job.clock_since is not None:
                    self._stop_clock(job, now)
                changed = (waiting_on != job.waiting_on or on_job != job.waiting_on_job
                           or behind != job.fenced_by or advancing != job.told_advancing)
                job.waiting_on, job.waiting_on_job, job.fenced_by = waiting_on, on_job, behind
                if changed:
                    job.told_advancing = advancing
                    self._tell(job, now, f"waiting on {waiting_on}"
                               + (f" ({on_job})" if on_job else "")
                               + (f", behind fence {behind}" if behind else "")
                               + (", clock advancing" if advancing else ", clock paused")
                               + f" at {job.queue_wait_s(now):.3f}s")

    def _next_breakpoint(self, after: float) -> float | None:
        """Earliest time > after at which a head ages (60 s) or leaves its retry delay."""
        best = None
        for job_id in self._head_of.values():
            job = self._jobs[job_id]
            for at in (job.ready_at + GRACE_S, job.retry_at):
                if at > after and (best is None or at < best):
                    best = at
        return best

    def _refresh(self, now: float) -> float:
        """Bring the core up to ``now``: re-decide blockers and clock pauses at each
        time-driven change between the previous call and now (a head reaching 60 s, a retry
        delay ending), in time order.  Between such breakpoints and events nothing changes,
        and every mutating method ends with `_reclassify`, so no pass is needed at ``now``
        itself unless it is a breakpoint.  Returns the effective time."""
        if now < self._t:
            now = self._t  # time never goes back; a stale `now` counts as the latest one
        while True:
            at = self._next_breakpoint(self._t)
            if at is None or at > now:
                break
            self._t = at
            self._reclassify(at)
        self._t = now
        return now
