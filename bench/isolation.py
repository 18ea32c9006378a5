"""Per-job cost of an isolation backend: prepare, join, run, finish (medians), beside the load.

    python bench/isolation.py [--backend cgroup] [--n 40] [--rounds 3] [--gap-ms 100]
    python bench/isolation.py --backend systemd --systemd-namespace [--n 40]

cgroup: each job is `prepare` (the job's groups and limits), then a forked child joins the
groups (writes its pid into every `cgroup_procs` file, as the keeper does, timed in the
child: `join`), execs `true`, and is waited for (`run`, fork to reaped), then `finish`.
`--gap-ms` spaces the jobs out (the first join after an idle spell pays a kernel RCU grace
period on cgroup v1 hosts without favordynmods: docs/isolation.md); `--gap-ms 0` runs them
back to back. Also printed: the mkdir calls per prepare (the parent group is made once, at
start-up), and whether the kernel's favordynmods mount option is in effect.

systemd: each job is `prepare` (the job's slice over D-Bus), then a forked child that
joins the job's scope as the keeper does (`join`: StartTransientUnit with its own pid) and
execs `true` (`run`: fork to reaped; older code: `systemd-run --scope ... -- true`), then
`finish`; with the D-Bus round trips per job. `--systemd-namespace` runs the measurement inside a real
systemd that is PID 1 of its own namespaces (tests/isolation/systemd_ns.py; root, cgroup
v1 hosts), for hosts where PID 1 is not systemd.

`--runner N`: N `true` jobs through a real `motor serve --isolation <backend>` (2 slots,
inside the systemd namespace with `--systemd-namespace`): jobs/s, and the CPU time per job
of the runner, of the spawner (keeperd, or the forkserver) with its keepers and jobs, and
of systemd (PID 1): on a loaded 2-core host the CPU per job is the steadier figure.
`--warmup N` (default 4) jobs run first and are not counted: what a runner makes once (the
slot slices and keeperd's slot spares with systemd, keeperd's spare threads and groups with
cgroup) is made by then. keeperd's live children (its slot spares) count in its figure.

Lines in the peers' format (`peer=motor metric=... value=... unit=ms`), then medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from benchlib import motor_serve, socket_of

ROOT = Path(__file__).resolve().parent.parent


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def favordynmods() -> bool:
    return any("favordynmods" in line.split()[3].split(",")
               for line in Path("/proc/self/mounts").read_text().splitlines()
               if line.split()[2] in ("cgroup", "cgroup2"))


def pid_cpu_ms(pid: int) -> float:
    """utime + stime of a process, in ms."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK")


def own_cpu_ms() -> float:
    t = os.times()
    return (t.user + t.system + t.children_user + t.children_system) * 1000


def emit(metric: str, values: list[float], extra: str = "") -> float:
    values = [v for v in values if v == v]  # NaN: not measured
    if not values:
        return float("nan")
    med = statistics.median(values)
    print(f"peer=motor metric={metric} value={med:.3f} unit=ms n={len(values)} "
          f"max={max(values):.3f}{' ' + extra if extra else ''}", flush=True)
    return med


def join_and_run(spec: dict) -> tuple[float, float]:
    """Fork a child that joins the job's confinement as the keeper does (timed inside
    it: motor/isolation/join.py) and execs `true`; return (join ms, fork-to-reaped ms)."""
    try:
        from motor.isolation.join import join_confinement
    except ImportError:  # older code (bench it before/after): the keeper's inline loop
        def join_confinement(spec):
            for path in spec["cgroup_procs"]:
                with open(path, "w") as f:
                    f.write(str(os.getpid()))

    r, w = os.pipe()
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the child: join as the keeper does, then exec
        try:
            os.close(r)
            a = time.perf_counter()
            join_confinement(spec)
            os.write(w, f"{(time.perf_counter() - a) * 1000:.6f}".encode())
            os.close(w)
            os.execv("/bin/true", ["true"])
        finally:
            os._exit(127)
    os.close(w)
    join_ms = float(os.read(r, 64) or b"nan")
    os.close(r)
    os.waitpid(pid, 0)
    return join_ms, (time.perf_counter() - t0) * 1000


