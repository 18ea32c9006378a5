"""The systemd backend for real: a real systemd as PID 1 (of its own namespaces, see
systemd_ns.py), a real `motor serve --isolation systemd` inside them, jobs checked from
inside their units.

Skipped, with the reason, where the harness cannot run (not root, no systemd, no cgroup v1).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from polling import json_lines, wait_for
from systemd_ns import SystemdNamespace, unavailable

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(unavailable() is not None,
                                                  reason=f"systemd harness: {unavailable()}")]

MiB = 1024 * 1024

#: From inside the job: its CPUs, its unit's groups, and the tightest memory limit above it.
INSIDE = r"""
import json, os
cpus = open("/proc/self/status").read().split("Cpus_allowed_list:")[1].split()[0]
groups = dict((l.split(":", 2)[1], l.split(":", 2)[2]) for l in open("/proc/self/cgroup").read().splitlines())
rel = groups["memory"]
limit, path = None, rel
while True:
    knob = "/sys/fs/cgroup/memory" + path + "/memory.limit_in_bytes"
    if os.path.exists(knob):
        value = int(open(knob).read())
        limit = value if limit is None else min(limit, value)
    if path in ("/", ""):
        break
    path = os.path.dirname(path)
print(json.dumps({"cpus": cpus, "memory_limit": limit, "group": rel,
                  "unit": groups["name=systemd"], "pid1": open("/proc/1/comm").read().strip()}))
"""


ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def ns_serve(systemd_ns, serve_factory):
    """`motor serve --isolation systemd` started inside the namespaces (stopped first)."""

    def make(*args: str):
        serve = serve_factory("--isolation", "systemd", *args)
        serve.prefix = tuple(systemd_ns.enter(cwd=str(ROOT)))
        return serve

    return make


def units(ns: SystemdNamespace, pattern: str) -> list[str]:
    out = ns.run("systemctl", "list-units", "--all", "--plain", "--no-legend", "--no-pager",
                 pattern).stdout.decode()
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def job_units(ns: SystemdNamespace) -> list[str]:
    """The units of single jobs (scopes, and slices of jobs without CPUs)."""
    return units(ns, "motor-jobs-j*")


def slot_slices(ns: SystemdNamespace) -> list[str]:
    """The slot slices, which stay from job to job."""
    return units(ns, "motor-jobs-s*.slice")


def spare_scopes(ns: SystemdNamespace) -> list[str]:
    """The active scopes of keeperd's slot spares (one per slot slice a job ran in)."""
    out = ns.run("systemctl", "list-units", "--state=active", "--plain", "--no-legend",
                 "--no-pager", "motor-jobs-s*-p*.scope").stdout.decode()
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def serve_with_a_spare(ns_serve, systemd_ns) -> tuple:
    """`motor serve` in the namespace, no slot made at its start, after one job claiming
    every CPU: (serve, that claim, the scope of the slot's spare, which keeperd made after
    that job)."""
    serve = ns_serve("--start-slots", "0").start()
    claim = str(serve.cli_json("health")["capacity"]["claim_limit"])
    first = serve.cli("run", "--json", "--weight", claim, "--", "true")
    assert first.returncode == 0, first.stderr
    wait_for(lambda: spare_scopes(systemd_ns), what="the slot's spare scope")
    (spare,) = spare_scopes(systemd_ns)
    return serve, claim, spare


def unit_slice(unit: str) -> str:
    """The slice a job's scope is in, from its control group path."""
    return unit.rstrip("/").split("/")[-2]


def run_inside(serve, claim: int, memory_max: int) -> tuple[dict, dict]:
    """`motor run` of the INSIDE probe: the job's terminal record and what it saw."""
    result = serve.cli("run", "--json", "--weight", str(claim), "--memory-max", str(memory_max),
                       "--", "python3", "-c", INSIDE)
    assert result.returncode == 0, result.stderr
    events = json_lines(result.stdout)
    return (events[-1]["record"],
            json.loads("".join(e["data"] for e in events if e["event"] == "output")))


