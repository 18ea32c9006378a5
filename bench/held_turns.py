"""Background work that held every admission, or the whole runner (issue 14, stop 63).

    python bench/held_turns.py [--only sweep,guard,expiry] [--files 200000]
                               [--expire-jobs 300] [--expire-mb 1] [--baseline-root DIR]

Each probe runs a real `motor serve` (`--isolation none`) of this checkout (and, with
`--baseline-root DIR`, of DIR's, e.g. `git archive REV | tar -x -C DIR`, right after it)
on a state directory under `$TMPDIR` (a tmpfs makes the trees cheap to make; deleting
and walking there is fast, so the waits below are floors):

- `sweep`: a workspace whose `target/debug/incremental` holds `--files` stale files (200
  directories, atimes 3 days back), swept by the first maintenance pass after a restart;
  `slowest_run_during_sweep` (s): the slowest of 40 `motor run -- true` in another
  workspace, one after the other from the restart;
- `guard`: a workspace of `--files` files used by a job while the first pass after a
  restart walks it (its build-folder guard then needs another walk);
  `slowest_run_during_guard` (s), measured the same way;
- `expiry`: `--expire-jobs` jobs printing `--expire-mb` MB each, their records then
  deleted by `Database.expire` called until none is left, as each maintenance pass calls
  it a day later (on a copy of the database, the runner stopped): `expire_call_max` and
  `expire_call_median` (ms, what one call holds the store, and before stop 63 the event
  loop), `expire_calls`, `expire_total` (ms) and `db_mb_after`.

Lines in the peers' format (`peer=motor metric=... value=...`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import load1

ROOT = Path(__file__).resolve().parent.parent

MAKE_INCREMENTAL = """
import os, sys
n = int(sys.argv[1])
os.makedirs('target/debug/deps', exist_ok=True)
for d in range(200):
    p = f'target/debug/incremental/crate{d}-0123456789abcdef'
    os.makedirs(p, exist_ok=True)
    for f in range(n // 200): open(f'{p}/{f}', 'w').close()
"""
MAKE_TREE = """
import os, sys
n = int(sys.argv[1])
for d in range(200):
    os.makedirs(f't/{d}', exist_ok=True)
    for f in range(n // 200): open(f't/{d}/{f}', 'w').close()
"""


def emit(peer: str, metric: str, value: float, unit: str, extra: str = "") -> None:
    print(f"peer={peer} metric={metric} value={value:.3f} unit={unit} load1={load1()}"
          f"{' ' + extra if extra else ''}", flush=True)


class Serve:
    """`motor serve` of the checkout `root` on `state`."""

    def __init__(self, root: Path, state: Path) -> None:
        self.root, self.state = root, state
        self.sock = state / "motor.sock"
        self.proc: subprocess.Popen | None = None

    def motor(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "motor", *args], cwd=self.root,
                              capture_output=True, **kw)

    def start(self) -> "Serve":
        log = open(self.state.parent / "serve.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "motor", "serve", "--state-dir", str(self.state),
             "--isolation", "none", "--free-space-floor-bytes", "0", "--max-queue-depth",
             "100000"], cwd=self.root, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not self.sock.exists():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise SystemExit(f"serve did not start ({self.state.parent / 'serve.log'})")
            time.sleep(0.01)
        return self

    def run(self, workspace: str, *command: str) -> float:
        """`motor run` of `command` in `workspace`: its wall time (s)."""
        t0 = time.perf_counter()
        r = self.motor("run", "--socket", str(self.sock), "--workspace", workspace, "--",
                       *command)
        if r.returncode != 0:
            raise SystemExit(f"motor run failed: {r.stderr.decode()[-500:]}")
        return time.perf_counter() - t0

    def stop(self) -> None:
        assert self.proc is not None
        self.proc.terminate()
        self.proc.wait(60)


def slowest_of_runs(serve: Serve, n: int = 40) -> float:
    return max(serve.run("other", "true") for _ in range(n))


def sweep_probe(root: Path, tmp: Path, files: int) -> float:
    serve = Serve(root, tmp / "state").start()
    serve.run("big", sys.executable, "-c", MAKE_INCREMENTAL, str(files))
    serve.stop()
    old = time.time() - 3 * 86400
    for d, _, names in os.walk(tmp / "state" / "workspaces" / "big" / "target"):
        for name in names:
            os.utime(os.path.join(d, name), (old, old))
    serve.start()
    try:
        return slowest_of_runs(serve)
    finally:
        serve.stop()


def guard_probe(root: Path, tmp: Path, files: int) -> float:
    serve = Serve(root, tmp / "state").start()
    serve.run("big", sys.executable, "-c", MAKE_TREE, str(files))
    serve.stop()
    serve.start()
    try:
        serve.run("big", "true")  # while the first pass walks it
        return slowest_of_runs(serve)
    finally:
        serve.stop()


def expiry_probe(root: Path, tmp: Path, jobs: int, mb: float) -> dict:
    serve = Serve(root, tmp / "state").start()
    size = int(mb * 1_000_000)
    script = f"head -c {size} /dev/zero | tr '\\0' x"
    lines = "".join(json.dumps({"command": ["sh", "-c", script], "workspace": f"w{i % 4}",
                                "weight_hint": 1}) + "\n" for i in range(jobs)).encode()
    r = serve.motor("submit", "--socket", str(serve.sock), "--from", "-", input=lines)
    if r.returncode != 0:
        raise SystemExit(f"submit --from failed: {r.stderr.decode()[-500:]}")
    sys.path.insert(0, str(ROOT))
    from motor.client import Client

    with Client(serve.sock, timeout=60) as client:
        while any(not job.terminal for job in client.jobs(all=True)):
            time.sleep(0.5)
    serve.stop()
    code = f"""
import json, os, statistics, sys, time
sys.path.insert(0, {str(root)!r})
from motor.store.db import Database
db = Database({str(tmp / 'state' / 'motor.db')!r})
now = int(time.time() * 1000) + 10 * 86400 * 1000
calls, n = [], 0
while True:
    t = time.perf_counter(); ids = db.expire(now); calls.append((time.perf_counter() - t) * 1e3)
    n += len(ids)
    if not ids:
        break
db.close()
print(json.dumps({{"calls": calls, "expired": n}}))
"""
    before = os.path.getsize(tmp / "state" / "motor.db") / 1e6
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True)
    got = json.loads(out.stdout)
    got["db_mb_before"] = before
    got["db_mb_after"] = os.path.getsize(tmp / "state" / "motor.db") / 1e6
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="sweep,guard,expiry")
    ap.add_argument("--files", type=int, default=200_000)
    ap.add_argument("--expire-jobs", type=int, default=300)
    ap.add_argument("--expire-mb", type=float, default=1.0)
    ap.add_argument("--baseline-root", default=None)
    args = ap.parse_args()
    trees = [("motor", ROOT)]
    if args.baseline_root:
        trees.append(("motor-baseline", Path(args.baseline_root).resolve()))
    only = set(args.only.split(","))
    for peer, root in trees:
        if "sweep" in only:
            with tempfile.TemporaryDirectory(prefix="motor-held-") as tmp:
                emit(peer, "slowest_run_during_sweep", sweep_probe(root, Path(tmp), args.files),
                     "s", f"files={args.files}")
        if "guard" in only:
            with tempfile.TemporaryDirectory(prefix="motor-held-") as tmp:
                emit(peer, "slowest_run_during_guard", guard_probe(root, Path(tmp), args.files),
                     "s", f"files={args.files}")
        if "expiry" in only:
            with tempfile.TemporaryDirectory(prefix="motor-held-") as tmp:
                got = expiry_probe(root, Path(tmp), args.expire_jobs, args.expire_mb)
                calls, extra = got["calls"], f"jobs={got['expired']} mb_each={args.expire_mb}"
                emit(peer, "expire_call_max", max(calls), "ms", extra)
                emit(peer, "expire_call_median", statistics.median(calls), "ms", extra)
                emit(peer, "expire_calls", len(calls), "calls", extra)
                emit(peer, "expire_total", sum(calls), "ms", extra)
                emit(peer, "db_mb_after", got["db_mb_after"], "MB",
                     f"{extra} db_mb_before={got['db_mb_before']:.1f}")


if __name__ == "__main__":
    main()
