"""The api actor: hosts the HTTP server (Unix socket, optional TCP) inside the tree.

It is the last child of the runner's supervisor: it starts accepting requests only once
every other subsystem is up, and it is the first to stop on shutdown. It is handed the
`Runner` facade (which speaks to the subsystems through their typed handles) when it is
made: its factory runs when the tree starts, after motor/runner/tree.py built the facade.
"""

from __future__ import annotations

import trio

import actors

from .app import make_app
from .server import serve_api


class ApiActor(actors.Actor):
    def __init__(self, runner):
        super().__init__(name="api")
        self.runner = runner
        self.app = None
        self._stop_serving = trio.Event()
        self._served = trio.Event()

    async def on_start(self):
        self.app = make_app(self.runner)
        await self.nursery.start(self._serve_http)

    async def _serve_http(self, task_status=trio.TASK_STATUS_IGNORED):
        try:
            await serve_api(self.app, self.runner.config, shutdown_trigger=self._stop_serving.wait,
                            task_status=task_status)
        finally:
            self._served.set()

    async def on_stop(self):
        """An orderly stop, before any other subsystem stops: the app says `connection:
        close` and ends its event streams, the listeners close, requests in flight are
        answered (the dispatcher and the store still run), idle connections are closed
        after a short grace (docs/protocol.md, "When the runner stops")."""
        if self.app is not None:
            self.app.stop()
        self._stop_serving.set()
        await self._served.wait()

    async def handle(self, msg):
        raise TypeError(f"api: unknown message {msg!r}")
