"""A store actor that holds its first message, so tests can stage saves in its inbox."""

from __future__ import annotations

import trio

import actors
from motor.store.actor import StoreActor


class GatedStore(StoreActor):
    """The store actor, holding the first message it gets until `go` is set (every save
    through its inbox: none handled at once in the sender's task), then handling each as
    the actor's own task does (`handle_now`, and `handle` when it says LATER): the saves
    staged behind the first are taken from the inbox with it."""

    immediate = ()

    def __init__(self, db, hub):
        super().__init__(db, hub)
        self.go = trio.Event()

    async def handle(self, msg):
        await self.go.wait()
        result = self.handle_now(msg)
        return await super().handle(msg) if result is actors.LATER else result
