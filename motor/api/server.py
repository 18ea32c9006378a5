"""Serve the ASGI app with hypercorn's trio worker on the runner's Unix socket (and TCP).

`serve_api(app, config)` claims the socket path (a live runner there is an error, a stale
socket file is removed), binds `unix:<socket>` plus `config.listen` when set, sets the
socket's mode (0600, or 0660 and the group when `socket_group` is set), and reports
`task_status.started(binds)` only once the socket accepts connections.
"""

from __future__ import annotations

import grp
import logging
import os
import socket
import stat
from pathlib import Path
from typing import Any, Awaitable, Callable

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from motor.config import ConfigError, RunnerConfig

log = logging.getLogger("motor.api.server")


class SocketInUse(RuntimeError):
    """Another runner answers on the socket path."""


def resolve_group(name: str) -> int:
    """A group name or number -> gid; ConfigError when unknown."""
    if name.isdigit():
        return int(name)
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise ConfigError(f"--socket-group: no group named {name!r}") from None


async def claim_socket_path(path: Path, *, connect_timeout: float = 2.0) -> None:
    """Make `path` free to bind: raise SocketInUse when a live runner answers there,
    unlink it when it is a stale socket (connect refused), refuse anything else."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise SocketInUse(f"{path} exists and is not a socket; refusing to replace it")
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with trio.move_on_after(connect_timeout) as scope:
            try:
                await sock.connect(str(path))
            except (ConnectionRefusedError, FileNotFoundError):
                log.info("removing stale socket %s", path)
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
                return
        if scope.cancelled_caught:
            # It exists and a connect neither succeeded nor was refused: someone owns it.
            raise SocketInUse(f"another runner is listening on {path} (connect timed out)")
        raise SocketInUse(f"another runner is listening on {path}")
    finally:
        sock.close()


def hypercorn_config(config: RunnerConfig) -> HypercornConfig:
    hc = HypercornConfig()
    hc.bind = [f"unix:{config.socket_path}"]
    if config.listen:
        hc.bind.append(config.listen)
    # Bind under a umask so the socket never exists with a wider mode than wanted.
    hc.umask = 0o117 if config.socket_group else 0o177
    hc.accesslog = None  # quiet: no access log
    hc.errorlog = logging.getLogger("motor.api.hypercorn")
    hc.include_server_header = False
    hc.graceful_timeout = 3.0
    return hc


async def serve_api(
    app: Any,
    config: RunnerConfig,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `app` until cancelled or until `shutdown_trigger()` returns (graceful).

    Raises SocketInUse (another runner answers on the socket) and ConfigError (unknown
    socket group).  `task_status.started(binds)` gets the bound addresses, e.g.
    `["http://unix:/run/motor.sock", "http://127.0.0.1:8080"]`, once they accept
    connections.  The socket file is removed on the way out when it is still ours.
    """
    path = config.socket_path
    gid = resolve_group(config.socket_group) if config.socket_group else None
    path.parent.mkdir(parents=True, exist_ok=True)
    await claim_socket_path(path)
    hc = hypercorn_config(config)
    trigger = shutdown_trigger if shutdown_trigger is not None else trio.sleep_forever
    inode = None
    try:
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(
                lambda task_status: hypercorn_serve(
                    app, hc, shutdown_trigger=trigger, task_status=task_status, mode="asgi"
                )
            )
            inode = os.stat(path).st_ino
            if gid is not None:
                os.chown(path, -1, gid)
                os.chmod(path, 0o660)
            else:
                os.chmod(path, 0o600)
            task_status.started(binds)
    finally:
        try:
            if inode is not None and os.stat(path).st_ino == inode:
                os.unlink(path)
        except OSError:
            pass
