"""A Hypothesis state machine over the reservation protocol: reserve, bind/complete (whole
or crashed between its publishes), take-over by the child, release, steal, park, reconcile,
a runner finishing and replacing its own slot, and a crash of any process at any point.

Invariants after every step:
- never more live acting runners than the cap;
- never two live acting runners for one turn;
- tokens are never reused (a token once retired never becomes current again);
- FIFO: queue ids follow enqueue order and enqueued_at_millis never decreases along them.
The critical-section bodies are the ones the real shell runs (motor.tasks.sections), on an
in-memory queue instead of the locked file."""

from __future__ import annotations

import uuid

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from motor.tasks import core
from motor.tasks.sections import complete_locked, next_parked_locked, reconcile_plan, take_over_locked
from motor.tasks.records import QueueFile, RunnerRecord
from tests.tasks.conftest import Processes

CAP = 2


class MemLocked:
    """The Locked interface on memory (one 'critical section' = one rule)."""

    def __init__(self, procs: Processes):
        self.queue = QueueFile()
        self.runners: dict[str, RunnerRecord] = {}
        self.observe = procs

    def publish(self) -> None:
        pass

    def read_task(self, task_id):
        return None   # task records are not modelled here

    def set_runner(self, task_id, record) -> None:
        if record is None:
            self.runners.pop(task_id, None)
        else:
            self.runners[task_id] = record


