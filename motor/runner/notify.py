"""systemd's service notifications (sd_notify(3)) for `motor serve` under `Type=notify`.

- `READY=1` once the API accepts requests (systemctl start returns then, and units ordered
  after motor start only then);
- `STOPPING=1` when a stop begins;
- when the unit sets `WatchdogSec=` (systemd passes `WATCHDOG_USEC`, and `WATCHDOG_PID` for
  the process it means), `WATCHDOG=1` every half of that, but only while the dispatcher
  answers a capacity question within that half. A runner whose event loop is blocked (a
  call that never returns) or whose dispatcher no longer answers stops pinging, and systemd
  kills it (`WatchdogSignal`, SIGABRT by default) and starts a fresh one; its jobs keep
  running under keeperd and are adopted (`KillMode=process`). Without it such a runner looked
  alive to its service manager for good.

No library: the protocol is one datagram per message on the Unix socket named by
`NOTIFY_SOCKET` (a leading `@` is the abstract namespace). Without `NOTIFY_SOCKET` nothing is
sent. A send that fails is logged once and never stops the runner.

A send waits for room on trio's socket, never in a blocking call: while the service
manager reads nothing (PID 1 stalled), its queue fills, and a blocking `sendto` then held
the whole event loop (before stop 67: with `WatchdogSec` 20 ms and a manager that read
nothing, the runner stopped answering after 8 s and ignored SIGTERM). `READY=1` waits up
to `READY_TIMEOUT_S` (the runner serves meanwhile), a ping up to half the watchdog period,
`STOPPING=1` up to `SEND_TIMEOUT_S`; what is not taken by then is dropped, said once.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Awaitable, Callable, Mapping

import trio

log = logging.getLogger("motor.runner")

#: how long `READY=1` may wait for the service manager to take it (the runner serves meanwhile)
READY_TIMEOUT_S = 30.0
#: ... and any other notification
SEND_TIMEOUT_S = 1.0


class Notifier:
    """Datagrams to systemd's notification socket."""

    def __init__(self, address: str):
        self.address = "\0" + address[1:] if address.startswith("@") else address
        self.sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._failed = False

    async def send(self, *lines: str, timeout: float = SEND_TIMEOUT_S) -> bool:
        """One datagram of `lines`, waiting up to `timeout` s for room in the manager's
        queue without holding the loop; whether it went."""
        with trio.move_on_after(timeout):
            try:
                await self.sock.sendto("\n".join(lines).encode(), self.address)
                return True
            except OSError as exc:
                self._said(str(exc))
                return False
        self._said(f"it took no notification for {timeout:g} s ({lines[0]} dropped)")
        return False

    def _said(self, why: str) -> None:
        if not self._failed:
            self._failed = True
            log.warning("runner: cannot notify the service manager at %s: %s",
                        self.address.replace("\0", "@"), why)

    def close(self) -> None:
        self.sock.close()


#: systemd's variables for the service's main process: read once, then taken out of the
#: runner's environment, which is the base of every job's (a job that runs a daemon of its
#: own must not find them; sd_notify(3)'s `unset_environment`)
SYSTEMD_VARIABLES = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def take_from_environ(environ=os.environ) -> tuple[Notifier | None, float | None]:
    """The notifier and the watchdog period of this process (`notifier`, `watchdog_s`), its
    systemd variables removed from `environ`."""
    mine = {name: environ.pop(name) for name in SYSTEMD_VARIABLES if name in environ}
    return notifier(mine), watchdog_s(mine)


def notifier(environ: Mapping[str, str] = os.environ) -> Notifier | None:
    address = environ.get("NOTIFY_SOCKET")
    return Notifier(address) if address else None


def watchdog_s(environ: Mapping[str, str] = os.environ) -> float | None:
    """The unit's WatchdogSec in seconds when it applies to this process, else None."""
    try:
        usec = int(environ.get("WATCHDOG_USEC", ""))
        pid = environ.get("WATCHDOG_PID")
        if usec <= 0 or (pid and int(pid) != os.getpid()):
            return None
    except ValueError:
        return None
    return usec / 1_000_000


async def keep_watchdog(notify: Notifier, period_s: float,
                        probe: Callable[[], Awaitable[object]]) -> None:
    """Ping every `period_s / 2` while `probe()` answers within that time (an error, such as
    a dispatcher between two incarnations, is no answer)."""
    half = period_s / 2
    while True:
        started, why = trio.current_time(), None
        with trio.move_on_after(half) as waited:
            try:
                await probe()
            except Exception as exc:  # noqa: BLE001 - said, and no ping this time
                why = repr(exc)
        if waited.cancelled_caught:
            why = f"no answer within {half:.3g} s"
        if why is None:
            await notify.send("WATCHDOG=1", timeout=max(0.0, started + half - trio.current_time()))
        else:
            log.warning("runner: the dispatcher did not answer (%s): no watchdog ping (systemd "
                        "restarts the runner after WatchdogSec %.3g s without one)", why, period_s)
        await trio.sleep_until(started + half)
