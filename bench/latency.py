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
- `cli_run_cpu` (ms): user+system CPU of each `motor run -- date` process (what the client
  itself costs; steadier than the wall under load);
- `cli_imports` (ms): the sum of `python -X importtime` self times of one `motor run -- date`
  beyond those of `python -c pass` (the client's own imports; min over the samples);
- `interpreter_wall` (ms, peer=python): `python -c pass`, the floor under any Python CLI;
  `interpreter_nosite_wall`: `python -S -c pass` (no site, no .pth files: the bare
  interpreter); `interpreter_cpu`, `interpreter_nosite_cpu`: their user+system CPU.

Each client figure comes in up to three forms (peer=): `motor` runs `python -m motor` of
this checkout's venv (an editable install, whose import hook site loads at every start:
pathlib, urllib, importlib.util); `motor-script` runs the venv's console script `motor`;
`motor-installed` runs a console script like pip's (`from motor.cli import console`) in a
throwaway venv that has motor and its dependencies on plain sys.path entries, as a wheel
install has them (no editable hook); its `interpreter_wall` is that venv's `python -c pass`.

In the same round, interleaved, it runs `latency.sh bare` and `latency.sh tsp` (tsp needs
the peers' `setup.sh`; a peer that cannot run is reported on a `#` line and skipped).
`--baseline-root DIR` also times `motor run -- date` and `motor status --help` with the
motor package found in DIR (e.g. an older checkout: `git archive REV | tar -x -C DIR`)
against the same runner, as peer=motor-baseline; and, in the same round right after this
checkout's, `start_latency` and `api_run_wall` with DIR's client against a runner of DIR's
(a child process of this script that imports DIR's motor), as peer=motor-baseline.

Before measuring, the motor package (and the baseline's) is byte-compiled
(`compileall`), as an installed package is: with PYTHONDONTWRITEBYTECODE set, every CLI
start would otherwise compile motor's sources again.

Every line carries the 1-minute load average (load1=) read when it was printed; the end
shows the medians over rounds of each round's median.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import PEERS, byte_compile, fs_note, load1

ROOT = Path(__file__).resolve().parent.parent
#: the motor this process imports and whose runner it starts: this checkout's, or, in the
#: `--api-only` child that `--baseline-root` runs, the baseline's (its client and runner)
MOTOR_ROOT = Path(os.environ.get("LATENCY_MOTOR_ROOT") or ROOT).resolve()
sys.path.insert(0, str(MOTOR_ROOT))

from motor.client import Client  # noqa: E402
from motor.records import JobRequest, Output, Terminal  # noqa: E402


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


def start_runner(tmp: Path, isolation: str,
                 motor: tuple[str, ...] = (sys.executable, "-m", "motor"), *extra: str,
                 ) -> tuple[subprocess.Popen, Path]:
    """`motor serve` (`motor`: the command that runs motor; `extra`: more of serve's
    options) on a state dir under `tmp`, once it listens: the process and its socket."""
    state = tmp / "state"
    log = open(tmp / "serve.log", "wb")
    proc = subprocess.Popen(
        [*motor, "serve", "--state-dir", str(state), "--max-weight", "2",
         "--free-space-floor-bytes", "0", "--isolation", isolation, *extra],
        stdout=log, stderr=subprocess.STDOUT, cwd=MOTOR_ROOT,
        env=motor_env(None if MOTOR_ROOT == ROOT else MOTOR_ROOT))
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


def wall_ms(argv: list[str], cwd: Path, env: dict, expect: bytes | None = None,
            cpu: list[float] | None = None) -> float:
    """The wall ms of one process; with `cpu`, also append its user+system CPU ms."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(argv, cwd=cwd, env=env, capture_output=True)
    wall = (time.perf_counter() - t0) * 1000.0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0 or (expect is not None and expect not in r.stdout):
        raise SystemExit(f"{argv}: exit {r.returncode}: {r.stderr.decode()[-500:]}")
    if cpu is not None:
        cpu.append((after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) * 1000.0)
    return wall


def import_self_us(python: str, args: list[str], cwd: Path, env: dict) -> dict[str, int]:
    """module -> self import time (us) of one `python -X importtime ARGS` process."""
    r = subprocess.run([python, "-X", "importtime", *args], cwd=cwd, env=env, capture_output=True)
    times = {}
    for line in r.stderr.decode(errors="replace").splitlines():
        if line.startswith("import time:") and "|" in line:
            self_us, _, name = line[len("import time:"):].split("|")
            if self_us.strip().isdigit():
                times[name.strip()] = int(self_us)
    return times


def client_imports_ms(argv: list[str], python: str, cwd: Path, env: dict, samples: int) -> list[float]:
    """The client's own import time (ms): self times of the modules `argv` (a python command
    line, or a script run by `python`) imports beyond what `python -c pass` imports, each
    module's minimum over `samples` runs (the minimum is what load does not add)."""
    floor = set()
    for _ in range(2):
        floor |= set(import_self_us(python, ["-c", "pass"], cwd, env))
    args = argv[1:] if argv[0] == python else argv
    best: dict[str, int] = {}
    for _ in range(samples):
        for name, us in import_self_us(python, args, cwd, env).items():
            if name not in floor:
                best[name] = min(us, best.get(name, us))
    return [sum(best.values()) / 1000.0]


def installed_env(tmp: Path) -> Path | None:
    """A venv where motor and its dependencies sit on plain sys.path entries (a .pth of
    paths, as a wheel install puts packages in site-packages: no editable import hook), with
    a `motor` console script as pip writes it. Its python, or None if venv fails."""
    import site
    import sysconfig

    venv = tmp / "installed"
    r = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], capture_output=True)
    if r.returncode != 0:
        print(f"# motor-installed: venv failed: {r.stderr.decode()[-300:]}", flush=True)
        return None
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True).stdout.strip()
    ours = [p for p in site.getsitepackages() + [sysconfig.get_paths()["purelib"]] if os.path.isdir(p)]
    (Path(purelib) / "motor_bench.pth").write_text("\n".join([str(ROOT), *dict.fromkeys(ours)]) + "\n")
    script = venv / "bin" / "motor"
    script.write_text(f"#!{python}\n# -*- coding: utf-8 -*-\nimport re\nimport sys\nfrom motor.cli import console\n"
                      "if __name__ == '__main__':\n"
                      "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n"
                      "    sys.exit(console())\n")
    script.chmod(0o755)
    return python


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


