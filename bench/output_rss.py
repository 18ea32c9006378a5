"""Runner memory and database size while a job prints a lot: a real `motor serve`.

    python bench/output_rss.py [--bytes 1GiB] [--cap 256MiB] [--binary] [--while-down]

Starts `motor serve` on a temporary state dir, submits one job that prints `--bytes` of
output (text lines from `yes`, or with `--binary` bytes from /dev/urandom, which the runner
turns into U+FFFD and JSON escapes), and samples the runner's RSS (the `motor serve`
process only; psutil, every 20 ms) until the job's terminal record is saved.

`--while-down`: the runner is killed (SIGKILL) once the job has started, the job finishes
while no runner runs (its keeper writes the whole output.log), then a new runner starts
and catches up from the saved log offset: the restarted runner's RSS is the one reported.

Prints one line per figure: RSS before the job (after start-up), peak while the job's
output was being stored, after (the job ended, 2 s later), the database size (motor.db
plus its WAL, and SQLite's free-page count) and the job's output.log size.
"""

from __future__ import annotations

import argparse
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from motor.config import parse_size  # noqa: E402

MiB = 1024 * 1024


def mib(n: float) -> str:
    return f"{n / MiB:.1f} MiB"


class Sampler(threading.Thread):
    """Peak RSS of one process, sampled until stopped."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.proc = psutil.Process(pid)
        self.peak = 0
        self.stop_flag = threading.Event()

    def run(self) -> None:
        while not self.stop_flag.is_set():
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.Error:
                return
            time.sleep(0.02)

    def stop(self) -> int:
        self.stop_flag.set()
        self.join()
        return self.peak


def start_serve(state: Path, cap: int, log_path: Path) -> subprocess.Popen:
    log = open(log_path, "ab")
    return subprocess.Popen(
        [sys.executable, "-m", "motor", "serve", "--state-dir", str(state), "--max-weight", "2",
         "--free-space-floor-bytes", "0", "--isolation", "none",
         "--max-output-bytes-per-job", str(cap)],
        stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


def connect(proc: subprocess.Popen, state: Path, log_path: Path) -> httpx.Client:
    sock = state / "motor.sock"
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"serve did not start: {log_path.read_text()[-2000:]}")
        if sock.exists():
            client = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)),
                                  base_url="http://motor", timeout=60)
            try:
                client.get("/v1/health").raise_for_status()
                return client
            except httpx.HTTPError:
                client.close()
        time.sleep(0.05)


class RunnerDied(Exception):
    pass


def wait_state(client: httpx.Client, job_id: str, states: set[str], timeout: float,
               proc: subprocess.Popen | None = None) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        try:
            record = client.get(f"/v1/jobs/{job_id}").json()
        except httpx.HTTPError as exc:
            if proc is not None:
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    pass
                else:
                    raise RunnerDied(f"the runner exited with code {proc.returncode}") from None
            raise SystemExit(f"runner unreachable: {exc}") from None
        if record.get("state") in states:
            return record
        if time.monotonic() > deadline:
            raise SystemExit(f"job {job_id} still {record.get('state')} after {timeout}s")
        time.sleep(0.1)


def db_figures(state: Path) -> tuple[int, int, int]:
    db, wal = state / "motor.db", state / "motor.db-wal"
    size = db.stat().st_size
    wal_size = wal.stat().st_size if wal.exists() else 0
    conn = sqlite3.connect(db)
    try:
        free = conn.execute("PRAGMA freelist_count").fetchone()[0]
        page = conn.execute("PRAGMA page_size").fetchone()[0]
    finally:
        conn.close()
    return size, wal_size, free * page


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes", default="1GiB", help="output the job prints (1GiB)")
    ap.add_argument("--cap", default="256MiB", help="--max-output-bytes-per-job (256MiB)")
    ap.add_argument("--binary", action="store_true", help="random bytes instead of text lines")
    ap.add_argument("--while-down", action="store_true",
                    help="kill the runner while the job runs; measure the restarted runner")
    args = ap.parse_args()
    total, cap = parse_size(args.bytes), parse_size(args.cap)
    source = "cat /dev/urandom" if args.binary else "yes 'motor bench output line 0123456789 abcdefghij'"
    mode = "while-down" if args.while_down else "live"
    kind = "binary" if args.binary else "text"
    print(f"bench=output_rss mode={mode} kind={kind} job_output={mib(total)} cap={mib(cap)}",
          flush=True)

    with tempfile.TemporaryDirectory(prefix="motor-bench-rss-") as tmp:
        state = Path(tmp) / "state"
        log_path = Path(tmp) / "serve.log"
        go = Path(tmp) / "go"  # the job prints once this file exists
        command = ["sh", "-c", f"while [ ! -e {go} ]; do sleep 0.05; done; {source} | head -c {total}"]
        proc = start_serve(state, cap, log_path)
        client = connect(proc, state, log_path)
        try:
            time.sleep(1.0)  # let start-up settle
            before = psutil.Process(proc.pid).memory_info().rss
            sampler = Sampler(proc.pid)
            sampler.start()
            t0 = time.monotonic()
            r = client.post("/v1/jobs", json={"command": command, "weight_hint": 1})
            if r.status_code != 202:
                raise SystemExit(f"submit: {r.status_code} {r.text}")
            job_id = r.json()["job_id"]
            wait_state(client, job_id, {"running"}, 60)
            if args.while_down:
                client.close()
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                sampler.stop()
                go.touch()
                status = state / "jobs" / job_id / "status.json"
                deadline = time.monotonic() + 1800
                while not status.exists():
                    if time.monotonic() > deadline:
                        raise SystemExit("the job did not finish while the runner was down")
                    time.sleep(0.2)
                print(f"runner killed; job finished while it was down after "
                      f"{time.monotonic() - t0:.1f} s", flush=True)
                proc = start_serve(state, cap, log_path)
                sampler = Sampler(proc.pid)  # from its first moment: adoption starts at once
                sampler.start()
                t0 = time.monotonic()
                client = connect(proc, state, log_path)
            else:
                go.touch()
            try:
                record = wait_state(client, job_id, {"succeeded", "failed", "lost", "cancelled",
                                                     "timed_out"}, 3600, proc)
            except RunnerDied as exc:
                print(f"{exc} while storing the output; "
                      f"runner_rss before={mib(before)} peak={mib(sampler.stop())}", flush=True)
                print(log_path.read_text(errors="replace")[-1500:], flush=True)
                raise SystemExit(1) from None
            elapsed = time.monotonic() - t0
            time.sleep(2.0)
            peak = sampler.stop()
            after = psutil.Process(proc.pid).memory_info().rss
            out_log = state / "jobs" / job_id / "output.log"
            db_size, wal_size, free = db_figures(state)
            print(f"job state={record['state']} exit_code={record['exit_code']} "
                  f"stored_in={elapsed:.1f} s", flush=True)
            print(f"runner_rss before={mib(before)} peak={mib(peak)} after={mib(after)}",
                  flush=True)
            print(f"db motor.db={mib(db_size)} wal={mib(wal_size)} free_pages={mib(free)} "
                  f"output.log={mib(out_log.stat().st_size)}", flush=True)
        finally:
            client.close()
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


if __name__ == "__main__":
    main()
