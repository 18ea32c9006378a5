"""The forkserver: a small long-lived process that forks one keeper per job.

Started by the runner as ``sys.executable <path to this file>`` (see
``scriptboot.bootstrap``; ``-m motor.execution.forkserver`` works too but
imports the ``motor`` package) with stdin/stdout pipes.  Protocol (one JSON object per line):

- on startup it writes ``{"ready": true, "pid": <its pid>}``
- request  ``{"id": <int>, "job_dir": "/abs/path"}``
- response ``{"id": <int>, "pid": <keeper pid>, "create_time": <float>}``
  or ``{"id": <int>, "error": "<message>"[, "code": "spawn_failed" | "claimed"]}``
  (with a code, the job was certainly not started by this request)

Each keeper is ``os.fork()``-ed from here (no new interpreter per job) and
points its stdio at /dev/null.  It then waits on a pipe: the forkserver first
records the keeper's identity in ``<job_dir>/keeper.json`` (the claim, an
exclusive ``link``: one keeper per job directory, ever), then releases it.
Only then does the keeper call ``os.setsid()`` and run
``motor.execution.keeper.run_keeper``.  A claim that cannot be written kills
the unreleased keeper (``{"code": "spawn_failed"}``); a job directory that is
already claimed too (``{"code": "claimed"}``).  A keeper whose forkserver dies
before releasing it never starts the job.  The forkserver reaps exited keepers.
At EOF on stdin (runner gone or closing) it exits without touching the
keepers: they are in their own sessions and keep running.

Stdlib only (plus the stdlib-only keeper/joblog modules): keep it small so
fork() stays cheap.
"""

from __future__ import annotations

import os
import sys


if __name__ == "__main__" and not __package__:  # run by path: see scriptboot.py
    import scriptboot  # the script's own directory is sys.path[0] here

    scriptboot.bootstrap(__file__)

import gc  # noqa: E402
import json  # noqa: E402
import select  # noqa: E402
import signal  # noqa: E402

from motor import faults as _faults  # noqa: E402
from motor.execution import keeper as _keeper  # noqa: E402
# the systemd backend's join step talks D-Bus (jeepney): imported once here, inherited by
# every keeper, instead of once per keeper in its join step
from motor.isolation import systemd as _systemd  # noqa: E402,F401

__all__ = ["main"]


def _write_line(obj: dict) -> None:
    data = memoryview(json.dumps(obj, separators=(",", ":")).encode() + b"\n")
    while data:
        n = os.write(1, data)
        data = data[n:]


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _child(job_dir: str, wake_r: int, wake_w: int, go_r: int) -> None:
    """In the forked child: wait to be released, then become the keeper.  Never returns."""
    code = 70
    try:
        gc.disable()  # short-lived: avoid touching (copying) inherited pages
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.close(wake_r)
        os.close(wake_w)
        # Drop the pipes to the runner: the keeper must never hold them (the
        # runner would not see EOF when the forkserver dies).
        devnull = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.close(devnull)
        # Nothing of the job may happen before our identity is recorded in
        # keeper.json (the claim): the forkserver writes it, then releases us.
        try:
            go = os.read(go_r, 1)
        except OSError:
            go = b""
        os.close(go_r)
        if go != b"g":  # the forkserver died before releasing us: never start the job
            code = _keeper.abandon(job_dir)
        else:
            code = _keeper.run_keeper(job_dir)
    except BaseException:
        code = 70
    finally:
        os._exit(code)




def _handle(line: bytes, wake_r: int, wake_w: int) -> None:
    req_id = None
    try:
        req = json.loads(line)
        req_id = req.get("id")
        job_dir = req["job_dir"]
        if not isinstance(job_dir, str) or not os.path.isabs(job_dir):
            raise ValueError(f"job_dir must be an absolute path, got {job_dir!r}")
    except Exception as exc:
        _write_line({"id": req_id, "error": f"bad request: {exc}"})
        return
    go_r, go_w = os.pipe()
    # Block SIGTERM across fork: the child unblocks it once its cancel
    # handler is installed, so an early cancel is delivered, not fatal.
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        pid = os.fork()
    except OSError as exc:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        os.close(go_r)
        os.close(go_w)
        _write_line({"id": req_id, "error": f"fork failed: {exc}"})
        return
    if pid == 0:
        os.close(go_w)
        _child(job_dir, wake_r, wake_w, go_r)
    signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
    os.close(go_r)
    try:
        try:
            # Not reaped yet (only this loop reaps), so /proc/<pid>/stat exists.
            create_time = _keeper.proc_create_time(pid)
        except OSError as exc:
            _keeper.kill_and_reap(pid)
            _write_line({"id": req_id, "error": f"cannot read keeper create time: {exc}"})
            return
        _faults.hit("forkserver.forked")  # tests: the keeper exists, its claim does not
        # The claim: the keeper's identity is durable before it may do anything.
        try:
            _keeper.claim_job_dir(job_dir, pid, create_time)
        except FileExistsError:
            _keeper.kill_and_reap(pid)
            _write_line({"id": req_id, "code": "claimed",
                         "error": f"{job_dir} already has a keeper (keeper.json exists)"})
            return
        except OSError as exc:
            _keeper.kill_and_reap(pid)
            _write_line({"id": req_id, "code": "spawn_failed",
                         "error": "cannot record the keeper's identity in "
                                  f"{os.path.join(job_dir, 'keeper.json')}: {exc}"})
            return
        _faults.hit("forkserver.claimed")  # tests: claimed, the keeper not yet released
        os.write(go_w, b"g")
    finally:
        os.close(go_w)
    _write_line({"id": req_id, "pid": pid, "create_time": create_time})


def main() -> int:
    # The runner stops us by closing stdin; terminal signals aimed at the
    # runner's process group must not take the forkserver down mid-request.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)

    # Keep the startup objects out of the collector so forked keepers do
    # not copy the pages it would touch.
    gc.collect()
    gc.freeze()
    try:
        _write_line({"ready": True, "pid": os.getpid()})
    except BrokenPipeError:
        return 0
    buf = b""
    while True:
        try:
            ready, _, _ = select.select([0, wake_r], [], [])
        except InterruptedError:  # pragma: no cover - PEP 475 retries
            continue
        if wake_r in ready:
            try:
                while os.read(wake_r, 512):
                    pass
            except BlockingIOError:
                pass
            _reap()
        if 0 in ready:
            chunk = os.read(0, 65536)
            if not chunk:
                _reap()
                return 0
            buf += chunk
            while True:
                nl = buf.find(b"\n")
                if nl < 0:
                    break
                line, buf = buf[:nl], buf[nl + 1 :]
                if line.strip():
                    try:
                        _handle(line, wake_r, wake_w)
                    except BrokenPipeError:
                        return 0
            _reap()


if __name__ == "__main__":
    sys.exit(main())
