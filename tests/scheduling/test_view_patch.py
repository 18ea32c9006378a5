"""The encoded status view patched from the view before (view.QueuedJson.patch): after any
run of events the dispatcher handles, the view it answers is byte for byte the encoding of
every queued record's live view, whether it came from the view before with only time
moved (`again`), from that view with the jobs that moved since changed (`patch`), or
afresh (`encode`). The events are random (Hypothesis): submits over a few workspaces with
siblings, gates, claims above max_weight, starts, ends, failed starts (requeued at the
front, cleanup pending), cancels, and time running past aging points and retry ends."""

from __future__ import annotations

import hypothesis.strategies as st
import msgspec
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from motor.scheduling import machine as m
from motor.scheduling.admission import AdmissionSettings
from motor.scheduling.messages import CancelJob

from .test_machine import Shell, _encoded_view, _live_views, submit

WORKSPACES = ("a", "b", "c", "d")


class ViewMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        # clocks saved at most once a minute: a clock's record seldom changes with it, so
        # the view must learn of its changes from the core
        self.machine = m.DispatchMachine.new(AdmissionSettings(claim_limit=6, max_weight=4,
                                                               max_queue_depth=24),
                                             clock_save_s=60.0)
        self.shell = Shell(self.machine)
        self.n = 0
        self.setups: dict[str, object] = {}  # job id -> its record as its start saved it
        self.made: set[str] = set()

    def _run(self, event) -> None:
        self.shell.run(event)
        for save in self.shell.of(m.SaveRecord):
            if save.purpose == "start":
                self.setups[save.record.job_id] = save.record

    @rule(ws=st.sampled_from(WORKSPACES), claim=st.sampled_from([1, 1, 2, 2, 3, 4, 6]),
          gate=st.booleans(),
          siblings=st.lists(st.sampled_from(WORKSPACES), max_size=2, unique=True))
    def a_submit(self, ws, claim, gate, siblings):
        self.n += 1
        job_id = f"j{self.n:03d}"
        siblings = [s for s in siblings if s != ws]
        submit(self.shell, job_id, f"t{self.n}", workspace=ws, weight_hint=claim, gate=gate,
               siblings=siblings)
        self._run(m.DiskAnswered(job_id, None))

    @precondition(lambda self: self.machine.active)
    @rule(data=st.data())
    def an_end(self, data):
        job_id = data.draw(st.sampled_from(sorted(self.machine.active)))
        self._run(m.Finished(job_id))

    @precondition(lambda self: any(j in self.setups for j in self.machine.active))
    @rule(data=st.data(), cleanup=st.booleans())
    def a_failed_start(self, data, cleanup):
        job_id = data.draw(st.sampled_from(sorted(j for j in self.machine.active
                                                  if j in self.setups)))
        self._run(m.JobStartFailed(job_id, "mount failed", cleanup, self.setups.pop(job_id)))

    @precondition(lambda self: self.machine.queued)
    @rule(data=st.data())
    def a_cancel(self, data):
        self._run(CancelJob(data.draw(st.sampled_from(sorted(self.machine.queued)))))

    @rule(dt=st.sampled_from([0.0, 0.25, 1.0, 7.0, 30.0, 61.0]))
    def time_passes(self, dt):
        self.shell.now += dt
        self.shell.wall_ms += int(dt * 1000)
        self._run(m.TimerFired())

    @rule(dt=st.sampled_from([0.0, 0.5, 20.0, 59.5]), full=st.booleans())
    def a_view(self, dt, full):
        """A view after only time moved (`dt`): the same bytes as the live views."""
        self.shell.now += dt
        assert _encoded_view(self.shell, full) == _live_views(self.machine, self.shell.now, full)
        cache = self.machine.queued_json if full else self.machine.queued_rows
        self.made.add(cache.last_made)

    def teardown(self) -> None:
        # the last view of both forms, after whatever came last
        for full in (False, True):
            assert _encoded_view(self.shell, full) == _live_views(self.machine, self.shell.now,
                                                                  full)


ViewMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40,
                                         deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
test_the_patched_view_is_every_live_view = ViewMachine.TestCase


