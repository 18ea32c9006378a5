"""The dispatcher's state machine (motor/scheduling/machine.py) driven directly: events in,
effects out, no trio. `Shell` stands in for the actor shell: it carries out the effects the
way scheduling/actor.py does (depth first, answers handed back) against in-memory stand-ins."""

from __future__ import annotations

import subprocess
import sys

import pytest

from motor.memory.core import MemoryCeiling
from motor.records import JobRecord, JobRequest, Refusal
from motor.scheduling import machine as m
from motor.scheduling.admission import AdmissionSettings
from motor.scheduling.core import retry_delay_s
from motor.scheduling.messages import BundleArrived, CancelJob, StatusView

SETTINGS = AdmissionSettings(claim_limit=4, max_weight=4, max_queue_depth=8)


class Shell:
    def __init__(self, machine: m.DispatchMachine):
        self.machine = machine
        self.done: list = []  # effects carried out, in order
        self.full = False  # the store refuses every save (StoreFull)
        self.now, self.wall_ms = 0.0, 1_000_000

    def run(self, event) -> list:
        self.done = []
        pending = list(reversed(self.machine.handle(event, self.now, self.wall_ms)))
        while pending:
            effect = pending.pop()
            self.done.append(effect)
            answer = None
            if isinstance(effect, (m.SaveRecord, m.SaveClocks)):
                answer = (m.SaveFailed(effect, "database or disk is full", 0) if self.full
                          else m.SaveDone(effect))
            elif isinstance(effect, m.PlaceCpus):
                answer = m.Placed(effect.job_id, list(range(effect.claim)))
            elif isinstance(effect, m.Continue):
                answer = effect.event
            if answer is not None:
                more = self.machine.handle(answer, self.now, self.wall_ms)
                pending.extend(reversed(more))
        return self.done

    def of(self, kind) -> list:
        return [e for e in self.done if isinstance(e, kind)]


def submit(shell: Shell, job_id: str, token: str, **kw) -> list:
    req = JobRequest(**{"command": ["make"], "workspace": "w", "weight_hint": 4, **kw})
    return shell.run(m.SubmitReceived(token, req, False, job_id))


def test_a_submit_asks_the_disk_and_is_answered_only_when_the_disk_answers():
    shell = Shell(m.DispatchMachine.new(SETTINGS))
    assert submit(shell, "j1", "t1") == [m.AskDisk("j1", "w", (), None)]
    assert shell.machine.core.statistics().pending == 0  # not accepted before the disk said yes
    shell.run(m.DiskAnswered("j1", None))
    [reply] = shell.of(m.Reply)
    assert reply.token == "t1" and reply.value.state == "queued" and reply.value.job_id == "j1"
    # it starts at once: its accept is saved with its start, one save (issue 14)
    [save] = shell.of(m.SaveRecord)
    assert save.purpose == "admit" and save.record.state == "setup" and save.accepted is reply.value
    assert [type(e).__name__ for e in save.events] == ["Accepted", "Queued"]
    assert shell.of(m.StartJobActor) == [m.StartJobActor("j1", fresh=True)] and shell.machine.active == {"j1"}
    assert shell.machine.starting == {} and shell.machine.admitted == {}


def test_answers_out_of_order_still_queue_jobs_in_job_id_order():
    shell = Shell(m.DispatchMachine.new(SETTINGS))
    for i in (1, 2, 3):
        submit(shell, f"j{i}", f"t{i}", workspace="same")
    assert shell.run(m.DiskAnswered("j3", None)) == []  # waits for the earlier ones
    assert shell.run(m.DiskAnswered("j2", None)) == []
    shell.run(m.DiskAnswered("j1", None))
    assert [r.token for r in shell.of(m.Reply)] == ["t1", "t2", "t3"]
    assert shell.of(m.StartJobActor) == [m.StartJobActor("j1", fresh=True)]
    assert list(shell.machine.queued) == ["j2", "j3"]


def test_an_accepted_jobs_clock_is_saved_with_its_record_and_admissions_go_one_by_one():
    """Issue 14: the clock of a job that joins its queue was saved right after its record,
    a second save of the same record. It is saved with the record now; and since the job is
    in its queue before that save, admissions completing in one message go one at a time:
    no start is decided while an accepted job is unsaved, and its save comes first."""
    shell = Shell(m.DispatchMachine.new(SETTINGS))
    for i in (1, 2, 3):
        submit(shell, f"j{i}", f"t{i}", workspace="same" if i < 3 else "other")
    shell.run(m.DiskAnswered("j2", None))
    shell.run(m.DiskAnswered("j3", None))
    done = shell.run(m.DiskAnswered("j1", None))  # all three complete in this message
    saves = [(e.record.job_id, e.purpose) for e in done
             if isinstance(e, (m.SaveRecord, m.SaveClocks)) for e in getattr(e, "saves", (e,))]
    # j1 starts (weight 4 fills max_weight 4), its accept and start one save; j2 and j3
    # wait, their clocks saved with their records: j2 paused behind j1 (its workspace's
    # owner), j3 advancing; each admitted after the save before it
    assert saves == [("j1", "admit"), ("j2", "accept"), ("j3", "accept")]
    records = {e.record.job_id: e.record for e in shell.of(m.SaveRecord)}
    assert (records["j2"].queue_clock_running, records["j3"].queue_clock_running) == (False, True)
    assert records["j2"].queue_clock_at_ms == shell.wall_ms == records["j2"].ready_at_ms
    placed = [e.job_id for e in done if isinstance(e, m.PlaceCpus)]
    assert placed == ["j1"]
    assert [r.token for r in shell.of(m.Reply)] == ["t1", "t2", "t3"]
    assert {k: v[0] for k, v in shell.machine.clock_saved.items()} == {"j2": False, "j3": True}