def test_systemd_backend_confines_each_job_in_its_slot_unit(ns_serve, systemd_ns):
    """No slot made at the start (`--start-slots 0`): the first job makes its slot slice,
    runs in a scope of its own there, and the slot's spare is made after it."""
    serve = ns_serve("--start-slots", "0").start()
    assert slot_slices(systemd_ns) == [] and spare_scopes(systemd_ns) == []
    health = serve.cli_json("health")["isolation"]
    assert health["backend"] == "systemd", health
    assert set(health["enforces"]) == {"cpus", "memory"}
    assert health["parent"] == "motor-jobs.slice"
    assert health["slot_spares"] is True and "Slot spares" in health["notes"][0], health

    claim = min(4, serve.cli_json("health")["capacity"]["claim_limit"])
    record, inside = run_inside(serve, claim, 256 * MiB)
    assert inside["pid1"] == "systemd"
    hexid = record["job_id"].replace("-", "")
    # the job's whole tree is in its scope, inside a slot slice, inside the jobs slice
    slot = unit_slice(inside["unit"])
    assert slot.startswith("motor-jobs-s"), inside
    assert inside["unit"] == (f"/motor.slice/motor-jobs.slice/{slot}/"
                              f"motor-jobs-j{hexid}.scope"), inside
    assert inside["group"] == inside["unit"]
    assert inside["memory_limit"] == record["memory_max_bytes"] == 256 * MiB
    expected = ",".join(map(str, record["cpus"]))
    assert len(record["cpus"]) == claim
    assert inside["cpus"] in (expected, f"{record['cpus'][0]}-{record['cpus'][-1]}"), inside
    # CPU time measured for the job's slice (a python3 start alone takes well over 1 ms)
    assert record["reservation_use"]["cpu_time_ms"] > 0
    # the scope went with the job's last process; the slot slice stays for the next job
    wait_for(lambda: job_units(systemd_ns) == [], what="the job's scope to go")
    assert slot in slot_slices(systemd_ns)

    # keeperd's spare for that slot, in a scope of the slot (motor/execution/slotspares.py)
    wait_for(lambda: spare_scopes(systemd_ns), what="the slot's spare scope")
    (spare,) = spare_scopes(systemd_ns)
    assert spare.startswith(slot.removesuffix(".slice") + "-p"), spare

    # the next job takes that slot (free again) with its own limit (the slice's limits
    # changed) and confinement, born in the spare's scope: no unit started for it
    second, inside = run_inside(serve, claim, 128 * MiB)
    assert inside["memory_limit"] == second["memory_max_bytes"] == 128 * MiB
    assert inside["unit"] == f"/motor.slice/motor-jobs.slice/{slot}/{spare}", inside
    assert inside["group"] == inside["unit"]
    assert second["reservation_use"]["cpu_time_ms"] > 0
    assert job_units(systemd_ns) == [] and spare_scopes(systemd_ns) == [spare]


def test_a_systemd_runners_keeperd_connects_to_systemd_at_its_start(ns_serve):
    """`motor serve --isolation systemd` has keeperd import its D-Bus client and open its
    connection at the start (keeperd's "prepare", stop 63), not at the first job: its log
    says the connection opened before any job, and the jobs use that one."""
    serve = ns_serve().start()
    log = serve.state_dir / "keeperd.log"

    def opened() -> int:
        text = log.read_text() if log.exists() else ""
        return sum("systemd: connection" in line and "opened" in line
                   for line in text.splitlines())

    wait_for(lambda: opened() == 1, what="keeperd's connection to systemd, before any job")
    for _ in range(2):
        assert serve.cli("run", "--weight", "1", "--", "true").returncode == 0
    assert opened() == 1


def test_a_systemd_runners_first_jobs_are_born_in_slots_made_at_its_start(
        ns_serve, systemd_ns, tmp_path):
    """Stop 64: `motor serve --isolation systemd` makes a slot slice per CPU (at most
    --max-weight and 8), with keeperd's spare in each, before it answers: a job of one CPU
    finds its slot carrying its limits, and is born in the spare's scope from its first
    instruction, confined to its CPU and its claim's memory. No unit is started for it
    (before, the slot's first job made the slice and a scope of its own). A restart leaves
    the slot of a job that still runs as it is."""
    serve = ns_serve("--max-weight", "2").start()
    health = serve.cli_json("health")
    count = min(len(health["cpus"]["allowed"]), 2)
    slots = [f"motor-jobs-s{n}.slice" for n in range(count)]
    assert slot_slices(systemd_ns) == slots
    spares = spare_scopes(systemd_ns)  # started before the runner answered
    assert sorted(s.split("-p")[0] + ".slice" for s in spares) == slots, spares
    result = serve.cli("run", "--json", "--weight", "1", "--", "python3", "-c", INSIDE)
    assert result.returncode == 0, result.stderr
    events = json_lines(result.stdout)
    record = events[-1]["record"]
    inside = json.loads("".join(e["data"] for e in events if e["event"] == "output"))
    slot = unit_slice(inside["unit"])
    assert slot in slots and inside["unit"].split("/")[-1] in spares, (inside, spares)
    assert inside["group"] == inside["unit"]
    assert inside["cpus"] == ",".join(map(str, record["cpus"])) and len(record["cpus"]) == 1
    assert inside["memory_limit"] == record["memory_max_bytes"], (inside, record)
    assert record["reservation_use"]["cpu_time_ms"] > 0
    assert job_units(systemd_ns) == [] and spare_scopes(systemd_ns) == spares
    assert slot_slices(systemd_ns) == slots

    # a restart leaves a slot whose job still runs as it is: its limits are the job's
    held = serve.cli_json("submit", "--weight", "1", "--memory-max", str(128 * MiB), "--",
                          "sh", "-c", f"echo in; while [ ! -e {tmp_path / 'go'} ]; do "
                          "sleep 0.01; done; exit 6")
    log = serve.state_dir / "jobs" / held["job_id"] / "output.log"
    wait_for(lambda: log.exists() and b"in" in log.read_bytes(), what="the job running")
    busy = json.loads((log.parent / "spec.json").read_text())["systemd_scope"]["slice"]
    knob = f"/sys/fs/cgroup/memory/motor.slice/motor-jobs.slice/{busy}/memory.limit_in_bytes"
    serve.kill9()
    serve.start()
    assert systemd_ns.run("cat", knob).stdout.decode().strip() == str(128 * MiB)
    (tmp_path / "go").touch()
    attached = serve.cli("attach", "--json", held["job_id"], "--from-seq", "0")
    assert attached.returncode == 6, attached.stderr
    assert slot_slices(systemd_ns) == slots and job_units(systemd_ns) == []


