"""How long the runner's event loop is held at a time, and by the store's commits.

    python bench/loop_stalls.py [--rounds 3] [--n 1000] [--isolation affinity]
                                [--baseline-root DIR]

Each round runs an embedded runner (`motor.open_runner`, `max_weight=2`) in a fresh process
and submits N jobs of `true` over 4 workspaces at once (as bench/job_cost.py does), waits
for every job's end, and takes, from the first submit to the last end:

- `loop_step` (ms): the longest single task step of the trio loop (a trio Instrument,
  `before_task_step` to `after_task_step`): for that long nothing else in the runner ran,
  not the API, not a health probe, not the other jobs' events; printed with the 99th
  percentile and the steps over 5 ms (count and their sum);
- `commit` (ms): each `Database.save_many` (one transaction): median, 99th percentile, max,
  the sum per job, and the commits over 5 ms; `loop_commit_max` and
  `loop_commits_over_5ms` of those on the event loop's thread, and `commits_in_thread` the
  others (stop 27 on, the store commits in a worker thread while commits are slow);
- `checkpoints`, `writes_held` and `writes_held_max` (ms): the store's WAL checkpoints (in a
  worker thread, stop 26 on; 0 for older code), how many rounds held the store's writes
  (a second step, or a WAL file past its bound), and the longest time a round held them
  (the writes wait, the loop does not);
- `jobs_per_s`.

`--io-load` runs, during each round, a writer beside the runner on the state directory's
file system (`dd` of 256 MiB with `conv=fsync`, over and over, into TMPDIR): a build host
whose builds write, where a sync waits behind their write-back. `--dirty-bytes N` (with
`--io-load`, root) also limits the host's dirty page cache to N bytes during each round
(`vm.dirty_bytes`, a quarter of it `vm.dirty_background_bytes`; the settings are restored
after): the kernel then throttles every writer, the runner's commits too, as a disk that
cannot keep up with the builds' writes does (4194304: commits of tens of ms, over a hundred
of them per 500 jobs). Stop 27 moved the commits to a worker thread while such slow ones
hold the loop (docs/operations.md, "When the disk is slow").

Stop 26 moved the WAL's checkpoints (two fdatasyncs each) out of the commits into a worker
thread (docs/operations.md, "The job database's checkpoints"): run with `--baseline-root DIR`
(`git archive REV | tar -x -C DIR`) for the code before, interleaved (peer=motor-baseline).
The state directory is made under TMPDIR (its file system decides what a sync costs:
bench/journaled_fs.sh). Every line carries load1=; the end shows medians over rounds.
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import tempfile
from pathlib import Path

from benchlib import BURST, ab_parser, fs_note, load1, run_round
from benchlib import peers as bench_peers

ROOT = Path(__file__).resolve().parent.parent
METRICS = ("loop_step_max", "loop_step_p99", "steps_over_5ms", "steps_over_5ms_sum",
           "commit_p50", "commit_p99", "commit_max", "commit_ms_per_job", "commits_over_5ms",
           "loop_commit_max", "loop_commits_over_5ms", "commits_in_thread",
           "checkpoints", "writes_held", "writes_held_max", "jobs_per_s")

ROUND = BURST + r"""
import json, sys, threading, time
import trio
from motor.store import db as dbm

iso, n = sys.argv[1], int(sys.argv[2])
steps, commits, on = [], [], [False]
loop_commits = []  # those on the event loop's thread
loop_thread = threading.get_ident()
real = dbm.Database.save_many

def save_many(self, writes, *lock_wait):
    t0 = time.perf_counter()
    try:
        return real(self, writes, *lock_wait)
    finally:
        if on[0]:
            commits.append(time.perf_counter() - t0)
            if threading.get_ident() == loop_thread:
                loop_commits.append(commits[-1])

dbm.Database.save_many = save_many
checkpoints, holds = [0], []  # checkpoint calls; how long the writes were held, each time
if hasattr(dbm.Database, "checkpoint"):  # stop 26 on
    from motor.store.holds import WriteHold
    real_checkpoint, real_ended = dbm.Database.checkpoint, WriteHold.round_ended
    def checkpoint(self):
        checkpoints[0] += on[0]
        return real_checkpoint(self)
    def round_ended(self):
        held = real_ended(self)
        if on[0] and held:
            holds.append(held)
        return held
    dbm.Database.checkpoint, WriteHold.round_ended = checkpoint, round_ended

class Steps(trio.abc.Instrument):
    t0 = None  # added inside a step: its end is not counted
    def before_task_step(self, task):
        self.t0 = time.perf_counter()
    def after_task_step(self, task):
        if self.t0 is not None:
            steps.append(time.perf_counter() - self.t0)

