"""A real systemd as PID 1, for the systemd backend's tests, on a host where it is not.

`SystemdNamespace.start()` runs /lib/systemd/systemd as PID 1 of new PID, mount and cgroup
namespaces, inside a fresh group in every cgroup v1 hierarchy (under this process's own
groups), with:

- its own /proc, /run (tmpfs: the manager's private socket lives there) and /sys/fs/cgroup
  (a new tmpfs with the hierarchies mounted again, rooted at the namespace's groups), so
  nothing it mounts or remounts reaches the host;
- empty unit and generator directories bind-mounted over the system ones, and a single
  empty target to boot into: no services, no tmpfiles, no udev, only the manager.

Commands run inside with `enter(...)` (nsenter into the three namespaces). `stop()` kills
PID 1 of the namespace (the kernel then kills everything in it) and removes the groups.

The harness needs root, util-linux unshare/nsenter, systemd, and a cgroup v1 (or hybrid)
host; `unavailable()` says why not, for a test skip.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

SYSTEMD = "/lib/systemd/systemd"
CGROUP_ROOT = "/sys/fs/cgroup"
GENERATOR_DIRS = ("/lib/systemd/system-generators", "/usr/lib/systemd/system-generators",
                  "/lib/systemd/system", "/etc/systemd/system")

INNER = """#!/bin/sh
# PID 1 of the new namespaces until it execs systemd.
set -e
mount --make-rprivate /
mount -t proc proc /proc
mount -t tmpfs tmpfs /run
mkdir -p /run/motor-empty /run/motor-units
# empty stand-ins for the targets a service's default dependencies name
for t in motor-test sysinit basic shutdown slices sockets paths timers local-fs network multi-user; do
    printf '[Unit]\\nDescription=%s (empty)\\n' $t > /run/motor-units/$t.target
done
mount -t tmpfs tmpfs {cgroup_root}
{mount_hierarchies}
for d in {unit_dirs}; do [ -d "$d" ] && mount --bind /run/motor-units "$d"; done
for d in {generator_dirs}; do [ -d "$d" ] && mount --bind /run/motor-empty "$d"; done
exec env container=motor-test {systemd} --system --unit=motor-test.target --log-target=console
"""


def cgroup_hierarchies(mounts: str = "/proc/self/mounts") -> list[tuple[str, str, str]]:
    """(mount point, fstype, options) of every cgroup hierarchy mounted under /sys/fs/cgroup."""
    out = []
    for line in Path(mounts).read_text().splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[2] in ("cgroup", "cgroup2") \
                and fields[1].startswith(CGROUP_ROOT + "/"):
            opts = [o for o in fields[3].split(",")
                    if o not in ("rw", "ro", "relatime", "nosuid", "nodev", "noexec")]
            out.append((fields[1], fields[2], ",".join(opts) or "none"))
    return out


def own_group(kind: str, options: str) -> str:
    """This process's group in a hierarchy (from /proc/self/cgroup)."""
    wanted = set(options.split(","))
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        num, controllers, path = line.split(":", 2)
        if kind == "cgroup2" and num == "0" and not controllers:
            return path
        if kind == "cgroup" and controllers and set(controllers.split(",")) == wanted:
            return path
    return "/"


def unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (namespaces, mounts, cgroups)"
    for tool in ("unshare", "nsenter", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if not os.path.exists(SYSTEMD):
        return f"{SYSTEMD} is not installed"
    if os.path.exists(os.path.join(CGROUP_ROOT, "cgroup.controllers")):
        return "this harness supports cgroup v1 and hybrid hosts only (here /sys/fs/cgroup is v2)"
    names = {opts for _, kind, opts in cgroup_hierarchies() if kind == "cgroup"}
    if not any("memory" in o.split(",") for o in names):
        return "no cgroup v1 memory hierarchy"
    if not any("name=systemd" in o.split(",") for o in names):
        return "no name=systemd hierarchy"
    return None


class SystemdNamespace:
    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.name = f"motor-sdtest-{os.getpid()}-{time.monotonic_ns()}"
        self.groups: list[str] = []
        self.proc: subprocess.Popen | None = None
        self.pid1: int | None = None  # host pid of the namespace's systemd
        self.log = workdir / "systemd-ns.log"

    def start(self, timeout: float = 30.0) -> "SystemdNamespace":
        hierarchies = cgroup_hierarchies()
        mounts = []
        for point, kind, opts in hierarchies:
            group = os.path.join(point, own_group(kind, opts).lstrip("/"), self.name)
            os.makedirs(group)
            self.groups.append(group)
            if "cpuset" in opts.split(","):
                parent = os.path.dirname(group)
                for knob in ("cpuset.cpus", "cpuset.mems"):
                    Path(group, knob).write_text(Path(parent, knob).read_text())
            if kind == "cgroup2":
                mounts.append(f"mkdir -p {point} && mount -t cgroup2 cgroup2 {point}")
            else:
                mounts.append(f"mkdir -p {point} && mount -t cgroup -o {opts} cgroup {point}")
        script = self.workdir / "systemd-ns-init.sh"
        script.write_text(INNER.format(
            cgroup_root=CGROUP_ROOT, mount_hierarchies="\n".join(mounts),
            unit_dirs=" ".join(GENERATOR_DIRS[2:]), generator_dirs=" ".join(GENERATOR_DIRS[:2]),
            systemd=SYSTEMD))
        script.chmod(0o755)
        groups = list(self.groups)

        def join_groups():  # in the child, before unshare: the namespace's root groups
            for g in groups:
                with open(os.path.join(g, "cgroup.procs"), "w") as f:
                    f.write(str(os.getpid()))

        with open(self.log, "wb") as logf:
            self.proc = subprocess.Popen(
                ["unshare", "--pid", "--fork", "--mount", "--cgroup", str(script)],
                stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=join_groups, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"systemd namespace exited {self.proc.returncode}: "
                                   f"{self.log.read_text(errors='replace')[-2000:]}")
            self.pid1 = self._find_pid1()
            if self.pid1 is not None and self.run("test", "-S", "/run/systemd/private").returncode == 0 \
                    and self.run("systemctl", "is-system-running").stdout.strip() in (
                        b"running", b"degraded"):
                return self
            time.sleep(0.05)
        raise RuntimeError(f"systemd did not come up: {self.log.read_text(errors='replace')[-2000:]}")

    def _find_pid1(self) -> int | None:
        try:
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        except OSError:
            return None
        for child in children:
            try:
                if Path(f"/proc/{child}/comm").read_text().strip() == "systemd":
                    return int(child)
            except OSError:
                pass
        return None

    def enter(self, *argv: str, cwd: str | None = None) -> list[str]:
        """The argv that runs `argv` inside the namespaces (the working dir kept)."""
        return ["nsenter", "-t", str(self.pid1), "-p", "-m", "-C",
                f"--wd={cwd or os.getcwd()}", *argv]

    def run(self, *argv: str, timeout: float = 30.0, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.enter(*argv), capture_output=True, timeout=timeout, **kw)

    def stop(self) -> None:
        if self.pid1 is not None:
            try:
                os.kill(self.pid1, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc is not None:
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        deadline = time.monotonic() + 10
        for group in self.groups:  # deepest first; tasks may take a moment to leave
            for dirpath, _dirs, _files in sorted(os.walk(group), key=lambda w: -w[0].count("/")):
                while True:
                    try:
                        os.rmdir(dirpath)
                        break
                    except FileNotFoundError:
                        break
                    except OSError:
                        if time.monotonic() > deadline:
                            break
                        time.sleep(0.05)


#: The start of a script run inside the namespace that talks to keeperd itself: the systemd
#: backend, keeperd for `<argv[1]>/state` (launched if none runs), `sock`, `hello`, `buf`.
KEEPERD_SCRIPT_HEAD = r"""
import json, os, signal, socket, subprocess, sys, time, uuid
from motor.execution import keeperd
from motor.execution.joblog import read_records, read_status, write_json_atomic
from motor.execution.keeperd_client import connect_or_launch
from motor.isolation.systemd import open_systemd_backend, job_scope

work = sys.argv[1]
state = os.path.join(work, "state")
os.makedirs(state, exist_ok=True)
backend = open_systemd_backend()
sock, hello, rest = connect_or_launch(state, [sys.executable, keeperd.__file__, state],
                                      dict(os.environ), True)
buf = rest
"""