def api_samples(sock: Path, samples: int, gap: float) -> tuple[list[float], list[float]]:
    """`start_latency` and `api_run_wall` samples against the runner on `sock`, one client."""
    with Client(sock, timeout=60) as client:
        client.health()
        api_latency(client, 0)  # warm: first workspace creation, first spawn
        lat: list[float] = []
        round_trip: list[float] = []
        for i in range(samples):
            time.sleep(gap)
            lat.append(api_latency(client, i, round_trip))
    return lat, round_trip


def api_only(args) -> None:
    """The `--api-only` child: a runner of MOTOR_ROOT's motor, its samples as JSON."""
    with tempfile.TemporaryDirectory(prefix="motor-lat-") as tmp:
        proc, sock = start_runner(Path(tmp), args.isolation)
        try:
            lat, round_trip = api_samples(sock, args.samples, args.gap)
        finally:
            proc.terminate()
            proc.wait(30)
    print(json.dumps({"start_latency": lat, "api_run_wall": round_trip}))


def emit_api(peer: str, lat: list[float], round_trip: list[float], args,
             medians: dict[str, list[float]]) -> None:
    extra = f"isolation={args.isolation} via=api"
    medians.setdefault(f"{peer} start_latency", []).append(
        emit(peer, "start_latency", lat, extra=extra))
    medians.setdefault(f"{peer} api_run_wall", []).append(
        emit(peer, "api_run_wall", round_trip, extra=extra))


def baseline_api_round(args, medians: dict[str, list[float]]) -> None:
    """The same API samples with the baseline's client and runner (a child process that
    imports the baseline's motor), as peer=motor-baseline."""
    base = Path(args.baseline_root).resolve()
    out = subprocess.run(
        [sys.executable, __file__, "--api-only", "--samples", str(args.samples),
         "--gap", str(args.gap), "--isolation", args.isolation],
        env={**motor_env(base), "LATENCY_MOTOR_ROOT": str(base)}, capture_output=True, check=True)
    got = json.loads(out.stdout.decode().splitlines()[-1])
    emit_api("motor-baseline", got["start_latency"], got["api_run_wall"], args, medians)