def test_a_disk_refusal_is_the_answer_and_leaves_nothing():
    shell = Shell(m.DispatchMachine.new(SETTINGS))
    submit(shell, "j1", "t1")
    full = Refusal(code="runner_disk_full", detail="no room")
    assert shell.run(m.DiskAnswered("j1", full)) == [
        m.NoteRefused("runner_disk_full"), m.Reply("t1", full)]
    assert shell.machine.core.statistics().pending == 0 and not shell.machine.queued


def test_malformed_requests_are_answered_at_once_and_not_counted():
    shell = Shell(m.DispatchMachine.new(SETTINGS))
    [reply] = submit(shell, "j1", "t1", workspace="..")
    assert reply.value.code == "bad_request"
    effects = submit(shell, "j2", "t2", weight_hint=9)
    assert [type(e) for e in effects] == [m.NoteRefused, m.Reply]
    assert effects[1].value.code == "runner_full"
    memory = Shell(m.DispatchMachine.new(SETTINGS,
                                         ceiling=MemoryCeiling(declared_min_bytes=1)))
    assert submit(memory, "j3", "t3")[0] == m.NoteRefused("workspace_setup_failed")


def test_a_bundle_that_arrives_while_the_disk_decides_is_not_missed():
    shell = Shell(m.DispatchMachine.new(SETTINGS))
    sha = "a" * 64
    submit(shell, "j1", "t1", bundle_sha256=sha)
    shell.run(BundleArrived(sha))  # uploaded after the disk looked for it
    shell.run(m.DiskAnswered("j1", None, bundle_present=False))
    assert shell.of(m.StartJobActor) == [m.StartJobActor("j1", fresh=True)]


def test_a_start_the_store_refuses_releases_its_cpus_and_requeues():
    shell = Shell(m.DispatchMachine.new(SETTINGS))
    submit(shell, "j1", "t1")
    shell.run(m.DiskAnswered("j1", None))
    submit(shell, "j2", "t2")
    machine = shell.machine
    shell.run(m.DiskAnswered("j2", None))  # j1 holds max_weight: j2 is accepted, queued
    assert list(machine.queued) == ["j2"]
    # the store fills before j2's start is recorded
    [place, settle] = machine.handle(m.Finished("j1"), 0.0, 1)[:2]
    assert place == m.PlaceCpus("j2", 4) and settle == m.Continue(m.Settle())
    [save] = machine.handle(m.Placed("j2", [0, 1, 2, 3]), 0.0, 1)
    assert save.purpose == "start" and save.record.state == "setup"
    assert machine.handle(m.SaveFailed(save, "full", 0), 0.0, 1) == [m.ReleaseCpus("j2")]
    assert list(machine.queued) == ["j2"] and machine.queued["j2"].state == "queued"
    assert machine.core.statistics().held_permits == 0 and "j2" not in machine.active


def test_a_job_this_dispatcher_queued_starts_fresh_the_first_time_only():
    """Issue 14: a job this machine accepted into its queue has no job directory until it
    is first placed, so that start is `fresh` (its actor does not look in the directory),
    like an admit's. A start after one the store refused looks again."""
    shell = Shell(m.DispatchMachine.new(SETTINGS))
    for job_id in ("j1", "j2", "j3"):
        submit(shell, job_id, "t" + job_id)
        shell.run(m.DiskAnswered(job_id, None))  # j1 starts; j2, j3 queue behind it
    assert list(shell.machine.queued) == ["j2", "j3"]
    assert shell.machine.unplaced == {"j2", "j3"}
    shell.run(m.Finished("j1"))
    assert shell.of(m.StartJobActor) == [m.StartJobActor("j2", fresh=True)]
    assert shell.machine.unplaced == {"j3"}
    # j3's first start is refused by the store: the next one is not fresh
    shell.full = True
    shell.run(m.Finished("j2"))
    assert not shell.of(m.StartJobActor) and list(shell.machine.queued) == ["j3"]
    assert not shell.machine.unplaced
    shell.full = False
    shell.now += retry_delay_s(1) + 1.0
    shell.run(m.TimerFired())
    started = shell.of(m.StartJobActor)
    assert started == [m.StartJobActor("j3")] and not started[0].fresh