def test_systemd_backend_reports_cpu_time_and_oom_kills(ns_serve, systemd_ns):
    serve = ns_serve().start()
    made = slot_slices(systemd_ns)  # at the start
    every = str(serve.cli_json("health")["capacity"]["claim_limit"])
    busy = serve.cli("run", "--json", "--weight", every, "--", "python3", "-c",
                     "import time\nt = time.process_time()\n"
                     "while time.process_time() - t < 0.5: pass")
    assert busy.returncode == 0, busy.stderr
    busy_record = json_lines(busy.stdout)[-1]["record"]
    use = busy_record["reservation_use"]
    assert 400 <= use["cpu_time_ms"] <= 5000, use
    # keeperd read the slot slice's counters at the job's end (issue 14): the runner did not
    status = json.loads((serve.state_dir / "jobs" / busy_record["job_id"] / "status.json").read_text())
    assert set(status["isolation_facts"]) == {"usage_usec", "oom_kills", "oom_v2", "failcnt"}, status
    # the next job, in the same slot slice, is charged its own CPU time only
    light = serve.cli("run", "--json", "--weight", every, "--", "sh", "-c", "sleep 0.05")
    light_record = json_lines(light.stdout)[-1]["record"]
    assert light_record["reservation_use"]["cpu_time_ms"] < 200, light_record
    assert slot_slices(systemd_ns) == made  # a slot made at the start served both

    hog = serve.cli("run", "--json", "--weight", "1", "--memory-max", str(64 * MiB), "--",
                    "python3", "-c", "b = bytearray(512 * 1024 * 1024); print(len(b))")
    terminal = json_lines(hog.stdout)[-1]["record"]
    assert terminal["state"] == "failed"
    assert terminal["reason"] == "oom_killed", terminal
    assert terminal["signal"] == 9 and hog.returncode == 128 + 9
    wait_for(lambda: job_units(systemd_ns) == [], what="the jobs' units to go")
    # the kill is the growth of its slice's counters: the next job there is no OOM kill,
    # even one that dies of SIGKILL
    after = serve.cli("run", "--json", "--weight", "1", "--memory-max", str(64 * MiB), "--",
                      "sh", "-c", "kill -9 $$")
    record = json_lines(after.stdout)[-1]["record"]
    assert record["signal"] == 9 and record["reason"] != "oom_killed", record
    assert slot_slices(systemd_ns) == made


def test_the_next_job_in_a_slot_starts_from_the_counters_at_the_last_ones_end(ns_serve):
    """Issue 14: the baseline of a slot's next job, started right after the last one ended,
    is the slice's counters keeperd read at that end (status.json's `isolation_facts`;
    since the change the runner takes them without a read of its own, which the pure test
    shows: here the two readings are equal), and each job is charged its own CPU time."""
    serve = ns_serve().start()
    every = str(serve.cli_json("health")["capacity"]["claim_limit"])
    burn = ("import time\nt = time.process_time()\n"
            "while time.process_time() - t < 0.3: pass")
    first = serve.cli_json("submit", "--weight", every, "--", "python3", "-c", burn)["job_id"]
    second = serve.cli_json("submit", "--weight", every, "--", "true")["job_id"]
    done = serve.cli("attach", "--json", second, "--from-seq", "0")
    assert done.returncode == 0, done.stderr
    jobs = serve.state_dir / "jobs"
    status = json.loads((jobs / first / "status.json").read_text())
    spec = json.loads((jobs / second / "spec.json").read_text())
    assert spec["systemd_scope"]["slice"] == json.loads(
        (jobs / first / "spec.json").read_text())["systemd_scope"]["slice"]
    assert spec["systemd_base"] == status["isolation_facts"], (spec, status)
    records = {r["job_id"]: r for r in serve.cli_json("jobs", "--all")}
    assert records[first]["reservation_use"]["cpu_time_ms"] >= 250, records[first]
    assert records[second]["reservation_use"]["cpu_time_ms"] < 200, records[second]


