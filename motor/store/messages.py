"""The store actor's messages (motor/store/actor.py) and how a save becomes the rows
`Database.save_many` writes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..records import Event, JobRecord


@dataclass(frozen=True)
class Save:
    """Upsert `record` and append `events` atomically; reply: the events with their seqs."""

    record: JobRecord
    events: Sequence[Event] = ()
    log_offset: int | None = None
    retain_until_ms: int | None = None
    #: write only the record's queue-wait clock (`ClockSave`: no events, issue 14)
    clock_only: bool = False


@dataclass(frozen=True)
class SaveMany:
    """Several saves in one transaction (all or none); reply: each one's stamped events."""

    saves: tuple[Save, ...]


def writes_of(msg: Save | SaveMany) -> list[tuple]:
    saves = msg.saves if isinstance(msg, SaveMany) else (msg,)
    return [(s.record, (), None, None, True) if s.clock_only else
            (s.record, s.events, s.log_offset, s.retain_until_ms) for s in saves]


def answers_of(msgs: list, stamped: list) -> list:
    """Each message's answer, from the stamped events of all their writes in order."""
    answers, at = [], 0
    for msg in msgs:
        if isinstance(msg, SaveMany):
            answers.append(stamped[at:at + len(msg.saves)])
            at += len(msg.saves)
        else:
            answers.append(stamped[at])
            at += 1
    return answers


def is_save(msg) -> bool:
    return isinstance(msg, (Save, SaveMany))


@dataclass(frozen=True)
class Expire:
    now_ms: int