def test_a_jobs_end_told_twice_changes_nothing_the_second_time():
    """A job's actor restarted after the dispatcher took its end asks again: the answer
    says its terminal save was not taken along (the actor saves it), and nothing else
    changes. (Before stop 50 the core raised and the dispatcher crashed.)"""
    shell = Shell(m.DispatchMachine.new(SETTINGS))
    submit(shell, "j1", "t1")
    shell.run(m.DiskAnswered("j1", None))
    shell.run(m.Finished("j1"))
    machine = shell.machine
    before = (machine.core.statistics(), set(machine.active), list(machine.queued))
    assert machine.handle(m.Finished("j1"), 0.0, 1) == [m.Reply(None, None)]
    assert (machine.core.statistics(), set(machine.active), list(machine.queued)) == before


def test_an_admission_the_store_refuses_leaves_nothing_of_the_job_it_started():
    """The accept and the start are one save ("admit"); refused, the submit is refused
    runner_disk_full and nothing is left of the job: CPUs released, no permits, nothing
    queued, the core does not know it; the next job is admitted and starts."""
    shell = Shell(m.DispatchMachine.new(SETTINGS))
    submit(shell, "j1", "t1")
    shell.full = True
    shell.run(m.DiskAnswered("j1", None))
    machine = shell.machine
    assert [type(e) for e in shell.done if not isinstance(e, (m.Continue, m.ArmTimer))] == [
        m.PlaceCpus, m.SaveRecord, m.ReleaseCpus, m.NoteRefused, m.Reply]
    [reply] = shell.of(m.Reply)
    assert reply.token == "t1" and reply.value.code == "runner_disk_full"
    stats = machine.core.statistics()
    assert (stats.pending, stats.held_permits) == (0, 0)
    assert (machine.starting, machine.admitted, machine.active, dict(machine.queued)) == (
        {}, {}, set(), {})
    assert machine.core.job_state("j1") is None
    shell.full = False
    submit(shell, "j2", "t2")
    shell.run(m.DiskAnswered("j2", None))
    assert [e.purpose for e in shell.of(m.SaveRecord)] == ["admit"]
    assert shell.of(m.StartJobActor) == [m.StartJobActor("j2", fresh=True)] and machine.active == {"j2"}


def test_a_job_that_waits_is_saved_after_the_starts_decided_at_its_admission():
    """A start decided at an admission may be another job's: j1's start failed and its
    retry delay has passed, its timer not yet fired, when j2 is admitted. j1 starts (placed,
    saved as `setup`, its actor started) and j2, which must wait behind it, has its accept
    saved alone after that, with no second decision. With the store full, j1's start is
    refused too (back to its queue), j2 is cancelled in the core, its submit refused, and
    the starts are decided once more without it."""
    for full in (False, True):
        shell = Shell(m.DispatchMachine.new(SETTINGS))
        machine = shell.machine
        submit(shell, "j1", "t1")
        shell.run(m.DiskAnswered("j1", None))
        [admit] = shell.of(m.SaveRecord)
        shell.run(m.JobStartFailed("j1", "spawn failed", False, admit.record))
        assert list(machine.queued) == ["j1"]
        shell.now += retry_delay_s(1) + 1.0  # past j1's retry: no TimerFired handled yet
        submit(shell, "j2", "t2", workspace="other")
        shell.full = full
        decide, decided = machine.core.decide, []
        machine.core.decide = lambda now: decided.append(now) or decide(now)
        done = shell.run(m.DiskAnswered("j2", None))
        assert len(decided) == (2 if full else 1)  # refused: once more, without j2
        saves = [(e.record.job_id, e.purpose) for e in done if isinstance(e, m.SaveRecord)]
        assert saves == [("j1", "start"), ("j2", "accept")]
        assert [e.job_id for e in done if isinstance(e, m.PlaceCpus)] == ["j1"]
        [reply] = shell.of(m.Reply)
        if full:  # j1's start was refused too (the same store): back to its queue
            assert reply.value.code == "runner_disk_full" and machine.core.job_state("j2") is None
            assert list(machine.queued) == ["j1"] and machine.active == set()
        else:
            assert reply.token == "t2" and reply.value.state == "queued"
            assert shell.of(m.StartJobActor) == [m.StartJobActor("j1")]
            assert machine.active == {"j1"} and list(machine.queued) == ["j2"]
        assert [type(e) for e in done].count(m.ArmTimer) == 1  # settled once, at the end


def test_a_cancel_the_store_cannot_record_stands_and_is_retried():
    shell = Shell(m.DispatchMachine.new(SETTINGS))
    submit(shell, "j1", "t1")
    shell.run(m.DiskAnswered("j1", None))
    submit(shell, "j2", "t2")
    shell.run(m.DiskAnswered("j2", None))  # queued behind j1
    shell.full = True
    effects = shell.run(CancelJob("j2"))
    assert shell.of(m.Reply)[-1].value == "cancelled" and m.ArmFlush(m.STORE_FULL_RETRY_S) in effects
    assert "j2" in shell.machine.unsaved and "j2" not in shell.machine.queued
    shell.run(m.FlushUnsaved())  # still full: armed again
    assert shell.of(m.ArmFlush) and "j2" in shell.machine.unsaved
    shell.full = False
    shell.run(m.FlushUnsaved())
    [save] = shell.of(m.SaveRecord)
    assert save.record.state == "cancelled" and shell.machine.unsaved == {}