def motor_round(args, medians: dict[str, list[float]]) -> None:
    with tempfile.TemporaryDirectory(prefix="motor-lat-") as tmp:
        proc, sock = start_runner(Path(tmp), args.isolation)
        try:
            emit_api("motor", *api_samples(sock, args.samples, args.gap), args, medians)
            if args.baseline_root:
                baseline_api_round(args, medians)

            run_args = ["run", "--socket", str(sock), "--", "date"]
            # (peer, the command before its arguments, the python it runs on, cwd, env)
            clients: list[tuple[str, list[str], str, Path, dict]] = [
                ("motor", [sys.executable, "-m", "motor"], sys.executable, ROOT, motor_env())]
            script = Path(sys.executable).with_name("motor")
            if script.exists():
                clients.append(("motor-script", [str(script)], sys.executable, ROOT, motor_env()))
            installed = installed_env(Path(tmp))
            if installed is not None:
                clients.append(("motor-installed", [str(installed.with_name("motor"))], str(installed),
                                Path(tmp), motor_env()))
            if args.baseline_root:
                base = Path(args.baseline_root).resolve()
                clients.append(("motor-baseline", [sys.executable, "-m", "motor"], sys.executable, base,
                                motor_env(base)))
            for peer, prefix, python, cwd, env in clients:
                walls: list[float] = []
                cpus: list[float] = []
                for _ in range(args.samples):
                    time.sleep(args.gap)
                    walls.append(wall_ms(prefix + run_args, cwd, env, expect=b"UTC", cpu=cpus))
                medians.setdefault(f"{peer} cli_run_wall", []).append(
                    emit(peer, "cli_run_wall", walls, extra=f"isolation={args.isolation}"))
                medians.setdefault(f"{peer} cli_run_cpu", []).append(emit(peer, "cli_run_cpu", cpus))
                if peer != "motor-baseline":
                    medians.setdefault(f"{peer} cli_imports", []).append(
                        emit(peer, "cli_imports", client_imports_ms(prefix + run_args, python, cwd, env,
                                                                    args.samples)))
                helps = [wall_ms(prefix + ["status", "--help"], cwd, env) for _ in range(args.samples)]
                medians.setdefault(f"{peer} cli_help_wall", []).append(emit(peer, "cli_help_wall", helps))
            floors = [("python", [sys.executable, "-c", "pass"], "interpreter_wall"),
                      ("python", [sys.executable, "-S", "-c", "pass"], "interpreter_nosite_wall")]
            if installed is not None:
                floors.append(("python-installed", [str(installed), "-c", "pass"], "interpreter_wall"))
            for peer, argv, metric in floors:
                floor_cpu: list[float] = []
                floor = [wall_ms(argv, ROOT, motor_env(), cpu=floor_cpu) for _ in range(args.samples)]
                medians.setdefault(f"{peer} {metric}", []).append(emit(peer, metric, floor))
                cpu_metric = metric.replace("_wall", "_cpu")
                medians.setdefault(f"{peer} {cpu_metric}", []).append(emit(peer, cpu_metric, floor_cpu))
        finally:
            proc.terminate()
            proc.wait(30)


def samples_parser(doc: str, samples: int) -> argparse.ArgumentParser:
    """The arguments of a script that takes start-latency samples: --rounds, --samples,
    --gap, --isolation, --no-peers."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--samples", type=int, default=samples)
    ap.add_argument("--gap", type=float, default=0.3, help="idle seconds before each sample")
    ap.add_argument("--isolation", default="affinity")
    ap.add_argument("--no-peers", action="store_true")
    return ap


def main() -> None:
    ap = samples_parser(__doc__, samples=10)
    ap.add_argument("--baseline-root", metavar="DIR")
    ap.add_argument("--api-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.api_only:
        api_only(args)
        return
    fs_note()
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
