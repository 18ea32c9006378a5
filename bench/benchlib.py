"""What several bench scripts share (imported from bench/, the scripts' own directory)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace


def fs_note(path: str | None = None) -> None:
    """Print a `#` line when the benches' state directories (tempfile's directory, as
    TMPDIR sets it) are on ext2/3/4 without a journal: there every file a job creates costs
    several times more for minutes after deletions (docs/performance.md, "The host's file
    system"); bench/journaled_fs.sh makes a journaled one."""
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from motor.disk.fsinfo import state_filesystem

    where = path or tempfile.gettempdir()
    info = state_filesystem(where)
    if info and info.get("journal") is False:
        print(f"# state directories in {where}: {info['type']} without a journal"
              f" ({info['source']}); after deletions file creation there is slow for minutes"
              " (bench/journaled_fs.sh, docs/performance.md)", flush=True)


@contextmanager
def motor_serve(tmp: Path, root: Path, *args: str, namespace: bool = False,
                env: dict | None = None):
    """`python -m motor serve --state-dir TMP/state ARGS` of `root`'s checkout, its output in
    TMP/serve.log; with `namespace`, inside a systemd that is PID 1 of its own namespaces
    (tests/isolation/systemd_ns.py, as `--isolation systemd` needs on this host). Yields
    its `proc`, `state` dir, `started` (`time.perf_counter()` just before its exec: the
    namespace's own start not counted) and `ns` (the namespace or None); stopped on exit,
    the namespace with it."""
    ns, prefix = None, []
    if namespace:
        sys.path.insert(0, str(root / "tests" / "isolation"))
        from systemd_ns import SystemdNamespace

        ns = SystemdNamespace(tmp).start()
        prefix = ns.enter(cwd=str(root))
    state = tmp / "state"
    log = open(tmp / "serve.log", "wb")
    started = time.perf_counter()
    proc = subprocess.Popen([*prefix, sys.executable, "-m", "motor", "serve", "--state-dir",
                             str(state), *args], stdout=log, stderr=subprocess.STDOUT,
                            cwd=root, env=env)
    try:
        yield SimpleNamespace(proc=proc, state=state, started=started, ns=ns,
                              log=tmp / "serve.log")
    finally:
        if ns is not None:
            ns.stop()  # ends the runner (inside) and everything else in the namespace
        else:
            proc.terminate()
        proc.wait(30)
        log.close()


def socket_of(serve, timeout: float = 30.0) -> Path:
    """The socket of a `motor_serve` runner, once it is there; SystemExit with the runner's
    output when it does not come within `timeout` or the runner ends first."""
    sock = serve.state / "motor.sock"
    deadline = time.monotonic() + timeout
    while not sock.exists():
        if time.monotonic() > deadline or serve.proc.poll() is not None:
            raise SystemExit(f"serve did not start: {serve.log.read_text()}")
        time.sleep(0.01)
    return sock


def byte_compile(root: Path) -> None:
    """Byte-compile `root`'s motor package, as an installed package is: with
    PYTHONDONTWRITEBYTECODE set, every start would otherwise compile its sources again."""
    import compileall

    compileall.compile_dir(str(root / "motor"), quiet=1)


def ended_jobs(sock: Path) -> list:
    """Every retained job's record (motor.client's `JobRecord`) once each has its end
    stored. A job leaves `GET /v1/status` as its permits return, and its terminal record is
    committed with the next job's start or just after it (docs/scheduling.md, "A job's end
    rides with the next start"): read in that moment, its record still says `setup` or
    `running` (stop 83: with every commit held 10 ms, one job of a burst did). Such a job's
    events are followed to their end, and the records read again."""
    from motor.client import Client

    with Client(sock, timeout=60) as client:
        while True:
            jobs = client.jobs(all=True)
            unended = [j for j in jobs if not j.terminal]
            if not unended:
                return jobs
            for _ in client.events(unended[0].job_id):
                pass


def host_busy_s() -> float:
    """CPU seconds the whole host has spent busy (every CPU, every process: /proc/stat's
    first line, all but idle and iowait; guest time is in user and nice already) since
    boot. Two readings around a burst, over its jobs, give the host's CPU per job, whoever
    spent it (the runner, keeperd, the jobs, the client, a peer's server)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]  # user .. steal
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user and system, every thread) process `pid` has spent: /proc/PID/stat's
    utime and stime, in clock ticks. Two readings around a burst give one process's own
    part of the host's CPU (`host_busy_s`), the other processes' load not in it."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command's name
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sched_s(pid: int) -> tuple[float, float]:
    """(seconds on a CPU, seconds waiting runnable for one) of process `pid`'s threads
    alive now: /proc/PID/task/*/schedstat, in nanoseconds, so two readings around a burst
    measure what /proc/PID/stat's clock ticks only sample. The wait is the time the process
    could have run and did not (behind other processes: docs/performance.md, "The budget at
    task-spooler's rate"). Threads that ended meanwhile are not counted."""
    on = wait = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                run_ns, wait_ns, _slices = f.read().split()
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended between the listing and the read
        on, wait = on + int(run_ns), wait + int(wait_ns)
    return on / 1e9, wait / 1e9


_REPO = Path(__file__).resolve().parent.parent
#: the peers' scripts: ../shared/bench/peers from the repo root (a worktree under /work/wt:
#: ../../shared)
PEERS = next((p for p in (_REPO.parent / "shared" / "bench" / "peers",
                          _REPO.parent.parent / "shared" / "bench" / "peers") if p.exists()),
             _REPO.parent / "shared" / "bench" / "peers")


def peer_line(script: str, args: list[str], env: dict | None = None) -> str | None:
    """The peer's figure line from PEERS/SCRIPT (a `#` line when it could not run)."""
    r = subprocess.run(["bash", str(PEERS / script), *args], capture_output=True, text=True,
                       env=dict(os.environ, **(env or {})))
    for line in r.stdout.splitlines():
        if line.startswith("peer="):
            return line
    print(f"# {script} {' '.join(args)}: {r.stderr.strip()[-300:]}", flush=True)
    return None


def field(line: str, name: str) -> float:
    """A figure line's `name=` value."""
    return float(line.split(f"{name}=")[1].split()[0])


def load1() -> str:
    """The 1-minute load average, as every figure line carries it (load1=)."""
    return f"{os.getloadavg()[0]:.2f}"


def ab_parser(doc: str, *, rounds: int | None = None) -> argparse.ArgumentParser:
    """The arguments of a bench that runs this checkout's motor, and with `--baseline-root
    DIR` another checkout's, interleaved (`peers`): `--isolation`, `--baseline-root` and,
    given a default, `--rounds`. The script adds its own."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    if rounds is not None:
        ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--isolation", default="affinity")
    ap.add_argument("--baseline-root", metavar="DIR",
                    help="also run the motor package found in DIR (peer=motor-baseline)")
    return ap


def peers(root: Path, baseline_root: str | None) -> list[tuple[str, Path]]:
    """(peer name, the checkout whose motor package a round imports): this checkout, and
    `--baseline-root DIR` as peer=motor-baseline when given."""
    out = [("motor", root)]
    if baseline_root:
        out.append(("motor-baseline", Path(baseline_root).resolve()))
    return out


def run_round(script: str, root: Path, *args: str) -> dict:
    """Run `script` (python source) in a fresh interpreter that imports motor from `root`;
    its last stdout line, as JSON. A failed round ends the bench with its stderr."""
    env = dict(os.environ, PYTHONPATH=str(root))
    r = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                       cwd=root, env=env)
    if r.returncode != 0:
        raise SystemExit(f"round in {root} failed: {r.stderr[-1500:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


#: Python source that a round script starts with (`ROUND = BURST + r"""..."""`): it runs in the
#: round's fresh interpreter against the motor of the tree under test (this one or a
#: baseline), so it is text, not an import, and uses only the embedding API every measured
#: tree has. `warm_runner(iso, depth)`: an embedded runner (`max_weight=2`) on a fresh state
#: directory, one job run first (keeperd up, code loaded); `burst(runner, n, command)`: N
#: jobs of claim 1 over 4 workspaces submitted at once, then each followed to its end; their
#: ids.
BURST = r"""
import contextlib as _contextlib, tempfile as _tempfile
import motor as _motor

@_contextlib.asynccontextmanager
async def warm_runner(iso, depth):
    # keeperd outlives the runner (by design) and may still remove its files as the
    # directory goes: a round's leftovers are not worth its figures
    with _tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as state:
        config = _motor.RunnerConfig(state_dir=state, max_weight=2, isolation=iso,
                                     free_space_floor_bytes=0, max_queue_depth=depth)
        async with _motor.open_runner(config) as runner:
            first = await runner.submit(_motor.JobRequest(command=["true"], workspace="w",
                                                          weight_hint=1))
            async for _ in runner.events(first.job_id):
                pass
            yield runner

async def burst(runner, n, command=("true",)):
    ids = [(await runner.submit(_motor.JobRequest(
        command=list(command), workspace=f"ws{i % 4}", weight_hint=1))).job_id
        for i in range(n)]
    for job_id in ids:
        async for _ in runner.events(job_id):
            pass
    return ids
"""
