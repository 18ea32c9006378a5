"""The task client's turn rules (motor.tasks.rules): pure decisions, tested on values.

What a TurnRunner does with a row (route, after_miss), which workers it asks, a submitted
turn's start (reserve_or_park), reconcile's plan, cancel, the orphan job a re-attaching turn
follows, and what a job's terminal record makes of the turn.  The shells that carry these
decisions are tested through real files and processes in the other modules here."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from motor.tasks import core, rules
from motor.tasks.records import TERMINAL_TURN_STATES, QueueEntry, QueueFile, RunnerRecord, TaskRecord, TurnRecord
from motor.tasks.workers import Fleet, WorkerSpec
from tests.tasks.conftest import Processes, Tokens


def row(state="waiting", owner=None, **kw) -> QueueEntry:
    return QueueEntry(queue_id=kw.pop("queue_id", 1), task_id=kw.pop("task_id", "t"), turn_id=kw.pop("turn_id", "1"),
                      enqueued_at_millis=0, state=state, owner=owner, **kw)


def task(*turns: TurnRecord, **kw) -> TaskRecord:
    return TaskRecord(task_id=kw.pop("task_id", "t"), project="/p", created_at_ms=0, workspace="task-t",
                      turns=list(turns) or [TurnRecord(turn_id="1", command=["true"])], **kw)


def imported_by(module: str) -> set[str]:
    """The modules importing `module` loads, in a fresh interpreter."""
    code = f"import sys; import {module}; print(' '.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


def test_rules_are_pure_and_sections_import_no_trio():
    rules_mods = imported_by("motor.tasks.rules")
    assert not {"trio", "psutil", "subprocess", "motor.client", "motor.tasks.store", "motor.tasks.host",
                "motor.tasks.remote"} & rules_mods
    section_mods = imported_by("motor.tasks.sections")
    assert not {"trio", "motor.client", "motor.tasks.remote"} & section_mods


def test_route_of_a_turn_runner(procs: Processes):
    me, other = procs.spawn(), procs.spawn()
    assert rules.route(None, me, wait_for_worker=True) == "gone"
    assert rules.route(row(owner=me, cancel_requested=True), me, wait_for_worker=True) == "cancelled"
    # cancel after the job was accepted: the runner follows the job (the worker cancels it)
    assert rules.route(row(owner=me, cancel_requested=True, job_id="j"), me, wait_for_worker=True) == "dispatch"
    assert rules.route(row(owner=me), me, wait_for_worker=True) == "claim"
    assert rules.route(row(owner=me), me, wait_for_worker=False) == "dispatch"          # attached, library
    assert rules.route(row(owner=other), me, wait_for_worker=True) == "dispatch"       # not ours to claim
    assert rules.route(row(owner=me, job_id="j"), me, wait_for_worker=True) == "dispatch"   # re-attach
    assert rules.route(row("dispatching", dispatch_owner=me), me, wait_for_worker=True) == "dispatch"


@given(state=st.sampled_from(["waiting", "parked", "dispatching"]), mine=st.booleans(), job=st.booleans(),
       cancel=st.booleans(), wait=st.booleans())
def test_route_claims_only_an_own_waiting_unaccepted_row(state, mine, job, cancel, wait):
    me = Processes().spawn()
    r = row(state, owner=me if mine else None, job_id="j" if job else None, cancel_requested=cancel)
    way = rules.route(r, me, wait_for_worker=wait)
    assert (way == "claim") == (wait and state == "waiting" and mine and not job and not cancel)
    assert (way == "cancelled") == (cancel and not job)


def test_after_a_missed_claim(procs):
    me, other = procs.spawn(), procs.spawn()
    assert rules.after_miss(None, me) == "gone"
    assert rules.after_miss(row("parked"), me) == "gone"
    assert rules.after_miss(row(owner=other), me) == "gone"
    assert rules.after_miss(row(owner=me, cancel_requested=True), me) == "cancelled"
    assert rules.after_miss(row(owner=me), me) == "wait"


def test_own_candidates_and_the_rest_of_the_fleet():
    a, b, c = (WorkerSpec(n, f"unix:/x/{n}", capabilities=caps)
               for n, caps in (("a", ("gpu",)), ("b", ()), ("c", ("gpu",))))
    fleet = Fleet((a, b, c))
    assert rules.own_candidates(fleet, task(), row()) == [a, b, c]
    assert rules.own_candidates(fleet, task(capabilities=["gpu"]), row()) == [a, c]
    assert rules.own_candidates(fleet, task(pin="b"), row()) == [b]
    assert rules.own_candidates(fleet, task(pin="b", capabilities=["gpu"]), row()) == []
    assert rules.own_candidates(fleet, task(pin="b"), row(worker="c")) == [c]          # re-attach: its worker
    assert rules.own_candidates(fleet, task(), row(worker="gone")) == []               # not in workers.toml
    assert rules.rest_of_fleet(fleet, [b], {"a": {}}) == [c]


def test_unreachable_detail_is_sorted_and_never_empty():
    assert rules.unreachable_detail(["worker b x", "worker a y"]) == "worker a y; worker b x"
    assert rules.unreachable_detail([]) == "no worker is configured for this turn"


def test_reserve_or_park(procs, tokens: Tokens):
    me = procs.spawn()
    q = QueueFile()
    core.enqueue(q, task_id="a", turn_id="1", owner=me, now_ms=1)
    core.enqueue(q, task_id="a", turn_id="2", owner=me, now_ms=2)
    core.enqueue(q, task_id="b", turn_id="1", owner=me, now_ms=3)
    kw = dict(reserver=me, cap=1, max_parallel={}, new_token=tokens)
    # an earlier turn of its task is queued: not eligible, parked without a reservation
    r = rules.reserve_or_park(q, {}, procs, task_id="a", turn_id="2", **kw)
    assert (r.kind, core.find_row(q, "a", "2").state, tokens.issued) == ("saturated", "parked", [])
    r = rules.reserve_or_park(q, {}, procs, task_id="a", turn_id="1", **kw)
    assert r.acquired and core.find_row(q, "a", "1").slot_reservation.token == r.token
    r = rules.reserve_or_park(q, {}, procs, task_id="b", turn_id="1", **kw)       # cap 1 is taken
    assert r.kind == "saturated" and core.find_row(q, "b", "1").state == "parked"


def test_reconcile_drops_dead_records_replaces_dead_holders_and_starts_parked(procs, tokens):
    me, live, dead = procs.spawn(), procs.spawn(), procs.spawn()
    q = QueueFile()
    for t in ("a", "b", "c"):
        core.enqueue(q, task_id=t, turn_id="1", owner=procs.spawn(), now_ms=1)
    a, b, c = (core.find_row(q, t, "1") for t in ("a", "b", "c"))
    a.state, a.owner, a.dispatch_owner, a.worker, a.job_id = "dispatching", None, dead, "w", "j"
    b.state, b.owner, b.dispatch_owner, b.worker = "dispatching", None, live, "w2"
    core.park(q, task_id="c", turn_id="1")
    runners = {"a": RunnerRecord(identity=dead, turn_id="1"), "b": RunnerRecord(identity=live, turn_id="1")}
    procs.kill(dead)
    dropped, parked, starts = rules.reconcile(q, runners, procs, me=me, cap=3, max_parallel={}, new_token=tokens)
    assert dropped == ["a"] and list(runners) == ["b"] and parked == []
    assert [(t, u) for t, u, _ in starts] == [("a", "1"), ("c", "1")]       # the dead holder's row first
    assert all(core.find_row(q, t, u).slot_reservation.token == tok for t, u, tok in starts)
    assert (a.worker, a.job_id) == ("w", "j")                                # re-attach, never re-run
    # saturated: a dead holder's row is parked instead (and keeps its worker and job id)
    q2 = QueueFile()
    core.enqueue(q2, task_id="d", turn_id="1", owner=dead, now_ms=1)
    d = core.find_row(q2, "d", "1")
    d.state, d.dispatch_owner, d.owner, d.worker, d.job_id = "dispatching", dead, None, "w", "j"
    _, parked, starts = rules.reconcile(q2, {"x": RunnerRecord(identity=live, turn_id="1")}, procs, me=me, cap=1,
                                        max_parallel={}, new_token=tokens)
    assert parked == [("d", "1")] and starts == [] and (d.state, d.worker, d.job_id) == ("parked", "w", "j")


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.tuples(st.sampled_from(["waiting", "dispatching", "parked"]), st.booleans()),
                     max_size=6),
       records=st.lists(st.booleans(), max_size=4), cap=st.integers(1, 3))
def test_reconcile_never_grows_occupancy_past_the_cap(rows, records, cap):
    procs, tokens = Processes(), Tokens()
    me = procs.spawn()
    q = QueueFile()
    for i, (state, alive) in enumerate(rows):
        holder = procs.spawn()
        core.enqueue(q, task_id=f"t{i}", turn_id="1", owner=procs.spawn(), now_ms=i)
        r = core.find_row(q, f"t{i}", "1")
        if state == "dispatching":
            r.state, r.owner, r.dispatch_owner, r.worker = "dispatching", None, holder, "w"
        elif state == "parked":
            core.park(q, task_id=f"t{i}", turn_id="1")
        else:
            r.owner = holder
        if not alive:
            procs.kill(holder)
    runners = {}
    for j, alive in enumerate(records):
        ident = procs.spawn()
        runners[f"r{j}"] = RunnerRecord(identity=ident, turn_id="1")
        if not alive:
            procs.kill(ident)
    before = core.occupied_runner_slots_locked(q, runners, procs)
    dropped, _, starts = rules.reconcile(q, runners, procs, me=me, cap=cap, max_parallel={}, new_token=tokens)
    assert all(core.is_live(procs, rec.identity) for rec in runners.values())
    assert len({(t, u) for t, u, _ in starts}) == len(starts)
    for t, u, tok in starts:
        res = core.find_row(q, t, u).slot_reservation
        assert res.token == tok and res.reserver == me and res.child is None
    assert core.occupied_runner_slots_locked(q, runners, procs) <= max(cap, before)


def test_cancel_marks_live_rows_and_ends_the_others(procs):
    live, dead = procs.spawn(), procs.spawn()
    q = QueueFile()
    core.enqueue(q, task_id="t", turn_id="1", owner=live, now_ms=1)
    core.enqueue(q, task_id="t", turn_id="2", owner=dead, now_ms=2)
    core.enqueue(q, task_id="u", turn_id="1", owner=dead, now_ms=3)
    r1 = core.find_row(q, "t", "1")
    r1.state, r1.owner, r1.dispatch_owner, r1.worker, r1.job_id = "dispatching", None, live, "w", "j1"
    procs.kill(dead)
    rec = task(TurnRecord(turn_id="1", command=["a"], state="running"), TurnRecord(turn_id="2", command=["b"]))
    assert rules.cancel_task(q, rec, procs, 99) == [("w", "j1")]
    assert r1.cancel_requested and core.find_row(q, "t", "2") is None
    assert (rec.turns[1].state, rec.turns[1].ended_at_ms, rec.turns[1].reason) == ("cancelled", 99, "cancelled")
    assert rec.turns[0].state == "running" and core.find_row(q, "u", "1") is not None   # others untouched


def job(job_id, at, workspace="task-t", turn=None):
    return SimpleNamespace(job_id=job_id, accepted_at_ms=at, workspace=workspace,
                           env={} if turn is None else {"MOTOR_TURN": turn})


def test_orphan_job_is_the_newest_unowned_job_of_this_turn_in_the_workspace():
    t = task(TurnRecord(turn_id="1", command=["a"], state="succeeded", job_id="old"),
             TurnRecord(turn_id="2", command=["b"], state="dispatching"))
    jobs = [job("old", 1), job("other-ws", 9, workspace="task-x"), job("next-turn", 8, turn="3"),
            job("mine", 5, turn="2"), job("unmarked", 4)]
    assert rules.orphan_job(jobs, t, "2") == "mine"
    assert rules.orphan_job([job("old", 1), job("next-turn", 8, turn="3")], t, "2") is None
    assert rules.may_own_orphan(t, "2") and not rules.may_own_orphan(t, "1") and not rules.may_own_orphan(t, "9")


@given(state=st.one_of(st.none(), st.text(max_size=12),
                       st.sampled_from(sorted(rules.JOB_TO_TURN_STATE))),
       exit_code=st.one_of(st.none(), st.integers(0, 255)))
def test_turn_outcome_is_always_a_terminal_turn_state(state, exit_code):
    out = rules.turn_outcome({"state": state, "exit_code": exit_code, "job_id": "j"})
    assert out["state"] in TERMINAL_TURN_STATES
    assert out["state"] == rules.JOB_TO_TURN_STATE.get(state, "failed")
    assert (out["exit_code"], out["job_id"]) == (exit_code, "j")


def test_finish_changes_keep_exit_code_even_when_none():
    got = rules.finish_changes(dict(state="lost", exit_code=None, signal=None, reason="stream_ended"))
    assert got == {"state": "lost", "exit_code": None, "reason": "stream_ended"}
