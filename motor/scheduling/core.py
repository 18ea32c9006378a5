"""The pure scheduling core of the runner: claims, capacity, queue order and queue wait.

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
``_rot_claims``, ``_bg_claims``   claim -> count of ordinary / background heads (walk cut-offs).
``_enforced``        queued jobs with ``runner_enforces_budget`` -> enrolment order (`expired`).
``_due``             heap [(time the budget runs out, enrolment, job_id)] of enforced jobs
                     whose clock advances (or -inf: paused and already run out); lazy
                     deletion: an entry is live while it is its job's ``due_key``.
``_breakpoints``     heap [(time, job_id)]: heads' aging points and retry ends (lazy deletion).
``_in_order``, ``_claims_in``   workspace -> its queued jobs sorted in fence order
                     (`_fence_order`), and their claims: which clocks a fence or a start
                     can move, found by bisection (`_reclassify`).
``_free_seen``       workspaces free at the last clock pass (every clock there advances).
``_dirty``, ``_fresh``   workspaces freed/changed, jobs that joined a queue, since the last
                     clock pass (`_reclassify`).
``_clock_changed``   ids whose clock changed course since `take_clock_changes`.
``_moved_ws``, ``_moved_jobs``   the status view's journal (`moved_since`): workspaces whose
                     queue head, owner or sibling user changed, and ids of jobs whose
                     state, clock or pending cleanup changed, since ``_moved_epoch`` began.
``_runs``            workspace -> [base, entries]: its run log, long runs of clock flips not
                     yet applied to each job queued there (`_run_clocks`); a job's ``seen``
                     is how far into it its clock is (`_catch_up`).
``_run_floor``, ``_run_due``   workspace -> the earliest time one of its paused runner-
                     enforced jobs could run out (`_floor`), and a heap of those for the
                     logs that may advance such a clock (`_fold_due`).
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
  (``clock_since`` set) and ``clock_acc`` while paused, once it has caught up with its
  workspace's run log; it never decreases, and it stops
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
first fence.  Queue-wait clock bookkeeping is a separate pass (`_reclassify`): only a job
whose own workspace is occupied by an active job can have its clock paused, so the pass
re-decides the jobs queued in occupied workspaces and starts the clocks of jobs that joined
a queue or whose workspace was freed; everything else keeps advancing untouched.

This core is incremental (issue 14); motor/scheduling/reference.py keeps the previous
straightforward core (a pass over every queued job per event) and
tests/scheduling/test_differential.py proves both give the same answers.  See "How the
core stays incremental" in docs/scheduling.md.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import heapq
import itertools
import math
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

from ..lifecycle import QUEUED, RUNNING, SETUP
from ..records import Refusal

#: The scheduling core's own sub-state of `queued` (lifecycle.QUEUED): accepted, counted in
#: max_queue_depth, not yet in its workspace queue (its source bundle is still uploading).
AWAITING_BUNDLES = "awaiting_bundles"

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

#: Heads that have waited this long (since ready()) are aged: class 2, and they fence.
GRACE_S = 60.0
#: Gate jobs' fixed queue-wait budget, and the default for jobs that cannot spill.
GATE_QUEUE_WAIT_S = 30 * 60.0
DEFAULT_QUEUE_WAIT_S = 30 * 60.0
#: Start-retry delay: 1 s doubling per consecutive failure, at most 60 s.
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 60.0
BACKGROUND_KINDS = frozenset({"warm_build", "cache_fill"})
WARM_BUILD_MAX_CLAIM = 4
STORY_LINES = 64
ENDED_MEMORY = 4096
#: The status view's journal (`Scheduler.moved_since`) is dropped past this many entries
#: (a view after that many changes is built afresh anyway).
MOVED_MEMORY = 65536

#: Budget comparisons tolerate float rounding (a deadline computed as t + remaining must be
#: expired when the timer fires at exactly that t).
_EPS_S = 1e-6
_PAUSE = object()  # `Scheduler._set_clocks`: every clock of the run pauses
#: `Scheduler._run_clocks` courses: every clock of the run advances; every one pauses;
#: each pauses when its claim fits the room, else advances
_ADVANCE, _PAUSE_RUN, _SPLIT = 0, 1, 2
#: A run of clocks longer than this is not flipped job by job at once: it is written in its
#: workspace's run log and each job catches up when it is read (`Scheduler._run_clocks`)
LAZY_RUN_MIN = 32
#: A workspace's run log past this many entries is folded into its jobs (`_fold`)
RUN_LOG_MAX = 64
EPS_MS = _EPS_S * 1000.0
#: Budget due times are filed as computed when a clock starts; entries this close to now are
#: re-checked with the exact formula (`expired`, `next_wakeup`), so rounding never decides.
_DUE_MARGIN_S = 1e-3


def wait_ms(acc: float, since: float | None, t: float) -> int:
    """queue_wait_ms at time `t` of a clock that holds `acc` seconds and has advanced since
    `since` (None: paused), as `wait_columns` computes it (no 29999 for 30 s)."""
    if since is None:
        return int(acc * 1000.0 + EPS_MS)
    elapsed = t - since
    return int((acc + (elapsed if elapsed > 0.0 else 0.0)) * 1000.0 + EPS_MS)


def _mutates(method):
    """A mutating method of the Scheduler: counted in `Scheduler.version`."""
    @functools.wraps(method)
    def counted(self, *args, **kwargs):
        self.version += 1
        if len(self._moved_jobs) + len(self._moved_ws) > MOVED_MEMORY:
            self._forget_moves()
        return method(self, *args, **kwargs)
    return counted


# --- plain data in and out ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class JobSpec:
    """What the core needs to know about an accepted job."""

    job_id: str
    workspace: str
    siblings: tuple[str, ...] = ()
    claim: int = 2
    #: Already honoured only if the gate_jobs capability was negotiated (the runner decides).
    gate: bool = False
    #: "job" | "warm_build" | "cache_fill" (the last two are background: dispatched last).
    kind: str = "job"
    queue_wait_limit_s: float | None = None
    timeout_s: float | None = None
    spill_eligible: bool = False
    #: True when no client follows the job (motor submit): the runner withdraws it itself.
    runner_enforces_budget: bool = False


@dataclass(frozen=True)
class Start:
    """Decision: start this job now (it is already counted as setting up)."""

    job_id: str
    claim: int


@dataclass(frozen=True)
class WaitStatus:
    """What a queued job waits on, and its queue-wait clock in milliseconds."""

    waiting_on: str | None  # "permits" | "workspace_owner" | "sibling_user" | "workspace_setup" | None
    waiting_on_job: str | None
    queue_wait_ms: int
    #: Why, in words, when waiting_on alone does not say it (a claim above max_weight).
    waiting_detail: str | None = None


@dataclass(frozen=True)
class SchedulerStats:
    held_permits: int  # claims of running + setting-up jobs
    setup_permits: int  # claims of setting-up jobs
    running: int
    setup: int
    pending: int  # accepted, not yet running: awaiting bundles + queued + setting up (max_queue_depth)
    awaiting_bundles: int
    queued: int
    queued_heads: int
    max_weight: int
    max_queue_depth: int
    claim_limit: int


def claim_for(weight_hint: int | None, kind: str, claim_limit: int) -> int:
    """A job claims exactly its weight_hint, else 2; a background job without a hint claims
    up to 4 vCPUs, fewer on a smaller host (``min(4, claim_limit)``)."""
    if weight_hint is not None:
        return weight_hint
    if kind in BACKGROUND_KINDS:
        return max(1, min(WARM_BUILD_MAX_CLAIM, claim_limit))
    return 2


def gate_honoured(requested: bool, capabilities) -> bool:
    """The gate mark counts only when the client negotiated the ``gate_jobs`` capability."""
    return bool(requested) and "gate_jobs" in tuple(capabilities or ())


def queue_wait_budget_s(spec: JobSpec, *, default_spill_s: float = 300.0) -> float:
    """The job's queue-wait budget in seconds (the client and the runner use this same rule).

    Gate jobs: a fixed 30 minutes.  Otherwise the explicit ``queue_wait_limit_s``; else
    ``default_spill_s`` for spill-eligible jobs; else 30 minutes capped by ``timeout_s``.
    A budget never depends on other jobs (a gate ahead never shortens it).
    """
    if spec.gate:
        return GATE_QUEUE_WAIT_S
    if spec.queue_wait_limit_s is not None:
        return max(0.0, float(spec.queue_wait_limit_s))
    if spec.spill_eligible:
        return max(0.0, float(default_spill_s))
    if spec.timeout_s is not None:
        return max(0.0, min(DEFAULT_QUEUE_WAIT_S, float(spec.timeout_s)))
    return DEFAULT_QUEUE_WAIT_S


def retry_delay_s(consecutive_failures: int) -> float:
    """1 s after the first failed start, doubling per consecutive failure, at most 60 s."""
    if consecutive_failures <= 0:
        return 0.0
    return min(RETRY_MAX_S, RETRY_FIRST_S * 2.0 ** min(consecutive_failures - 1, 16))


# The client's local queue-wait deadline lives in motor.queue_wait (standard library only),
# so that `motor run` need not import this core; it is re-exported here.
from motor.queue_wait import LocalDeadline  # noqa: E402


# --- internal job record ----------------------------------------------------------------


@dataclass(eq=False, slots=True)
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
    head_keys: list = field(default_factory=list)  # [(index list name, key)] while filed as head
    due_key: tuple | None = None  # its entry in Scheduler._due while it has one
    #: its place in the fence order while queued (`_fence_order`), an entry of
    #: Scheduler._in_order
    order: tuple | None = None
    #: how far into its workspace's run log (`Scheduler._runs`) its clock is caught up
    seen: int = 0
    # (time, line, clock value or None): formatted only when read (`Scheduler.story`); a
    # workspace freed or taken tells every clock queued there (issue 14)
    story: deque = field(default_factory=lambda: deque(maxlen=STORY_LINES))
    job_id: str = field(init=False)  # the spec's, read on every clock flip: plain attributes
    claim: int = field(init=False)
    workspace: str = field(init=False)
    #: dispatched last (a background kind, not a gate job); read on every head filed and
    #: every fence looked for, so kept, not derived each time (a spec replaced later
    #: changes only whether the runner enforces its budget)
    background: bool = field(init=False)

    def __post_init__(self) -> None:
        spec = self.spec
        self.job_id, self.claim, self.workspace = spec.job_id, spec.claim, spec.workspace
        self.background = (not spec.gate) and spec.kind in BACKGROUND_KINDS

    def queue_wait_s(self, now: float) -> float:
        if self.clock_since is None:
            return self.clock_acc
        return self.clock_acc + max(0.0, now - self.clock_since)


def _due_key(job: _Job, seq: int | None) -> tuple | None:
    """A queued job's entry in ``Scheduler._due`` (`seq`: its place among the jobs whose
    budget the runner enforces; None: it is not one of them, no entry): an advancing clock
    runs out at ``clock_since + budget - clock_acc``; a paused one never, unless it already
    has (then it is filed at -inf)."""
    if seq is None:
        return None
    remaining = job.budget_s - job.clock_acc
    if job.clock_since is not None:
        return (job.clock_since + remaining, seq, job.job_id)
    if remaining <= _EPS_S or job.clock_acc + _EPS_S >= job.budget_s:
        return (-math.inf, seq, job.job_id)
    return None


def _lines(story) -> list[str]:
    """A job's story entries `(time, line, clock value or None)` as its text lines."""
    return [f"t={now:.3f} {line}" if at is None else f"t={now:.3f} {line} at {at:.3f}s"
            for now, line, at in story]