def test_a_job_in_a_systemd_unit_outlives_the_runner_and_is_readopted(
        ns_serve, systemd_ns, tmp_path):
    barrier = tmp_path / "go"
    serve = ns_serve("--start-slots", "0").start()  # the job in a scope of its own
    # after the barrier the job leaves an orphan that burns 0.3 s of CPU and ends: the job's
    # own rusage misses it (keeperd reaps it), its slice's counters do not
    burn = ("import time; t = time.process_time(); "
            "[0 for _ in iter(lambda: time.process_time() - t < 0.3, False)]")
    job = serve.cli_json("submit", "--weight", "1", "--", "sh", "-c",
                         f"echo before; while [ ! -e {barrier} ]; do sleep 0.01; done; "
                         f"echo after; (python3 -c '{burn}' &); sleep 1.5; exit 7")
    job_id = job["job_id"]
    log = serve.state_dir / "jobs" / job_id / "output.log"
    wait_for(lambda: log.exists() and b"before" in log.read_bytes(), what="first line")
    serve.kill9()

    # the runner is gone; the job's unit is still there and the restarted runner adopts it
    unit = f"motor-jobs-j{job_id.replace('-', '')}"
    assert sorted(job_units(systemd_ns)) == [f"{unit}.scope"]
    # a job slice the store does not know (with a process in it): the start-up sweep stops it
    leftover = systemd_ns.run("systemd-run", "--unit=motor-leftover-sleep",
                              "--slice=motor-jobs-jfeedbeef.slice", "sleep", "1000")
    assert leftover.returncode == 0, leftover.stderr
    assert "motor-jobs-jfeedbeef.slice" in job_units(systemd_ns)
    (serve.state_dir / "jobs" / "feedbeef").mkdir()  # a job of this state dir
    serve.start()
    wait_for(lambda: sorted(job_units(systemd_ns)) == [f"{unit}.scope"],
             what="the leftover slice to be stopped, the job's scope kept")
    assert b"start-up sweep: unit motor-jobs-jfeedbeef.slice: stopped" in serve.log.read_bytes()
    barrier.write_text("")
    result = serve.cli("attach", "--json", job_id, "--from-seq", "0")
    events = json_lines(result.stdout)
    assert "".join(e["data"] for e in events if e["event"] == "output") == "before\nafter\n"
    assert events[-1]["record"]["exit_code"] == 7 and result.returncode == 7
    # the restarted runner took the slice's counters before the job from its spec.json:
    # the job's CPU time is their growth, the orphan's 0.3 s included
    assert events[-1]["record"]["reservation_use"]["cpu_time_ms"] >= 300, events[-1]["record"]
    wait_for(lambda: job_units(systemd_ns) == [], what="the job's units to go")


def test_a_missing_program_is_a_spawn_failure_not_a_systemd_run_error(ns_serve):
    serve = ns_serve().start()
    result = serve.cli("run", "--json", "--weight", "1", "--", "no-such-program-anywhere")
    record = json_lines(result.stdout)[-1]["record"]
    assert record["state"] == "failed", record
    assert "no-such-program-anywhere" in (record.get("detail") or ""), record


EXAMPLES = ROOT / "examples"


