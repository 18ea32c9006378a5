"""The dispatcher actor (the seed's "state lock", one serializing actor): a thin shell.

Every admission, start, end, cancel and withdraw passes through it one at a time; machine.py
decides (a pure `handle(event, now, wall_ms) -> [effects]`), this shell carries the effects
out through the typed handles; the views and a running job's cancel are answered between
(`readers`). The disk is asked by a task of its own unless idle (docs/scheduling.md)."""

from __future__ import annotations

import contextlib
import logging
import math

import trio

import actors

from ..clock import uuid7
from ..lifecycle import QUEUED
from ..records import Refusal
from . import effects as fx
from . import machine as m
from .admission import AdmissionSettings
from .effects import DispatchDeps  # noqa: F401 (the runner's tree imports it from here)
from .messages import (DISK_ADMIT_TIMEOUT_S, BundleArrived, CancelJob, CapacityView,
                       CeilingChanged, Finished, Heartbeat, QueuedViews, SetupDone, StartFailed,
                       StatusView, Submit, Unfollowed, Withdraw)

log = logging.getLogger("motor.dispatcher")


#: the messages that are the machine's events as they are
_AS_IS = (SetupDone, Finished, CancelJob, Unfollowed, BundleArrived, QueuedViews, Heartbeat,
          StatusView, m.DiskAnswered, m.TimerFired, m.FlushUnsaved)


