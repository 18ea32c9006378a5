"""The task client over a two-worker fleet: submit-to-first-output latency, and the drain
time of N queued one-line turns beside the same N commands run with `motor run` on one runner.

    python bench/tasks_latency.py [--n 200] [--latency-rounds 5] [--isolation none]

Two real `motor serve` (mini-1, mini-2) on two Unix sockets in a temporary directory.
1. latency: `motor task submit` of `echo first-output` on the idle fleet; the clock runs from
   just before the CLI starts until the turn's output.log under the client dir holds the line
   (the CLI's own start-up is included, as a user feels it).  One line per round, then the median.
2. drain: N tasks of `echo N` are queued (parked) in one go through the task client's queue
   actor, then `motor task reconcile` starts runners (the cap is 2, one per worker; each
   finishing runner takes the next parked turn in-process); the clock runs from reconcile
   until every turn has ended (each is checked to have succeeded).
3. the same N commands, one `motor run -- echo N` after another against one runner.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from motor.tasks import core  # noqa: E402
from motor.tasks.client import TaskClient  # noqa: E402
from motor.tasks.queue import open_queue  # noqa: E402
from motor.tasks.store import ClientDir  # noqa: E402
from motor.tasks.workers import load_fleet  # noqa: E402


def start_serve(state: Path, isolation: str) -> subprocess.Popen:
    state.mkdir(parents=True)
    log = open(state.parent / f"{state.name}.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "motor", "serve", "--state-dir", str(state),
                             "--free-space-floor-bytes", "0", "--isolation", isolation],
                            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    deadline = time.monotonic() + 60
    while b"listening on" not in (state.parent / f"{state.name}.log").read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"serve did not start: {(state.parent / f'{state.name}.log').read_text()}")
        time.sleep(0.02)
    return proc


WORKERS = ("mini-1", "mini-2")


@contextmanager
def two_workers(tmp: Path, isolation: str) -> Iterator[None]:
    """Two real `motor serve` workers, mini-1 and mini-2, under `tmp` while in the block."""
    serves = [start_serve(tmp / name, isolation) for name in WORKERS]
    try:
        yield
    finally:
        for s in serves:
            s.terminate()
            s.wait(30)


def client_dir(cdir: Path, tmp: Path) -> Path:
    """A task client dir whose workers.toml lists the two workers under `tmp`."""
    cdir.mkdir()
    (cdir / "workers.toml").write_text("".join(
        f'[[workers]]\nname = "{name}"\nendpoint = "unix:{tmp / name / "motor.sock"}"\n\n'
        for name in WORKERS))
    return cdir


def task_cli(cdir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "motor", "task", "--client-dir", str(cdir), *args],
                          capture_output=True, cwd=ROOT, timeout=600)


def wait_runners_gone(cdir: Path) -> None:
    import psutil

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if not any(str(cdir) in (p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE
                   for p in psutil.process_iter(["cmdline", "status"])):
            return
        time.sleep(0.05)


def latency(cdir: Path, project: Path, rounds: int) -> list[float]:
    figures = []
    for i in range(rounds):
        t0 = time.monotonic()
        r = task_cli(cdir, "submit", "--project", str(project), "--", "echo", "first-output")
        assert r.returncode == 0, r.stderr
        task_id = r.stdout.decode().strip()
        out = cdir / "turns" / task_id / "1" / "output.log"
        while not (out.exists() and b"first-output" in out.read_bytes()):
            time.sleep(0.002)
        figures.append(time.monotonic() - t0)
        print(f"metric=submit_to_first_output round={i + 1} value={figures[-1]:.3f} unit=s", flush=True)
        wait_runners_gone(cdir)
    return figures


def queue_parked(cdir: Path, project: Path, n: int) -> list[str]:
    async def main():
        c = ClientDir(cdir)
        async with trio.open_nursery() as nursery:
            queue = await open_queue(nursery, c)
            tc = TaskClient(c, queue, load_fleet(cdir / "workers.toml"))
            ids = []
            for i in range(n):
                task_id, turn_id = await tc.create_task(str(project), ["echo", str(i)])
                await queue.locked(lambda L, t=task_id, u=turn_id: core.park(L.queue, task_id=t, turn_id=u))
                ids.append(task_id)
            nursery.cancel_scope.cancel()
            return ids

    return trio.run(main)


def drain(cdir: Path, project: Path, n: int) -> float:
    ids = queue_parked(cdir, project, n)
    c = ClientDir(cdir)
    t0 = time.monotonic()
    r = task_cli(cdir, "reconcile")
    assert r.returncode == 0, r.stderr
    pending = set(ids)
    while pending:
        for task_id in list(pending):
            t = c.read_task(task_id)
            if t is not None and t.state in core_terminal():
                assert t.state == "succeeded", (task_id, t.current)
                pending.discard(task_id)
        time.sleep(0.02)
    wall = time.monotonic() - t0
    workers = {c.read_task(i).current.worker for i in ids}
    print(f"metric=task_drain n={n} workers=2 value={wall:.3f} unit=s turns_per_s={n / wall:.2f} "
          f"used={','.join(sorted(workers))}", flush=True)
    return wall


def core_terminal():
    from motor.tasks.records import TERMINAL_TURN_STATES

    return TERMINAL_TURN_STATES


def motor_run_sequence(socket: Path, n: int) -> float:
    t0 = time.monotonic()
    for i in range(n):
        r = subprocess.run([sys.executable, "-m", "motor", "run", "--socket", str(socket), "--workspace", "bench",
                            "--", "echo", str(i)], capture_output=True, cwd=ROOT, timeout=600)
        assert r.returncode == 0 and r.stdout == f"{i}\n".encode(), r.stderr
    wall = time.monotonic() - t0
    print(f"metric=motor_run_sequence n={n} runners=1 value={wall:.3f} unit=s jobs_per_s={n / wall:.2f}",
          flush=True)
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--latency-rounds", type=int, default=5)
    ap.add_argument("--isolation", default="none")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="motor-tasks-bench-") as tmp:
        tmp = Path(tmp)
        with two_workers(tmp, args.isolation):
            cdir = client_dir(tmp / "client", tmp)
            project = tmp / "project"
            project.mkdir()
            (project / "README").write_text("bench\n")
            lat = latency(cdir, project, args.latency_rounds)
            print(f"summary submit_to_first_output median={statistics.median(lat):.3f}s "
                  f"min={min(lat):.3f}s max={max(lat):.3f}s rounds={len(lat)}", flush=True)
            wall_tasks = drain(cdir, project, args.n)
            wall_run = motor_run_sequence(tmp / "mini-1" / "motor.sock", args.n)
            print(f"summary n={args.n} task_drain_two_workers={wall_tasks:.3f}s "
                  f"motor_run_one_runner={wall_run:.3f}s ratio={wall_run / wall_tasks:.2f}", flush=True)


if __name__ == "__main__":
    main()