def test_a_view_after_a_submit_patches_only_the_jobs_that_moved():
    """A deep queue (one job holds all capacity, 200 jobs queued over 20 workspaces): after a
    submit, the next view takes anew only the new job (its workspace's queue did not change
    head); after the holder ends and jobs start, only the jobs of the workspaces that moved;
    a failed start puts the job back (at the end of the view) and a record changed in
    place is encoded again; each view equal to the live views. A cancel drops the job; an
    event that moves more than half the jobs (and more than 64) builds the view afresh."""
    machine = m.DispatchMachine.new(AdmissionSettings(claim_limit=4, max_weight=4,
                                                      max_queue_depth=300))
    shell = Shell(machine)
    submit(shell, "h", "th", workspace="hold", weight_hint=4)
    shell.run(m.DiskAnswered("h", None))
    for i in range(200):
        submit(shell, f"j{i:02d}", f"t{i}", workspace=f"w{i % 20}", weight_hint=1)
        shell.run(m.DiskAnswered(f"j{i:02d}", None))
    rows = machine.queued_rows

    def view(now: float) -> None:
        shell.now = now
        assert _encoded_view(shell, False) == _live_views(machine, now, False)

    view(1.0)
    assert rows.last_made == "encode" and rows.redone_last == 200
    submit(shell, "k", "tk", workspace="w3", weight_hint=1)  # behind w3's head
    shell.run(m.DiskAnswered("k", None))
    view(2.0)
    assert (rows.last_made, rows.redone_last, rows.encoded_last) == ("patch", 1, 1)
    shell.run(CancelJob("j05"))  # a head: w5's jobs wait on the next one now
    view(3.0)
    assert rows.last_made == "patch" and rows.redone_last == 9 and len(rows) == 200
    shell.run(m.Finished("h"))  # four heads start (claim 1 each, max_weight 4)
    setups = {s.record.job_id: s.record for s in shell.of(m.SaveRecord) if s.purpose == "start"}
    assert len(machine.queued) == 196 and len(setups) == 4
    failed = sorted(setups)[0]  # its start fails: requeued at the front of its workspace
    shell.run(m.JobStartFailed(failed, "mount failed", False, setups[failed]))
    assert list(machine.queued)[-1] == failed  # it joined the dispatcher's dict again
    view(4.0)  # the started left the view; the failed one is at its end
    assert rows.last_made == "patch" and 4 <= rows.redone_last <= 60 and rows.encoded_last == 1
    assert len(rows) == len(machine.queued)  # its entries: of the jobs still queued
    # any change of a queued record is shown, the core's state moved or not
    record = machine.queued["j00"]
    machine.queued["j00"] = msgspec.structs.replace(record, command=["make", "-j1"])
    view(4.5)
    assert (rows.last_made, rows.redone_last, rows.encoded_last) == ("patch", 1, 1)
    assert b'"command":["make","-j1"]' in _encoded_view(shell, False)
    for job_id in list(machine.queued)[:120]:
        shell.run(CancelJob(job_id))
    view(5.0)
    assert rows.last_made == "encode"


def test_a_clock_that_changes_course_for_an_end_elsewhere_is_patched():
    """A job queued behind the running owner of its workspace has its clock paused while it
    would fit once the owner ends. A start in another workspace takes that room (its clock
    advances; saved at once) and that job's end gives it back: the clock pauses again,
    though nothing in its own workspace moved, and its save waits (`clock_save_s`). The
    patched view shows it paused before its record is saved again (the core journals every
    clock that changes course), and takes no other job anew."""
    machine = m.DispatchMachine.new(AdmissionSettings(claim_limit=4, max_weight=4,
                                                      max_queue_depth=16), clock_save_s=60.0)
    shell = Shell(machine)
    for job_id, ws, claim in (("a", "x", 1), ("b", "x", 2), ("z1", "z", 4), ("z2", "z", 4)):
        submit(shell, job_id, f"t{job_id}", workspace=ws, weight_hint=claim)
        shell.run(m.DiskAnswered(job_id, None))
    assert machine.active == {"a"} and machine.core.clock_state("b", 0.0)[1] is False
    shell.now = 2.0
    submit(shell, "c", "tc", workspace="y", weight_hint=3)
    shell.run(m.DiskAnswered("c", None))
    assert machine.active == {"a", "c"} and machine.queued["b"].queue_clock_running
    shell.now = 3.0
    assert _encoded_view(shell, False) == _live_views(machine, 3.0, False)
    shell.run(m.Finished("c"))
    assert machine.core.clock_state("b", 3.0)[1] is False
    assert "b" in machine.clock_check  # saved later: its record stands meanwhile
    shell.now = 5.0
    assert _encoded_view(shell, False) == _live_views(machine, 5.0, False)
    assert (machine.queued_rows.last_made, machine.queued_rows.redone_last) == ("patch", 1)


def test_a_job_adopted_after_a_restart_moves_the_jobs_queued_in_its_workspaces():
    """The core's journal (`moved_since`) counts the jobs queued in the workspace and the
    sibling workspaces of a job adopted as running after a restart: they now wait on it."""
    from motor.scheduling.core import JobSpec, Scheduler

    s = Scheduler(max_weight=4, max_queue_depth=8, claim_limit=4)
    for job_id, ws, claim in (("q1", "a", 4), ("q2", "a", 1), ("q3", "b", 4), ("q4", "c", 4)):
        s.accept(JobSpec(job_id, ws, claim=claim), 0.0)
        s.ready(job_id, 0.0)
    mark = s.moved_mark()
    assert s.moved_since(mark) == set()
    s.adopt_running(JobSpec("r", "a", siblings=("b",), claim=1), 1.0)
    assert s.wait_statuses(["q2", "q3"], 1.0)[0][:2] == ("workspace_owner", "r")
    assert s.moved_since(mark) == {"q1", "q2", "q3", "r"}
