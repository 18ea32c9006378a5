"""The 10,000-queued rows of issue 14: a real `motor serve` with a deep queue.

    python bench/scale.py [--n 10000] [--workspaces 2000] [--isolation affinity]
                          [--max-weight 2] [--tries 5] [--drain-limit 300] [--drain-after S]
                          [--no-restart]
                          [--profile DIR]

A runner on a temporary state dir (`--max-queue-depth` = n + 100, `--max-weight`). A
blocker job (`sleep`, claim = max_weight) takes all capacity; then N jobs of `true`
(claim 1) are submitted one after another through the HTTP API on the Unix socket, over
`--workspaces` workspaces (job i in workspace i % W). It prints, in the peers' line format
(`peer=motor metric=... value=... unit=...`, with load1= the 1-minute load average):

- `submit_rate` per block of 1,000 submits (jobs/s; `block=K` is the K-th thousand), with
  the CPU per submit of the runner (`runner_cpu_ms`, from /proc) and of this client
  (`client_cpu_ms`) in that block: a rate that falls while the runner's CPU per submit
  does not is the host's or the client's, not the runner's work growing with the queue;
- `health_latency` and `status_latency` with N queued (and first with none queued, for
  comparison on a shared machine): median and p90 of `--tries` requests (`GET /v1/health`,
  `GET /v1/status`), ms; with N queued also the CPU time per request of the runner
  (`runner_cpu_ms`, from /proc) and of this client (`client_cpu_ms`: reading and decoding
  the answer), steadier than wall time when other work shares the machine;
- `status_full_latency`: the same for `GET /v1/status?full=1` (whole records; what `GET
  /v1/status` answered before stop 31);
- `status_latency_after_event`: `GET /v1/status` with one more job submitted (untimed)
  before each request, so that each view follows an event (`--tries` more jobs queued);
- `jobs_latency` with N queued: the same for `GET /v1/jobs?all=1` (every retained record,
  each queued one with its live wait fields; stop 25);
- `runner_rss`: the runner process's resident set size, MiB;
- `restart_to_healthy`: SIGTERM the runner, start it again on the same state dir, seconds
  from the new process's start until `GET /v1/health` answers 200, and `restart_to_queue`
  until `GET /v1/status` shows all N queued again (jobs are recovered from SQLite; the
  blocker outlives the runner and is adopted);
- `drain_rate`: cancel the blocker and count the jobs that end per second until none is
  queued or running (polled every 0.2 s through `/v1/health`, whose capacity is O(1)),
  or `--drain-limit` seconds pass (then the rate of those that ended;
  `complete=0` says so). Every ended job is checked to have succeeded. `--drain-after S`
  starts it no sooner than S seconds after the last submit (`after_fill_s=` says when):
  with 61 every job queued has passed its 60 s aging point, so a head waiting for
  permits fences (with a few deep workspaces: each start moves the fence);
- `burst_rate` (before the fill, `--reference-rounds` times, default 3): the row's "200-job
  rate" measured in the same invocation, on the same file system and with the same
  isolation: `throughput.py`'s motor round (a fresh runner, 200 `true` jobs over 4
  workspaces, one request each); at the end `drain_vs_burst`, the drain rate over the
  median burst rate.

The state directories are made under `$TMPDIR` (stop 51; before, always under /tmp, which
on the development host is the unjournaled root file system while `throughput.py`'s rounds
ran on the journaled image `bench/journaled_fs.sh` makes: docs/performance.md, "The host's
file system").

`--profile DIR` runs each runner start under cProfile (main thread only: work in
`trio.to_thread` threads is not in it) and writes DIR/serve-K.prof when it stops; the
figures are then slower than unprofiled ones.

At the end the runner is stopped and any job keeper still alive under the state dir is
ended (jobs outlive runners).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import fs_note, load1

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from motor.client import Client, RunnerUnavailable  # noqa: E402
from motor.execution.spawner import cancel_keepers_under  # noqa: E402
from motor.records import TERMINAL_STATES, RefusedError  # noqa: E402


def emit(metric: str, value: float, unit: str, extra: str = "") -> None:
    print(f"peer=motor metric={metric} value={value:.3f} unit={unit} load1={load1()}"
          f"{' ' + extra if extra else ''}", flush=True)


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))]


class Runner:
    def __init__(self, tmp: Path, args: argparse.Namespace):
        self.tmp = tmp
        self.state = tmp / "state"
        self.sock = self.state / "motor.sock"
        self.log = tmp / "serve.log"
        self.argv = [sys.executable, "-m", "motor", "serve", "--state-dir", str(self.state),
                     "--max-weight", str(args.max_weight), "--max-queue-depth", str(args.n + 100),
                     "--free-space-floor-bytes", "0", "--isolation", args.isolation]
        if args.isolation == "cgroup":  # a private parent: other runs' cleanup empties motor-jobs
            self.argv += ["--cgroup-parent", f"motor-scale-{os.getpid()}"]
        self.proc: subprocess.Popen | None = None
        self.profile_dir = Path(args.profile).resolve() if args.profile else None
        self.starts = 0

    def start(self) -> float:
        """Start; seconds until /v1/health answers."""
        env = {k: v for k, v in os.environ.items() if k not in ("MOTOR_SOCKET", "MOTOR_STATE_DIR")}
        argv = self.argv
        self.starts += 1
        if self.profile_dir is not None:  # cProfile of the runner's main thread, written at exit
            self.profile_dir.mkdir(parents=True, exist_ok=True)
            out = self.profile_dir / f"serve-{self.starts}.prof"
            argv = [argv[0], "-m", "cProfile", "-o", str(out)] + argv[1:]
        with open(self.log, "ab") as log:
            t0 = time.perf_counter()
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        deadline = time.monotonic() + 600
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"serve exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise SystemExit("serve did not become healthy in 600 s")
            if self.sock.exists():
                try:
                    with Client(self.sock, timeout=600) as c:
                        c.health()
                    return time.perf_counter() - t0
                except (RunnerUnavailable, RefusedError):
                    pass
            time.sleep(0.005)

    def stop(self) -> float:
        if self.proc is None or self.proc.poll() is not None:
            return 0.0
        t0 = time.perf_counter()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
        return time.perf_counter() - t0

    def rss_mib(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
        return float("nan")


def timed(fn, tries: int) -> list[float]:
    out = []
    for _ in range(tries):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000.0)
    return out


def cpu_ms(pid: int) -> float:
    """CPU time (user + system) the process has used so far, ms (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000.0 / os.sysconf("SC_CLK_TCK")


def timed_cpu(fn, tries: int, pid: int) -> tuple[list[float], str]:
    """`timed`, and the CPU time per request of the runner (`pid`) and of this client: on a
    shared machine these vary less with the load than the wall time does."""
    runner0, client0 = cpu_ms(pid), time.process_time()
    values = timed(fn, tries)
    runner = (cpu_ms(pid) - runner0) / tries
    client = (time.process_time() - client0) * 1000.0 / tries
    return values, f"runner_cpu_ms={runner:.1f} client_cpu_ms={client:.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=10_000, help="jobs queued behind the blocker")
    ap.add_argument("--workspaces", type=int, default=2_000)
    ap.add_argument("--isolation", default="affinity")
    ap.add_argument("--max-weight", type=int, default=2)
    ap.add_argument("--tries", type=int, default=5, help="requests per latency figure")
    ap.add_argument("--drain-limit", type=float, default=300.0, help="seconds to measure the drain")
    ap.add_argument("--drain-after", type=float, default=0.0, metavar="S",
                    help="start the drain no sooner than S seconds after the last submit "
                         "(61: every queued job has passed its 60 s aging point)")
    ap.add_argument("--no-restart", action="store_true")
    ap.add_argument("--reference-rounds", type=int, default=3,
                    help="200-job bursts before the fill, for drain_vs_burst (0: none)")
    ap.add_argument("--block", type=int, default=1000, help="submits per submit_rate line")
    ap.add_argument("--profile", metavar="DIR",
                    help="run the runner under cProfile; DIR/serve-K.prof per start (K from 1), "
                         "written when it stops; read with `python -m pstats`")
    args = ap.parse_args()
    fs_note()
    print(f"# scale: n={args.n} workspaces={args.workspaces} isolation={args.isolation} "
          f"max_weight={args.max_weight} load1={load1()}", flush=True)

    bursts = []
    for _ in range(args.reference_rounds):
        from throughput import motor_round  # the throughput row's own round (bench/ is on sys.path)

        wall, _submitted, _busy = motor_round(200, args.isolation)
        bursts.append(200 / wall)
        emit("burst_rate", bursts[-1], "jobs/s", "n=200 workspaces=4")
    if bursts:
        emit("burst_rate_median", statistics.median(bursts), "jobs/s", f"rounds={len(bursts)}")

    with tempfile.TemporaryDirectory(prefix="motor-scale-") as tmp:
        runner = Runner(Path(tmp), args)
        blocker = None
        try:
            emit("start_to_healthy", runner.start(), "s", "queued=0")
            client = Client(runner.sock, timeout=600)
            blocker = client.submit({"command": ["sleep", "3600"], "weight_hint": args.max_weight,
                                     "workspace": "blocker"})
            deadline = time.monotonic() + 120
            while client.get(blocker.job_id).state != "running":
                if time.monotonic() > deadline:
                    raise SystemExit("the blocker did not start")
                time.sleep(0.05)

            # the same latency figures with nothing queued, for comparison (the machine is shared)
            for metric, path in (("health_latency", "/v1/health"), ("status_latency", "/v1/status")):
                values = timed(lambda: client.call("GET", path), args.tries)
                emit(metric, statistics.median(values), "ms",
                     f"p90={p90(values):.3f} tries={len(values)} queued=0")

            # -- fill ---------------------------------------------------------------------
            t_fill = time.perf_counter()
            t_block = t_fill
            runner_block, client_block = cpu_ms(runner.proc.pid), time.process_time()
            for i in range(args.n):
                client.call("POST", "/v1/jobs", json={
                    "command": ["true"], "weight_hint": 1, "workspace": f"ws{i % args.workspaces}",
                    "capabilities": client.capabilities})
                if (i + 1) % args.block == 0 or i + 1 == args.n:
                    now = time.perf_counter()
                    runner_now, client_now = cpu_ms(runner.proc.pid), time.process_time()
                    done = (i % args.block) + 1
                    emit("submit_rate", done / (now - t_block), "jobs/s",
                         f"block={(i // args.block) + 1} queued={i + 1} "
                         f"runner_cpu_ms={(runner_now - runner_block) / done:.2f} "
                         f"client_cpu_ms={(client_now - client_block) * 1000.0 / done:.2f}")
                    t_block, runner_block, client_block = now, runner_now, client_now
            t_filled = time.perf_counter()
            fill = t_filled - t_fill
            emit("fill_wall", fill, "s", f"n={args.n} jobs_per_s={args.n / fill:.1f}")

            # -- latency and size with N queued ---------------------------------------------
            for metric, path in (("health_latency", "/v1/health"), ("status_latency", "/v1/status"),
                                 ("status_full_latency", "/v1/status?full=1"),
                                 ("jobs_latency", "/v1/jobs?all=1")):
                values, cpu = timed_cpu(lambda: client.call("GET", path), args.tries, runner.proc.pid)
                emit(metric, statistics.median(values), "ms",
                     f"p90={p90(values):.3f} tries={len(values)} queued={args.n} {cpu}")
            # the same status view with an event between two requests (one more job
            # submitted, untimed): the view before patched with the jobs that moved (stop
            # 32; before, built from the records), not the view before with its clocks run
            # on alone (docs/scheduling.md, "The status view, encoded")
            values, runner_ms, client_ms = [], 0.0, 0.0
            for i in range(args.tries):
                client.call("POST", "/v1/jobs", json={
                    "command": ["true"], "weight_hint": 1, "workspace": f"extra{i}",
                    "capabilities": client.capabilities})
                runner0, client0 = cpu_ms(runner.proc.pid), time.process_time()
                values += timed(lambda: client.call("GET", "/v1/status"), 1)
                runner_ms += cpu_ms(runner.proc.pid) - runner0
                client_ms += (time.process_time() - client0) * 1000.0
            emit("status_latency_after_event", statistics.median(values), "ms",
                 f"p90={p90(values):.3f} tries={len(values)} queued={args.n + args.tries} "
                 f"runner_cpu_ms={runner_ms / args.tries:.1f} client_cpu_ms={client_ms / args.tries:.1f}")
            status = client.status()
            queued = len(status.get("queued", []))
            emit("runner_rss", runner.rss_mib(), "MiB", f"queued={queued}")

            # -- restart ----------------------------------------------------------------------
            if not args.no_restart:
                stop_s = runner.stop()
                emit("stop", stop_s, "s", f"queued={args.n}")
                t0 = time.perf_counter()
                healthy = runner.start()
                emit("restart_to_healthy", healthy, "s", f"queued={args.n}")
                client = Client(runner.sock, timeout=600)
                while True:
                    status = client.status()
                    if len(status.get("queued", [])) >= args.n:
                        break
                    if time.perf_counter() - t0 > 600:
                        raise SystemExit(f"only {len(status.get('queued', []))} queued after restart")
                    time.sleep(0.05)
                emit("restart_to_queue", time.perf_counter() - t0, "s", f"queued={args.n}")
                emit("runner_rss_after_restart", runner.rss_mib(), "MiB", f"queued={args.n}")

            # -- drain --------------------------------------------------------------------------
            time.sleep(max(0.0, args.drain_after - (time.perf_counter() - t_filled)))
            after_fill = time.perf_counter() - t_filled
            client.cancel(blocker.job_id)
            t0 = time.perf_counter()
            remaining = args.n
            while time.perf_counter() - t0 < args.drain_limit:
                # polled through /v1/health's capacity (O(1) in the runner): a /v1/status poll
                # builds the whole queued view, and at 10,000 queued that would be measured
                # as part of the drain. pending_jobs counts queued + setting up, held_permits
                # the claims of active jobs (the blocker's until it has ended).
                capacity = client.health()["capacity"]
                remaining = capacity["pending_jobs"] + capacity["held_permits"]
                if remaining == 0:
                    break
                time.sleep(0.2)
            status = client.status()
            if status.get("queued") or status.get("running"):
                remaining = max(remaining, len(status["queued"]) + len(status["running"]))
            wall = time.perf_counter() - t0
            records = client.call("GET", "/v1/jobs", params={"all": "1"})
            ended = [r for r in records if r["job_id"] != blocker.job_id and r["state"] in TERMINAL_STATES]
            bad = [r for r in ended if r["state"] != "succeeded"]
            emit("drain_rate", len(ended) / wall, "jobs/s",
                 f"ended={len(ended)} wall_s={wall:.1f} complete={int(remaining == 0)} not_succeeded={len(bad)}"
                 f" after_fill_s={after_fill:.1f}")
            if bursts:
                emit("drain_vs_burst", len(ended) / wall / statistics.median(bursts), "x")
            if bad:
                print(f"# not succeeded (first 3): {bad[:3]}", flush=True)
            return 1 if bad else 0
        finally:
            if blocker is not None and runner.proc is not None and runner.proc.poll() is None:
                try:
                    with Client(runner.sock, timeout=30) as c:  # the blocker, if still running
                        c.cancel(blocker.job_id)
                except (RunnerUnavailable, RefusedError):
                    pass
            runner.stop()
            cancel_keepers_under(runner.state)


if __name__ == "__main__":
    raise SystemExit(main())