def q(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(p * len(values)))]

async def main():
    async with warm_runner(iso, n + 10) as runner:
        trio.lowlevel.add_instrument(Steps())
        on[0] = True
        t0 = time.perf_counter()
        await burst(runner, n)
        wall = time.perf_counter() - t0
        on[0] = False
    ms = lambda v: round(1000.0 * v, 3)
    long = [s for s in steps if s > 0.005]
    print(json.dumps({
        "loop_step_max": ms(max(steps)), "loop_step_p99": ms(q(steps, 0.99)),
        "steps_over_5ms": len(long), "steps_over_5ms_sum": ms(sum(long)),
        "commit_p50": ms(q(commits, 0.5)), "commit_p99": ms(q(commits, 0.99)),
        "commit_max": ms(max(commits)), "commit_ms_per_job": ms(sum(commits) / n),
        "commits_over_5ms": len([c for c in commits if c > 0.005]),
        "loop_commit_max": ms(max(loop_commits, default=0.0)),
        "loop_commits_over_5ms": len([c for c in loop_commits if c > 0.005]),
        "commits_in_thread": len(commits) - len(loop_commits),
        "checkpoints": checkpoints[0], "writes_held": len(holds),
        "writes_held_max": ms(max(holds, default=0.0)),
        "jobs_per_s": round(n / wall, 1)}))

trio.run(main)
"""


VM = "/proc/sys/vm"


@contextlib.contextmanager
def dirty_limit(nbytes: int | None):
    """The host's dirty page cache limited to `nbytes` (vm.dirty_bytes, and a quarter of
    it as vm.dirty_background_bytes) while the block runs, then the settings as they were
    (root; a ratio written back clears its bytes setting, and the other way round)."""
    if nbytes is None:
        yield
        return
    names = ("dirty_bytes", "dirty_ratio", "dirty_background_bytes", "dirty_background_ratio")
    before = {name: Path(VM, name).read_text().strip() for name in names}
    try:
        Path(VM, "dirty_bytes").write_text(str(nbytes))
        Path(VM, "dirty_background_bytes").write_text(str(max(nbytes // 4, 4096)))
        yield
    finally:
        for kind in ("", "background_"):  # the one in use last, so that it wins
            used = f"dirty_{kind}bytes" if before[f"dirty_{kind}bytes"] != "0" \
                else f"dirty_{kind}ratio"
            Path(VM, used).write_text(before[used])


@contextlib.contextmanager
def io_load(on: bool, dirty_bytes: int | None = None):
    """A shell loop of `dd ... conv=fsync` into TMPDIR while the block runs (with the
    host's dirty page cache limited to `dirty_bytes`, when given)."""
    if not on:
        yield
        return
    target = os.path.join(tempfile.gettempdir(), f"motor-io-load-{os.getpid()}")
    with dirty_limit(dirty_bytes):
        proc = subprocess.Popen(
            ["sh", "-c", f"while :; do dd if=/dev/zero of={target} bs=1M count=256 conv=fsync "
                         "status=none; done"], start_new_session=True)
        try:
            yield
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(target)


def main() -> None:
    ap = ab_parser(__doc__, rounds=3)
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--io-load", action="store_true",
                    help="a dd writer with fsync on TMPDIR's file system during each round")
    ap.add_argument("--dirty-bytes", type=int, metavar="N",
                    help="with --io-load: the host's vm.dirty_bytes set to N during each round "
                         "(restored after; root): every writer is throttled, a disk that stalls")
    args = ap.parse_args()
    fs_note()
    peers = bench_peers(ROOT, args.baseline_root)
    every: dict[str, dict[str, list[float]]] = {p: {m: [] for m in METRICS} for p, _ in peers}
    print(f"# loop_stalls: rounds={args.rounds} n={args.n} isolation={args.isolation} "
          f"io_load={args.io_load} dirty_bytes={args.dirty_bytes} load1={load1()}", flush=True)
    for _ in range(args.rounds):
        for peer, root in peers:
            with io_load(args.io_load, args.dirty_bytes):
                got = run_round(ROUND, root, args.isolation, str(args.n))
            for m in METRICS:
                every[peer][m].append(got[m])
            print(f"peer={peer} " + " ".join(f"{m}={got[m]}" for m in METRICS)
                  + f" n={args.n} isolation={args.isolation} load1={load1()}", flush=True)
    print(f"# medians over {args.rounds} rounds (ms, but counts and jobs_per_s), load1={load1()}")
    for peer, _ in peers:
        print(f"# {peer:15s} " + " ".join(f"{m}={statistics.median(every[peer][m]):g}"
                                           for m in METRICS))


if __name__ == "__main__":
    main()
