"""keeperd's slot spares (motor/execution/slotspares.py) inside the namespaced systemd harness
(systemd_ns.py): after a slot's first job, the slot's jobs are born in its spare's scope,
as the spare's children, with no unit started for them, and their ends are relayed to
keeperd; a spare that dies under a running job leaves it to keeperd; a spare that dies is
made again; a job the spare cannot exec is a spawn failure with the reason."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from systemd_ns import KEEPERD_SCRIPT_HEAD, unavailable

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(unavailable() is not None,
                                                  reason=f"systemd harness: {unavailable()}")]

ROOT = Path(__file__).resolve().parents[2]

#: Run inside the namespace: jobs with CPUs in one slot slice, one after another, each
#: printing the unit it runs in and its parent; the spare's scope awaited after the first;
#: then the spare killed, and two more jobs.
HELPERS = r"""
serial = 0

def request(req):
    global buf, serial
    serial += 1
    req["id"] = serial
    sock.sendall(json.dumps(req).encode() + b"\n")
    while True:
        while b"\n" not in buf:
            buf += sock.recv(65536)
        line, _, buf = buf.partition(b"\n")
        msg = json.loads(line)
        if msg.get("id") == serial:
            return msg

# the unit, the parent, the signals the job's processes start with blocked and ignored,
# its cwd, umask, CPUs and oom_score_adj
PROBE = ("grep :name=systemd: /proc/self/cgroup | cut -d: -f3; echo $PPID; "
         "grep -E '^Sig(Ign|Blk)' /proc/self/status | tr -d '\\t'; pwd; umask; "
         "grep Cpus_allowed_list /proc/self/status | cut -f2; cat /proc/self/oom_score_adj; "
         "exit 3")
FIELDS = ("unit", "ppid", "blocked", "ignored", "cwd", "umask", "cpus", "oom")

def job(tag, command=None, cwd="/", during=None, timeout_s=60.0, cpus=(0,), umask=None):
    job_id = str(uuid.uuid4())
    fields = backend.prepare(job_id, list(cpus), None)
    d = os.path.join(state, "jobs", tag)
    os.makedirs(d)
    spec = {"job_id": job_id, "command": command or ["sh", "-c", PROBE],
            "cwd": cwd, "env": {**os.environ, "MOTOR_JOB_ID": job_id}, "cpus": list(cpus),
            "timeout_s": timeout_s, "kill_grace_s": 1.0, "umask": umask}
    spec.update(fields)
    write_json_atomic(os.path.join(d, "spec.json"), spec)
    spawned = request({"op": "spawn", "job_dir": d})
    if during is not None:
        during(job_id)
    request({"op": "wait", "job_dir": d})
    facts = backend.finish(job_id)
    recs, _ = read_records(os.path.join(d, "output.log"))
    text = b"".join(data for stream, data in recs if stream == "stdout").decode().split("\n")
    status = read_status(d)
    seen = dict(zip(FIELDS, text)) if len(text) > len(FIELDS) else {}
    return {"spawn": spawned, "exit_code": status["exit_code"], "reason": status.get("reason"),
            "detail": status.get("detail"), **seen, "unit": seen.get("unit"),
            "ppid": int(seen["ppid"]) if seen else None,
            "slice": fields["systemd_scope"]["slice"],
            "cpu_time_ms": facts.get("cpu_time_ms"), "cleanup_error": facts.get("cleanup_error")}

def spare_scopes():
    out = subprocess.run(["systemctl", "list-units", "--plain", "--no-legend", "--no-pager",
                          "--state=active", "motor-jobs-s*-p*.scope"],
                         capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]

def await_spare(old=()):
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        now = [s for s in spare_scopes() if s not in old]
        if now:
            return now
        time.sleep(0.02)
    return []

def spare_pid_of(scope):
    return int(scope.rsplit("-p", 1)[1].split(".")[0])

