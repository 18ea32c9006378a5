"""The api actor: hosts the HTTP server (Unix socket, optional TCP) inside the tree.

It is the last child of the runner's supervisor: it starts accepting requests only once
every other subsystem is up, and it is the first to stop on shutdown. It is handed the
`Runner` facade (which speaks to the subsystems through their typed handles) when it is
made: its factory runs when the tree starts, after motor/runner/tree.py built the facade.
"""

from __future__ import annotations

import actors

from .app import make_app
from .server import serve_api


class ApiActor(actors.Actor):
    def __init__(self, runner):
        super().__init__(name="api")
        self.runner = runner

    async def on_start(self):
        await self.nursery.start(serve_api, make_app(self.runner), self.runner.config)

    async def handle(self, msg):
        raise TypeError(f"api: unknown message {msg!r}")
