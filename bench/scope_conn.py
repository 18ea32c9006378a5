"""systemd's CPU per job scope: each forked child opening its own connection (the old
keeperd path, still the forkserver's: motor/isolation/join.py start_scope) against keeperd's
one kept connection (motor/execution/sdscopes.py ScopeStarter, the child's pid in PIDs).

    python bench/scope_conn.py [--n 60] [--rounds 3]

Runs inside a systemd that is PID 1 of its own namespaces (tests/isolation/systemd_ns.py;
root, cgroup v1 hosts). Per round and mode: N job slices made beforehand (not measured),
then N scopes, one at a time, each for a forked child that waits on a pipe and exits once
its scope holds it; PID 1's CPU time (utime+stime) over those N, per scope. The modes
alternate within each round. Lines in the peers' format, then the load average.
"""

from __future__ import annotations

import argparse
import os
import selectors
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def pid_cpu_ms(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK")


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def own_connection(fields: dict) -> None:
    """The old path: the child starts its own scope over its own connection."""
    from motor.isolation.join import join_confinement

    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            join_confinement(fields)
        except BaseException:
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if status:
        raise SystemExit("own connection: the child's scope failed")


def kept_connection(starter, sel, fields: dict) -> None:
    """keeperd's path: the child waits; keeperd asks for the scope with the child's pid."""
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(go_w)
        os._exit(0 if os.read(go_r, 1) == b"g" else 1)
    os.close(go_r)
    results: list = []
    starter.start(fields["systemd_scope"], pid, results.append)
    while not results:
        for key, events in sel.select(10):
            key.data(events)
    os.write(go_w, b"g" if results[0] is None else b"e")
    os.close(go_w)
    _, status = os.waitpid(pid, 0)
    if results[0] is not None or status:
        raise SystemExit(f"kept connection: {results[0]}")


def measure(args) -> None:
    from motor.execution.sdscopes import ScopeStarter
    from motor.isolation.systemd import open_systemd_backend

    backend = open_systemd_backend()
    sel = selectors.EpollSelector()
    starter = ScopeStarter(sel, lambda line: None)
    print(f"# scope start, systemd PID 1 CPU per scope; n {args.n}; load {load()}", flush=True)
    for rnd in range(args.rounds):
        for mode in ("own_connection", "kept_connection"):
            jobs = [uuid.uuid4().hex for _ in range(args.n)]
            specs = [backend.prepare(j, None, None) for j in jobs]
            before = pid_cpu_ms(1)
            for fields in specs:
                if mode == "own_connection":
                    own_connection(fields)
                else:
                    kept_connection(starter, sel, fields)
            per = (pid_cpu_ms(1) - before) / args.n
            starter.close()  # no kept connection open (and fed signals) in the other mode
            for j in jobs:
                backend.finish(j)
            print(f"peer=motor metric=systemd_scope_cpu value={per:.2f} unit=ms mode={mode} "
                  f"round={rnd} connections_opened={starter.opened} load1={load().split()[0]}",
                  flush=True)
    starter.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inside:
        measure(args)
        return
    sys.path.insert(0, str(ROOT / "tests" / "isolation"))
    from systemd_ns import SystemdNamespace

    with tempfile.TemporaryDirectory(prefix="motor-bench-") as tmp:
        ns = SystemdNamespace(Path(tmp)).start()
        try:
            rc = subprocess.run(ns.enter(sys.executable, __file__, "--inside", *sys.argv[1:],
                                         cwd=str(ROOT))).returncode
        finally:
            ns.stop()
    raise SystemExit(rc)


if __name__ == "__main__":
    main()