def test_a_job_cancelled_while_queued_ends_with_its_clock_at_the_end():
    """Its terminal record's queue_wait_ms is the clock when it was cancelled, not the value
    saved with its record at acceptance (0 for a clock that advanced ever since)."""
    shell = Shell(m.DispatchMachine.new(SETTINGS))
    submit(shell, "j1", "t1", workspace="a")  # all 4 CPUs
    shell.run(m.DiskAnswered("j1", None))
    submit(shell, "j2", "t2", workspace="b")  # waits for capacity: its clock advances
    shell.run(m.DiskAnswered("j2", None))
    shell.now = 7.5
    shell.run(CancelJob("j2"))
    [save] = [s for s in shell.of(m.SaveRecord) if s.record.job_id == "j2"]
    assert save.record.state == "cancelled" and save.record.queue_wait_ms == 7500
    assert save.events[0].record["queue_wait_ms"] == 7500  # the terminal event says the same


def test_recovery_adopts_running_jobs_and_requeues_queued_ones_in_id_order():
    records = (
        JobRecord(job_id="j1", state="running", workspace="a", claim=2, cpus=[0, 1]),
        JobRecord(job_id="j2", state="setup", workspace="b", claim=2, cpus=[2, 3]),
        JobRecord(job_id="j3", state="queued", workspace="c", claim=2, queued_at_ms=1),
        JobRecord(job_id="j4", state="queued", workspace="c", claim=1, queued_at_ms=2),
    )
    shell = Shell(m.DispatchMachine.new(SETTINGS))
    shell.run(m.Recover(records, with_actor={"j1"}))
    assert shell.of(m.StartJobActor) == [m.StartJobActor("j2")]
    assert shell.machine.active == {"j1", "j2"} and list(shell.machine.queued) == ["j3", "j4"]
    assert all(r.budget_enforced_by == "runner" for r in shell.machine.queued.values())
    shell.run(StatusView())
    [reply] = shell.of(m.Reply)
    assert reply.value["capacity"]["held_permits"] == 4


