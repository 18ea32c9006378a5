"""The api actor: hosts the HTTP server (Unix socket, optional TCP) inside the tree.

It is the last child of the runner's supervisor: it starts accepting requests only once
every other subsystem is up, and it is the first to stop on shutdown.
"""

from __future__ import annotations

import actors

from .app import make_app
from .server import serve_api


class ApiActor(actors.Actor):
    def __init__(self, tree):
        super().__init__(name="api")
        self.tree = tree

    async def on_start(self):
        runner = self.tree.runner
        await self.nursery.start(serve_api, make_app(runner), runner.config)

    async def handle(self, msg):
        raise TypeError(f"api: unknown message {msg!r}")
