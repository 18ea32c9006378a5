"""Task client fixtures: process identities whose liveness the test controls."""

from __future__ import annotations

import uuid

import pytest

from motor.tasks.records import ProcessIdentity


class Processes:
    """An injected liveness oracle: identities are alive until the test kills them.
    `observe(identity)` answers like motor.tasks.store.observe_process."""

    def __init__(self) -> None:
        self._next = 1000
        self.alive: set[ProcessIdentity] = set()
        self.ambiguous: set[ProcessIdentity] = set()

    def spawn(self) -> ProcessIdentity:
        ident = ProcessIdentity(pid=self._next, start_time_micros=self._next * 1000 + 7)
        self._next += 1
        self.alive.add(ident)
        return ident

    def kill(self, ident: ProcessIdentity) -> None:
        self.alive.discard(ident)
        self.ambiguous.discard(ident)

    def recycle(self, ident: ProcessIdentity) -> ProcessIdentity:
        """The pid is reused by another process (a different start time)."""
        self.kill(ident)
        other = ProcessIdentity(pid=ident.pid, start_time_micros=ident.start_time_micros + 1)
        self.alive.add(other)
        return other

    def __call__(self, ident: ProcessIdentity) -> str:
        if ident in self.ambiguous:
            return "ambiguous"
        if ident in self.alive:
            return "matching"
        if any(a.pid == ident.pid for a in self.alive):
            return "mismatch"
        return "gone"


class Tokens:
    """Fresh v4 tokens, remembering every one handed out."""

    def __init__(self) -> None:
        self.issued: list[uuid.UUID] = []

    def __call__(self) -> uuid.UUID:
        token = uuid.uuid4()
        self.issued.append(token)
        return token


@pytest.fixture
def procs() -> Processes:
    return Processes()


@pytest.fixture
def tokens() -> Tokens:
    return Tokens()
