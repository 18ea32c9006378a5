"""open_runner: the runner's supervisor tree, and the `Runner` facade over it.

host.py holds start-up's host reads (state dir, lock, probe), tree.py the tree wiring,
facade.py the `Runner` embedding API; `serve_forever` (below) is `motor serve`.

```
runner (one_for_one)
├── store        StoreActor        sole writer of records and events (SQLite)
├── cpu          CpuActor          placement state
├── disk         DiskActor         free-space admission
├── accounting   AccountingActor   refusal and end counts for health
├── execution    (dynamic)         one JobExecution per job setting up or running
├── dispatcher   Dispatcher        queue, permits, start/end/cancel/withdraw
├── maintenance  Maintenance       retention pass every minute
└── api          ApiActor          HTTP on the Unix socket (only under `serve`)
```
Each subsystem is its own supervisor with its actor as child, so a crash restarts only that
actor (rebuilding its state from the store). A crash loop escalates to the root, which
never restarts a subsystem: the runner stops (`serve` exits 3) and the service manager
starts a fresh one.
Children start in this order and stop in reverse: the API stops accepting first, the
store closes last.
"""

from __future__ import annotations

import gc
import logging
import signal

import trio

from .. import faults, logsink
from ..config import RunnerConfig
from ..lifecycle import RETENTION_MS
from .facade import Runner
from .host import Host, StartupError, StateDirLock, check_database_present, probe_host
from .notify import READY_TIMEOUT_S, keep_watchdog, take_from_environ
from .tree import SUBSYSTEM_INTENSITY, SUBSYSTEM_PERIOD_S, open_runner

__all__ = [
    "Host", "RETENTION_MS", "Runner", "StartupError", "StateDirLock", "SUBSYSTEM_INTENSITY",
    "SUBSYSTEM_PERIOD_S", "check_database_present", "open_runner", "probe_host", "serve_forever",
    "tune_collector",
]

log = logging.getLogger("motor.runner")


# -- serve -----------------------------------------------------------------------------------


#: `motor serve`'s collector thresholds (Python's default: 700, 10, 10)
GC_THRESHOLDS = (10_000, 10, 10)


def tune_collector() -> None:
    """The cyclic garbage collector of a long-running runner (issue 14), set once the tree
    is up: what lives then (the modules, the queue recovered from the store) is frozen out
    of every collection, and a young collection comes after 10,000 new containers, not 700.
    With 10,000 queued jobs a full collection walked every record, 60-70 ms each, four of
    them while the queue filled; with these settings none came in that run, and the time
    spent collecting fell from about 400 to about 150 ms (docs/performance-history.md). Only
    `motor serve` does this: an embedding program's collector is its own."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


#: The signals that stop `motor serve` in order, and the exit status each leaves: SIGHUP
#: (its terminal hung up, or a `kill -HUP` meant as a reload) stops it as SIGTERM does,
#: then exits 129 (128 + SIGHUP, what its default action left, without the orderly stop),
#: so a service manager that restarts on failure starts it again.
STOP_SIGNALS = {signal.SIGINT: 0, signal.SIGTERM: 0, signal.SIGHUP: 128 + signal.SIGHUP}


async def serve_forever(config: RunnerConfig) -> int:
    """`motor serve`: run the tree with the API until a stop signal (STOP_SIGNALS), and
    the exit status it leaves; under systemd's `Type=notify`, say ready and stopping, and
    keep its watchdog (notify.py)."""
    notify, period = take_from_environ()
    with trio.open_signal_receiver(*STOP_SIGNALS) as signals:
        async with open_runner(config, api=True) as runner, trio.open_nursery() as nursery:
            tune_collector()
            logsink.say(f"motor: listening on {config.socket_path}"  # never from the loop
                        + (f" and http://{config.listen}" if config.listen else "")
                        + f" (state {config.state_path}, isolation {runner.host.backend.name},"
                        f" max_weight {config.max_weight}, claim limit {runner.host.claim_limit})")
            if notify is not None:
                await notify.send("READY=1", f"STATUS=serving on {config.socket_path}",
                                  timeout=READY_TIMEOUT_S)
                if period is not None:
                    nursery.start_soon(keep_watchdog, notify, period,
                                       runner.handles.dispatcher.capacity)
            await faults.ahit("runner.serving")  # tests: a failure nothing restarts
            async for signum in signals:
                log.info("runner: %s, stopping (running jobs keep running)",
                         signal.Signals(signum).name)
                break
            nursery.cancel_scope.cancel()  # the watchdog pings no more
            if notify is not None:
                with trio.CancelScope(shield=True):  # (this scope is cancelled): bounded
                    await notify.send("STOPPING=1")
                notify.close()
    return STOP_SIGNALS[signum]
