"""Start latency and the client's own cost, beside the peers, in the peers' line format.

    python bench/latency.py [--rounds 3] [--samples 10] [--gap 0.3] [--isolation affinity]
                            [--no-peers] [--baseline-root DIR]

Each round starts a real `motor serve` (`--max-weight 2`) on a temporary state dir, then
measures, `--samples` times each (idle runner, `--gap` seconds apart):

- `start_latency` (ms): submit one job `date +%s.%N` through the HTTP API on the Unix
  socket (motor.client.Client, follow=True) and take the job's own timestamp minus the
  time read just before the submit: submit -> job running, as ../shared/bench/peers/
  latency.sh measures it for the peers;
- `api_run_wall` (ms): from the same submits, until the terminal event arrives: the
  runner's whole round trip for one job, with no client start-up;
- `cli_run_wall` (ms): the wall time of a whole `motor run -- date` process (interpreter
  start, imports, submit, follow, exit): about `api_run_wall` plus the client's start-up;
- `cli_help_wall` (ms): `motor status --help` (start-up and imports only, no runner);
- `interpreter_wall` (ms, peer=python): `python -c pass`, the floor under any Python CLI.

In the same round, interleaved, it runs `latency.sh bare` and `latency.sh tsp` (tsp needs
the peers' `setup.sh`; a peer that cannot run is reported on a `#` line and skipped).
`--baseline-root DIR` also times `motor run -- date` and `motor status --help` with the
motor package found in DIR (e.g. an older checkout: `git archive REV | tar -x -C DIR`)
against the same runner, as peer=motor-baseline.

Before measuring, the motor package (and the baseline's) is byte-compiled
(`compileall`), as an installed package is: with PYTHONDONTWRITEBYTECODE set, every CLI
start would otherwise compile motor's sources again.

Every line carries the 1-minute load average (load1=) read when it was printed; the end
shows the medians over rounds of each round's median.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: ../shared from the repo root (a worktree under /work/wt: ../../shared)
PEERS = next((p for p in (ROOT.parent / "shared" / "bench" / "peers",
                          ROOT.parent.parent / "shared" / "bench" / "peers") if p.exists()),
             ROOT.parent / "shared" / "bench" / "peers")
sys.path.insert(0, str(ROOT))

from motor.client import Client  # noqa: E402
from motor.records import JobRequest, Output, Terminal  # noqa: E402


def load1() -> str:
    return f"{os.getloadavg()[0]:.2f}"


def emit(peer: str, metric: str, values: list[float], unit: str = "ms", extra: str = "") -> float:
    med = statistics.median(values)
    print(f"peer={peer} metric={metric} value={med:.3f} unit={unit} samples={len(values)} "
          f"min={min(values):.3f} max={max(values):.3f} load1={load1()}{' ' + extra if extra else ''}",
          flush=True)
    return med


def motor_env(root: Path | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("MOTOR_SOCKET", "MOTOR_STATE_DIR")}
    if root is not None:
        env["PYTHONPATH"] = str(root)
    return env


def start_runner(tmp: Path, isolation: str) -> tuple[subprocess.Popen, Path]:
    state = tmp / "state"
    log = open(tmp / "serve.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "motor", "serve", "--state-dir", str(state), "--max-weight", "2",
         "--free-space-floor-bytes", "0", "--isolation", isolation],
        stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=motor_env())
    log.close()
    sock = state / "motor.sock"
    deadline = time.monotonic() + 60
    while b"listening on" not in (tmp / "serve.log").read_bytes():
        if time.monotonic() > deadline or proc.poll() is not None:
            raise SystemExit(f"serve did not start: {(tmp / 'serve.log').read_text()}")
        time.sleep(0.01)
    return proc, sock


def api_latency(client: Client, i: int, walls: list[float] | None = None) -> float:
    """ms from just before the submit to the job's own `date +%s.%N`; with `walls`, also
    append the ms until the terminal event (the runner's whole round trip for one job)."""
    req = JobRequest(command=["date", "+%s.%N"], workspace=f"lat{i % 2}", weight_hint=1)
    p0 = time.perf_counter()
    t0 = time.time()
    out = ""
    with client.submit(req, follow=True) as stream:
        for event in stream:
            if isinstance(event, Output) and event.stream == "stdout":
                out += event.data
            elif isinstance(event, Terminal):
                if event.record["state"] != "succeeded":
                    raise SystemExit(f"latency job ended {event.record['state']}: {event.record}")
                if walls is not None:
                    walls.append((time.perf_counter() - p0) * 1000.0)
                break
    return (float(out.strip()) - t0) * 1000.0


def wall_ms(argv: list[str], cwd: Path, env: dict, expect: bytes | None = None) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(argv, cwd=cwd, env=env, capture_output=True)
    wall = (time.perf_counter() - t0) * 1000.0
    if r.returncode != 0 or (expect is not None and expect not in r.stdout):
        raise SystemExit(f"{argv}: exit {r.returncode}: {r.stderr.decode()[-500:]}")
    return wall


def peer_latency(peer: str, samples: int, gap: float) -> float | None:
    script = PEERS / "latency.sh"
    if not script.exists():
        print(f"# {peer}: {script} not found", flush=True)
        return None
    env = dict(os.environ, LAT_GAP=str(gap))
    r = subprocess.run(["bash", str(script), peer, str(samples)], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        print(f"# {peer}: {(r.stderr.strip() or r.stdout.strip())[-300:]}", flush=True)
        return None
    line = r.stdout.strip().splitlines()[-1]
    print(f"{line} load1={load1()}", flush=True)
    return float(dict(kv.split("=", 1) for kv in line.split())["value"])


def motor_round(args, medians: dict[str, list[float]]) -> None:
    with tempfile.TemporaryDirectory(prefix="motor-lat-") as tmp:
        proc, sock = start_runner(Path(tmp), args.isolation)
        try:
            with Client(sock, timeout=60) as client:
                client.health()
                api_latency(client, 0)  # warm: first workspace creation, first spawn
                lat: list[float] = []
                round_trip: list[float] = []
                for i in range(args.samples):
                    time.sleep(args.gap)
                    lat.append(api_latency(client, i, round_trip))
            key = "motor start_latency"
            medians.setdefault(key, []).append(
                emit("motor", "start_latency", lat, extra=f"isolation={args.isolation} via=api"))
            medians.setdefault("motor api_run_wall", []).append(
                emit("motor", "api_run_wall", round_trip, extra=f"isolation={args.isolation} via=api"))

            run = [sys.executable, "-m", "motor", "run", "--socket", str(sock), "--", "date"]
            roots: list[tuple[str, Path, dict]] = [("motor", ROOT, motor_env())]
            if args.baseline_root:
                base = Path(args.baseline_root).resolve()
                roots.append(("motor-baseline", base, motor_env(base)))
            for peer, cwd, env in roots:
                walls = []
                for _ in range(args.samples):
                    time.sleep(args.gap)
                    walls.append(wall_ms(run, cwd, env, expect=b"UTC"))
                medians.setdefault(f"{peer} cli_run_wall", []).append(
                    emit(peer, "cli_run_wall", walls, extra=f"isolation={args.isolation}"))
                helps = [wall_ms([sys.executable, "-m", "motor", "status", "--help"], cwd, env)
                         for _ in range(args.samples)]
                medians.setdefault(f"{peer} cli_help_wall", []).append(emit(peer, "cli_help_wall", helps))
            floor = [wall_ms([sys.executable, "-c", "pass"], ROOT, motor_env()) for _ in range(args.samples)]
            medians.setdefault("python interpreter_wall", []).append(emit("python", "interpreter_wall", floor))
        finally:
            proc.terminate()
            proc.wait(30)


def byte_compile(root: Path) -> None:
    import compileall

    compileall.compile_dir(str(root / "motor"), quiet=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--gap", type=float, default=0.3, help="idle seconds before each sample")
    ap.add_argument("--isolation", default="affinity")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--baseline-root", metavar="DIR")
    args = ap.parse_args()
    byte_compile(ROOT)
    if args.baseline_root:
        byte_compile(Path(args.baseline_root).resolve())
    print(f"# latency: rounds={args.rounds} samples={args.samples} isolation={args.isolation} "
          f"load1={load1()}", flush=True)
    medians: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        motor_round(args, medians)
        if not args.no_peers:
            for peer in ("bare", "tsp"):
                value = peer_latency(peer, args.samples, args.gap)
                if value is not None:
                    medians.setdefault(f"{peer} start_latency", []).append(value)
    print(f"# medians over {args.rounds} rounds (ms), load1={load1()}")
    for key, values in medians.items():
        print(f"# {key:<32} {statistics.median(values):9.3f}  ({len(values)} rounds)")
    if "bare start_latency" in medians:
        bare = statistics.median(medians["bare start_latency"])
        mine = statistics.median(medians["motor start_latency"])
        print(f"# motor start_latency / fork+exec (bare): {mine / bare:.2f}x")


if __name__ == "__main__":
    main()
