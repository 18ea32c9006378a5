"""The first jobs after a runner's start (issue 14, stop 64).

    python bench/first_jobs.py [--isolation cgroup] [--systemd-namespace] [--rounds 3]
                               [--jobs 6] [--baseline-root DIR]

Per round and peer (this checkout, then `--baseline-root DIR`'s, e.g. `git archive REV |
tar -x -C DIR`), a fresh state directory under `$TMPDIR` and a fresh `motor serve`
(`--max-weight 2`; with `--systemd-namespace`, inside the systemd namespace of
tests/isolation/systemd_ns.py, as `--isolation systemd` needs here), then `--jobs` `true`
jobs one after the other through motor's client (claim 1, four workspaces in turn), each
timed from its submit to its terminal record. What a start prepares (a systemd runner's
slots and their spares, a cgroup v1 runner's pool of spares: docs/keeper.md, "Prepared at
the runner's start") shows in the first job's time and in the start's.

Lines in the peers' format, per round: `first_job_ms`, `later_jobs_ms` (the median of the
others), `start_ms` (from `motor serve`'s exec to its first answer to health); then `#`
lines with each peer's medians over the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from benchlib import byte_compile, load1, motor_serve, peers

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from motor.client import Client  # noqa: E402  (this checkout's client, for either runner)
from motor.records import JobRequest, Terminal  # noqa: E402


def one_round(root: Path, isolation: str, namespace: bool, jobs: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="motor-first-jobs-") as tmp:
        with motor_serve(Path(tmp), root, "--max-weight", "2", "--free-space-floor-bytes", "0",
                         "--isolation", isolation, namespace=namespace) as serve:
            proc, state, t0 = serve.proc, serve.state, serve.started
            sock = state / "motor.sock"
            deadline = time.monotonic() + 60
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"serve did not start: {(Path(tmp) / 'serve.log').read_text()}")
                try:
                    with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)),
                                      base_url="http://motor") as c:
                        if c.get("/v1/health").status_code == 200:
                            break
                except httpx.TransportError:
                    time.sleep(0.002)
            start_ms = (time.perf_counter() - t0) * 1e3
            walls = []
            with Client(sock, timeout=60) as client:
                for n in range(jobs):
                    t = time.perf_counter()
                    request = JobRequest(command=["true"], workspace=f"ws{n % 4}", weight_hint=1)
                    with client.submit(request, follow=True) as events:
                        for event in events:
                            if isinstance(event, Terminal):
                                if event.record["state"] != "succeeded":
                                    raise SystemExit(f"job {n}: {event.record}")
                                break
                    walls.append((time.perf_counter() - t) * 1e3)
    return {"first_job_ms": walls[0], "later_jobs_ms": statistics.median(walls[1:]),
            "start_ms": start_ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--isolation", default="cgroup")
    ap.add_argument("--systemd-namespace", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=6)
    ap.add_argument("--baseline-root", metavar="DIR")
    args = ap.parse_args()
    if args.jobs < 2:
        ap.error("--jobs must be at least 2")
    for _, root in peers(ROOT, args.baseline_root):
        byte_compile(root)  # as installed: else each start compiles the sources again
    seen: dict[str, dict[str, list[float]]] = {}
    for r in range(1, args.rounds + 1):
        for peer, root in peers(ROOT, args.baseline_root):
            figures = one_round(root, args.isolation, args.systemd_namespace, args.jobs)
            for metric, value in figures.items():
                seen.setdefault(peer, {}).setdefault(metric, []).append(value)
                print(f"peer={peer} metric={metric} value={value:.3f} unit=ms "
                      f"isolation={args.isolation} round={r} load1={load1()}", flush=True)
    for peer, metrics in seen.items():
        print(f"# {peer} ({args.isolation}, medians of {args.rounds}): " + ", ".join(
            f"{m} {statistics.median(v):.1f}" for m, v in metrics.items()), flush=True)


if __name__ == "__main__":
    main()
