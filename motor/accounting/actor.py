"""The accounting actor: owns the Ledger; others cast facts to it."""

from __future__ import annotations

from dataclasses import dataclass

import actors

from .core import Ledger


@dataclass(frozen=True)
class AdmissionRefused:
    code: str


@dataclass(frozen=True)
class JobEnded:
    job_id: str
    state: str


@dataclass(frozen=True)
class Report:
    """Reply: a dict of the ledger's figures."""


class AccountingActor(actors.Actor):
    inbox_size = 1024

    def __init__(self):
        super().__init__(name="accounting")
        self.ledger = Ledger()

    async def handle(self, msg):
        if isinstance(msg, AdmissionRefused):
            self.ledger.refused(msg.code)
        elif isinstance(msg, JobEnded):
            self.ledger.ended(msg.state)
        elif isinstance(msg, Report):
            return {
                "admission_refusals": dict(self.ledger.admission_refusals),
                "finished": dict(self.ledger.finished),
            }
        else:
            raise TypeError(f"accounting: unknown message {msg!r}")