def bench_cgroup(args) -> None:
    from motor.isolation import cgroup as cg

    parent = f"motor-bench-{os.getpid()}"
    backend = cg.open_cgroup_backend(parent=parent)
    mkdirs = 0
    real_mkdir = os.mkdir

    def counting_mkdir(path, *a, **kw):
        nonlocal mkdirs
        mkdirs += 1
        return real_mkdir(path, *a, **kw)

    cg.os.mkdir = counting_mkdir
    cpu = max(os.sched_getaffinity(0))
    print(f"# cgroup v{backend.version} under {backend.flavour.describe_parent()}; "
          f"favordynmods={'on' if favordynmods() else 'off (per mount options)'}; "
          f"gap {args.gap_ms} ms; load {load()}", flush=True)
    try:
        for rnd in range(args.rounds):
            phases: dict[str, list[float]] = {"prepare": [], "join": [], "run": [], "finish": []}
            mkdirs = 0
            for i in range(args.n):
                time.sleep(args.gap_ms / 1000)
                jid = f"bench-{uuid.uuid4().hex}"
                t0 = time.perf_counter()
                fields = backend.prepare(jid, [cpu], 256 << 20)
                t1 = time.perf_counter()
                join_ms, run_ms = join_and_run(fields)
                t2 = time.perf_counter()
                result = backend.finish(jid)
                t3 = time.perf_counter()
                if result.get("cleanup_error"):
                    raise SystemExit(f"finish: {result['cleanup_error']}")
                phases["prepare"].append((t1 - t0) * 1000)
                phases["join"].append(join_ms)
                phases["run"].append(run_ms)
                phases["finish"].append((t3 - t2) * 1000)
            for name, values in phases.items():
                emit(f"cgroup_{name}", values, f"round={rnd} gap_ms={args.gap_ms}")
            print(f"# round {rnd}: mkdir calls per prepare {mkdirs / args.n:.2f}; "
                  f"load {load()}", flush=True)
    finally:
        cg.os.mkdir = real_mkdir
        for path in backend.flavour.parent_paths():
            try:
                os.rmdir(path)
            except OSError as exc:
                print(f"# cannot remove {path}: {exc}", file=sys.stderr)


def bench_systemd(args) -> None:
    from jeepney import HeaderFields

    from motor.isolation import systemd as sd

    backend = sd.open_systemd_backend()
    calls: dict[str, int] = {}
    real_call = sd.SystemdManager._call
    real_connect = sd.SystemdManager.connect

    def counting_call(self, message):
        member = message.header.fields.get(HeaderFields.member)
        calls[member] = calls.get(member, 0) + 1
        return real_call(self, message)

    def counting_connect(self):
        calls["(connect)"] = calls.get("(connect)", 0) + 1
        return real_connect(self)

    sd.SystemdManager._call = counting_call
    sd.SystemdManager.connect = counting_connect
    print(f"# systemd backend; {backend.notes[0]}; gap {args.gap_ms} ms; load {load()}",
          flush=True)
    for rnd in range(args.rounds):
        phases: dict[str, list[float]] = {"prepare": [], "join": [], "run": [], "finish": [],
                                          "total": []}
        calls.clear()
        pid1_before, own_before = pid_cpu_ms(1), own_cpu_ms()
        for i in range(args.n):
            time.sleep(args.gap_ms / 1000)
            jid = uuid.uuid4().hex
            t0 = time.perf_counter()
            fields = backend.prepare(jid, [max(os.sched_getaffinity(0))], 256 << 20)
            t1 = time.perf_counter()
            if "command_prefix" in fields:  # before the join step started the scope itself
                join_ms = float("nan")
                subprocess.run([*fields["command_prefix"], "/bin/true"], check=True)
            else:
                join_ms, _ = join_and_run(fields)
            t2 = time.perf_counter()
            result = backend.finish(jid)
            t3 = time.perf_counter()
            if result.get("cleanup_error") or result.get("start_error"):
                raise SystemExit(f"finish: {result}")
            for name, value in (("prepare", t1 - t0), ("run", t2 - t1), ("finish", t3 - t2),
                                ("total", t3 - t0)):
                phases[name].append(value * 1000)
            phases["join"].append(join_ms)
        for name, values in phases.items():
            emit(f"systemd_{name}", values, f"round={rnd}")
        pid1_cpu = (pid_cpu_ms(1) - pid1_before) / args.n
        own_cpu = (own_cpu_ms() - own_before) / args.n
        print(f"peer=motor metric=systemd_cpu_per_job value={pid1_cpu + own_cpu:.2f} unit=ms "
              f"systemd_pid1={pid1_cpu:.2f} bench_and_children={own_cpu:.2f} round={rnd}",
              flush=True)
        per_job = ", ".join(f"{k} {v / args.n:.2f}" for k, v in sorted(calls.items()))
        print(f"# round {rnd}: D-Bus calls per job: {per_job}; load {load()}", flush=True)


