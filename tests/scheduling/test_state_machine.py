"""A Hypothesis state machine drives the scheduling core at random and checks, after every
step, the invariants of docs/scheduling.md against an independent model of job states and
workspace FIFOs."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from motor.scheduling.core import GRACE_S, JobSpec, Scheduler, retry_delay_s, wait_ms

MAX_WEIGHT = 8
CLAIM_LIMIT = 12  # claims 9..12 are over max_weight: accepted, they wait and never start
DEPTH = 12
WORKSPACES = ("a", "b", "c", "d", "e")
ACTIVE = ("setup", "running")


class _M:
    """The model's view of one job."""

    def __init__(self, spec: JobSpec, seq: int):
        self.spec = spec
        self.seq = seq
        self.state = "awaiting_bundles"
        self.ready_at = 0.0
        self.ready_seq = 0
        self.failures = 0
        self.retry_at = float("-inf")
        self.cleanup = False
        self.ran = False  # it ended from setting up or running (finished)

    @property
    def touched(self) -> set[str]:
        return {self.spec.workspace, *self.spec.siblings}

    @property
    def background(self) -> bool:
        return not self.spec.gate and self.spec.kind != "job"


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.s = Scheduler(max_weight=MAX_WEIGHT, max_queue_depth=DEPTH, claim_limit=CLAIM_LIMIT)
        self.now = 0.0
        self.jobs: dict[str, _M] = {}
        self.fifo: dict[str, list[str]] = {w: [] for w in WORKSPACES}
        self.last_ms: dict[str, int] = {}
        self.snapshot: tuple | None = None  # (version, job ids, waits, clocks) at the last step
        self.moves: tuple | None = None  # (the core's moved_mark, each job's wait and clock)
        self.counter = 0
        self.ready_counter = 0

    # --- helpers ---------------------------------------------------------------------

    def in_state(self, *states: str) -> list[str]:
        return sorted(j for j, m in self.jobs.items() if m.state in states)

    def active(self) -> list[_M]:
        return [m for m in self.jobs.values() if m.state in ACTIVE]

    def heads(self) -> list[_M]:
        return [self.jobs[q[0]] for q in self.fifo.values() if q]

    def why(self, job_id: str) -> str:
        return "\n".join(self.s.story(job_id))

    # --- rules -----------------------------------------------------------------------

    @rule(
        ws=st.sampled_from(WORKSPACES),
        siblings=st.lists(st.sampled_from(WORKSPACES), max_size=2, unique=True),
        claim=st.sampled_from([1, 2, 2, 2, 3, 4, 4, 5, 6, 8, 0, 10, CLAIM_LIMIT + 1]),
        gate=st.sampled_from([False, False, True]),
        kind=st.sampled_from(["job", "job", "job", "warm_build", "cache_fill"]),
        limit=st.sampled_from([None, None, 0, 30, 90, 400]),
        enforce=st.booleans(),
        ready_now=st.sampled_from([True, True, True, False]),
        then=st.booleans(),
    )
    def accept(self, ws, siblings, claim, gate, kind, limit, enforce, ready_now, then):
        self.counter += 1
        job_id = f"j{self.counter}"
        sibs = tuple(w for w in siblings if w != ws)
        spec = JobSpec(job_id, ws, siblings=sibs, claim=claim, gate=gate and kind == "job",
                       kind=kind, queue_wait_limit_s=limit, runner_enforces_budget=enforce)
        pending = len(self.in_state("awaiting_bundles", "queued", "setup"))
        refusal = self.s.accept(spec, self.now)
        if claim < 1 or claim > CLAIM_LIMIT or pending >= DEPTH:
            assert refusal is not None and refusal.code == "runner_full"
            assert self.s.job_state(job_id) is None
            return
        assert refusal is None
        self.jobs[job_id] = _M(spec, self.counter)
        if ready_now:
            self._ready(job_id)
        self.then_decide(then)

    @precondition(lambda self: self.in_state("awaiting_bundles"))
    @rule(data=st.data(), then=st.booleans())
    def ready(self, data, then):
        self._ready(data.draw(st.sampled_from(self.in_state("awaiting_bundles"))))
        self.then_decide(then)

    def _ready(self, job_id: str) -> None:
        assert self.s.ready(job_id, self.now)
        m = self.jobs[job_id]
        m.state = "queued"
        m.ready_at = self.now
        self.ready_counter += 1
        m.ready_seq = self.ready_counter
        self.fifo[m.spec.workspace].append(job_id)

    def then_decide(self, flag: bool) -> None:
        """The runner decides after every event; sometimes leave a gap to test that too."""
        if flag:
            self.decide()

    @rule()
    def decide(self):
        heads_before = {m.spec.job_id for m in self.heads()}
        starts = self.s.decide(self.now)
        started = []
        for start in starts:
            m = self.jobs[start.job_id]
            assert start.job_id in heads_before and m.state == "queued", self.why(start.job_id)
            assert start.claim == m.spec.claim
            assert self.fifo[m.spec.workspace][0] == start.job_id
            assert self.now >= m.retry_at and not m.cleanup
            assert m.spec.claim <= MAX_WEIGHT, "max_weight is a hard bound"
            self.fifo[m.spec.workspace].pop(0)
            m.state = "setup"
            started.append(m)
        self.check_fences(started)
        self.check_liveness(started)

    def check_fences(self, started: list[_M]) -> None:
        busy = set().union(*(m.touched for m in self.active())) if self.active() else set()
        for h in self.heads():
            if h.cleanup or h.touched & busy or h.spec.claim > MAX_WEIGHT:
                continue  # blocked by its own workspace, or over-max: fences no one
            # h waits for permits (or its retry delay) after this decide
            if h.spec.gate:
                for m in started:
                    assert m.spec.gate and m.seq < h.seq, \
                        f"{m.spec.job_id} started past waiting gate {h.spec.job_id}\n{self.why(h.spec.job_id)}"
            elif self.now - h.ready_at >= GRACE_S:
                for m in started:
                    if h.background:
                        ok = not m.background or (m.ready_at, m.ready_seq) < (h.ready_at, h.ready_seq)
                    else:
                        ok = m.spec.gate or (not m.background and self.now - m.ready_at >= GRACE_S
                                             and (m.ready_at, m.ready_seq) < (h.ready_at, h.ready_seq))
                    assert ok, f"{m.spec.job_id} backfilled past aged head {h.spec.job_id}\n" \
                        + self.why(h.spec.job_id)

    def check_liveness(self, started: list[_M]) -> None:
        if started or self.active():
            return
        heads = self.heads()
        # an idle host with queued heads starts one unless a retry delay holds the line
        assert all(h.cleanup or h.spec.claim > MAX_WEIGHT for h in heads) \
            or any(self.now < h.retry_at for h in heads), [self.why(h.spec.job_id) for h in heads]

    @precondition(lambda self: self.in_state("setup"))
    @rule(data=st.data())
    def setup_done(self, data):
        job_id = data.draw(st.sampled_from(self.in_state("setup")))
        self.s.setup_done(job_id, self.now)
        self.jobs[job_id].state = "running"
        self.jobs[job_id].failures = 0

    @precondition(lambda self: self.active())
    @rule(data=st.data(), then=st.booleans())
    def finish(self, data, then):
        job_id = data.draw(st.sampled_from(self.in_state(*ACTIVE)))
        self.s.finished(job_id, self.now)
        self.jobs[job_id].state = "ended"
        self.jobs[job_id].ran = True
        self.then_decide(then)

    @precondition(lambda self: self.in_state("setup"))
    @rule(data=st.data(), cleanup=st.booleans(), then=st.booleans())
    def start_failed(self, data, cleanup, then):
        job_id = data.draw(st.sampled_from(self.in_state("setup")))
        self.s.start_failed(job_id, self.now, cleanup_pending=cleanup)
        m = self.jobs[job_id]
        m.state = "queued"
        m.failures += 1
        m.retry_at = self.now + retry_delay_s(m.failures)
        m.cleanup = cleanup
        self.fifo[m.spec.workspace].insert(0, job_id)
        self.then_decide(then)

    @precondition(lambda self: any(m.cleanup and m.state == "queued" for m in self.jobs.values()))
    @rule(data=st.data(), then=st.booleans())
    def cleanup_done(self, data, then):
        ids = sorted(j for j, m in self.jobs.items() if m.cleanup and m.state == "queued")
        job_id = data.draw(st.sampled_from(ids))
        assert self.s.cleanup_done(job_id, self.now)
        self.jobs[job_id].cleanup = False
        self.then_decide(then)

    def _remove(self, job_id: str) -> None:
        m = self.jobs[job_id]
        if m.state == "queued":
            self.fifo[m.spec.workspace].remove(job_id)
        m.state = "ended"
        m.cleanup = False
        self.last_ms.pop(job_id, None)

    @precondition(lambda self: self.jobs)
    @rule(data=st.data(), how=st.sampled_from(["cancel", "withdraw"]))
    def remove(self, data, how):
        """Cancel or withdraw a job, mostly a live one; the answers follow its state."""
        live = self.in_state("awaiting_bundles", "queued", *ACTIVE)
        job_id = data.draw(st.sampled_from(live or sorted(self.jobs)))
        m = self.jobs[job_id]
        pending = m.state in ("awaiting_bundles", "queued")
        if how == "cancel":
            assert self.s.cancel(job_id, self.now) is pending
            assert self.s.cancel(job_id, self.now) is False
        else:
            answer = self.s.withdraw(job_id, self.now)
            if pending:
                assert answer == "withdrawn"
            elif m.state in ACTIVE or m.ran:
                assert answer == "started"
            else:  # ended before it started: never "withdrawn" again
                assert answer == "already_ended"
        if pending:
            self._remove(job_id)

    @rule()
    def withdraw_expired(self):
        for job_id in self.s.expired(self.now):
            m = self.jobs[job_id]
            assert m.state == "queued" and m.spec.runner_enforces_budget
            ms = self.s.wait_status(job_id, self.now).queue_wait_ms
            assert ms >= self.s.budget_s(job_id) * 1000 - 1
            assert self.s.withdraw(job_id, self.now) == "withdrawn"
            self._remove(job_id)

    def must_advance(self) -> list[str]:
        """Queued jobs whose clock the seed never pauses: nothing blocks them but capacity,
        a queued head of their workspace, their own busy sibling or a cleanup (only an
        active owner or sibling user of their own workspace may pause a clock)."""
        busy_ws = set().union(*(m.touched for m in self.active())) if self.active() else set()
        out = []
        for q in self.fifo.values():
            for i, job_id in enumerate(q):
                m = self.jobs[job_id]
                if m.spec.workspace not in busy_ws:
                    out.append(job_id)
                elif i == 0 and (m.cleanup or set(m.spec.siblings) & busy_ws):
                    out.append(job_id)
        return out

    @rule(dt=st.sampled_from([0.0, 0.25, 1.0, 2.0, 30.0, 59.75, 60.0, 61.0, 200.0]),
          then=st.booleans())
    def advance(self, dt, then):
        before = {j: self.s.wait_status(j, self.now).queue_wait_ms for j in self.must_advance()}
        self.now += dt
        for job_id, ms in before.items():
            after = self.s.wait_status(job_id, self.now).queue_wait_ms
            assert after >= ms + int(dt * 1000) - 1, self.why(job_id)
        self.then_decide(then)

    @rule()
    def wake_up(self):
        at = self.s.next_wakeup(self.now)
        if at is not None:
            assert at >= self.now
            if at == self.now:  # only a budget already due answers now
                assert self.s.expired(self.now), self.s.statistics()
                self.withdraw_expired()
            self.now = at
            self.decide()

    # --- invariants ------------------------------------------------------------------

    @invariant()
    def states_match_the_model(self):
        for job_id, m in self.jobs.items():
            expected = None if m.state == "ended" else m.state
            assert self.s.job_state(job_id) == expected, (job_id, m.state, self.why(job_id))
        stats = self.s.statistics()
        assert stats.queued == len(self.in_state("queued"))
        assert stats.awaiting_bundles == len(self.in_state("awaiting_bundles"))
        assert stats.pending == stats.queued + stats.awaiting_bundles + stats.setup
        assert stats.setup == len(self.in_state("setup"))
        assert stats.running == len(self.in_state("running"))
        assert stats.queued_heads == len(self.heads())

    @invariant()
    def permits_and_workspaces(self):
        active = self.active()
        held = sum(m.spec.claim for m in active)
        stats = self.s.statistics()
        assert stats.held_permits == held
        assert stats.setup_permits == sum(m.spec.claim for m in active if m.state == "setup")
        assert held <= MAX_WEIGHT  # a hard bound: over-max claims never start
        seen: set[str] = set()
        for m in active:
            assert not (m.touched & seen), f"{m.spec.job_id} shares a workspace or sibling"
            seen |= m.touched

    @invariant()
    def queue_wait_never_decreases(self):
        for job_id, m in self.jobs.items():
            if m.state in ("queued", *ACTIVE):
                status = self.s.wait_status(job_id, self.now)
                assert status.queue_wait_ms >= self.last_ms.get(job_id, 0), self.why(job_id)
                self.last_ms[job_id] = status.queue_wait_ms
                if m.state == "queued":
                    assert status.waiting_on in ("permits", "workspace_owner", "sibling_user",
                                                 "workspace_setup")
                    if m.cleanup:
                        assert status.waiting_on == "workspace_setup"
                    if m.spec.runner_enforces_budget and \
                            status.queue_wait_ms >= self.s.budget_s(job_id) * 1000:
                        # a runner-enforced budget that ran out is due now, never later
                        assert self.s.next_wakeup(self.now) == self.now, self.why(job_id)

    @invariant()
    def a_standing_version_means_only_the_clocks_ran_on(self):
        """While `version` stands (no mutating call, no time-driven pass), every job waits on
        what it waited on and its queue_wait_ms is its clock run on (`wait_ms`): what the
        status view's `QueuedJson.again` relies on."""
        ids = [j for j, m in self.jobs.items() if m.state in ("queued", *ACTIVE)]
        t = self.s.refresh(self.now)
        if self.snapshot is not None and self.snapshot[:2] == (self.s.version, ids):
            ms, waits = self.s.wait_columns(ids, self.now)
            assert waits == self.snapshot[2]
            assert ms == [wait_ms(*clock, t) for clock in zip(*self.snapshot[3])]
        clocks: tuple[list, list] = ([], [])
        ms, waits = self.s.wait_columns(ids, self.now, clocks)
        assert ms == [wait_ms(*clock, t) for clock in zip(*clocks)]
        self.snapshot = (self.s.version, ids, waits, clocks)

    @invariant()
    def every_job_whose_wait_or_clock_moved_is_journaled(self):
        """A live job whose wait fields or clock differ from the last step's is among the
        core's `moved_since` that step's mark: what the status view's `QueuedJson.patch`
        relies on to take only those anew."""
        ids = [j for j, m in self.jobs.items()
               if m.state in ("awaiting_bundles", "queued", *ACTIVE)]
        self.s.refresh(self.now)
        clocks: tuple[list, list] = ([], [])
        _, waits = self.s.wait_columns(ids, self.now, clocks)
        now = {j: (w, acc, since) for j, w, acc, since in zip(ids, waits, *clocks)}
        if self.moves is not None:
            mark, before = self.moves
            moved = self.s.moved_since(mark)
            changed = {j for j, seen in before.items() if j in now and now[j] != seen}
            assert moved is not None and changed <= moved, changed - moved
        self.moves = (self.s.moved_mark(), now)


TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(
    max_examples=300,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_a_head_reaching_its_aging_point_moves_the_version_and_a_clock():
    """Found by the machine above (a pass at a head's 60 s aging point that did not count in
    `version`): with no call in between, a head ages at 60 s, the core re-decides a clock
    at that point, and `version` moves; a status view kept from before would be wrong."""
    s = Scheduler(max_weight=MAX_WEIGHT, max_queue_depth=DEPTH, claim_limit=CLAIM_LIMIT)
    s.accept(JobSpec("a1", "a", claim=1), 0.0)
    s.ready("a1", 0.0)
    assert [start.job_id for start in s.decide(0.0)] == ["a1"]
    s.accept(JobSpec("c", "c", claim=4), 0.0)
    s.ready("c", 0.0)
    s.accept(JobSpec("a2", "a", claim=1), 0.0)
    s.accept(JobSpec("b", "b", claim=4), 0.0)
    s.ready("b", 0.0)
    s.ready("a2", 1.0)
    ids = ["a1", "c", "a2", "b"]
    clocks: tuple[list, list] = ([], [])
    s.wait_columns(ids, 1.0, clocks)
    version = s.version
    t = s.refresh(60.75)
    assert s.version != version
    ms, _ = s.wait_columns(ids, 60.75)
    assert ms != [wait_ms(*clock, t) for clock in zip(*clocks)]
