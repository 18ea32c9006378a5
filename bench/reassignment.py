"""Seed 001 (waiting runner reassignment): on the saturated pool, the time from the mini-2
task's submit to its start, with reassignment and without it.

    python bench/reassignment.py [--rounds 3] [--hold 5] [--isolation none]

Two real `motor serve` (mini-1, mini-2).  Each round, in a fresh client dir: task A pinned to
mini-1 runs a turn that holds until released; task B pinned to mini-1 gets the second (last)
runner process, which waits for mini-1; task C pinned to mini-1 is parked; then task D pinned
to mini-2 is submitted (parked: the cap of two runners is used).  The clock runs from just
before D's `motor task submit` until D's turn records its start (`started_at_ms`, the
worker's Started event).  A is released `--hold` seconds after D's submit, so without
reassignment (MOTOR_TASK_REASSIGN=0 for every process of the round) D waits for mini-1's
turns; with it, B's waiting process runs D on the idle mini-2 at once.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from tasks_latency import client_dir, two_workers, wait_runners_gone  # noqa: E402

from motor.tasks import core  # noqa: E402
from motor.tasks.store import ClientDir  # noqa: E402


def cli(cdir: Path, env: dict, *args: str) -> str:
    import subprocess

    r = subprocess.run([sys.executable, "-m", "motor", "task", "--client-dir", str(cdir), *args],
                       capture_output=True, cwd=ROOT, timeout=600, env=env)
    if r.returncode != 0:
        raise SystemExit(f"motor task {' '.join(args)}: {r.stderr.decode()}")
    return r.stdout.decode().strip()


def until(pred, what: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.005)
    raise SystemExit(f"timed out waiting for {what}")


def one_round(tmp: Path, i: int, reassign: bool, hold: float) -> float:
    env = dict(os.environ, MOTOR_TASK_REASSIGN="1" if reassign else "0")
    cdir = client_dir(tmp / f"client-{'on' if reassign else 'off'}-{i}", tmp)
    project = tmp / "project"
    project.mkdir(exist_ok=True)
    go = cdir / "go"
    c = ClientDir(cdir)

    def state(t):
        rec = c.read_task(t)
        return rec.current.state if rec else None

    a = cli(cdir, env, "submit", "--project", str(project), "--pin", "mini-1", "--",
            "sh", "-c", f"while [ ! -e {go} ]; do sleep 0.02; done")
    until(lambda: state(a) == "running", "A to run")
    b = cli(cdir, env, "submit", "--project", str(project), "--pin", "mini-1", "--", "true")
    until(lambda: (r := core.find_row(c.read_queue(), b, "1")) is not None and r.owner != r.enqueue_owner
          and r.state in ("waiting", "dispatching"), "B's runner")
    cli(cdir, env, "submit", "--project", str(project), "--pin", "mini-1", "--", "true")
    t0 = time.time()
    d = cli(cdir, env, "submit", "--project", str(project), "--pin", "mini-2", "--", "true")
    released = False
    while True:
        rec = c.read_task(d)
        if rec is not None and rec.current.started_at_ms is not None:
            started = rec.current.started_at_ms / 1000.0
            donated = rec.current.donated_from is not None
            break
        if not released and time.time() - t0 >= hold:
            go.touch()
            released = True
        time.sleep(0.005)
    go.touch()
    until(lambda: all(t.state == "succeeded" for t in c.list_tasks()) and len(c.list_tasks()) == 4, "all tasks")
    wait_runners_gone(cdir)
    value = started - t0
    print(f"metric=mini2_submit_to_start reassignment={'on' if reassign else 'off'} round={i + 1} "
          f"value={value:.3f} unit=s donated={donated} hold={hold:g}", flush=True)
    return value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hold", type=float, default=5.0)
    ap.add_argument("--isolation", default="none")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="motor-reassign-bench-") as tmp:
        tmp = Path(tmp)
        with two_workers(tmp, args.isolation):
            results = {}
            for reassign in (True, False):
                results[reassign] = [one_round(tmp, i, reassign, args.hold) for i in range(args.rounds)]
            on, off = results[True], results[False]
            print(f"summary mini2_submit_to_start with_reassignment median={statistics.median(on):.3f}s "
                  f"without median={statistics.median(off):.3f}s hold={args.hold:g}s rounds={args.rounds}",
                  flush=True)


if __name__ == "__main__":
    main()