def children(pid: int) -> list[int]:
    """The children of every thread of `pid`."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def find_spawner(runner: int, state: str) -> int | None:
    """The runner's spawner: keeperd (started detached, `keeperd.py STATE_DIR`) or the
    forkserver (a child of the runner), whichever runs."""
    for c in children(runner):
        if b"forkserver" in Path(f"/proc/{c}/cmdline").read_bytes():
            return c
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"keeperd.py") for a in argv) and state.encode() in argv:
            return int(entry.name)
    return None


def tree_cpu_ms(pid: int) -> float:
    """utime+stime of a process and of its reaped descendants (cutime, cstime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) * 1000 / os.sysconf("SC_CLK_TCK")


def live_tree_cpu_ms(pid: int) -> dict[int, float]:
    """tree_cpu_ms of each live child of `pid` (keeperd's slot spares: their CPU is in
    keeperd's cutime only once they are reaped)."""
    out = {}
    for c in children(pid):
        try:
            out[c] = tree_cpu_ms(c)
        except OSError:
            pass
    return out


def settle_until_idle(c) -> None:
    """Until nothing is queued or running."""
    while True:
        status = c.get("/v1/status").json()
        if not status["queued"] and not status["running"]:
            return
        time.sleep(0.02)  # light polling: its CPU counts in the runner's