def job_units():
    out = subprocess.run(["systemctl", "list-units", "--all", "--plain", "--no-legend",
                          "--no-pager", "motor-jobs-j*"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]

"""

SCRIPT = KEEPERD_SCRIPT_HEAD + HELPERS + r"""
result = {"keeperd": hello.get("pid"), "jobs": []}
result["jobs"].append(job("a0"))
result["spares"] = await_spare()
for n in range(1, 4):
    result["jobs"].append(job(f"a{n}"))
# one spare, jobs that differ in cwd, umask and CPUs: each runs with its own
result["varied"] = [job("v0", cwd="/tmp", umask=0o022),
                    job("v1", cpus=(len(os.sched_getaffinity(0)) - 1,)),
                    job("v2", umask=0o027)]
result["keeperd_oom"] = open(f"/proc/{hello['pid']}/oom_score_adj").read().strip()
result["spare_oom"] = open(f"/proc/{spare_pid_of(result['spares'][0])}/oom_score_adj").read().strip()
result["job_units_after"] = job_units()
# a job of the spare's that outlives its timeout: keeperd kills its tree; while it runs,
# the backend finds it (adopt: a process of the job's in a spare's scope)
seen = {}
def look(job_id):  # the spawn was answered: the job has exec'd, its marker is there
    seen["adopt"] = backend.adopt(job_id)
    seen["job_units"] = job_units()
result["timed_out"] = job("t0", ["sh", "-c", "sleep 30; exit 5"], during=look, timeout_s=0.5)
result["timed_out"].update(seen)
result["bad_cwd"] = job("bad", cwd="/no/such/dir")
# an order too big for one message to the spare (300 kB of argv): forked into a scope of
# its own instead, and it runs
result["big"] = job("big", ["sh", "-c", PROBE, *["x" * 1000] * 300])
# the spare dies while a job of its runs: keeperd reaps that job (its subreaper); the
# next job gets a scope of its own, and a new spare follows
spare_pid = spare_pid_of(result["spares"][0])
go = os.path.join(work, "go")
def dead(pid):
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True

def kill_spare(job_id):  # the job waits for `go`; the spare is dead before it is there
    os.kill(spare_pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while not dead(spare_pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    open(go, "w").close()
result["orphaned"] = job("k0", ["sh", "-c", f"while [ ! -e {go} ]; do sleep 0.01; done; exit 4"],
                         during=kill_spare)
result["after_kill"] = job("b0")
result["new_spares"] = await_spare(result["spares"])
result["old_spare_reaped"] = not os.path.exists(f"/proc/{spare_pid}")
result["after_new"] = job("b1")
result["log"] = open(os.path.join(state, "keeperd.log")).read() if os.path.exists(
    os.path.join(state, "keeperd.log")) else ""
sock.close()
print(json.dumps(result))
"""


#: keeperd with its fault probe on: the slot's spare dies right after reaping its first job,
#: before relaying the job's end (slotspares.FAULT_ENV)
LOST_SCRIPT = ('import os; os.environ["MOTOR_KEEPERD_FAULT"] = "spare-drops-exit"\n'
               + KEEPERD_SCRIPT_HEAD + HELPERS + r"""
result = {"first": job("a0"), "spares": await_spare()}
spare_pid = spare_pid_of(result["spares"][0])
result["lost"] = job("l0")
deadline = time.monotonic() + 20
while os.path.exists(f"/proc/{spare_pid}") and time.monotonic() < deadline:
    time.sleep(0.01)
result["spare_reaped"] = not os.path.exists(f"/proc/{spare_pid}")
result["after"] = job("b0")
result["new_spares"] = await_spare(result["spares"])
sock.close()
print(json.dumps(result))
""")

#: a runner's start (issue 14): two slot slices made before any job, keeperd asked to
#: "prepare" them; its answer, then the first job of each slot
PREPARED_SCRIPT = KEEPERD_SCRIPT_HEAD + HELPERS + r"""
last = len(os.sched_getaffinity(0)) - 1
scopes, problems = backend.make_slots([([0], None), ([last], None)])
result = {"problems": problems, "scopes": scopes}
result["prepare"] = request({"op": "prepare", "systemd_address": backend.address,
                             "slots": scopes + [{"slice": "not-a-slot", "slot": True}]})
result["spares_at_answer"] = spare_scopes()
result["first"] = job("a0", cpus=(0,))
result["other"] = job("a1", cpus=(last,))
result["job_units"] = job_units()
sock.close()
print(json.dumps(result))
"""


def test_a_prepared_slot_has_its_spare_before_its_first_job(systemd_ns, tmp_path):
    """A runner's start (stop 64): the slot slices it made are named in keeperd's
    "prepare", which makes a spare in each and answers once their scopes have started. The
    slots' first jobs are then born in the spares' scopes, with no unit of their own (they
    were forked into scopes of their own before)."""
    work = tmp_path / "work"
    work.mkdir()
    run = systemd_ns.run(sys.executable, "-c", PREPARED_SCRIPT, str(work), cwd=str(ROOT),
                         timeout=120)
    assert run.returncode == 0, run.stderr.decode()
    out = json.loads(run.stdout)
    assert out["problems"] == [], out
    slots = [scope["slice"] for scope in out["scopes"]]
    assert slots == ["motor-jobs-s0.slice", "motor-jobs-s1.slice"], out["scopes"]
    # the answer names the slots it made spares for (not the malformed one), and came
    # once their scopes were active
    assert out["prepare"]["prepared"] == ["systemd"], out["prepare"]
    assert out["prepare"]["spares"] == slots, out["prepare"]
    spares = sorted(out["spares_at_answer"])
    assert [s.split("-p")[0] for s in spares] == ["motor-jobs-s0", "motor-jobs-s1"], spares
    for job, slot, spare in ((out["first"], slots[0], spares[0]),
                             (out["other"], slots[1], spares[1])):
        assert job["exit_code"] == 3 and job["slice"] == slot, job
        assert job["unit"] == f"/motor.slice/motor-jobs.slice/{slot}/{spare}", job
        assert job["ppid"] == int(spare.rsplit("-p", 1)[1].split(".")[0]), job
    assert out["job_units"] == [], out["job_units"]


def test_a_slots_jobs_are_born_in_its_spares_scope_as_its_children(systemd_ns, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    run = systemd_ns.run(sys.executable, "-c", SCRIPT, str(work), cwd=str(ROOT), timeout=180)
    assert run.returncode == 0, run.stderr.decode()
    out = json.loads(run.stdout)
    first, *spared = out["jobs"]
    slot = first["slice"]
    stem = slot.removesuffix(".slice")
    # the slot's first job: forked into a scope of its own, as before; then the spare's scope
    assert first["unit"].split("/")[-1].startswith("motor-jobs-j"), first
    assert len(out["spares"]) == 1 and out["spares"][0].startswith(stem + "-p"), out["spares"]
    spare = out["spares"][0]
    spare_pid = int(spare.removeprefix(stem + "-p").removesuffix(".scope"))
    for job in [first, *spared]:
        assert job["exit_code"] == 3 and job["reason"] is None, job
        assert job["cleanup_error"] is None and job["cpu_time_ms"] is not None, job
    for job in spared:
        # born in the spare's scope, in the slot slice, from its first instruction, the
        # spare's child (its exit, relayed by the spare: the exit code is right)
        assert job["slice"] == slot, job
        assert job["unit"] == f"/motor.slice/motor-jobs.slice/{slot}/{spare}", job
        assert job["ppid"] == spare_pid, job
        # nothing of the spare's dispositions (keeperd's: SIGINT, SIGHUP, SIGPIPE ignored,
        # SIGTERM and SIGCHLD caught) reaches the job: it starts as keeperd's own spawns do
        # (glibc's posix_spawn leaves its two internal signals, 32 and 33, ignored:
        # docs/keeper.md)
        blocked, ignored = (int(job[k].split(":")[1], 16) for k in ("blocked", "ignored"))
        assert blocked == 0 and ignored & ~(0b11 << 31) == 0, job
    assert out["job_units_after"] == [], out["job_units_after"]  # no unit per job
    # the spare keeps the last job's cwd, umask and CPUs between jobs: each job had its own;
    # its oom_score_adj is raised for each spawn only (the job's, not the spare's)
    keeperd_oom = int(out["keeperd_oom"])
    v0, v1, v2 = out["varied"]
    last_cpu = str(len(os.sched_getaffinity(0)) - 1)
    assert (v0["cwd"], v0["umask"], v0["cpus"]) == ("/tmp", "0022", "0"), v0
    assert (v1["cwd"], v1["cpus"]) == ("/", last_cpu) and v1["umask"] == spared[0]["umask"], v1
    assert (v2["cwd"], v2["umask"], v2["cpus"]) == ("/", "0027", "0"), v2
    assert all(j["unit"].endswith("/" + spare) for j in (v0, v1, v2)), out["varied"]
    assert all(int(j["oom"]) == min(1000, keeperd_oom + 500) for j in (v0, v1, v2)), out["varied"]
    assert int(out["spare_oom"]) == keeperd_oom, out
    timed_out = out["timed_out"]
    assert timed_out["reason"] == "timed_out" and timed_out["exit_code"] is None, timed_out
    # it ran in the spare's scope (no unit of its own), and adopt found it there
    assert timed_out["job_units"] == [] and timed_out["adopt"] is True, timed_out
    # the spare could not exec it: the job's spawn failure, with why
    bad = out["bad_cwd"]
    assert bad["reason"] == "spawn_failed" and "/no/such/dir" in (bad["detail"] or ""), bad
    big = out["big"]
    assert big["exit_code"] == 3 and big["unit"].split("/")[-1].startswith("motor-jobs-j"), big
    assert "cannot send an order" in out["log"], out["log"]
    # the spare killed under a running job: keeperd reaped it, its exit code is right
    orphaned = out["orphaned"]
    assert orphaned["exit_code"] == 4 and orphaned["reason"] is None, orphaned
    # the next job gets a scope of its own, then a new spare serves
    assert out["after_kill"]["unit"].split("/")[-1].startswith("motor-jobs-j"), out["after_kill"]
    assert out["after_kill"]["exit_code"] == 3
    assert len(out["new_spares"]) == 1 and out["new_spares"] != out["spares"], out
    assert out["old_spare_reaped"], out  # keeperd reaped the killed spare (no zombie left)
    assert out["after_new"]["unit"].endswith("/" + out["new_spares"][0]), out["after_new"]
    assert out["after_new"]["exit_code"] == 3


def test_a_job_whose_end_died_with_its_spare_is_concluded_without_an_exit_status(
        systemd_ns, tmp_path):
    """The spare reaped the job and died before relaying its end: keeperd cannot learn the
    exit status from anyone, and concludes the job without one, saying why; the slot goes
    on (its next job in a scope of its own, then a new spare)."""
    work = tmp_path / "work"
    work.mkdir()
    run = systemd_ns.run(sys.executable, "-c", LOST_SCRIPT, str(work), cwd=str(ROOT), timeout=120)
    assert run.returncode == 0, run.stderr.decode()
    out = json.loads(run.stdout)
    assert out["first"]["exit_code"] == 3, out["first"]
    assert len(out["spares"]) == 1, out
    lost = out["lost"]
    # it ran in the spare's scope as the spare's child (its probe printed all of that) ...
    assert lost["unit"].endswith("/" + out["spares"][0]), lost
    assert lost["ppid"] == int(out["spares"][0].rsplit("-p", 1)[1].split(".")[0]), lost
    # ... and its end is known, its exit status is not
    assert lost["exit_code"] is None and lost["reason"] is None, lost
    assert "exit status was lost with its slot's spare process" in (lost["detail"] or ""), lost
    assert out["spare_reaped"], out
    assert out["after"]["exit_code"] == 3, out["after"]
    assert out["after"]["unit"].split("/")[-1].startswith("motor-jobs-j"), out["after"]
    assert len(out["new_spares"]) == 1 and out["new_spares"] != out["spares"], out