def test_the_example_units_run_motor_under_systemd_and_jobs_outlive_a_restart(
        systemd_ns, tmp_path):
    """examples/motor.service and examples/motor-jobs.slice, installed in the namespace's
    systemd (ExecStart's python, config and state dir redirected to this test's), started
    with systemctl: the runner picks the systemd backend, reads the slice's MemoryMax, and a
    running job survives `systemctl restart motor` (KillMode=process; the job is in its own
    unit) and is re-adopted."""
    state, barrier = tmp_path / "state", tmp_path / "go"
    unit = (EXAMPLES / "motor.service").read_text()
    exec_line = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    argv = exec_line[len("ExecStart="):].split()
    assert argv[1:4] == ["-m", "motor", "serve"]
    argv[0] = sys.executable
    argv[argv.index("--config") + 1] = str(EXAMPLES / "runner.toml")
    argv += ["--state-dir", str(state), "--free-space-floor-bytes", "0"]
    unit = unit.replace(exec_line, "ExecStart=" + " ".join(argv))
    unit = unit.replace("[Service]", f"[Service]\nWorkingDirectory={ROOT}")
    unit = "\n".join(line for line in unit.splitlines()  # no /var/lib/motor on this host
                     if not line.startswith(("StateDirectory", "Environment=MOTOR_STATE_DIR")))
    (tmp_path / "motor.service").write_text(unit)
    for name, source in (("motor.service", tmp_path / "motor.service"),
                         ("motor-jobs.slice", EXAMPLES / "motor-jobs.slice")):
        assert systemd_ns.run("cp", str(source), f"/run/motor-units/{name}").returncode == 0
    assert systemd_ns.run("systemctl", "daemon-reload").returncode == 0
    started = systemd_ns.run("systemctl", "start", "motor.service")
    assert started.returncode == 0, started.stderr

    socket = str(state / "motor.sock")

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "motor", args[0], "--socket", socket,
                               *args[1:]], capture_output=True, timeout=60, cwd=ROOT)

    # Type=notify: `systemctl start` returned on READY=1, sent once the API answers
    assert cli("health").returncode == 0
    shown = systemd_ns.run("systemctl", "show", "-p", "Type", "-p", "WatchdogUSec", "motor.service")
    assert b"Type=notify" in shown.stdout and b"WatchdogUSec=30s" in shown.stdout, shown.stdout
    health = json.loads(cli("health", "--json").stdout)
    assert health["isolation"]["backend"] == "systemd"
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    ram = int(next(line for line in meminfo if line.startswith("MemTotal:")).split()[1]) * 1024
    slice_max = health["isolation"]["memory_max"]
    assert abs(slice_max - ram * 90 // 100) <= 1 << 20, (slice_max, ram)

    job = json.loads(cli("submit", "--json", "--weight", "1", "--memory-max", str(2 * ram), "--",
                         "sh", "-c", f"echo before; while [ ! -e {barrier} ]; do sleep 0.01; "
                         "done; echo after; exit 3").stdout)
    log = state / "jobs" / job["job_id"] / "output.log"
    wait_for(lambda: log.exists() and b"before" in log.read_bytes(), what="the job to start")
    restarted = systemd_ns.run("systemctl", "restart", "motor.service")
    assert restarted.returncode == 0, restarted.stderr
    assert cli("health").returncode == 0  # answers again (READY=1 again)
    barrier.write_text("")
    result = cli("attach", "--json", job["job_id"], "--from-seq", "0")
    events = json_lines(result.stdout)
    assert "".join(e["data"] for e in events if e["event"] == "output") == "before\nafter\n"
    record = events[-1]["record"]
    assert record["exit_code"] == 3 and result.returncode == 3
    # a claim's memory_max is clamped to the slice's MemoryMax, never above it
    assert record["memory_max_bytes"] == slice_max
    assert systemd_ns.run("systemctl", "stop", "motor.service").returncode == 0


BACKEND_SCRIPT = r"""
import json, sys
from motor.isolation.systemd import open_systemd_backend, job_slice
backend = open_systemd_backend()
job, bare = "0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b", "0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5d"
memory = "/sys/fs/cgroup/memory/motor.slice/motor-jobs.slice/"
first = backend.prepare(job, [0], 64 << 20)
again = backend.prepare(job, [0], 32 << 20)  # a retried start: the slice takes the new limit
limit = int(open(memory + "motor-jobs-s0.slice/memory.limit_in_bytes").read())
facts = backend.finish(job)
# a job without CPUs: a slice of its own, with its limit, gone after finish
own = backend.prepare(bare, None, 48 << 20)
own_limit = int(open(memory + job_slice("motor-jobs", bare) + "/memory.limit_in_bytes").read())
adopted = backend.adopt(bare)
own_facts = backend.finish(bare)
print(json.dumps({"slices": [first["systemd_scope"]["slice"], again["systemd_scope"]["slice"],
                             own["systemd_scope"]["slice"]],
                  "facts": facts, "limit": limit, "own_limit": own_limit, "adopted": adopted,
                  "own_facts": own_facts, "after": backend.adopt(bare)}))
"""


def test_prepare_is_idempotent_and_finish_removes_the_slice(systemd_ns):
    """A job with CPUs: its slot slice takes each prepare's limits and stays after finish. A
    job without CPUs: a slice of its own, removed by finish."""
    result = systemd_ns.run(sys.executable, "-c", BACKEND_SCRIPT, cwd=str(ROOT))
    assert result.returncode == 0, result.stderr.decode()
    out = json.loads(result.stdout)
    assert out["slices"][:2] == ["motor-jobs-s0.slice"] * 2
    assert out["limit"] == 32 << 20 and out["own_limit"] == 48 << 20
    assert out["adopted"] and not out["after"]
    for facts in (out["facts"], out["own_facts"]):
        assert facts["cleanup_error"] is None and facts["oom_killed"] is False, facts
    assert job_units(systemd_ns) == []
    assert "motor-jobs-s0.slice" in slot_slices(systemd_ns)


REFUSED_SCRIPT = r"""
import json, subprocess, sys, time
from motor.isolation.systemd import open_systemd_backend, job_scope
backend = open_systemd_backend()
job = "0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5c"
fields = backend.prepare(job, [0], 64 << 20)
# someone else holds the scope's name: systemd refuses the job's scope
holder = subprocess.Popen(["systemd-run", "--scope", "--quiet",
                           "--unit=" + job_scope("motor-jobs", job), "sleep", "30"])
while subprocess.run(["systemctl", "is-active", "--quiet", job_scope("motor-jobs", job)]).returncode:
    time.sleep(0.01)
# the keeper's join step, in a process of its own
join = ("import json, sys\n"
        "from motor.isolation.join import JoinError, join_confinement\n"
        "try:\n"
        "    join_confinement(json.loads(sys.argv[1]))\n"
        "except JoinError as exc:\n"
        "    sys.exit(str(exc))\n")
run = subprocess.run([sys.executable, "-c", join, json.dumps(fields)], capture_output=True,
                     text=True)
facts = backend.finish(job)
holder.kill()
print(json.dumps({"rc": run.returncode, "stderr": run.stderr, "facts": facts}))
"""


def test_a_scope_systemd_refuses_is_reported_as_a_start_error(systemd_ns):
    result = systemd_ns.run(sys.executable, "-c", REFUSED_SCRIPT, cwd=str(ROOT))
    assert result.returncode == 0, result.stderr.decode()
    out = json.loads(result.stdout)
    assert out["rc"] == 1 and "UnitExists" in out["stderr"], out
    assert "already" in out["stderr"], out
    assert "did not start the job's scope" in out["facts"]["start_error"], out


def test_a_stalled_systemd_delays_jobs_but_never_wedges_the_runner(ns_serve, systemd_ns):
    """systemd stopped (SIGSTOP) while the runner serves: health still answers, a job's
    start fails on the D-Bus timeout and is requeued with the retry delay, and once systemd
    runs again the job runs and succeeds. (No slot made at the start: the job's start
    needs systemd.)"""
    serve = ns_serve("--start-slots", "0").start()
    os.kill(systemd_ns.pid1, signal.SIGSTOP)
    try:
        job = serve.cli_json("submit", "--weight", "1", "--", "sh", "-c", "echo ran")
        assert serve.cli("health").returncode == 0
        wait_for(lambda: b"start failed" in serve.log.read_bytes(), timeout=60,
                 what="the start to fail on the stalled manager")
        status = serve.cli_json("status")  # requeued: waiting out its retry delay, or retrying
        pending = {j["job_id"]: j["state"] for j in status["queued"] + status["running"]}
        assert pending.get(job["job_id"]) in ("queued", "setup"), status
    finally:
        os.kill(systemd_ns.pid1, signal.SIGCONT)
    result = serve.cli("attach", "--json", job["job_id"], "--from-seq", "0", timeout=120)
    events = json_lines(result.stdout)
    record = events[-1]["record"]
    assert record["state"] == "succeeded" and record["attempts"] >= 2, record
    assert "".join(e["data"] for e in events if e["event"] == "output") == "ran\n"


def test_a_job_runs_in_a_slot_made_at_the_start_while_systemd_is_stalled(ns_serve, systemd_ns):
    """With its slot made at the start, a job of one CPU needs no call to systemd: it runs,
    confined, while systemd is stopped (SIGSTOP), and its record comes."""
    serve = ns_serve().start()
    os.kill(systemd_ns.pid1, signal.SIGSTOP)
    try:
        result = serve.cli("run", "--json", "--weight", "1", "--", "sh", "-c",
                           "grep :name=systemd: /proc/self/cgroup | cut -d: -f3", timeout=60)
    finally:
        os.kill(systemd_ns.pid1, signal.SIGCONT)
    events = json_lines(result.stdout)
    record = events[-1]["record"]
    assert record["state"] == "succeeded" and record["attempts"] == 1, record
    unit = "".join(e["data"] for e in events if e["event"] == "output").strip()
    assert unit.split("/")[-1] in spare_scopes(systemd_ns), unit


SETTLE_SCRIPT = r"""
import json, subprocess
from motor.isolation.systemd import open_systemd_backend, job_scope
backend = open_systemd_backend()
quiet, busy, third = ("0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a0%d" % i for i in (1, 2, 3))

def alive(pid):
    return subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode == 0

def active(unit):
    return subprocess.run(["systemctl", "is-active", unit], capture_output=True,
                          text=True).stdout.strip()

slots = [backend.prepare(job, [n], 64 << 20)["systemd_scope"]["slice"]
         for n, job in enumerate((quiet, busy))]
# a process left in the busy job's scope (one that left the job's process group)
left = subprocess.Popen(["systemd-run", "--scope", "--quiet", "--unit=" + job_scope("motor-jobs", busy),
                         "--slice=" + slots[1], "sleep", "1000"])
while subprocess.run(["systemctl", "is-active", "--quiet", job_scope("motor-jobs", busy)]).returncode:
    pass
settled = {job: backend.settle(job) for job in (quiet, busy)}
slice_kept = active(slots[1])
released = {job: backend.release(job) for job in (quiet, busy)}
left.wait(10)
scope_gone = active(job_scope("motor-jobs", busy)) != "active"
# another unit put in a slot slice: not this job's, left alone; the slot is not taken again
# while it runs there
third_slot = backend.prepare(third, [0], 64 << 20)["systemd_scope"]["slice"]
subprocess.run(["systemd-run", "--unit=motor-stranger", "--slice=" + third_slot, "sleep", "1000"],
               check=True, capture_output=True)
stranger = int(subprocess.run(["systemctl", "show", "-p", "MainPID", "--value", "motor-stranger"],
                              capture_output=True, text=True).stdout)
third_facts = backend.settle(third)
backend.release(third)
stranger_alive = alive(stranger)
next_slot = backend.prepare(quiet, [0], 64 << 20)["systemd_scope"]["slice"]
backend.finish(quiet)
subprocess.run(["systemctl", "stop", "motor-stranger"], capture_output=True)
print(json.dumps({"slots": slots, "settled": settled, "released": released,
                  "scope_gone": scope_gone, "slice_kept": slice_kept, "left_rc": left.returncode,
                  "third": third_facts, "third_slot": third_slot,
                  "stranger_alive": stranger_alive, "next_slot": next_slot}))
"""


def test_settle_keeps_an_empty_slice_for_release_and_stops_one_with_a_process_left(systemd_ns):
    """One live process tree per job: a process left in the job's scope is killed by the
    scope's stop in `settle`, before the terminal record, and the slot slice stays; a
    process of another unit in a slot slice is not the job's to kill, and the slot is not
    taken again while it runs there (its counters would not be the next job's)."""
    result = systemd_ns.run(sys.executable, "-c", SETTLE_SCRIPT, cwd=str(ROOT))
    assert result.returncode == 0, result.stderr.decode()
    out = json.loads(result.stdout)
    assert out["slots"][0] != out["slots"][1]  # two jobs prepared at once: two slots
    assert out["scope_gone"] and out["left_rc"] != 0, out  # the sleep in the scope was killed
    assert out["slice_kept"] == "active", out  # by the scope's stop: the slot slice stays
    assert all(f["cleanup_error"] is None for f in out["settled"].values()), out["settled"]
    assert out["released"] == dict.fromkeys(out["released"]) and len(out["released"]) == 2
    assert out["third"]["cleanup_error"] is None and out["stranger_alive"], out
    assert out["next_slot"] != out["third_slot"], out
    assert job_units(systemd_ns) == []


def test_a_jobs_scope_goes_with_its_last_process_and_its_slot_slice_serves_the_next_job(
        ns_serve, systemd_ns, tmp_path):
    """Through `motor serve` in the namespace: held at `release.begin`, a job's terminal
    record is out, its scope already gone with its last process, and the next job claiming
    every CPU runs to its end in the same slot slice, which stays."""
    barrier, reached = tmp_path / "release", tmp_path / "release.reached"
    serve = ns_serve("--start-slots", "0")  # the jobs forked into scopes of their own
    serve.env = {"MOTOR_FAULTS": f"release.begin=wait:{barrier}"}
    serve.start()
    claim = serve.cli_json("health")["capacity"]["claim_limit"]
    records = []
    for _ in range(2):
        result = serve.cli("run", "--json", "--weight", str(claim), "--", "true")
        assert result.returncode == 0, result.stderr
        records.append(json_lines(result.stdout)[-1]["record"])
        wait_for(reached.exists, what="the job's release at the barrier")
    assert [r["state"] for r in records] == ["succeeded"] * 2
    wait_for(lambda: job_units(systemd_ns) == [], what="both scopes to go with their jobs")
    assert slot_slices(systemd_ns) == ["motor-jobs-s0.slice"]
    barrier.touch()


OVERLAP = r"""
import os, sys, time
unit = [l.split(":", 2)[2] for l in open("/proc/self/cgroup").read().splitlines()
        if l.split(":", 2)[1] == "name=systemd"][0]
print(unit, flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
"""


def test_jobs_whose_claims_overlap_run_at_once_each_in_a_slot_of_its_own(
        ns_serve, systemd_ns, tmp_path):
    """More claimed than the host has CPUs (`--max-weight` above the CPU count): two jobs
    share CPUs and run at once, each in a slot slice of its own, each charged its own CPU
    time."""
    go = tmp_path / "go"
    cpus = len(os.sched_getaffinity(0))
    serve = ns_serve("--max-weight", str(2 * cpus)).start()
    ids = [serve.cli_json("submit", "--workspace", f"w{n}", "--weight", str(cpus), "--",
                          "python3", "-c", OVERLAP, str(go))["job_id"] for n in range(2)]
    logs = [serve.state_dir / "jobs" / job_id / "output.log" for job_id in ids]
    wait_for(lambda: all(log.exists() and b"scope" in log.read_bytes() for log in logs),
             what="both jobs running")
    running = {j["job_id"]: j for j in serve.cli_json("status")["running"]}
    assert set(running) == set(ids), running
    go.touch()
    units, records = [], []
    for job_id in ids:
        result = serve.cli("attach", "--json", job_id, "--from-seq", "0")
        events = json_lines(result.stdout)
        units.append("".join(e["data"] for e in events if e["event"] == "output").strip())
        records.append(events[-1]["record"])
    assert [r["state"] for r in records] == ["succeeded"] * 2, records
    assert records[0]["cpus"] == records[1]["cpus"]  # the claims overlap
    assert unit_slice(units[0]) != unit_slice(units[1]), units
    assert all(unit_slice(u).startswith("motor-jobs-s") for u in units), units
    assert all(r["reservation_use"]["cpu_time_ms"] > 0 for r in records), records


def test_a_process_a_job_left_in_its_slots_spare_scope_is_killed_before_its_record(
        ns_serve, systemd_ns):
    """One live process tree per job, for a job born in its slot spare's scope: a process
    that left the job's process group and environment (so keeperd cannot tell it is the
    job's) is killed by the stop of the spare's scope in `settle`, before the terminal
    record; the slot's next job runs, and a new spare follows."""
    serve, claim, spare = serve_with_a_spare(ns_serve, systemd_ns)

    left = serve.cli("run", "--json", "--weight", claim, "--", "sh", "-c",
                     "setsid env -i sleep 1000 & pid=$!; "
                     "until grep -qx sleep /proc/$pid/comm; do sleep 0.01; done; echo $pid")
    events = json_lines(left.stdout)
    record = events[-1]["record"]
    assert record["state"] == "succeeded", record
    pid = "".join(e["data"] for e in events if e["event"] == "output").strip()
    assert pid.isdigit(), events
    # the record is out: the escaped sleep is gone, and the spare's scope with it
    assert systemd_ns.run("test", "-e", f"/proc/{pid}").returncode != 0, (
        f"sleep {pid} still runs: " + systemd_ns.run("systemctl", "status", spare).stdout.decode())
    assert spare not in spare_scopes(systemd_ns)

    again = serve.cli("run", "--json", "--weight", claim, "--", "true")
    assert json_lines(again.stdout)[-1]["record"]["state"] == "succeeded"
    wait_for(lambda: [s for s in spare_scopes(systemd_ns) if s != spare],
             what="a new spare for the slot")
    assert b"cleanup_error" not in serve.log.read_bytes()


def test_without_slot_spares_every_job_gets_a_scope_of_its_own(ns_serve, systemd_ns):
    """`MOTOR_KEEPERD_SLOT_SPARES=0` (for hosts that want a unit per job): the slot's jobs
    each run in a transient scope named for the job, and no spare is made."""
    serve = ns_serve()
    serve.env = {"MOTOR_KEEPERD_SLOT_SPARES": "0"}
    serve.start()
    health = serve.cli_json("health")
    assert health["isolation"]["slot_spares"] is False, health["isolation"]
    claim = str(health["capacity"]["claim_limit"])
    for _ in range(3):
        record, inside = run_inside(serve, int(claim), 128 * MiB)
        hexid = record["job_id"].replace("-", "")
        assert inside["unit"].endswith(f"/motor-jobs-j{hexid}.scope"), inside
        assert record["reservation_use"]["cpu_time_ms"] > 0
    assert spare_scopes(systemd_ns) == []


def test_a_job_in_its_slots_spare_scope_outlives_the_runner_and_is_readopted(
        ns_serve, systemd_ns, tmp_path):
    """A job a slot spare spawned: the runner is killed (-9) while it runs; keeperd and the
    spare go on, the restarted runner adopts the job, and its end comes through the spare's
    relay with its exit code and its slot's CPU time."""
    barrier = tmp_path / "go"
    serve, claim, spare = serve_with_a_spare(ns_serve, systemd_ns)
    job = serve.cli_json("submit", "--weight", claim, "--", "sh", "-c",
                         "grep :name=systemd: /proc/self/cgroup | cut -d: -f3; "
                         f"while [ ! -e {barrier} ]; do sleep 0.01; done; echo after; exit 7")
    job_id = job["job_id"]
    log = serve.state_dir / "jobs" / job_id / "output.log"
    wait_for(lambda: log.exists() and b"scope" in log.read_bytes(), what="the job running")
    serve.kill9()

    assert job_units(systemd_ns) == [] and spare_scopes(systemd_ns) == [spare]
    serve.start()
    barrier.write_text("")
    result = serve.cli("attach", "--json", job_id, "--from-seq", "0")
    events = json_lines(result.stdout)
    out = "".join(e["data"] for e in events if e["event"] == "output").split()
    assert out[0].endswith("/" + spare) and out[1] == "after", out
    record = events[-1]["record"]
    assert record["exit_code"] == 7 and result.returncode == 7, record
    assert record["reservation_use"]["cpu_time_ms"] is not None, record


def test_a_job_whose_exit_status_died_with_its_spare_is_recorded_with_why(
        ns_serve, systemd_ns):
    """Through `motor serve`, with keeperd's fault probe (`MOTOR_KEEPERD_FAULT=
    spare-drops-exit`: a slot spare dies after reaping its job, before relaying the end):
    the job's terminal record has no exit code and says why, `motor run` says so too, and
    the slot's next job runs (in a scope of its own; then a new spare)."""
    serve = ns_serve("--start-slots", "0")  # the slot's spare made after its first job
    serve.env = {"MOTOR_KEEPERD_FAULT": "spare-drops-exit"}
    serve.start()
    claim = str(serve.cli_json("health")["capacity"]["claim_limit"])
    assert serve.cli("run", "--weight", claim, "--", "true").returncode == 0
    wait_for(lambda: spare_scopes(systemd_ns), what="the slot's spare scope")
    (spare,) = spare_scopes(systemd_ns)
    lost = serve.cli("run", "--json", "--weight", claim, "--", "sh", "-c", "exit 3")
    record = json_lines(lost.stdout)[-1]["record"]
    assert record["exit_code"] is None and record["state"] == "failed", record
    assert "exit status was lost with its slot's spare process" in (record["detail"] or ""), record
    assert lost.returncode == 1, lost  # failed, not the job's own 3
    assert b"exit status was lost" in lost.stderr, lost.stderr
    after = serve.cli("run", "--json", "--weight", claim, "--", "sh", "-c", "exit 5")
    assert after.returncode == 5, after.stderr
    wait_for(lambda: spare_scopes(systemd_ns) and spare_scopes(systemd_ns) != [spare],
             what="a new spare")