def bench_runner(args) -> None:
    """N `true` jobs through a real `motor serve` (2 slots): the wall time, and the CPU
    time per job of the runner, of the forkserver with its keepers and jobs, and (systemd)
    of PID 1: the figure that decides throughput on a loaded 2-core host."""
    import httpx

    with tempfile.TemporaryDirectory(prefix="motor-bench-") as tmp, motor_serve(
            Path(tmp), ROOT, "--max-weight", "2", "--max-queue-depth", str(args.runner + 10),
            "--free-space-floor-bytes", "0", "--isolation", args.backend,
            namespace=args.systemd_namespace) as serve:
        proc, state, ns = serve.proc, serve.state, serve.ns
        sock = socket_of(serve)
        runner = proc.pid
        while Path(f"/proc/{runner}/comm").read_text().strip() == "nsenter":
            runner = children(runner)[0]  # nsenter forks the runner in the namespace
        parts = {"runner": runner}
        deadline = time.monotonic() + 30
        while len(parts) == 1:  # the spawner: keeperd (detached) or the forkserver (a child)
            spawner = find_spawner(runner, str(state))
            if spawner is not None:
                parts["spawner_keepers_jobs"] = spawner
            elif time.monotonic() > deadline:
                raise SystemExit("no keeperd or forkserver found")
            else:
                time.sleep(0.05)
        if ns is not None:
            parts["systemd_pid1"] = ns.pid1
        transport = httpx.HTTPTransport(uds=str(sock))
        with httpx.Client(transport=transport, base_url="http://motor", timeout=60) as c:
            c.get("/v1/health").raise_for_status()
            # warm-up jobs, not counted: what a runner that has served jobs has made
            # once (keeperd's spare threads and spare groups, its slot spares, the
            # slot slices), as in the steady state the row is about
            for i in range(args.warmup):
                c.post("/v1/jobs", json={"command": ["true"], "weight_hint": 1,
                                         "workspace": f"warm{i}"}).raise_for_status()
            settle_until_idle(c)
            time.sleep(0.3)  # keeperd's refills (spare threads) made in idle time
            spawner = parts["spawner_keepers_jobs"]
            before = {k: tree_cpu_ms(p) for k, p in parts.items()}
            live_before = live_tree_cpu_ms(spawner)
            t0 = time.perf_counter()
            for i in range(args.runner):
                r = c.post("/v1/jobs", json={"command": ["true"], "weight_hint": 1,
                                             "workspace": f"ws{i % 4}"})
                r.raise_for_status()
            settle_until_idle(c)
            wall = time.perf_counter() - t0
            after = {k: tree_cpu_ms(p) for k, p in parts.items()}
            live_after = live_tree_cpu_ms(spawner)  # made during the run: all of it
            after["spawner_keepers_jobs"] += sum(
                ms - live_before.get(child, 0.0) for child, ms in live_after.items())
            jobs = c.get("/v1/jobs", params={"all": 1}).json()
            ok = sum(1 for j in jobs if j["state"] == "succeeded"
                     and not str(j.get("workspace")).startswith("warm"))
        per_job = {k: (after[k] - before[k]) / args.runner for k in parts}
        warnings = [line for line in (Path(tmp) / "serve.log").read_text(
            errors="replace").splitlines() if "WARNING" in line or "ERROR" in line]
        for line in warnings[:5]:
            print(f"# serve: {line[:300]}", flush=True)
        total = sum(per_job.values())
        print(f"peer=motor metric=runner_cpu_per_job value={total:.2f} unit=ms "
              + " ".join(f"{k}={v:.2f}" for k, v in per_job.items())
              + f" isolation={args.backend} jobs_per_s={args.runner / wall:.1f} "
              f"succeeded={ok}/{args.runner} warnings={len(warnings)} "
              f"load1={load().split()[0]}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=("cgroup", "systemd", "affinity"), default="cgroup",
                    help="affinity: --runner only")
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gap-ms", type=float, default=100.0)
    ap.add_argument("--systemd-namespace", action="store_true")
    ap.add_argument("--warmup", type=int, default=4, metavar="N",
                    help="--runner: N jobs first, not counted (default 4)")
    ap.add_argument("--runner", type=int, default=0, metavar="N",
                    help="N true jobs through a real motor serve: wall and CPU per job")
    args = ap.parse_args()
    if args.runner:
        for _ in range(args.rounds):
            bench_runner(args)
        return
    if args.systemd_namespace:
        sys.path.insert(0, str(ROOT / "tests" / "isolation"))
        from systemd_ns import SystemdNamespace

        argv = [a for a in sys.argv[1:] if a != "--systemd-namespace"]
        with tempfile.TemporaryDirectory(prefix="motor-bench-") as tmp:
            ns = SystemdNamespace(Path(tmp)).start()
            try:
                rc = subprocess.run(ns.enter(sys.executable, __file__, *argv,
                                             cwd=str(ROOT))).returncode
            finally:
                ns.stop()
        raise SystemExit(rc)
    if args.backend == "cgroup":
        bench_cgroup(args)
    else:
        bench_systemd(args)


if __name__ == "__main__":
    main()