_UNWALKED = object()  # no fence was looked for


def _sorted_remove(lst: list, key) -> None:
    i = bisect.bisect_left(lst, key)
    assert lst[i] == key
    del lst[i]


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
        self._ended: OrderedDict[str, tuple[str, list[tuple]]] = OrderedDict()
        self._queues: dict[str, deque[str]] = {}
        self._head_of: dict[str, str] = {}
        self._gate_heads: list[tuple] = []
        self._ready_heads: list[tuple] = []
        self._rot_heads: list[tuple] = []
        self._bg_heads: list[tuple] = []
        self._rot_claims: Counter[int] = Counter()  # claims of ordinary heads
        self._bg_claims: Counter[int] = Counter()  # claims of background heads
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
        self._enforced: dict[str, int] = {}  # queued runner-enforced job -> enrolment order
        self._enforced_seq = itertools.count(1)
        self._due: list[tuple] = []  # heap [(budget due time, enrolment, job_id)], lazy
        self._breakpoints: list[tuple[float, str]] = []  # heap [(time, head job_id)], lazy
        self._dirty: set[str] = set()  # workspaces changed since the last clock pass
        self._fresh: list[_Job] = []  # jobs that joined a queue since the last clock pass
        self._clock_changed: set[str] = set()  # for take_clock_changes()
        #: occupied workspace -> (head, room, claims behind the head, fence) at its
        #: last full clock pass (see `_reclassify`)
        self._occupied_seen: dict[str, tuple] = {}
        #: workspace -> its queued jobs' `_Job.order` entries, sorted (`_fence_order`),
        #: and their claims
        self._in_order: dict[str, list[tuple]] = {}
        self._claims_in: dict[str, Counter[int]] = {}
        #: workspaces that were free at the last clock pass: every clock queued there
        #: advances, but for the jobs that joined since (see `_reclassify`)
        self._free_seen: set[str] = set()
        #: a clock pass at `_t` is owed: `finished()` leaves it to the `decide()` that
        #: follows at the same instant (see `decide`); anything else runs it first
        self._owed = False
        self._t = -math.inf
        #: counts the changes that may move a job's wait fields other than by its clock
        #: running on: every mutating method (`_mutates`) and each time-driven pass in
        #: `_refresh`. While it stands, each job's waiting_on/waiting_on_job/waiting_detail
        #: stay and its queue_wait_ms follows `wait_ms` of its `wait_columns` clock.
        self.version = 0
        #: the status view's journal (`moved_since`); a new epoch when it is dropped
        self._moved_ws: list[str] = []
        self._moved_jobs: list[str] = []
        self._moved_epoch = 0
        #: queued heads with sibling workspaces (their wait reads those workspaces' holders)
        self._sib_heads: set[str] = set()
        #: workspace -> [base, entries]: its run log, the clock flips of long runs of the
        #: jobs queued there not yet applied to each job (`_run_clocks`, `_catch_up`)
        self._runs: dict[str, list] = {}
        #: workspace -> a time no paused runner-enforced job queued there can run out
        #: before, whatever its run log does next (`_floor`); heap [(that time, workspace)]
        #: of the logs that may advance such a clock, folded once it is reached
        self._run_floor: dict[str, float] = {}
        self._run_due: list[tuple[float, str]] = []
        self._run_due_at: dict[str, float] = {}
        #: workspaces whose run log grew since `take_clock_changes`
        self._run_changed: set[str] = set()
        #: queued jobs that were requeued after a failed start (their retry delay)
        self._retrying: set[str] = set()

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

    @_mutates
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

    @_mutates
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
        self._moved_jobs.append(job_id)
        job.ready_at = now - max(0.0, ready_age_s)
        job.clock_acc = max(0.0, waited_s)
        job.ready_seq = next(self._ready_seq)
        ws = job.spec.workspace
        dq = self._queues.get(ws)
        if dq is None:
            dq = self._queues[ws] = deque()
        dq.append(job_id)
        self._put_in_order(job)
        if len(dq) == 1:
            self._file_head(ws)
        if job.spec.runner_enforces_budget:
            self._enrol(job)
        self._fresh.append(job)
        self._clock_changed.add(job_id)
        self._tell(job, now, "ready: joined the queue of workspace "
                   f"{ws} at position {len(dq)}"
                   + (f", resuming at {waited_s:.3f}s waited, ready {ready_age_s:.3f}s ago"
                      if waited_s or ready_age_s else ""))
        self._reclassify(now)
        self._catch_up(job)
        waiting_on, on_job, _, _ = self._blockers(job, dq, dq[0] == job_id)
        self._tell(job, now, f"waiting on {waiting_on}" + (f" ({on_job})" if on_job else "")
                   + (", clock advancing" if job.clock_since is not None else ", clock paused"))
        return True

    @_mutates
    def set_runner_enforced(self, job_id: str, enforced: bool) -> None:
        """Who enforces a pending job's queue-wait budget: the runner (`expired`) or a client
        that follows it. A follower that goes away hands enforcement back to the runner."""
        job = self._jobs.get(job_id)
        if job is None or job.state not in (AWAITING_BUNDLES, QUEUED):
            return
        self._settle()
        self._catch_up(job)
        job.spec = dataclasses.replace(job.spec, runner_enforces_budget=enforced)
        if job.state == QUEUED:
            if enforced:
                self._enrol(job)
            else:
                self._unenrol(job)
        self._tell(job, self._t, "budget enforced by the " + ("runner" if enforced else "client"))

    @_mutates
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
        self._moved_ws.extend(job.touched)
        self._moved_jobs.append(job.job_id)
        self._tell(job, now, f"adopted after restart: running, held permits now {self._held}")
        self._reclassify(now)

    # --- dispatch -------------------------------------------------------------------

    @_mutates
    def decide(self, now: float) -> list[Start]:
        """The heads to start now, in order; each is already counted as setting up.

        A clock pass owed by `finished()` at this same instant is folded into this call's
        own pass: the walk reads no clock, and a clock that would start at this instant and
        pause again at it (a deep workspace's queue, when the job that ended there is
        followed by the next one) gains nothing, so it is not flipped twice."""
        if self._owed and now <= self._t:
            now = self._t
            chosen, _ = self._walk(now, need_fence=False)
            starts = [self._start(job, now) for job in chosen]
            self._owed = False
            self._reclassify(now)
            return starts
        now = self._refresh(now)
        chosen, _ = self._walk(now, need_fence=False)
        if not chosen:
            return []
        starts = [self._start(job, now) for job in chosen]
        self._reclassify(now)
        return starts

    @_mutates
    def setup_done(self, job_id: str, now: float) -> None:
        job = self._get(job_id, SETUP)
        now = self._refresh(now)
        job.state = RUNNING
        job.failures = 0
        self._n_setup -= 1
        self._n_running += 1
        self._setup_held -= job.claim
        self._tell(job, now, "setup done: running")

    @_mutates
    def start_failed(self, job_id: str, now: float, *, cleanup_pending: bool = False) -> None:
        """A start attempt failed: requeue the job at its place after a retry delay.

        A job adopted after a restart while it was setting up counts as running; its setup
        is redone, and if that fails it is requeued the same way."""
        job = self._jobs.get(job_id)
        if job is None or job.state != RUNNING:
            job = self._get(job_id, SETUP)
        now = self._refresh(now)
        self._release(job)
        if job.state == RUNNING:  # adopted: it never spawned
            self._n_running -= 1
        else:
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
        self._put_in_order(job)
        self._retrying.add(job_id)
        self._file_head(ws)
        if job.spec.runner_enforces_budget:
            self._enrol(job)
        self._clock_changed.add(job_id)
        self._tell(job, now, f"start failed (#{job.failures}): requeued at its place, "
                   f"retry in {delay:g}s" + (", cleanup pending" if cleanup_pending else ""))
        self._reclassify(now)

    @_mutates
    def cleanup_done(self, job_id: str, now: float) -> bool:
        """The failed start attempt's cleanup finished; False if there was none pending."""
        job = self._jobs.get(job_id)
        if job is None or job.state != QUEUED or not job.cleanup_pending:
            return False
        now = self._refresh(now)
        job.cleanup_pending = False
        self._dirty.add(job.spec.workspace)
        self._moved_ws.append(job.spec.workspace)
        self._tell(job, now, "cleanup of the failed start done")
        self._reclassify(now)
        return True

    @_mutates
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
        self._owed = True  # the clock pass, at `now`: the next call runs it (see `decide`)

    @_mutates
    def cancel(self, job_id: str, now: float) -> bool:
        """Remove a queued or awaiting-bundle job.  False (no error) when there is none."""
        job = self._jobs.get(job_id)
        if job is None or job.state not in (AWAITING_BUNDLES, QUEUED):
            return False
        now = self._refresh(now)
        self._remove_pending(job, now, "cancelled")
        self._reclassify(now)
        return True

    @_mutates
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
        """Blocker and queue-wait clock of a live job (KeyError if not live).  The blocker is
        computed here, when asked: it depends only on the state, which the last event set."""
        job = self._jobs[job_id]
        self._refresh(now)
        return self._wait_status(job)

    def wait_statuses(self, job_ids, now: float) -> list[tuple]:
        """The fields of `wait_status` as plain tuples (waiting_on, waiting_on_job,
        queue_wait_ms, waiting_detail) for each of `job_ids`, in order, with the core brought
        up to ``now`` once (`wait_columns`)."""
        waits_ms, waits = self.wait_columns(job_ids, now)
        return [(w[0], w[1], ms, w[2]) for ms, w in zip(waits_ms, waits)]

    def wait_columns(self, job_ids, now: float, clocks: tuple[list, list] | None = None
                     ) -> tuple[list[int], list[tuple]]:
        """The status view of a deep queue (issue 14): for each of `job_ids`, in order, its
        queue_wait_ms, and its (waiting_on, waiting_on_job, waiting_detail), with the core
        brought up to ``now`` once. Every job behind the queued head of a workspace waits
        on the same: those share one tuple (the same object), so a caller may key what it
        derives from a wait by the tuple's identity. `clocks`, two lists, get each job's
        clock: the seconds it holds, and since when it advances (None: paused); while
        `version` stands, its queue_wait_ms at a later time is `wait_ms(held, since, t)`.
        (Two lists of floats, not a tuple per job: nothing for the cyclic collector.)"""
        self._refresh(now)
        add_held, add_since = ((clocks[0].append, clocks[1].append) if clocks is not None
                               else (None, None))
        jobs, queues, t, max_weight = self._jobs, self._queues, self._t, self.max_weight
        owner, sib_user = self._owner, self._sib_user
        idle = (None, None, None)  # a job not queued: setting up or running
        # {workspace: (its queued head, the wait of a job behind it)}
        behind: dict[str, tuple] = {}
        waits_ms: list[int] = []
        waits: list[tuple] = []
        add_ms, add = waits_ms.append, waits.append
        runs, catch_up = self._runs, self._catch_up
        for job_id in job_ids:  # ~1 us per job: 10,000 per view (issue 14)
            job = jobs[job_id]
            if runs:
                catch_up(job)
            add_ms(wait_ms(job.clock_acc, job.clock_since, t))
            if add_held is not None:
                add_held(job.clock_acc)
                add_since(job.clock_since)
            if job.state != QUEUED:
                add(idle)
                continue
            ws = job.workspace
            entry = behind.get(ws)
            if entry is None:
                head = queues[ws][0]
                holder = owner.get(ws)
                if holder is not None:
                    wait = ("workspace_owner", holder, None)
                else:
                    holder = sib_user.get(ws)
                    wait = (("sibling_user", holder, None) if holder is not None
                            else ("workspace_owner", head, None))
                entry = behind[ws] = (head, wait)
            if entry[0] != job_id:
                wait = entry[1]
            else:
                waiting_on, on_job, _, _ = self._blockers(job, queues[ws], True)
                wait = (waiting_on, on_job, None)
            if job.claim > max_weight:
                wait = (wait[0], wait[1], self._over_max(job.claim))
            add(wait)
        return waits_ms, waits

    def _over_max(self, claim: int) -> str:
        return (f"claim {claim} vCPUs exceeds max_weight {self.max_weight}: "
                "it waits until it fits (serve --max-weight)")

    def _wait_status(self, job: _Job) -> WaitStatus:
        self._catch_up(job)
        ms = wait_ms(job.clock_acc, job.clock_since, self._t)
        if job.state != QUEUED:
            return WaitStatus(None, None, ms)
        detail = self._over_max(job.claim) if job.claim > self.max_weight else None
        dq = self._queues[job.spec.workspace]
        waiting_on, on_job, _, _ = self._blockers(job, dq, dq[0] == job.spec.job_id)
        return WaitStatus(waiting_on, on_job, ms, detail)

    def clock_state(self, job_id: str, now: float) -> tuple[float, bool, float]:
        """(queue wait so far in s, whether the clock advances now, seconds since ready())
        of a queued job: what the dispatcher persists so a restart resumes the clock."""
        job = self._jobs[job_id]
        now = self._refresh(now)
        self._catch_up(job)
        age = 0.0 if math.isnan(job.ready_at) else max(0.0, now - job.ready_at)
        return job.queue_wait_s(now), job.clock_since is not None, age

    def clock_states(self, job_ids, now: float) -> list[tuple[float, bool, float] | None]:
        """`clock_state` of each of `job_ids`, in order, None for one not queued (ended,
        started, awaiting its bundles), with the core brought up to ``now`` once: the
        dispatcher's clock saves, after a workspace freed or taken flipped every clock
        queued there."""
        now = self._refresh(now)
        jobs = self._jobs
        out = []
        for job_id in job_ids:
            job = jobs.get(job_id)
            if job is None or job.state != QUEUED:
                out.append(None)
                continue
            self._catch_up(job)
            age = 0.0 if math.isnan(job.ready_at) else max(0.0, now - job.ready_at)
            out.append((job.queue_wait_s(now), job.clock_since is not None, age))
        return out

    def moved_mark(self) -> tuple[int, int, int]:
        """Where the status view's journal stands now, for `moved_since`."""
        return (self._moved_epoch, len(self._moved_ws), len(self._moved_jobs))

    def moved_since(self, mark: tuple[int, int, int]) -> set[str] | None:
        """Ids of the live jobs whose `wait_columns` fields or clock may differ from what they
        were at `mark` (a `moved_mark`), or None when the journal since then was dropped.

        The journal holds the workspaces whose queued head, owner or sibling user changed
        and the jobs whose state, clock or pending cleanup changed. A workspace stands for
        every job queued there (behind the head they wait on the head or the holder, the
        head on its own workspace's holders); when any workspace changed, every queued head
        with siblings counts too (it reads its siblings' holders). Ids of jobs no longer
        live are left out. Call `refresh` first: a time-driven pass journals its changes."""
        epoch, n_ws, n_jobs = mark
        if epoch != self._moved_epoch:
            return None
        jobs = self._jobs
        moved = {job_id for job_id in self._moved_jobs[n_jobs:] if job_id in jobs}
        if len(self._moved_ws) > n_ws:
            queues = self._queues
            for ws in set(self._moved_ws[n_ws:]):
                dq = queues.get(ws)
                if dq:
                    moved.update(dq)
            moved.update(self._sib_heads)
        return moved

    def _forget_moves(self) -> None:
        self._moved_ws = []
        self._moved_jobs = []
        self._moved_epoch += 1

    def take_clock_changes(self, now: float) -> set[str]:
        """Ids of the jobs that joined a queue, or whose queue-wait clock started, paused or
        resumed, since the previous call (as of ``now``); the dispatcher persists the clocks
        of exactly these instead of looking at every queued job after every message.  Ids
        may since have left the queue."""
        self._refresh(now)
        changed, self._clock_changed = self._clock_changed, set()
        if self._run_changed:  # a run log may have flipped any job queued there
            queues = self._queues
            for ws in self._run_changed:
                dq = queues.get(ws)
                if dq:
                    changed.update(dq)
            self._run_changed.clear()
        return changed

    def job_state(self, job_id: str) -> str | None:
        """AWAITING_BUNDLES, or lifecycle.QUEUED, SETUP ("setup"), RUNNING; None when not live."""
        job = self._jobs.get(job_id)
        return None if job is None else job.state

    def budget_s(self, job_id: str) -> float:
        return self._jobs[job_id].budget_s

    def expired(self, now: float) -> list[str]:
        """Queued runner-enforced jobs whose observed queue wait reached their budget."""
        now = self._refresh(now)
        t = self._t
        self._fold_due(t)
        found = []
        taken = []
        while (entry := self._due_next(taken)) is not None:
            due, order, job_id = entry
            if due > t + _DUE_MARGIN_S:
                break
            job = self._jobs[job_id]
            self._catch_up(job)
            if job.due_key != entry:
                continue  # its run log moved it: its entry now is further on in `_due`
            if job.queue_wait_s(t) + _EPS_S >= job.budget_s:
                found.append((order, job_id))
        self._due_put_back(taken)
        found.sort()
        return [job_id for _, job_id in found]

    def next_wakeup(self, now: float) -> float | None:
        """The earliest time at which decide()/expired() could change on their own: a head
        aging or leaving its retry delay, or a runner-enforced budget running out.  A budget
        that is already due (a zero budget, or one reached exactly now) answers ``now``, so
        the dispatcher acts on it at once instead of at the next breakpoint."""
        now = self._refresh(now)
        t = self._t
        self._fold_due(t)
        while True:
            best = self._next_budget(t)
            if best == t:
                return t  # due now (paused or not): expired() lists it
            at = self._next_breakpoint()
            if best is None or (at is not None and at < best):
                best = at
            # a run log whose floor comes first may advance a clock that runs out before
            # `best`: its jobs are made exact, and the answer looked for again
            if not self._fold_due(math.inf if best is None else best, folded=True):
                return best

    def _next_budget(self, t: float) -> float | None:
        """When the first runner-enforced budget runs out, on the clocks as they are (`t`
        when one already has); None when none advances."""
        best_budget = None
        taken = []
        while (entry := self._due_next(taken)) is not None:
            due, _, job_id = entry
            if due > t + _DUE_MARGIN_S and best_budget is not None \
                    and due > best_budget + _DUE_MARGIN_S:
                break
            job = self._jobs[job_id]
            self._catch_up(job)
            if job.due_key != entry:
                continue  # its run log moved it: its entry now is further on in `_due`
            remaining = job.budget_s - job.queue_wait_s(t)
            if remaining <= _EPS_S:
                best_budget = t
                break
            if job.clock_since is None:
                continue  # paused: its budget cannot run out until the clock advances again
            at = t + remaining
            if best_budget is None or at < best_budget:
                best_budget = at
        self._due_put_back(taken)
        return best_budget

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
        self._settle()
        job = self._jobs.get(job_id)
        if job is not None:
            self._catch_up(job)
            return _lines(job.story)
        ended = self._ended.get(job_id)
        return _lines(ended[1]) if ended else []

    # --- internals: bookkeeping -----------------------------------------------------

    def _get(self, job_id: str, state: str) -> _Job:
        job = self._jobs.get(job_id)
        if job is None or job.state != state:
            raise ValueError(f"job {job_id!r} is not {state}")
        return job

    def _tell(self, job: _Job, now: float, line: str, at: float | None = None) -> None:
        job.story.append((now, line, at))

    def _forget(self, job: _Job, now: float, outcome: str) -> None:
        self._tell(job, now, outcome)
        del self._jobs[job.job_id]
        self._clock_changed.discard(job.job_id)
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
            self._take_from_order(job)
            if not dq:
                del self._queues[ws]
                self._free_seen.discard(ws)
            elif was_head:
                self._file_head(ws)
            self._n_queued -= 1
            self._unenrol(job)
            self._stop_clock(job, now)
            self._dirty.add(ws)
            self._tell(job, now, f"queue wait {job.clock_acc:.3f}s")
        self._forget(job, now, outcome)

    def _release(self, job: _Job) -> None:
        ws = job.spec.workspace
        if self._owner.get(ws) == job.job_id:
            del self._owner[ws]
        for s in job.touched[1:]:
            if self._sib_user.get(s) == job.job_id:
                del self._sib_user[s]
        self._dirty.update(job.touched)
        self._moved_ws.extend(job.touched)
        self._held -= job.claim

    def _stop_clock(self, job: _Job, now: float) -> None:
        self._catch_up(job)
        if job.clock_since is not None:
            job.clock_acc += max(0.0, now - job.clock_since)
            job.clock_since = None
            self._redue(job)

    # --- internals: budget deadlines ------------------------------------------------

    def _enrol(self, job: _Job) -> None:
        """The runner enforces this queued job's budget (`expired`, `next_wakeup`)."""
        if job.job_id not in self._enforced:
            self._enforced[job.job_id] = next(self._enforced_seq)
        self._redue(job)

    def _unenrol(self, job: _Job) -> None:
        if self._enforced.pop(job.job_id, None) is not None:
            self._redue(job)

    def _redue(self, job: _Job) -> None:
        """Keep the job's entry in ``_due`` (a heap by the time its budget runs out) true
        (`_due_key`)."""
        key = _due_key(job, self._enforced.get(job.job_id))
        if job.clock_since is None:
            self._floor(job, self._t)  # for its run log (`_run_clocks`)
        if key == job.due_key:
            return
        job.due_key = key  # the entry it had, if any, is stale now: dropped when met
        if key is not None:
            heapq.heappush(self._due, key)
            if len(self._due) > 2 * len(self._enforced) + 64:
                self._trim_due()

    def _trim_due(self) -> None:
        """Rebuild ``_due`` from the live entries (once stale ones are most of it)."""
        jobs = self._jobs
        self._due = [k for j in self._enforced if (k := jobs[j].due_key) is not None]
        heapq.heapify(self._due)

    def _due_next(self, taken: list) -> tuple | None:
        """Pop ``_due``'s next live entry in order (dropping stale ones and duplicates of a
        live one) onto ``taken``; None when there is none.  `_due_put_back` restores them."""
        due, jobs = self._due, self._jobs
        while due:
            entry = heapq.heappop(due)
            job = jobs.get(entry[2])
            if job is not None and job.due_key == entry and not (taken and taken[-1] == entry):
                taken.append(entry)
                return entry
        return None

    def _due_put_back(self, taken: list) -> None:
        for entry in taken:
            heapq.heappush(self._due, entry)

    # --- internals: starts and head indexes -----------------------------------------

    def _start(self, job: _Job, now: float) -> Start:
        ws = job.spec.workspace
        dq = self._queues[ws]
        assert dq[0] == job.job_id
        self._unfile_head(ws)
        dq.popleft()
        self._take_from_order(job)
        job.prev_dispatch = self._last_dispatch.get(ws)
        self._last_dispatch[ws] = next(self._dispatch_counter)
        if dq:
            self._file_head(ws)
        else:
            del self._queues[ws]
            self._free_seen.discard(ws)
        self._n_queued -= 1
        self._n_setup += 1
        self._unenrol(job)
        self._stop_clock(job, now)
        job.state = SETUP
        self._held += job.claim
        self._setup_held += job.claim
        self._owner[ws] = job.job_id
        for s in job.touched[1:]:
            self._sib_user[s] = job.job_id
        self._moved_ws.extend(job.touched)
        self._moved_jobs.append(job.job_id)
        self._tell(job, now, f"started: claim {job.claim}, held permits now {self._held}"
                   f"/{self.max_weight}, queue wait {job.clock_acc:.3f}s")
        return Start(job.job_id, job.claim)

    @staticmethod
    def _fence_order(job: _Job) -> tuple:
        """A queued job's place in the order a fence is compared in, as a key that does not
        change while it waits: gate jobs by arrival, then ordinary jobs, then background
        jobs, each by readiness. Behind the head of an occupied workspace a job is at or
        ahead of a fence F (`_order_key`: its clock may pause) exactly when its key is at
        most F's: a job that has not aged is ready later than any aged fence, so it is
        behind one either way, as its class-3 `_order_key` says."""
        if job.spec.gate:
            return (1, job.accept_seq, job.job_id)
        return (4 if job.background else 2, job.ready_at, job.ready_seq, job.job_id)

    def _put_in_order(self, job: _Job) -> None:
        job.order = key = self._fence_order(job)
        ws = job.workspace
        log = self._runs.get(ws)
        job.seen = 0 if log is None else log[0] + len(log[1])  # the log so far is not its
        order = self._in_order.get(ws)
        if order is None:
            self._in_order[ws] = [key]
            self._claims_in[ws] = Counter((job.claim,))
            return
        self._claims_in[ws][job.claim] += 1
        if order[-1] < key:
            order.append(key)  # the usual case: readied after everything queued there
        else:
            bisect.insort(order, key)

    def _take_from_order(self, job: _Job) -> None:
        self._catch_up(job)  # its clock, exact as it leaves the queue
        self._retrying.discard(job.job_id)
        ws = job.workspace
        order = self._in_order[ws]
        if order[0] == job.order:
            del order[0]  # the usual case: the head starts
        else:
            _sorted_remove(order, job.order)
        job.order = None
        if not order:
            del self._in_order[ws], self._claims_in[ws]
            self._runs.pop(ws, None)
            self._run_floor.pop(ws, None)
            self._run_due_at.pop(ws, None)
            return
        claims = self._claims_in[ws]
        claims[job.claim] -= 1
        if not claims[job.claim]:
            del claims[job.claim]

    def _tail_claims(self, ws: str, head: _Job) -> set[int]:
        """The claims of the jobs queued behind `head` in `ws`."""
        claims = self._claims_in[ws]
        return {c for c, n in claims.items() if n > 1 or c != head.claim}

    def _file_head(self, ws: str) -> None:
        job = self._jobs[self._queues[ws][0]]
        self._head_of[ws] = job.job_id
        if len(job.touched) > 1:
            self._sib_heads.add(job.job_id)
        ready_key = (job.ready_at, job.ready_seq, job.job_id)
        if job.spec.gate:
            keys = [(self._gate_heads, (job.accept_seq, job.job_id))]
        elif job.background:
            keys = [(self._bg_heads, ready_key)]
            self._bg_claims[job.claim] += 1
        else:
            keys = [(self._ready_heads, ready_key),
                    (self._rot_heads, (self._last_dispatch.get(ws, 0), *ready_key))]
            self._rot_claims[job.claim] += 1
        for lst, key in keys:
            bisect.insort(lst, key)
        job.head_keys = keys
        # its time-driven breakpoints (aging, end of retry delay), if still to come
        for at in (job.ready_at + GRACE_S, job.retry_at):
            if at > self._t:
                heapq.heappush(self._breakpoints, (at, job.job_id))

    def _unfile_head(self, ws: str) -> None:
        job_id = self._head_of.pop(ws, None)
        if job_id is None:
            return
        self._moved_ws.append(ws)
        self._sib_heads.discard(job_id)
        job = self._jobs[job_id]
        for lst, key in job.head_keys:
            _sorted_remove(lst, key)
        if not job.spec.gate:
            counter = self._bg_claims if job.background else self._rot_claims
            counter[job.claim] -= 1
            if not counter[job.claim]:
                del counter[job.claim]
        job.head_keys = []

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

    def _walk(self, now: float, *, need_fence: bool) -> tuple[list[_Job], _Job | None]:
        """Walk the heads in dispatch order as if starting those that may start (nothing is
        changed); return the heads to start, in order, and the fence the walk stops at.

        Same walk as the reference, with two shortcuts that cannot change its outcome:
        ordinary heads that have not aged never fence, so once the permits left are below
        the smallest ordinary head's claim the rotation (class 3) is skipped; background
        heads fence only once aged (a prefix of their order), so once the permits left are
        below the smallest background claim only that prefix is looked at, for the fence
        (and not at all when the caller does not need the fence)."""
        jobs = self._jobs
        held = self._held
        extra: set[str] = set()
        starts: list[_Job] = []

        def visit(job: _Job) -> bool:
            """True when the walk stops at this head (a fence)."""
            nonlocal held
            if job.cleanup_pending or self._conflict(job, extra):
                return False
            if now >= job.retry_at and job.claim <= self.max_weight - held:
                extra.update(job.touched)
                starts.append(job)
                held += job.claim
                return False
            return self._fences(job, now)

        for _, job_id in self._gate_heads:
            job = jobs[job_id]
            if visit(job):
                return starts, job
        for ready_at, _, job_id in self._ready_heads:
            if ready_at + GRACE_S > now:
                break
            job = jobs[job_id]
            if visit(job):
                return starts, job
        if self._rot_claims and self.max_weight - held >= min(self._rot_claims):
            smallest = min(self._rot_claims)
            for _, ready_at, _, job_id in self._rot_heads:
                if ready_at + GRACE_S > now:
                    visit(jobs[job_id])  # an ordinary head that has not aged never fences
                    if self.max_weight - held < smallest:
                        break
        if self._bg_claims:
            may_start = self.max_weight - held >= min(self._bg_claims)
            if not may_start and not need_fence:
                return starts, None
            for ready_at, _, job_id in self._bg_heads:
                if not may_start and ready_at + GRACE_S > now:
                    break  # only aged background heads fence; nothing here can start
                job = jobs[job_id]
                if visit(job):
                    return starts, job
                if may_start and self.max_weight - held < min(self._bg_claims):
                    may_start = False
                    if not need_fence:
                        break
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

    def _set_clock(self, job: _Job, now: float, advancing: bool) -> None:
        """Start or pause a queued job's clock (as `_stop_clock`, with its budget deadline
        kept in `_due`), told in its story and reported changed. The flip of `_set_clocks`
        for one job, kept apart on purpose: heads and single jobs flip once or more per
        event, and routed through the run's loop they made a starting `decide()` and the
        pass after the heads age slower at 10,000 queued over 2,000 workspaces
        (docs/performance-history.md, "Stop 45"). The deadline's formula is shared (`_due_key`)."""
        self._catch_up(job)
        since = job.clock_since
        if advancing == (since is not None):
            return
        if advancing:
            job.clock_since = now
            line = "clock advancing"
        else:
            job.clock_acc += max(0.0, now - since)
            job.clock_since = None
            line = "clock paused"
        job_id = job.job_id
        if job.due_key is not None or job_id in self._enforced:
            self._redue(job)
        self._clock_changed.add(job_id)
        self._moved_jobs.append(job_id)
        job.story.append((now, line, job.clock_acc))

    def _set_clocks(self, run, head: _Job | None, now: float, room) -> bool:
        """Start or pause the clocks of a run of queued jobs in one loop (issue 14: a
        workspace freed or taken changes course for every clock queued there, thousands
        in a deep one): each change told in the job's story, its budget deadline kept in
        `_due` and the job reported changed (written out by the dispatcher). `room` None:
        every clock advances (a workspace freed); `_PAUSE`: every one pauses. Otherwise
        the run is the jobs at or ahead of the fence in fence order behind `head`
        (skipped) of an occupied workspace with `room`: a clock pauses when the job's
        claim fits and it is not in a retry delay (`pauses` in `_reclassify`, whose
        comparison with the fence each of them passes). False when a job of the run is
        in a retry delay (the workspace's record is then not kept)."""
        enforced, changed, moved = self._enforced, self._clock_changed, self._moved_jobs
        due, runs, catch_up = self._due, self._runs, self._catch_up
        cacheable = True
        for job in run:
            if job is head:
                continue
            if runs:
                catch_up(job)
            since = job.clock_since
            if room is None:
                pause = False
            elif room is _PAUSE:
                pause = True
            elif job.retry_at > now:
                cacheable = pause = False
            else:
                pause = job.claim <= room
            if pause:
                if since is None:
                    continue
                job.clock_acc += max(0.0, now - since)
                job.clock_since = None
                line = "clock paused"
            else:
                if since is not None:
                    continue
                job.clock_since = now
                line = "clock advancing"
            job_id = job.job_id
            if (key := _due_key(job, enforced.get(job_id))) != job.due_key:  # `_redue`
                job.due_key = key
                if key is not None:
                    heapq.heappush(due, key)
            if pause and job_id in enforced:
                self._floor(job, now)
            changed.add(job_id)
            moved.append(job_id)
            # its value now (`queue_wait_s(now)`): the accumulated time, either way
            job.story.append((now, line, job.clock_acc))
        if len(due) > 2 * len(enforced) + 64:
            self._trim_due()
        return cacheable

    def _run_clocks(self, ws: str, now: float, lo: tuple | None, hi: tuple | None,
                    skip: _Job | None, room: int | None, course: int) -> bool:
        """Flip the clocks of the jobs queued in `ws` whose fence-order key (`_fence_order`)
        is above `lo` and at most `hi` (None: no bound), but `skip`: `course` _ADVANCE or
        _PAUSE_RUN (only those whose claim fits `room`, unless it is None), or _SPLIT
        (pause when the claim fits `room`, else advance), as `_set_clocks` does.

        A long run (more than LAZY_RUN_MIN jobs; issue 14: a deep workspace freed or taken
        flips thousands, and a drain over a few workspaces spent half its time here) is
        written in the workspace's run log instead, one entry, and each job applies it
        when its clock is next read or changed (`_catch_up`): the same flips in the same
        order at the same times, its story told the same. The status view's journal and
        `take_clock_changes` name the workspace's jobs; a budget that may run out under
        the log is kept by the workspace's floor (`_floor`, `_fold_due`). False when a job
        of a _SPLIT run is in a retry delay (as `_set_clocks`)."""
        order = self._in_order.get(ws)
        if not order:
            return True
        start = 0 if lo is None else bisect.bisect_right(order, lo)
        stop = len(order) if hi is None else bisect.bisect_right(order, hi)
        if stop - start <= LAZY_RUN_MIN or (course == _SPLIT and any(
                (job := self._jobs[j]).workspace == ws and job is not skip
                and job.retry_at > now for j in self._retrying)):
            jobs = self._jobs
            run = [jobs[key[-1]] for key in order[start:stop]]
            if course == _SPLIT:
                return self._set_clocks(run, skip, now, room)
            if room is not None:
                run = [job for job in run if job.claim <= room]
            return self._set_clocks(run, skip, now, _PAUSE if course == _PAUSE_RUN else None)
        log = self._runs.get(ws)
        if log is None:
            log = self._runs[ws] = [0, []]
        log[1].append((now, lo, hi, None if skip is None else skip.job_id, room, course))
        self._moved_ws.append(ws)
        self._run_changed.add(ws)
        floor = self._run_floor.get(ws)
        if course != _PAUSE_RUN and floor is not None \
                and floor < self._run_due_at.get(ws, math.inf):
            self._run_due_at[ws] = floor
            heapq.heappush(self._run_due, (floor, ws))
        if len(log[1]) > RUN_LOG_MAX:
            self._fold(ws)
        return True

    def _catch_up(self, job: _Job) -> None:
        """Apply to a queued job's clock the entries of its workspace's run log written
        since it last did (`_run_clocks`)."""
        if job.order is None:
            return  # not queued: it caught up when it left the queue
        log = self._runs.get(job.workspace)
        if log is None:
            return
        base, entries = log
        end = base + len(entries)
        if job.seen >= end:
            return
        first, job.seen = job.seen - base, end
        key, claim, job_id = job.order, job.claim, job.job_id
        since, acc, story = job.clock_since, job.clock_acc, job.story
        changed = False
        for i in range(first, len(entries)):
            t, lo, hi, skip, room, course = entries[i]
            if job_id == skip or (lo is not None and key <= lo) or (hi is not None and key > hi):
                continue
            if course == _SPLIT:
                pause = claim <= room
            elif room is not None and claim > room:
                continue
            else:
                pause = course == _PAUSE_RUN
            if pause:
                if since is None:
                    continue
                acc += max(0.0, t - since)
                since = None
                story.append((t, "clock paused", acc))
            else:
                if since is not None:
                    continue
                since = t
                story.append((t, "clock advancing", acc))
            changed = True
        if changed:
            job.clock_since, job.clock_acc = since, acc
            if job.due_key is not None or job_id in self._enforced:
                self._redue(job)
            self._clock_changed.add(job_id)

    def _floor(self, job: _Job, now: float) -> None:
        """A runner-enforced queued job's clock paused at `now`: it cannot run out before
        now + what is left of its budget, whenever it advances again; its workspace's floor
        is the earliest of those (a lower bound: kept until the log is folded)."""
        if job.job_id not in self._enforced or job.order is None:
            return
        at = now + job.budget_s - job.clock_acc
        ws = job.workspace
        if at < self._run_floor.get(ws, math.inf):
            self._run_floor[ws] = at

    def _fold(self, ws: str) -> None:
        """Every job queued in `ws` catches up with its run log, which starts over empty."""
        log = self._runs.get(ws)
        if log is None:
            return
        jobs, t = self._jobs, self._t
        self._run_floor.pop(ws, None)  # made again from the paused clocks as they are now
        self._run_due_at.pop(ws, None)
        for key in self._in_order.get(ws, ()):
            job = jobs[key[-1]]
            self._catch_up(job)
            if job.clock_since is None:
                self._floor(job, t)
        log[0] += len(log[1])
        log[1] = []

    def _fold_due(self, t: float, *, folded: bool = False):
        """Fold the run logs of the workspaces whose floor is reached by `t` (a budget may
        run out: each job's due time is then exact in `_due`). `folded`: whether any was."""
        heap, any_folded = self._run_due, False
        while heap:
            at, ws = heap[0]
            if self._run_due_at.get(ws) != at or not self._runs.get(ws, (0, ()))[1]:
                heapq.heappop(heap)  # stale: folded, or pushed again earlier
                if self._run_due_at.get(ws) == at:
                    del self._run_due_at[ws]
                continue
            if at > t + _DUE_MARGIN_S:
                break
            heapq.heappop(heap)
            self._fold(ws)
            any_folded = True
        return any_folded if folded else None

    def _reclassify(self, now: float) -> None:
        """Decide, as of now, which queued clocks advance -- touching only what can differ.

        Clock rule: the clock pauses only when the job's blockers are the seed's two (an
        earlier job owning its workspace, or a sibling user of its workspace; see
        `_blockers`) AND it would fit once those holders free their permits AND no fence
        stands ahead of it in order AND it is not in a start-retry delay.  Otherwise it
        advances.

        Only a job whose own workspace is *occupied* (owned, or used as a sibling, by an
        active job) can have such a blocker, so every queued job elsewhere advances.  The
        pass therefore (1) starts the clocks of the jobs that joined a queue since the last
        pass, and of the jobs in workspaces freed or changed since then, unless the
        workspace is occupied, and (2) re-decides the jobs queued in occupied
        workspaces (few: at most the touched sets of the active jobs), walking the heads
        for the fence only when one of them could pause.
        """
        cache = self._occupied_seen
        if self._dirty:
            owner, sib_user = self._owner, self._sib_user
            for ws in self._dirty:
                if ws in owner or ws in sib_user:
                    continue  # occupied: its record is checked below
                seen = cache.pop(ws, None)
                dq = self._queues.get(ws)
                if dq:
                    self._advance_freed(ws, dq, seen, now)
                    self._free_seen.add(ws)
            self._dirty.clear()
        fresh_in: dict[str, list[_Job]] = {}  # occupied workspace -> jobs that joined it
        if self._fresh:
            owner, sib_user = self._owner, self._sib_user
            starting = []
            for job in self._fresh:
                if job.state == QUEUED:
                    ws = job.workspace
                    fresh_in.setdefault(ws, []).append(job)
                    if ws not in owner and ws not in sib_user:
                        starting.append(job)
            self._set_clocks(starting, None, now, None)
            self._fresh.clear()
        occupied = [(ws, h) for table in (self._owner, self._sib_user)
                    for ws, h in table.items() if ws in self._queues]
        if not occupied:
            return
        walked = False
        fence = fence_key = None

        def walk() -> None:
            """Find the fence (once per pass: a dry walk of the heads)."""
            nonlocal walked, fence, fence_key
            if not walked:
                _, fence = self._walk(now, need_fence=True)
                fence_key = None if fence is None else self._order_key(fence, now)
                walked = True

        def pauses(job: _Job, room: int) -> bool:
            """A pausable job: does its clock pause (fits once its holder frees, not in a
            retry delay, no fence ahead of it)?"""
            if not (now >= job.retry_at and job.claim <= room):
                return False
            walk()
            return fence is None or fence is job or not fence_key < self._order_key(job, now)

        free_seen, jobs, queues = self._free_seen, self._jobs, self._queues
        owner, sib_user, held = self._owner, self._sib_user, self._held  # (no flip moves them)
        for ws, holder in occupied:
            dq = queues[ws]
            was_free = ws in free_seen
            if was_free:
                free_seen.discard(ws)
            room = self.max_weight - (held - jobs[holder].claim)
            head = jobs[dq[0]]
            pausable = not head.cleanup_pending
            if pausable:
                for w in head.touched[1:]:
                    if w in owner or w in sib_user:
                        pausable = False
                        break
            advancing = not (pausable and pauses(head, room))
            if self._runs:
                self._catch_up(head)
            if advancing != (head.clock_since is not None):  # (most passes: no flip, no call)
                self._set_clock(head, now, advancing)
            if len(dq) == 1:
                # Nothing behind the head: a record of the jobs behind an earlier head
                # would go stale here (this head's clock flips by the head's rule, and a
                # job requeued at the front after a failed start puts it behind again,
                # where the record would say it is as it was): dropped.
                cache.pop(ws, None)
                continue
            # The jobs behind the head all pause or not by (their claim <= room, the fence):
            # whether a job is behind a given fence does not change with time (a job that
            # has not aged is behind an aged fence either way).  So when the fence and the
            # claims' side of room are what they were at this workspace's last pass, and
            # every job behind the head now was behind the head then (the same head, or
            # that head has left the queue: the next job started after it) or joined the
            # tail since, nothing behind the head can change: skip them.  The record
            # outlives a change of holder (the job that ended and the next one started at
            # the same instant, `decide`); it is dropped when the workspace is freed.
            seen = cache.get(ws)
            if seen is not None:
                s_head, s_room, s_claims, s_fence = seen
                if s_room == room:  # (most passes: the room a start and an end left alike)
                    crossed = False
                else:
                    lo, hi = (s_room, room) if s_room < room else (room, s_room)
                    crossed = any(lo < c <= hi for c in s_claims)
                if not crossed and (s_head == dq[0] or self._left_queue(s_head)):
                    same = not s_claims or min(s_claims) > room  # all advance, as they did
                    if not same:
                        walk()
                        same = fence is s_fence
                    if same or s_fence is not _UNWALKED:
                        if not same:
                            # Only the fence moved (fence is walked here): the jobs between
                            # the two in fence order, and only those, change answer.
                            self._fence_moved(ws, head, room, s_fence, fence, now)
                        # Jobs that joined the tail since: decided alone (a job joining
                        # changes no other job's answer); the record now covers them too.
                        joined = [j for j in fresh_in[ws] if j is not head] \
                            if ws in fresh_in else ()
                        for job in joined:
                            self._set_clock(job, now, not pauses(job, room))
                        cache[ws] = (dq[0], room,
                                     s_claims | {j.claim for j in joined} if joined else s_claims,
                                     fence if walked else s_fence)
                        continue
            if was_free:
                # Free at the last pass: every clock queued here advances, but for the jobs
                # that joined since. Behind the head the clocks that pause now are those of
                # the jobs at or ahead of the fence in `_fence_order` (every job, without a
                # fence) whose claim fits: found by bisection, not by a pass over the queue.
                walk()
                cacheable = self._run_clocks(
                    ws, now, None, None if fence is None else self._fence_order(fence), head,
                    room, _SPLIT)
                for job in fresh_in.get(ws, ()):
                    if job is not head:
                        self._set_clock(job, now, not pauses(job, room))
                if cacheable:
                    cache[ws] = (dq[0], room, self._tail_claims(ws, head), fence)
                else:
                    cache.pop(ws, None)
                continue
            claims = set()
            cacheable = True
            for i in range(1, len(dq)):
                job = self._jobs[dq[i]]
                claims.add(job.claim)
                if job.retry_at > now:
                    cacheable = False  # (never seen: only a head is in a retry delay)
                self._set_clock(job, now, not pauses(job, room))
            if cacheable:
                cache[ws] = (dq[0], room, claims, fence if walked else _UNWALKED)
            else:
                cache.pop(ws, None)

    def _advance_freed(self, ws: str, dq: deque[str], seen: tuple | None, now: float) -> None:
        """Advance the clocks of the jobs queued in `ws`, just freed (or changed while free),
        that may be paused: when it was free at the last pass too, its head only (only a
        pass that finds a workspace occupied pauses a clock); with the record of its last
        pass while occupied (`seen`, see `_reclassify`), its head and the jobs at or ahead
        of that pass's fence in `_fence_order` (every job, without a fence; the head only,
        when no claim fitted); else every job queued there. (Jobs that joined since the
        last pass are the caller's.)"""
        head = self._jobs[dq[0]]
        if seen is None:
            if ws in self._free_seen:
                self._set_clock(head, now, True)
            else:
                self._run_clocks(ws, now, None, None, None, None, _ADVANCE)
            return
        if not (seen[0] == dq[0] or self._left_queue(seen[0])):
            self._run_clocks(ws, now, None, None, None, None, _ADVANCE)
            return
        self._set_clock(head, now, True)
        fence = seen[3]
        if fence is not _UNWALKED:
            self._run_clocks(ws, now, None, None if fence is None else self._fence_order(fence),
                             None, None, _ADVANCE)

    def _fence_moved(self, ws: str, head: _Job, room: int, was: _Job | None,
                     fence: _Job | None, now: float) -> None:
        """`_reclassify` for the jobs behind `head` in the occupied workspace `ws` when only
        the fence changed since its record (`was` then, `fence` now): a job's answer
        there is (its claim fits `room`) and (no fence, or it is at or ahead of the fence
        in `_fence_order`), and the claims' side of room is as it was; so the jobs whose
        answer changes are those between the two fences in that order (no fence: after
        every job), found by bisection instead of a pass over the queue (issue 14: with a
        deep workspace every start moved the fence and re-decided thousands of jobs)."""
        top = (5,)  # after every key: where "no fence" stands
        old_at = top if was is None else self._fence_order(was)
        new_at = top if fence is None else self._fence_order(fence)
        if old_at == new_at:
            return
        lo, hi = (old_at, new_at) if old_at < new_at else (new_at, old_at)
        # between the two fences every key is at or ahead of the new one, or every key behind it
        self._run_clocks(ws, now, lo, None if hi is top else hi, head, room,
                         _PAUSE_RUN if new_at == hi else _ADVANCE)

    def _left_queue(self, job_id: str) -> bool:
        """Whether a workspace's recorded head has left its queue (started, ended): then
        every job queued there now was behind it, or joined since."""
        job = self._jobs.get(job_id)
        return job is None or job.state != QUEUED

    def _next_breakpoint(self) -> float | None:
        """Earliest time > the core's time at which a head ages (60 s) or leaves its retry
        delay.  Stale heap entries (no longer a head, or a time that is no longer its own)
        are dropped on the way."""
        heap = self._breakpoints
        while heap:
            at, job_id = heap[0]
            if at > self._t and self._is_breakpoint(at, job_id):
                return at
            heapq.heappop(heap)
        return None

    def _is_breakpoint(self, at: float, job_id: str) -> bool:
        job = self._jobs.get(job_id)
        return (job is not None and job.state == QUEUED
                and self._head_of.get(job.spec.workspace) == job_id
                and (at == job.ready_at + GRACE_S or at == job.retry_at))

    def _settle(self) -> None:
        """Run the clock pass `finished()` owes, at its own instant."""
        if self._owed:
            self._owed = False
            self._reclassify(self._t)

    def refresh(self, now: float) -> float:
        """Bring the core up to ``now`` (`_refresh`); the effective time."""
        return self._refresh(now)

    def _refresh(self, now: float) -> float:
        """Bring the core up to ``now``: re-decide clock pauses at each time-driven change
        between the previous call and now (a head reaching 60 s, a retry delay ending), in
        time order, exactly as an event would.  Between such breakpoints and events nothing
        changes, and every mutating method ends with `_reclassify` (or, `finished()`, owes
        it: `_settle` runs it first), so no pass is needed at ``now`` itself unless it is a
        breakpoint.  Returns the effective time."""
        self._settle()
        if now < self._t:
            now = self._t  # time never goes back; a stale `now` counts as the latest one
        while True:
            at = self._next_breakpoint()
            if at is None or at > now:
                break
            self._t = at
            self.version += 1
            self._reclassify(at)
        self._t = now
        return now
