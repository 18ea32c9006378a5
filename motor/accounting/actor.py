"""The accounting actor: owns the Ledger; others cast facts to it.

Facts arrive as casts, sent with `notify` (never waits: a blocked or restarting accounting
actor drops the fact instead of delaying a start or a terminal record):
- `AdmissionRefused(code)`  dispatcher: a request refused before any record existed;
- `JobStarted(...)`         job actor: setup finished, the job runs (capacity wait at start);
- `JobEnded(record)`        job actor / dispatcher: the terminal record, as saved.

On start (runner start-up or a restart of this actor) the indexes are rebuilt once from the
retained records in the store; after that a `Report` (health probe) reads only the indexes.
The hourly queue-wait buckets are not rebuilt: they reset on restart.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import actors

from ..records import JobRecord
from .core import Ledger
from .host import HostSampler, RepositoryNames

log = logging.getLogger("motor.accounting")


@dataclass(frozen=True)
class AdmissionRefused:
    code: str


@dataclass(frozen=True)
class JobStarted:
    """Setup finished and the job runs; `queue_wait_ms` is its capacity wait at start."""

    job_id: str
    repository: str | None
    workspace: str
    claim: int
    started_at_ms: int
    queue_wait_ms: int


@dataclass(frozen=True)
class JobEnded:
    """The terminal record, as saved."""

    record: JobRecord

    @property
    def job_id(self) -> str:
        return self.record.job_id

    @property
    def state(self) -> str:
        return self.record.state


@dataclass(frozen=True)
class Report:
    """Reply: a dict of the ledger's figures at wall time `now_ms` (None: the actor's clock)."""

    now_ms: int | None = None


def notify(ref: Any, msg: Any) -> bool:
    """Cast `msg` to accounting without ever waiting; False (and a log line) if dropped."""
    if ref is None:
        return False
    try:
        ref.cast_nowait(msg)
        return True
    except (actors.InboxFull, actors.ActorDead) as exc:
        log.warning("accounting: dropped %s (%r)", type(msg).__name__, exc)
    except Exception:  # accounting must never cost a start or a terminal record
        log.exception("accounting: dropped %s", type(msg).__name__)
    return False


class AccountingActor(actors.Actor):
    inbox_size = 1024

    def __init__(self, db: Any = None, clock: Any = None, *,
                 host: HostSampler | None = None,
                 repository_of: Callable[[str | None], str] | None = None):
        super().__init__(name="accounting")
        self.db = db
        self.clock = clock
        self.host = host if host is not None else HostSampler()
        self.repository_of = repository_of or RepositoryNames()
        self.ledger = Ledger()

    async def on_start(self):
        if self.db is None:
            return
        name = self.repository_of
        self.ledger.rebuild(
            ((r, name(r.repository)) for r in self.db.iter_terminal()),
            ((r, name(r.repository)) for r in self.db.live()))
        log.debug("accounting: rebuilt from %d retained terminal records",
                  len(self.ledger.retained))

    immediate = (AdmissionRefused, JobStarted, JobEnded, Report)  # all of them: none waits

    def handle_now(self, msg):
        if isinstance(msg, AdmissionRefused):
            self.ledger.refused(msg.code)
        elif isinstance(msg, JobStarted):
            self.ledger.started(
                msg.job_id, repository=self.repository_of(msg.repository),
                workspace=msg.workspace, claim=msg.claim, started_at_ms=msg.started_at_ms,
                queue_wait_ms=msg.queue_wait_ms)
        elif isinstance(msg, JobEnded):
            self.ledger.ended(msg.record, self.repository_of(msg.record.repository))
        elif isinstance(msg, Report):
            now = msg.now_ms if msg.now_ms is not None else self._now()
            report = self.ledger.report(now)
            host = self.host.sample()
            if host is not None:
                report["host"] = host
            return report
        else:
            raise TypeError(f"accounting: unknown message {msg!r}")

    def _now(self) -> int:
        if self.clock is not None:
            return self.clock.now_ms()
        import time

        return time.time_ns() // 1_000_000