def test_the_machine_and_admission_import_no_trio():
    code = ("import sys, motor.scheduling.machine, motor.scheduling.admission; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('trio', 'actors')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_recovery_saves_no_clock_whose_persisted_course_still_holds():
    """Issue 14: a restart with 10,000 queued jobs wrote every job's clock again (one commit
    each, before the dispatcher answered anything). A persisted clock (value, wall time,
    course) still describes the clock exactly while its course is the same, so only a job
    whose course changed across the restart is saved."""
    wall = 1_000_000
    records = (
        JobRecord(job_id="j1", state="running", workspace="busy", claim=1, cpus=[0]),
        # advancing before, advancing now (its workspace is free): nothing to save
        JobRecord(job_id="j2", state="queued", workspace="a", claim=1, queued_at_ms=1,
                  ready_at_ms=wall - 5000, queue_wait_ms=4000, queue_clock_at_ms=wall - 1000,
                  queue_clock_running=True),
        # paused before (behind an owner), its workspace free now: it resumes, so it is saved
        JobRecord(job_id="j3", state="queued", workspace="b", claim=1, queued_at_ms=2,
                  ready_at_ms=wall - 5000, queue_wait_ms=2000, queue_clock_at_ms=wall - 3000,
                  queue_clock_running=False),
        # paused before and paused now (behind the adopted j1, it fits once j1 ends)
        JobRecord(job_id="j4", state="queued", workspace="busy", claim=1, queued_at_ms=3,
                  ready_at_ms=wall - 5000, queue_wait_ms=1000, queue_clock_at_ms=wall - 2000,
                  queue_clock_running=False),
        # a record from before the persisted clock fields: saved once, to have them
        JobRecord(job_id="j5", state="queued", workspace="c", claim=1, queued_at_ms=wall - 1000),
    )
    machine = m.DispatchMachine.new(AdmissionSettings(claim_limit=1, max_weight=1,
                                                      max_queue_depth=8))
    shell = Shell(machine)
    shell.wall_ms = wall
    shell.run(m.Recover(records, with_actor={"j1"}))
    [clocks] = shell.of(m.SaveClocks)  # one effect: one transaction
    saved = {s.record.job_id: s.record for s in clocks.saves}
    assert sorted(saved) == ["j3", "j5"]
    assert saved["j3"].queue_clock_running is True and saved["j3"].queue_wait_ms == 2000
    assert saved["j5"].ready_at_ms is not None
    # the unsaved ones resume from what is stored: j2 kept advancing while the runner was down
    assert machine.core.clock_state("j2", shell.now)[:2] == (5.0, True)
    assert machine.core.clock_state("j4", shell.now)[:2] == (1.0, False)


@pytest.mark.parametrize("full", [False, True], ids=["rows", "full"])
def test_the_status_view_shows_each_queued_record_with_its_live_wait_fields(full):
    """The view is built with one refresh for the whole queue (issue 14); each entry is still
    exactly the public record with the job's wait fields as wait_status answers them (with
    `full`), or that record with only the status row's fields."""
    from motor.records import public_record

    shell = Shell(m.DispatchMachine.new(AdmissionSettings(claim_limit=6, max_weight=4,
                                                          max_queue_depth=16)))
    for i, (ws, claim) in enumerate([("a", 4), ("a", 1), ("b", 2), ("c", 6), ("a", 3)]):
        submit(shell, f"j{i}", f"t{i}", workspace=ws, weight_hint=claim)
        shell.run(m.DiskAnswered(f"j{i}", None))
    shell.now = 7.5
    shell.run(StatusView(full=full))
    [reply] = shell.of(m.Reply)
    machine = shell.machine
    expected = [public_record(_live_view(machine, r, 7.5)) for r in machine.queued.values()]
    if not full:
        expected = [_row(r) for r in expected]
        assert len(reply.value["queued"][0]) == 13  # the row's fields, waiting_detail unset
    assert reply.value["queued"] == expected and len(expected) == 4
    by_id = {r["job_id"]: r for r in reply.value["queued"]}
    assert by_id["j1"]["waiting_on"] == "workspace_owner" and by_id["j1"]["waiting_on_job"] == "j0"
    assert "claim 6 vCPUs exceeds max_weight 4" in by_id["j3"]["waiting_detail"]
    assert "waiting_detail" not in by_id["j2"] and by_id["j2"]["queue_wait_ms"] == 7500


def _row(public: dict) -> dict:
    """A public record with only the status row's fields, in its own order."""
    from motor.scheduling.view import LIVE_FIELDS, ROW_FIELDS

    return {k: v for k, v in public.items() if k in ROW_FIELDS or k in LIVE_FIELDS}


def _encoded_view(shell: Shell, full: bool) -> bytes:
    """The encoded status view's queued records, joined as GET /v1/status joins them."""
    from motor.scheduling.view import join_array

    shell.run(StatusView(encoded=True, full=full))
    [reply] = shell.of(m.Reply)
    return join_array(list(reply.value["queued"]))


def _live_view(machine: m.DispatchMachine, record, now: float):
    """A queued record with its live wait fields, as GET /v1/jobs/{id} shows it."""
    import msgspec

    return msgspec.structs.replace(record, **machine._wait_fields(record.job_id, now))


def _live_views(machine: m.DispatchMachine, now: float, full: bool) -> bytes:
    """Each queued record's live view, made public and encoded: what the encoded status
    view must equal byte for byte."""
    import msgspec

    from motor.records import public_record

    views = [public_record(_live_view(machine, r, now)) for r in machine.queued.values()]
    return msgspec.json.encode(views if full else [_row(r) for r in views])


@pytest.mark.parametrize("full", [False, True], ids=["rows", "full"])
def test_the_encoded_status_view_is_each_live_view_and_follows_every_change_of_a_record(full):
    """Issue 14: GET /v1/status splices each queued record's encoded public form, kept from
    the previous view, with its live wait fields encoded per view. The bytes equal the
    encoding of every record's live view, on the first view (all encoded), on a later one
    (none encoded again, the wait fields moved on), and after each change of a queued
    record: a requeue after a failed start (new attempts and detail), a clock saved when it
    paused (the stored queue_wait_ms is not what the view shows; its kept bytes stand for
    the new record, as only clock fields changed: stop 25), and a cancel (the job leaves the
    view and the cache). The same for the status rows and for the whole records (`full`)."""
    import json

    machine = m.DispatchMachine.new(AdmissionSettings(claim_limit=6, max_weight=4,
                                                      max_queue_depth=16))
    shell = Shell(machine)
    for i, (ws, claim) in enumerate([("a", 4), ("a", 1), ("b", 2), ("c", 6), ("a", 3)]):
        submit(shell, f"j{i}", f"t{i}", workspace=ws, weight_hint=claim)
        shell.run(m.DiskAnswered(f"j{i}", None))
    assert list(machine.queued) == ["j1", "j2", "j3", "j4"] and machine.active == {"j0"}
    cache = machine.queued_json if full else machine.queued_rows

    shell.now = 7.5
    assert _encoded_view(shell, full) == _live_views(machine, 7.5, full)
    assert cache.encoded_last == 4 and not cache.again_last
    shell.now = 9.25  # only time moved: the view before, its clocks run on (QueuedJson.again)
    body = _encoded_view(shell, full)
    assert body == _live_views(machine, 9.25, full) and cache.encoded_last == 0
    assert cache.again_last
    by_id = {r["job_id"]: r for r in json.loads(body)}
    assert by_id["j2"]["queue_wait_ms"] == 9250 and by_id["j2"]["waiting_on"] == "permits"
    assert by_id["j4"]["waiting_on"] == "workspace_owner" and by_id["j4"]["waiting_on_job"] == "j0"
    assert "claim 6 vCPUs exceeds max_weight 4" in by_id["j3"]["waiting_detail"]

    # j0 ends: j1 (now the owner of a) and j2 start; j4's clock changes course and is saved
    shell.now = 10.0
    shell.run(m.Finished("j0"))
    assert machine.active == {"j1", "j2"} and list(machine.queued) == ["j3", "j4"]
    [clock] = [s for batch in shell.of(m.SaveClocks) for s in batch.saves]
    [setup] = [s.record for s in shell.of(m.SaveRecord)
               if s.purpose == "start" and s.record.job_id == "j1"]
    assert clock.record.job_id == "j4" and machine.queued["j4"] is clock.record
    shell.now = 12.0
    body = _encoded_view(shell, full)
    assert body == _live_views(machine, 12.0, full) and cache.encoded_last == 0
    assert not cache.again_last  # events came between: encoded from the records
    assert len(cache) == 2  # j1, j2 left the queue: their entries too
    by_id = {r["job_id"]: r for r in json.loads(body)}
    assert by_id["j4"]["waiting_on_job"] == "j1"
    # its clock resumed at 10 s (j4 would not fit beside j2): saved then at 0, live now 2 s
    assert (clock.record.queue_clock_running, clock.record.queue_wait_ms) == (True, 0)
    assert by_id["j4"]["queue_wait_ms"] == 2000

    # j1's start fails: requeued with a new record (attempts, detail)
    shell.run(m.JobStartFailed("j1", "mount failed", False, setup))
    assert sorted(machine.queued) == ["j1", "j3", "j4"]
    shell.now = 13.0
    body = _encoded_view(shell, full)
    assert body == _live_views(machine, 13.0, full) and cache.encoded_last >= 1
    by_id = {r["job_id"]: r for r in json.loads(body)}
    if full:
        assert by_id["j1"]["attempts"] == 1 and by_id["j1"]["detail"] == "mount failed"

    # a cancel: the job leaves the view and its cached entry goes
    shell.run(CancelJob("j4"))
    body = _encoded_view(shell, full)
    assert body == _live_views(machine, 13.0, full) and "j4" not in {r["job_id"] for r in json.loads(body)}
    assert len(cache) == len(machine.queued) and "j4" not in machine.queued


def test_a_view_after_only_time_passed_is_the_one_before_unless_a_breakpoint_passed():
    """The encoded view is the view before with its clocks run on (QueuedJson.again) while
    the dispatcher handled no event but views and the core did no time-driven pass; a
    head reaching its 60 s aging point between two views is such a pass (Scheduler.version)
    and the view is encoded afresh. Each view equals the live views of that instant."""
    machine = m.DispatchMachine.new(AdmissionSettings(claim_limit=4, max_weight=2,
                                                      max_queue_depth=16))
    shell = Shell(machine)
    for i, (ws, claim, gate) in enumerate([("a", 2, False), ("b", 1, False), ("b", 1, False),
                                           ("c", 2, False), ("d", 1, True)]):
        submit(shell, f"j{i}", f"t{i}", workspace=ws, weight_hint=claim, gate=gate)
        shell.run(m.DiskAnswered(f"j{i}", None))
    assert machine.active == {"j0"}
    cache = machine.queued_rows
    seen = []
    for now in (1.0, 2.5, 30.0, 59.0, 61.0, 62.0, 200.0):
        version = machine.core.version
        shell.now = now
        assert _encoded_view(shell, False) == _live_views(machine, now, False)
        shell.run(m.Heartbeat("j2"))  # a view too: no event
        seen.append((now, cache.again_last, machine.core.version != version))
    assert seen[1] == (2.5, True, False)  # the first view is encoded; then only time
    passed = [(again, moved) for _, again, moved in seen[1:]]
    assert (False, True) in passed, "no aging point passed between two views"
    assert all(again != moved for again, moved in passed)


def test_clocks_are_saved_alone_unless_the_jobs_record_awaits_a_refused_save():
    """Issue 14: a clock save writes the clock alone (`clock_only`: the store's `clocks`
    table), since the stored record is the one held but for its clock. A job whose requeue
    the store refused (a full state fs) has a stored record older than that: its clock
    save writes its whole record, until the requeue itself is saved."""
    shell = Shell(m.DispatchMachine.new(SETTINGS))
    machine = shell.machine
    submit(shell, "j1", "t1", workspace="a")
    shell.run(m.DiskAnswered("j1", None))  # starts (all 4 CPUs)
    submit(shell, "j2", "t2", workspace="b")
    shell.run(m.DiskAnswered("j2", None))  # waits for capacity: its clock advances
    assert "j1" in machine.active and machine.queued["j2"].queue_clock_running
    shell.now, shell.wall_ms = 5.0, 1_005_000
    shell.full = True  # j1's start fails (its cleanup pending) and the requeue is refused
    shell.run(m.JobStartFailed("j1", "no", True, JobRecord(
        job_id="j1", state="setup", workspace="a", claim=4, queued_at_ms=1)))
    assert "j1" in machine.unsaved and "j1" in machine.queued
    shell.full = False
    shell.now, shell.wall_ms = 6.0, 1_006_000
    shell.run(CancelJob("j2"))  # a message: j1's resumed clock is saved now
    clocks = [s for batch in shell.of(m.SaveClocks) for s in batch.saves]
    assert [(s.record.job_id, s.clock_only) for s in clocks] == [("j1", False)]
    assert clocks[0].store_write == (clocks[0].record, (), None, False)
    assert clocks[0].record.queue_clock_running and clocks[0].record.state == "queued"
    shell.run(m.FlushUnsaved())  # the requeue is saved: from now on, its clocks alone
    assert "j1" not in machine.unsaved
    machine.clock_saved.pop("j1")  # as after a flip of its course
    machine.clock_check.add("j1")
    shell.now += m.CLOCK_SAVE_S  # clocks saved at 6.0: the next ones CLOCK_SAVE_S later
    shell.wall_ms += int(m.CLOCK_SAVE_S * 1000)
    shell.run(m.TimerFired())
    clocks = [s for batch in shell.of(m.SaveClocks) for s in batch.saves]
    assert [(s.record.job_id, s.clock_only) for s in clocks] == [("j1", True)]
    assert clocks[0].store_write == (clocks[0].record, (), None, True)



def _clock_saves(shell: Shell) -> dict:
    return {s.record.job_id: (s.record.queue_clock_running, s.record.queue_wait_ms)
            for batch in shell.of(m.SaveClocks) for s in batch.saves}


def _capacity_waiter(shell: Shell) -> None:
    """j1 runs (all 4 CPUs); j2 waits for capacity in another workspace: its clock advances
    from 0.0, saved with its record."""
    submit(shell, "j1", "t1", workspace="a")
    shell.run(m.DiskAnswered("j1", None))
    submit(shell, "j2", "t2", workspace="b")
    shell.run(m.DiskAnswered("j2", None))
    assert shell.machine.clock_saved["j2"] == (True, 0.0, 0.0)


def test_clock_changes_within_clock_save_s_of_the_last_are_saved_at_its_end():
    """Stop 23: a changed clock is saved at once when no clock was saved in the last
    CLOCK_SAVE_S; one that changes sooner waits for the end of that time (the dispatcher's
    timer is armed for it) and is saved then, with its value at that moment."""
    shell = Shell(m.DispatchMachine.new(SETTINGS))
    machine = shell.machine
    _capacity_waiter(shell)
    shell.now = 5.0
    machine.clock_saved.pop("j2")  # as after a change of its course
    machine.clock_check.add("j2")
    shell.run(m.TimerFired())
    assert _clock_saves(shell) == {"j2": (True, 5000)}
    assert machine.clock_save_at == 5.0 + m.CLOCK_SAVE_S
    shell.now = 5.1
    machine.clock_saved.pop("j2")
    machine.clock_check.add("j2")
    done = shell.run(m.TimerFired())
    assert _clock_saves(shell) == {} and "j2" in machine.clock_check
    assert [e.deadline for e in done if isinstance(e, m.ArmTimer)][-1] == machine.clock_save_at
    shell.now = machine.clock_save_at  # the timer fires
    shell.run(m.TimerFired())
    assert _clock_saves(shell) == {"j2": (True, 5250)} and not machine.clock_check
    shell.now = 7.0
    shell.run(m.FlushClocks())  # nothing changed since: nothing to save
    assert _clock_saves(shell) == {}


def test_a_save_of_many_clocks_holds_off_the_next_for_a_second_per_4000():
    """Stop 43: after a save of N clocks the next waits max(CLOCK_SAVE_S, N / 4000 s), so a
    few deep workspaces taken and freed in turn (thousands of clocks flipped at each start
    and end) no longer spend most of the dispatcher's time saving them; a save of fewer
    than 1,000 clocks keeps CLOCK_SAVE_S."""
    assert m.CLOCK_SAVE_ROWS_PER_S == 4000
    shell = Shell(m.DispatchMachine.new(AdmissionSettings(
        claim_limit=4, max_weight=4, max_queue_depth=3000)))
    machine = shell.machine
    submit(shell, "j0", "t0", workspace="a")
    shell.run(m.DiskAnswered("j0", None))  # runs on all 4 CPUs: the others wait, advancing
    waiting = [f"q{i:04d}" for i in range(2000)]
    for job_id in waiting:
        submit(shell, job_id, "t" + job_id, workspace="b" + job_id)
        shell.run(m.DiskAnswered(job_id, None))
    shell.now = 5.0
    for job_id in waiting:  # as after a change of their courses
        machine.clock_saved.pop(job_id)
        machine.clock_check.add(job_id)
    shell.run(m.TimerFired())
    assert len(_clock_saves(shell)) == 2000
    assert machine.clock_save_at == 5.0 + 2000 / 4000
    shell.now = 5.3  # later than CLOCK_SAVE_S, sooner than half a second: it waits
    machine.clock_saved.pop("q0001")
    machine.clock_check.add("q0001")
    done = shell.run(m.TimerFired())
    assert _clock_saves(shell) == {} and "q0001" in machine.clock_check
    assert [e.deadline for e in done if isinstance(e, m.ArmTimer)][-1] == 5.5
    shell.now = 5.5
    shell.run(m.TimerFired())
    assert _clock_saves(shell) == {"q0001": (True, 5500)}
    assert machine.clock_save_at == 5.5 + m.CLOCK_SAVE_S  # one clock: the usual spacing
    machine.clock_save_s = 0.0  # every change at once: no spacing, however many clocks
    shell.now = 6.0
    for job_id in waiting:
        machine.clock_saved.pop(job_id)
        machine.clock_check.add(job_id)
    shell.run(m.TimerFired())
    assert len(_clock_saves(shell)) == 2000 and machine.clock_save_at == 6.0


def test_a_clock_is_saved_again_unless_the_stored_one_still_tells_its_value():
    """A clock whose course is the stored one is skipped only while the stored value, plus
    the time since if it advances, is its value: one that paused and advanced again
    within CLOCK_SAVE_S has the stored course and a smaller value, and is saved."""
    shell = Shell(m.DispatchMachine.new(SETTINGS))
    machine = shell.machine
    _capacity_waiter(shell)
    shell.now = 5.0
    machine.clock_check.add("j2")  # stored (advancing, 0.0 at 0.0): 5.0 now, as stored
    shell.run(m.FlushClocks())
    assert _clock_saves(shell) == {} and not machine.clock_check
    machine.clock_saved["j2"] = (True, 0.0, 1.0)  # as if stored at 1.0: it says 4.0 now
    machine.clock_check.add("j2")
    shell.run(m.FlushClocks())
    assert _clock_saves(shell) == {"j2": (True, 5000)}
    assert machine.clock_saved["j2"] == (True, 5.0, 5.0)
    machine.clock_saved["j2"] = (False, 5.0, 5.0)  # the other course: saved
    machine.clock_check.add("j2")
    shell.now = 6.0
    shell.run(m.FlushClocks())
    assert _clock_saves(shell) == {"j2": (True, 6000)}


def test_a_submit_with_the_key_of_one_being_admitted_gets_that_ones_answer_and_no_job():
    shell = Shell(m.DispatchMachine.new(SETTINGS))
    submit(shell, "j1", "t1", idempotency_key="k")
    assert submit(shell, "j2", "t2", idempotency_key="k") == []  # waits: no disk ask, no job
    other = submit(shell, "j3", "t3", idempotency_key="k", command=["rm", "-rf", "x"])
    [refused] = other
    assert refused.token == "t3" and refused.value.code == "idempotency_key_reused"
    assert "j1" in refused.value.detail
    shell.run(m.DiskAnswered("j1", None))
    replies = shell.of(m.Reply)
    assert [r.token for r in replies] == ["t1", "t2"]
    assert replies[0].value is replies[1].value and replies[0].value.job_id == "j1"
    assert replies[0].value.idempotency_key == "k"
    assert [s.record.job_id for s in shell.of(m.SaveRecord)] == ["j1"]
    assert shell.machine.keyed == {} and shell.machine.key_waiters == {}
    # once answered, the shell finds the job in the store: `existing`
    req = JobRequest(command=["make"], workspace="w", weight_hint=4, idempotency_key="k")
    shell.run(m.SubmitReceived("t4", req, False, "j4", existing=replies[0].value))
    assert shell.done == [m.Reply("t4", replies[0].value)]
    stats = shell.machine.core.statistics()
    assert (stats.queued, stats.setup, shell.machine.active, shell.machine.admitting) == (0, 1, {"j1"}, {})


def test_the_submits_waiting_on_a_keyed_admission_share_its_refusal_and_the_key_is_free_again():
    shell = Shell(m.DispatchMachine.new(SETTINGS))
    submit(shell, "j1", "t1", idempotency_key="k")
    submit(shell, "j2", "t2", idempotency_key="k")
    shell.run(m.DiskAnswered("j1", Refusal(code="runner_disk_full", detail="no space")))
    assert [(r.token, r.value.code) for r in shell.of(m.Reply)] == [
        ("t1", "runner_disk_full"), ("t2", "runner_disk_full")]
    assert submit(shell, "j3", "t3", idempotency_key="k") == [m.AskDisk("j3", "w", (), None)]
    # and a store that refuses the save: both answered with its refusal too
    shell2 = Shell(m.DispatchMachine.new(SETTINGS))
    shell2.full = True
    submit(shell2, "j1", "t1", idempotency_key="k")
    submit(shell2, "j2", "t2", idempotency_key="k")
    shell2.run(m.DiskAnswered("j1", None))
    assert [(r.token, r.value.code) for r in shell2.of(m.Reply)] == [
        ("t1", "runner_disk_full"), ("t2", "runner_disk_full")]
    assert shell2.machine.keyed == {} and shell2.machine.key_waiters == {}