class Reservations(RuleBasedStateMachine):
    @initialize()
    def setup(self):
        self.procs = Processes()
        self.L = MemLocked(self.procs)
        self.tasks = 0
        self.clock = 10_000
        self.issued: list[uuid.UUID] = []
        self.retired: set[uuid.UUID] = set()
        self.spawns: list[dict] = []        # {task, turn, token, parent, child}
        self.acting: dict = {}              # identity -> (task, turn) it runs now
        self.enqueue_order: list[int] = []

    def token(self) -> uuid.UUID:
        t = uuid.uuid4()
        self.issued.append(t)
        return t

    def _retire_gone_tokens(self, before: dict):
        after = {e.key: e.slot_reservation.token for e in self.L.queue.entries if e.slot_reservation}
        for key, tok in before.items():
            if after.get(key) != tok:
                self.retired.add(tok)

    def _tokens_now(self) -> dict:
        return {e.key: e.slot_reservation.token for e in self.L.queue.entries if e.slot_reservation}

    # -- rules ----------------------------------------------------------------------------

    @rule(skew=st.integers(-50, 50))
    def enqueue(self, skew):
        self.tasks += 1
        self.clock += skew
        row = core.enqueue(self.L.queue, task_id=f"t{self.tasks}", turn_id="1", owner=self.procs.spawn(),
                           now_ms=self.clock)
        self.enqueue_order.append(row.queue_id)

    @precondition(lambda self: self.L.queue.entries)
    @rule(data=st.data())
    def submit_reserve(self, data):
        """A submitter (the row's enqueuer, or any new process) reserves and spawns."""
        row = data.draw(st.sampled_from(core.fifo(self.L.queue)))
        reserver = row.enqueue_owner if self.procs(row.enqueue_owner) == "matching" else self.procs.spawn()
        before = self._tokens_now()
        if not core.eligible(self.L.queue, row):
            return
        r = core.reserve_runner_slot(self.L.queue, self.L.runners, self.procs, task_id=row.task_id,
                                     turn_id=row.turn_id, reserver=reserver, cap=CAP, new_token=self.token)
        self._retire_gone_tokens(before)
        if r.kind == "saturated":
            core.park(self.L.queue, task_id=row.task_id, turn_id=row.turn_id)
            self._retire_gone_tokens(before)
        elif r.acquired:
            self.spawns.append(dict(task=row.task_id, turn=row.turn_id, token=r.token, parent=reserver,
                                    child=self.procs.spawn()))

    @precondition(lambda self: any(e.state == "waiting" and e.slot_reservation is None
                                   for e in self.L.queue.entries))
    @rule()
    def submit_oldest_waiting(self):
        """The enqueuer of the oldest unreserved waiting row reserves (a burst of submits)."""
        row = next(e for e in core.fifo(self.L.queue) if e.state == "waiting" and e.slot_reservation is None)

        class One:
            def draw(self, _):
                return row

        self.submit_reserve(One())

    @precondition(lambda self: any(s["child"] not in self.acting for s in self.spawns))
    @rule()
    def newest_child_takes_over(self):
        s = next(s for s in reversed(self.spawns) if s["child"] not in self.acting)

        class One:
            def draw(self, _):
                return s

        self.child_takes_over(One())

    @precondition(lambda self: self.spawns)
    @rule(data=st.data(), half=st.booleans())
    def parent_completes(self, data, half):
        s = data.draw(st.sampled_from(self.spawns))
        if self.procs(s["parent"]) != "matching":
            return
        before = self._tokens_now()
        try:
            if half:   # the parent dies between the two publishes
                core.complete_bind(self.L.queue, self.procs, task_id=s["task"], turn_id=s["turn"],
                                   token=s["token"], child=s["child"])
                self.procs.kill(s["parent"])
            else:
                complete_locked(self.L, s["task"], s["turn"], s["token"], s["child"])
        except core.QueueError:
            core.release_runner_slot(self.L.queue, task_id=s["task"], turn_id=s["turn"], token=s["token"],
                                     reserver=s["parent"])
        self._retire_gone_tokens(before)
        self._child_may_act(s)

    def _child_may_act(self, s):
        row = core.find_row(self.L.queue, s["task"], s["turn"])
        if (row is not None and self.procs(s["child"]) == "matching" and row.owner == s["child"]
                and row.state == "waiting"):
            self.acting[s["child"]] = (s["task"], s["turn"])

    @precondition(lambda self: self.spawns)
    @rule(data=st.data())
    def child_takes_over(self, data):
        s = data.draw(st.sampled_from(self.spawns))
        if self.procs(s["child"]) != "matching" or s["child"] in self.acting:
            return
        before = self._tokens_now()
        try:
            take_over_locked(self.L, s["task"], s["turn"], s["token"], s["child"])
        except core.QueueError:
            self.procs.kill(s["child"])     # refused: the child exits
            return
        finally:
            self._retire_gone_tokens(before)
        self.acting[s["child"]] = (s["task"], s["turn"])

    @precondition(lambda self: self.spawns)
    @rule(data=st.data())
    def parent_releases(self, data):
        s = data.draw(st.sampled_from(self.spawns))
        before = self._tokens_now()
        if core.release_runner_slot(self.L.queue, task_id=s["task"], turn_id=s["turn"], token=s["token"],
                                    reserver=s["parent"]):
            self.procs.kill(s["child"])     # the spawn failed: no child
        self._retire_gone_tokens(before)

    @precondition(lambda self: self.procs.alive)
    @rule(data=st.data())
    def crash(self, data):
        victim = data.draw(st.sampled_from(sorted(self.procs.alive, key=lambda p: p.pid)))
        self.procs.kill(victim)
        self.acting.pop(victim, None)

    @rule()
    def reconcile(self):
        me = self.procs.spawn()
        before = self._tokens_now()
        starts = reconcile_plan(self.L, me, CAP, {}, self.token)
        self._retire_gone_tokens(before)
        for task, turn, token in starts:
            self.spawns.append(dict(task=task, turn=turn, token=token, parent=me, child=self.procs.spawn()))
        self.procs.kill(me) if not starts else None

    @precondition(lambda self: self.acting)
    @rule(data=st.data())
    def runner_finishes_turn(self, data):
        runner = data.draw(st.sampled_from(sorted(self.acting, key=lambda p: p.pid)))
        task, turn = self.acting[runner]
        row = core.find_row(self.L.queue, task, turn)
        if row is not None and row.state == "waiting" and row.owner == runner:
            core.begin_dispatch(self.L.queue, task_id=task, turn_id=turn, me=runner, worker="mini-1")
        row = core.find_row(self.L.queue, task, turn)
        if row is None or row.dispatch_owner != runner:
            return
        before = self._tokens_now()
        core.finish_turn(self.L.queue, task_id=task, turn_id=turn, me=runner)
        nxt = next_parked_locked(self.L, runner, CAP, {}, self.token, task)
        self._retire_gone_tokens(before)
        if nxt is None:
            del self.acting[runner]
            self.procs.kill(runner)         # nothing parked: the runner exits
        else:
            self.acting[runner] = nxt

    # -- invariants -----------------------------------------------------------------------

    def _live_acting(self):
        out = {}
        for ident, key in self.acting.items():
            if self.procs(ident) != "matching":
                continue
            row = core.find_row(self.L.queue, *key)
            if row is None or ident not in (row.owner, row.dispatch_owner):
                continue
            out[ident] = key
        return out

    @invariant()
    def never_more_live_runners_than_the_cap(self):
        if hasattr(self, "L"):
            live = self._live_acting()
            assert len(live) <= CAP, (live, self.L.queue)

    @invariant()
    def never_two_live_runners_for_one_turn(self):
        if hasattr(self, "L"):
            keys = list(self._live_acting().values())
            assert len(keys) == len(set(keys)), keys

    @invariant()
    def tokens_never_reused(self):
        if hasattr(self, "L"):
            assert len(set(self.issued)) == len(self.issued)
            current = set(self._tokens_now().values())
            assert not (current & self.retired), (current & self.retired)

    @invariant()
    def fifo_preserved(self):
        if hasattr(self, "L"):
            assert self.enqueue_order == sorted(self.enqueue_order)
            rows = core.fifo(self.L.queue)
            stamps = [r.enqueued_at_millis for r in rows]
            assert stamps == sorted(stamps)
            assert len({r.queue_id for r in rows}) == len(rows)


Reservations.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
test_reservation_protocol_state_machine = Reservations.TestCase