class Dispatcher(actors.Actor):
    inbox_size = 512
    #: handled in the sender's task while the dispatcher is idle (`handle_now`, issue 14); not
    #: a Submit (a client submitting in a loop yields to the jobs it starts: docs/scheduling.md)
    #: nor its own follow-ups (DiskAnswered, TimerFired, FlushUnsaved)
    immediate = (SetupDone, Finished, StartFailed, CancelJob, Withdraw, Unfollowed,
                 BundleArrived, CeilingChanged)
    readers = (CapacityView, StatusView, QueuedViews, Heartbeat, CancelJob)  # also while saving

    def __init__(self, deps: DispatchDeps):
        super().__init__(name="dispatcher")
        self.deps, self.job, config = deps, deps.job, deps.job.config
        settings = AdmissionSettings.from_config(
            config, claim_limit=deps.claim_limit, capabilities=deps.capabilities,
            floor_bytes=config.floor_bytes())
        self.machine = m.DispatchMachine.new(settings, confined_cpu_list=config.linux_cpus,
                                             ceiling=deps.ceiling, clock_save_s=config.clock_save_s)
        self._asks_in, self._asks = trio.open_memory_channel[m.AskDisk](math.inf)
        self._timer: trio.CancelScope | None = None
        self._wakeup, self._answer = math.inf, None  # _answer: the reply to the current message
        self._asking = 0  # disk admissions handed to `_disk_asker`, not answered yet
        self._ride: list | None = None  # a Finished's ride (messages.py) until saved
        self._recovered = False  # the machine holds the recovered jobs: views read from then

    async def on_start(self):
        deps, records = self.deps, tuple(self.deps.job.records.live())
        await deps.job.cpu.keep_only_recorded(records)  # a predecessor's unsaved starts
        shas = {r.bundle_sha256 for r in records if r.state == QUEUED and r.bundle_sha256}
        present = {sha for sha in shas if await deps.disk.has_bundle(sha)}
        self.nursery.start_soon(self._timer_loop)
        self.nursery.start_soon(self._disk_asker)
        await self._run(m.Recover(records, deps.execution.jobs(), present, set(deps.followers)))
        self._recovered = True
        if (queued := len(self.machine.queued)) + (active := len(self.machine.active)):
            log.info("dispatcher: recovered %d queued and %d running jobs", queued, active)

    async def on_stop(self):  # the queue-wait clocks changed since the last clock save
        with contextlib.suppress(actors.ActorDead, actors.CallTimeout):
            await self._run(m.FlushClocks())

    def read(self, msg):  # the machine is whole wherever `_run` waits, once recovered
        if not self._recovered and not isinstance(msg, CapacityView):
            return actors.LATER  # a view before recovery would miss the recovered jobs
        if isinstance(msg, CancelJob):  # a running job's: at once (effects.py)
            return fx.cancel_running(self.machine, msg.job_id, self.job, self.deps.execution)
        return self.machine.view(msg, trio.current_time(), self.job.clock.now_ms())

    def handle_now(self, msg):
        """A message, in its sender's task when this actor is idle: the effects carried out
        at once while each can be (the store commits on the loop, the allocator and the
        execution supervisor idle); the rest in this actor's own task, next (`effects.Resume`)."""
        self._answer, pending = None, []
        if (waits := self._advance(self._event(msg), pending)) is not None:
            token = self.defer_reply() if self.answering else None
            self.handle_next(fx.Resume([*pending, waits], token))  # before any other message
            return None
        return self._answer

    async def handle(self, msg):
        self._answer = None
        if isinstance(msg, fx.Resume):
            await self._run(None, msg.pending)
            if msg.token is not None:
                msg.token.reply(self._answer)
            return None
        await self._run(self._event(msg))
        return self._answer

    def _event(self, msg):
        self._ride = [msg.ride] if isinstance(msg, Finished) and msg.ride is not None else None
        if isinstance(msg, _AS_IS):
            return msg
        if isinstance(msg, Submit):  # answered once the disk has answered (DiskAnswered)
            return m.SubmitReceived(self.defer_reply(), msg.request, msg.follow, uuid7(  # (and
                self.job.clock.now_ms()), self.job.records.keyed(msg.request))  # its key's job)
        if isinstance(msg, StartFailed):
            return m.JobStartFailed(msg.job_id, msg.detail, msg.cleanup_pending,
                                    self.job.records.get(msg.job_id))
        if isinstance(msg, Withdraw):
            return m.WithdrawJob(msg.job_id, self.job.records.get(msg.job_id))
        if isinstance(msg, CeilingChanged):
            self.deps.ceiling = msg.ceiling  # a restarted dispatcher starts from it
            return msg
        raise TypeError(f"dispatcher: unknown message {msg!r}")

    async def _run(self, event, pending=None) -> None:
        """Hand `event` to the machine and carry out its effects in order (`pending`: those
        left by `handle_now`), waiting for those that must wait."""
        pending = [] if pending is None else pending
        while (waits := self._advance(event, pending)) is not None:
            event = await fx.wait(waits, self.job, self.deps.execution, self._ride)

    def _advance(self, event, pending: list):
        """Hand `event` to the machine and carry out the effects at once, each answer back
        to the machine before the next effect (depth first), until none is left (None) or
        one would wait: that effect, taken off `pending`."""
        while True:
            if event is not None:
                pending.extend(reversed(self.machine.handle(
                    event, trio.current_time(), self.job.clock.now_ms())))
            if not pending:
                return None
            effect = pending.pop()
            if (event := self._do_now(effect)) is fx.NOT_NOW:
                return effect

    def _do_now(self, effect):
        """Carry `effect` out without waiting (effects.py): its answer for the machine, or
        effects.NOT_NOW."""
        answer = fx.now(effect, self.job, self.deps.execution, self._ride)
        if answer is not fx.NOT_HERS:
            return answer
        if isinstance(effect, m.Reply):
            if effect.token is None:  # a Finished with a ride answers whether it went along
                self._answer = effect.value if self._ride is None else not self._ride
            else:
                effect.token.reply(effect.value)
        elif isinstance(effect, m.AskDisk):
            refusal = actors.LATER if self._asking or effect.bundle_sha256 else (  # none before
                self.deps.disk.admit_now(effect.job_id, effect.workspace, effect.siblings))
            if refusal is not actors.LATER:  # the disk answered at once: no round trip
                return m.DiskAnswered(effect.job_id, refusal, True)
            self._asking += 1
            self._asks_in.send_nowait(effect)
        elif isinstance(effect, m.ArmTimer):
            self._wakeup = math.inf if effect.deadline is None else effect.deadline
            if self._timer is not None:
                self._timer.deadline = self._wakeup
        elif isinstance(effect, m.ArmFlush):
            self.nursery.start_soon(self._flush_later, effect.delay_s)
        elif isinstance(effect, m.Continue):
            return effect.event
        else:
            raise TypeError(f"dispatcher: unknown effect {effect!r}")
        return None

    async def _disk_asker(self):
        """Disk admissions one at a time, in arrival order; each answer comes back as a message."""
        async for ask in self._asks:
            try:
                refusal = await self.deps.disk.admit(ask.job_id, ask.workspace, ask.siblings,
                                                     timeout=DISK_ADMIT_TIMEOUT_S)
                present = (ask.bundle_sha256 is None or refusal is not None
                           or await self.deps.disk.has_bundle(ask.bundle_sha256))
            except (actors.CallTimeout, actors.ActorDead) as exc:
                refusal, present = Refusal(code="runner_disk_full", detail=(
                    f"disk admission did not complete ({exc}); retry later")), False
            self._asking -= 1
            await self.cast_self(m.DiskAnswered(ask.job_id, refusal, present))

    async def _timer_loop(self):
        while True:
            with trio.CancelScope(deadline=self._wakeup) as self._timer:
                await trio.sleep_forever()
            self._timer = None
            if trio.current_time() >= self._wakeup:
                self._wakeup = math.inf
                await self.cast_self(m.TimerFired())  # also while on_start still runs

    async def _flush_later(self, delay_s: float) -> None:
        await trio.sleep(delay_s)
        await self.cast_self(m.FlushUnsaved())

