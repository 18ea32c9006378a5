"""Fault injection at named points, for tests and bench scripts (off unless configured).

`MOTOR_FAULTS` is a comma-separated list of `POINT=ACTION`:

- `POINT=kill`         the runner process kills itself with SIGKILL there (a crash);
- `POINT=kill:P`       the same with probability P (0..1) at each pass (a restart storm);
- `POINT=wait:PATH`    the runner creates `PATH.reached`, then waits until `PATH` exists
                       (an explicit barrier a test releases by creating the file);
- `POINT=raise`        the code raises FaultInjected there (an error nothing expected);
- `POINT=sleep:S`      the process sleeps S real seconds there at each pass, blocking (in
                       async code its event loop with it): a slow or loaded host, for load
                       probes (docs/actors.md, "Real work under autojump");
- `actor.NAME=crash`   the subsystem NAME starts normally, then its actor raises
                       FaultInjected on every message it handles (a crash loop that its
                       supervisor gives up on; motor/runner/tree.py).

Named points (each documented where it is hit):

- `runner.serving`     `motor serve` is serving (its socket bound, systemd told it is
                       ready), outside every supervisor (motor/runner/__init__.py): `raise`
                       there is a runner that fails where nothing restarts it;
- `setup.look`         a job's actor is about to look in its job directory before the
                       set-up (every start but a `fresh` one: motor/execution/actor.py);
- `setup.begin`        a job's setup, before the disk check (motor/execution/actor.py);
- `setup.spawned`      the forkserver reported the keeper's pid (motor/execution/actor.py);
- `forkserver.forked`  the keeper is forked, its claim (keeper.json) not yet written;
- `forkserver.claimed` the claim is written, the keeper not yet released
                       (both motor/execution/forkserver.py; they kill the forkserver);
- `keeper.spawned`     the job runs, keeper.json does not yet carry its pid;
- `keeper.status`      the job ended, status.json is not yet written
                       (both motor/execution/keeper.py; they kill the keeper).
  Under keeperd (motor/execution/keeperd.py) the same four names mark the same steps of
  the start protocol in keeperd: `forkserver.forked` the spawn request is in, no claim yet;
  `forkserver.claimed` the claim is written, the job not spawned; `keeper.spawned` and
  `keeper.status` as above. There they pause or kill keeperd, i.e. every job it keeps;
- `keeperd.kill_trees` keeperd has read the processes below a job's escapees (the job
                       ended, or it kills one orphaned after the end), not yet killed them
                       (motor/execution/keeperd.py): a `wait:` there stages a fork that the
                       read missed;
- `release.begin`      a job's terminal record is written, its isolation groups or units
                       not yet removed (motor/execution/messages.py, `release_isolation`);
- `unpack.extracted`   a bundle is fully extracted into its staging directory, before its
                       entries move into the workspace (motor/disk/bundles.py);
- `disk.walk`          the disk actor's walk of workspaces (their sizes) begins, in a
                       worker thread (motor/disk/host.py);
- `disk.guard`         the build-folder guard's walk of workspaces jobs left begins
                       (motor/disk/walking.py, off the disk actor's turn; host.py
                       `Trees.guard`, in it: a `JobIdle` call);
- `disk.staging`       the disk actor's start-up sweep of bundle staging leftovers
                       begins, in a worker thread (motor/disk/host.py);
- `disk.sweep`         a workspace's daily sweep scans its Cargo units (motor/disk/host.py
                       `stale_scans`), in a maintenance pass's walk, in a worker thread;
- `disk.purge`         a tree moved into a workspace root's trash is about to be deleted
                       (motor/disk/trash.py): by a cleanup in the disk actor's turn, or by
                       the trash's collection in a maintenance pass's walk, off it;
- `api.bind`           the API's Unix socket is bound at its hidden name with its mode,
                       not yet listening nor linked at its path (motor/api/server.py
                       `bind_listening`; the event loop waits there: at a start, nothing
                       else is served yet);
- `api.accepting_stopped` the runner is stopping: the API's accept loop has stopped, the
                       socket file is still there, the connections queued in the kernel
                       not yet taken (motor/api/server.py);
- `api.submitted`      a single submit is accepted and recorded, its answer not yet sent
                       (motor/api/app.py): `kill` there is a runner that crashes between
                       accepting a job and saying so (docs/protocol.md, "Idempotent submits");
- `store.expire`       the store is about to delete a batch of expired jobs (in a worker
                       thread: motor/store/db.py `expire`);
- `store.commit`       the store is about to write a transaction (motor/store/actor.py, on
                       the event loop or in a worker thread: where commits run then): a
                       `wait:` barrier there is a disk that stalls a commit.

Without the variable every point is a no-op costing one environment lookup.
"""

from __future__ import annotations

import os
import random
import signal
import time

ENV = "MOTOR_FAULTS"
POLL_S = 0.01


def action(point: str) -> str | None:
    spec = os.environ.get(ENV)
    if not spec:
        return None
    for item in spec.split(","):
        name, sep, act = item.strip().partition("=")
        if sep and name == point:
            return act
    return None


def _begin(point: str) -> str | None:
    act = action(point)
    if act is None:
        return None
    if act == "kill" or (act.startswith("kill:") and random.random() < float(act[5:])):
        os.kill(os.getpid(), signal.SIGKILL)
    if act.startswith("kill:"):
        return None
    if act.startswith("sleep:"):
        try:
            seconds = float(act[len("sleep:"):])
        except ValueError:
            raise ValueError(f"{ENV}: {act!r} at {point}: not a number of seconds") from None
        time.sleep(seconds)
        return None
    if act == "raise":
        raise FaultInjected(f"{ENV}: fault injected at {point}")
    if act.startswith("wait:"):
        gate = act[len("wait:"):]
        with open(gate + ".reached", "a"):
            pass
        return gate
    raise ValueError(f"{ENV}: unknown action {act!r} at {point}")


class FaultInjected(RuntimeError):
    """Raised at a point set to `raise`, and by an actor that `actor.NAME=crash` makes
    crash."""


def crashes(actor_name: str) -> bool:
    """Whether `actor.<actor_name>=crash` is configured."""
    return action(f"actor.{actor_name}") == "crash"


def hit(point: str) -> None:
    """A named point in blocking code (a worker thread)."""
    gate = _begin(point)
    while gate is not None and not os.path.exists(gate):
        time.sleep(POLL_S)


async def ahit(point: str, when: bool = True) -> None:
    """A named point in async code (passed only `when` true)."""
    gate = _begin(point) if when else None
    if gate is None:
        return
    import trio

    while not os.path.exists(gate):
        await trio.sleep(POLL_S)
