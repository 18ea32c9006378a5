"""Shared test actors (module name is unique to avoid rootdir import clashes)."""

from __future__ import annotations

import trio

import actors


class Boom(Exception):
    pass


class Echo(actors.Actor):
    """Replies with the message; 'crash' raises Boom; 'stop' stops; ('wait', ev) blocks."""

    def __init__(self, *, log: list | None = None, **kw):
        super().__init__(**kw)
        self.log = log if log is not None else []
        self.raised: list[BaseException] = []

    async def on_start(self):
        self.log.append(("start", self.name))

    async def handle(self, msg):
        if msg == "crash":
            exc = Boom(self.name)
            self.raised.append(exc)
            raise exc
        if msg == "stop":
            self.stop()
            return "stopping"
        if isinstance(msg, tuple) and msg[0] == "wait":
            await msg[1].wait()
            return "waited"
        if isinstance(msg, tuple) and msg[0] == "sleep":
            await trio.sleep(msg[1])
            return "slept"
        return msg

    async def on_stop(self):
        self.log.append(("stop", self.name))


class Factory:
    """Child factory that remembers every incarnation it made."""

    def __init__(self, cls=Echo, **kw):
        self.cls = cls
        self.kw = kw
        self.made: list = []

    def __call__(self):
        inst = self.cls(**self.kw)
        self.made.append(inst)
        return inst
