"""The systemd backend's pure parts: unit names, the CPU bitmask, the slice's properties, the
keeper's command prefix, the OOM verdict on fake cgroup trees, and the D-Bus client against
a small fake manager on a Unix socket (errors keep their D-Bus names)."""

from __future__ import annotations

import os
import signal
import socket
import threading

import pytest
from fake_dbus import AUTH_OK, dbus_messages
from jeepney import DBusAddress, new_error, new_method_return, new_signal

from motor.isolation import IsolationError, systemd
from motor.isolation.systemd import (
    SystemdBackend,
    SystemdError,
    SystemdManager,
    cpu_mask,
    job_figures,
    job_scope,
    job_slice,
    oom_verdict,
    slice_counters,
    slice_group,
    slice_properties,
    slot_counters_when_empty,
    slot_slice,
    slice_ran,
    systemd_accounts_cpu,
    unified_usage_usec,
)

JOB = "0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b"
MiB = 1024 * 1024


def test_a_job_slice_is_a_child_of_the_jobs_slice_and_keeps_the_id_unique():
    assert job_slice("motor-jobs", JOB) == "motor-jobs-j0190a1b2c3d47e5f8a9b0c1d2e3f4a5b.slice"
    assert job_scope("motor-jobs", JOB) == "motor-jobs-j0190a1b2c3d47e5f8a9b0c1d2e3f4a5b.scope"
    # no dash of the id survives: systemd would read each one as a slice level
    assert job_slice("motor-jobs", JOB).count("-") == 2
    for bad in ("", "..", "a/b", "a b", ".x", "x" * 200):
        with pytest.raises(IsolationError):
            job_slice("motor-jobs", bad)


def test_cpu_mask_is_systemds_little_endian_bitmask():
    assert cpu_mask([]) == b""
    assert cpu_mask([0]) == b"\x01"
    assert cpu_mask([0, 1]) == b"\x03"
    assert cpu_mask([7, 8]) == b"\x80\x01"
    assert cpu_mask([255]) == bytes(31) + b"\x80"
    with pytest.raises(ValueError):
        cpu_mask([-1])


def test_slice_properties_carry_the_limits_and_accounting():
    props = dict(slice_properties(JOB, [2, 3], 256 * MiB))
    assert props["MemoryMax"] == ("t", 256 * MiB)
    assert props["AllowedCPUs"] == ("ay", b"\x0c")
    assert props["CPUAccounting"] == ("b", True) and props["MemoryAccounting"] == ("b", True)
    bare = dict(slice_properties(JOB, None, None))
    assert "MemoryMax" not in bare and "AllowedCPUs" not in bare


def test_the_keeper_joins_a_scope_in_the_jobs_slice_itself():
    """No `systemd-run` per job: the spec names the scope, and the keeper's join step asks
    systemd for it with its own pid (motor/isolation/join.py)."""
    backend = SystemdBackend(address="/nonexistent")
    fields = backend.spec_fields(JOB, [1], 64 * MiB)
    assert fields["pin"] is True and fields["cgroup_procs"] == []
    assert "command_prefix" not in fields
    assert fields["systemd_scope"] == {"address": "/nonexistent",
                                       "scope": job_scope("motor-jobs", JOB),
                                       "slice": job_slice("motor-jobs", JOB),
                                       "description": f"motor job {JOB}"}
    slot = backend.spec_fields(JOB, [3, 2, 7], None, slot_slice("motor-jobs", 4))
    assert slot["systemd_scope"]["slice"] == "motor-jobs-s4.slice"
    assert backend.spec_fields(JOB, None, None)["pin"] is False


def test_a_slices_control_group_has_a_level_per_dash():
    assert slice_group("motor-jobs-s0.slice") == "/motor.slice/motor-jobs.slice/motor-jobs-s0.slice"
    assert slice_group("motor-jobs.slice") == "/motor.slice/motor-jobs.slice"


# -- the OOM verdict on fake cgroup trees -----------------------------------------------------


GROUP = "/motor.slice/motor-jobs.slice/motor-jobs-jX.slice"


def write(root, rel, name, text):
    path = os.path.join(root, rel.lstrip("/"), name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def test_v2_memory_events_are_exact(tmp_path):
    write(tmp_path, GROUP, "memory.events", "low 0\nhigh 0\nmax 9\noom 1\noom_kill 1\n")
    assert oom_verdict(GROUP, None, str(tmp_path))["oom_killed"] is True
    write(tmp_path, GROUP, "memory.events", "low 0\nhigh 0\nmax 9\noom 0\noom_kill 0\n")
    verdict = oom_verdict(GROUP, signal.SIGKILL, str(tmp_path))
    assert verdict["oom_killed"] is False and verdict["oom_rule"] == "v2 memory.events"


def test_v2_events_in_a_hybrid_unified_mount_count_too(tmp_path):
    write(tmp_path, "unified" + GROUP, "memory.events", "oom 1\noom_kill 2\n")
    assert oom_verdict(GROUP, None, str(tmp_path)) == {
        "oom_killed": True, "oom_kills": 2, "oom_rule": "v2 memory.events"}


def test_v1_counts_a_kill_in_the_slice_itself(tmp_path):
    write(tmp_path, "memory" + GROUP, "memory.oom_control", "oom_kill_disable 0\noom_kill 1\n")
    assert oom_verdict(GROUP, None, str(tmp_path))["oom_killed"] is True


def test_v1_kill_in_the_removed_scope_is_sigkill_after_the_slice_hit_its_limit(tmp_path):
    write(tmp_path, "memory" + GROUP, "memory.oom_control", "oom_kill_disable 0\noom_kill 0\n")
    write(tmp_path, "memory" + GROUP, "memory.failcnt", "78\n")
    assert oom_verdict(GROUP, signal.SIGKILL, str(tmp_path))["oom_killed"] is True
    assert oom_verdict(GROUP, signal.SIGSEGV, str(tmp_path))["oom_killed"] is False
    assert oom_verdict(GROUP, None, str(tmp_path))["oom_killed"] is False
    write(tmp_path, "memory" + GROUP, "memory.failcnt", "0\n")  # never at its limit
    assert oom_verdict(GROUP, signal.SIGKILL, str(tmp_path))["oom_killed"] is False


def _slot_backend(fake_manager, tmp_path):
    """A backend on a fake cgroup tree under `tmp_path`, its manager the fake one: slot 0's
    slice there, empty, its CPU counter at 1 ms. (backend, root, slot 0's group)."""
    fake_manager.accept_slices = True
    root = tmp_path / "cg"
    backend = SystemdBackend(address=fake_manager.path, cgroup_root=str(root))
    s0 = "/motor.slice/motor-jobs.slice/motor-jobs-s0.slice"
    write(root, "unified" + s0, "cpu.stat", "usage_usec 1000\n")
    write(root, "unified" + s0, "cgroup.procs", "")
    return backend, root, s0


def test_keeperds_reading_of_a_slot_slice_at_a_jobs_end_spares_the_runner_its_reads(
        fake_manager, tmp_path):
    """Issue 14: keeperd reads a slot job's slice when the job has ended (status.json's
    `isolation_facts`): the counters when nothing but the slot's spare is left there, None
    when a process is (or for a slice of the job's own). `settle_quick` takes them as they
    are and reads no group; facts of another shape are not trusted (the slice is read)."""
    backend, root, s0 = _slot_backend(fake_manager, tmp_path)
    write(root, "unified" + s0 + "/motor-jobs-s0-p77.scope", "cgroup.procs", "77\n")  # the spare
    fields = backend.prepare(JOB, [0], 64 * MiB)
    scope = fields["systemd_scope"]
    assert scope["slot"] is True and scope["cgroup_root"] == str(root)
    write(root, "unified" + s0, "cpu.stat", "usage_usec 8000\n")  # the job ran 7 ms
    counters = slot_counters_when_empty(scope)
    assert counters == {"usage_usec": 8000, "oom_kills": None, "oom_v2": False, "failcnt": None}
    assert slot_counters_when_empty({**scope, "slot": False}) is None
    assert slot_counters_when_empty(backend.spec_fields(JOB, None, None)["systemd_scope"]) is None
    write(root, "unified" + s0, "cgroup.procs", "4242\n")  # a process left: not empty
    assert slot_counters_when_empty(scope) is None
    # with that process there a read of the slice says "not settled": keeperd's facts are
    # taken without one, facts of another shape are not
    assert backend.settle_quick(JOB, None, {**counters, "usage_usec": "8000"}) is None
    assert backend.settle_quick(JOB, None, {"cpu_time_ms": 7}) is None
    settled = backend.settle_quick(JOB, None, counters)
    assert settled["cpu_time_ms"] == 7 and settled["oom_killed"] is False, settled


def test_a_slot_emptied_at_its_last_jobs_end_is_the_next_jobs_without_a_read(
        fake_manager, tmp_path, monkeypatch):
    """Issue 14: within EMPTIED_FRESH_S of a slot job's end (`settle_quick`, on keeperd's
    facts or on the runner's own reads), the next job with the slot's limits takes it with
    no read of the slice: free, and its baseline the counters after the job before. Taken,
    the slot is read again for the job after; so is one whose last end is older."""
    backend, root, s0 = _slot_backend(fake_manager, tmp_path)
    jobs = [f"0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a{n:02x}" for n in range(3)]
    backend.prepare(jobs[0], [0], 64 * MiB)
    after = {"usage_usec": 9000, "oom_kills": None, "oom_v2": False, "failcnt": None}
    assert backend.settle_quick(jobs[0], None, after)["cpu_time_ms"] == 8
    assert backend.release(jobs[0]) is None
    # the slice now reads otherwise: a read would find it busy, with other counters
    write(root, "unified" + s0, "cgroup.procs", "4343\n")
    write(root, "unified" + s0, "cpu.stat", "usage_usec 20000\n")
    calls = len(fake_manager.calls)
    assert backend.prepare_is_light([0], 64 * MiB)
    second = backend.prepare(jobs[1], [0], 64 * MiB)
    assert second["systemd_scope"]["slice"] == "motor-jobs-s0.slice"
    assert second["systemd_base"] == after and len(fake_manager.calls) == calls
    # its end read by the runner (no facts): the slice empty, its counters read
    write(root, "unified" + s0, "cgroup.procs", "")
    assert backend.settle_quick(jobs[1])["cpu_time_ms"] == 11
    backend.release(jobs[1])
    write(root, "unified" + s0, "cpu.stat", "usage_usec 25000\n")
    third = backend.prepare(jobs[2], [0], 64 * MiB)
    assert third["systemd_base"]["usage_usec"] == 20000  # at the last end, not read now
    write(root, "unified" + s0, "cpu.stat", "usage_usec 26000\n")
    assert backend.settle_quick(jobs[2])["cpu_time_ms"] == 6
    backend.release(jobs[2])
    # the window past: read as it is, a process there keeps the slot from the next job
    monkeypatch.setattr(systemd, "EMPTIED_FRESH_S", 0.0)
    write(root, "unified" + s0, "cgroup.procs", "4343\n")
    assert not backend.prepare_is_light([0], 64 * MiB)


def test_a_jobs_figures_are_the_growth_of_its_slot_slices_counters(tmp_path):
    """A slot slice holds one job after another: each job's CPU time and OOM verdict are
    what its slice's counters grew by over the job, so an earlier job's kill or limit hit
    is never this job's."""
    cpu = "/motor.slice/motor-jobs.slice/motor-jobs-s0.slice"
    write(tmp_path, "unified" + cpu, "cpu.stat", "usage_usec 5000\nuser_usec 1\nsystem_usec 1\n")
    write(tmp_path, "memory" + cpu, "memory.oom_control", "oom_kill_disable 0\noom_kill 1\n")
    write(tmp_path, "memory" + cpu, "memory.failcnt", "40\n")
    before = slice_counters(cpu, str(tmp_path))
    assert before == {"usage_usec": 5000, "oom_kills": 1, "oom_v2": False, "failcnt": 40}
    write(tmp_path, "unified" + cpu, "cpu.stat", "usage_usec 2305000\n")
    after = slice_counters(cpu, str(tmp_path))
    quiet = job_figures(before, after, signal.SIGKILL)  # the earlier job's kill and hits
    assert quiet["cpu_time_ms"] == 2300 and quiet["oom_kills"] == 0
    assert quiet["oom_killed"] is False
    write(tmp_path, "memory" + cpu, "memory.failcnt", "41\n")  # this job hit the limit
    after = slice_counters(cpu, str(tmp_path))
    assert job_figures(before, after, signal.SIGKILL)["oom_killed"] is True
    assert job_figures(before, after, signal.SIGTERM)["oom_killed"] is False
    write(tmp_path, "memory" + cpu, "memory.oom_control", "oom_kill_disable 0\noom_kill 2\n")
    assert job_figures(before, slice_counters(cpu, str(tmp_path)), None)["oom_killed"] is True


def test_v2_growth_of_oom_kills_is_exact_and_missing_counters_are_absent(tmp_path):
    cpu = "/motor.slice/motor-jobs.slice/motor-jobs-s3.slice"
    write(tmp_path, cpu, "cpu.stat", "usage_usec 100\n")
    write(tmp_path, cpu, "memory.events", "oom 1\noom_kill 1\n")
    before = slice_counters(cpu, str(tmp_path))
    write(tmp_path, cpu, "memory.events", "oom 2\noom_kill 2\n")
    facts = job_figures(before, slice_counters(cpu, str(tmp_path)), None)
    assert facts["oom_killed"] is True and facts["oom_kills"] == 1
    assert facts["cpu_time_ms"] == 0
    gone = slice_counters("/motor.slice/nothing.slice", str(tmp_path))
    assert gone["usage_usec"] is None
    assert job_figures(gone, gone, signal.SIGKILL)["cpu_time_ms"] is None  # absent, not 0


def test_a_missing_group_is_no_oom(tmp_path):
    assert oom_verdict(GROUP, signal.SIGKILL, str(tmp_path))["oom_killed"] is False


def test_systemd_accounts_cpu_only_where_it_can_read_a_figure(tmp_path):
    assert systemd_accounts_cpu(str(tmp_path)) is False  # v1 with cpuacct apart from cpu
    write(tmp_path, "cpu", "cpuacct.usage", "0\n")  # cpu,cpuacct co-mounted
    assert systemd_accounts_cpu(str(tmp_path)) is True
    os.remove(tmp_path / "cpu" / "cpuacct.usage")
    write(tmp_path, "", "cgroup.controllers", "cpu memory\n")  # v2
    assert systemd_accounts_cpu(str(tmp_path)) is True


def test_the_unified_cpu_figure_and_whether_anything_ran_in_the_slice(tmp_path):
    root = str(tmp_path)
    assert unified_usage_usec(GROUP, root) is None and slice_ran(GROUP, root) is None
    write(tmp_path, "memory" + GROUP, "memory.max_usage_in_bytes", "0\n")  # v1 only: by memory
    assert slice_ran(GROUP, root) is False
    write(tmp_path, "memory" + GROUP, "memory.max_usage_in_bytes", "7782400\n")
    assert slice_ran(GROUP, root) is True
    write(tmp_path, "unified" + GROUP, "cpu.stat", "usage_usec 0\nuser_usec 0\n")  # hybrid
    assert unified_usage_usec(GROUP, root) == 0 and slice_ran(GROUP, root) is False
    write(tmp_path, GROUP, "cpu.stat", "usage_usec 379233\nuser_usec 143709\n")  # pure v2
    assert unified_usage_usec(GROUP, root) == 379233 and slice_ran(GROUP, root) is True


def test_a_job_never_put_in_its_unit_ends_spawn_failed_unless_cancelled():
    from motor.lifecycle import terminal_from_status
    from motor.records import JobRecord

    record = JobRecord(job_id=JOB, state="running", workspace="w", command=["true"], claim=1,
                       accepted_at_ms=1, queued_at_ms=1, started_at_ms=2)
    status = {"exit_code": 1, "signal": None, "reason": None, "ended_at_ms": 5}
    facts = {"oom_killed": False, "start_error": "systemd did not start the job's scope"}
    ended = terminal_from_status(record, status, 9, facts)
    assert (ended.state, ended.reason, ended.exit_code) == ("failed", "spawn_failed", 1)
    assert ended.detail == "systemd did not start the job's scope"
    cancelled = terminal_from_status(record, {**status, "reason": "cancelled"}, 9, facts)
    assert (cancelled.state, cancelled.reason) == ("cancelled", "cancelled")
    assert terminal_from_status(record, status, 9, {"oom_killed": False}).reason is None
    own = {**status, "exit_code": 127, "reason": "spawn_failed", "detail": "cannot execute 'x'"}
    assert terminal_from_status(record, own, 9, facts).detail == "cannot execute 'x'"


# -- the D-Bus client against a fake manager ------------------------------------------------------


class FakeManager:
    """Accepts pipelined EXTERNAL auth, answers GetUnit (NoSuchUnit), Get (Version), and
    anything else with an AccessDenied error. Records the calls."""

    def __init__(self, path):
        self.path = str(path)
        self.calls: list[tuple[str, tuple]] = []
        self.units: list[str] = []  # loaded units (ListUnitsByPatterns, StopUnit answer them)
        self.accept_scopes = False  # StartTransientUnit of a .scope: a job and its JobRemoved
        self.accept_slices = False  # ... of a .slice, the same (then GetUnit finds it, active)
        self.accepted = 0  # connections accepted
        #: signals sent in the same write as the auth OK line (systemd's private socket sends
        #: a new connection every signal at once: they may arrive right behind it)
        self.greeting_signals = 0
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(self.path)
        self.sock.listen()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            with conn:
                greeting = AUTH_OK
                for i in range(self.greeting_signals):
                    greeting += new_signal(
                        DBusAddress("/org/freedesktop/systemd1/unit/x",
                                    interface="org.freedesktop.DBus.Properties"),
                        "PropertiesChanged", "sa{sv}as",
                        ("org.freedesktop.systemd1.Unit", {}, [])).serialise(serial=500 + i)
                for msg in dbus_messages(conn, greeting):
                    member = msg.header.fields[3]  # MEMBER
                    self.calls.append((member, msg.body))
                    if member == "Get" and msg.body[1] == "Version":
                        reply = new_method_return(msg, "v", (("s", "252-fake"),))
                    elif member == "ListUnitsByPatterns":
                        rows = [(n, "motor job", "loaded", "active", "active", "",
                                 "/org/freedesktop/systemd1/unit/x", 0, "", "/")
                                for n in self.units]
                        reply = new_method_return(msg, "a(ssssssouso)", (rows,))
                    elif member == "StopUnit" and msg.body[0] in self.units:
                        self.units.remove(msg.body[0])
                        reply = new_method_return(msg, "o", ("/org/freedesktop/systemd1/job/1",))
                    elif (member == "StartTransientUnit" and msg.body[0] not in self.units
                          and (self.accept_scopes and msg.body[0].endswith(".scope")
                               or self.accept_slices and msg.body[0].endswith(".slice"))):
                        self.units.append(msg.body[0])
                        job = f"/org/freedesktop/systemd1/job/{len(self.calls)}"
                        conn.sendall(new_method_return(msg, "o", (job,)).serialise(
                            serial=1000 + len(self.calls)))
                        removed = new_signal(
                            DBusAddress("/org/freedesktop/systemd1",
                                        interface="org.freedesktop.systemd1.Manager"),
                            "JobRemoved", "uoss", (len(self.calls), job, msg.body[0], "done"))
                        conn.sendall(removed.serialise(serial=2000 + len(self.calls)))
                        continue
                    elif member == "StartTransientUnit" and msg.body[0] in self.units:
                        reply = new_error(msg, "org.freedesktop.systemd1.UnitExists", "s",
                                          (f"Unit {msg.body[0]} already exists.",))
                    elif member == "Hello":
                        reply = new_method_return(msg, "s", (":1.42",))
                    elif member in ("AddMatch", "Subscribe"):
                        reply = new_method_return(msg)
                    elif member == "GetUnit" and msg.body[0] in self.units:
                        reply = new_method_return(msg, "o", ("/unit/" + msg.body[0].replace(
                            "-", "_2d").replace(".", "_2e"),))
                    elif member == "Get" and msg.body[1] == "ActiveState":
                        reply = new_method_return(msg, "v", (("s", "active"),))
                    elif member == "SetUnitProperties" and msg.body[0] in self.units:
                        reply = new_method_return(msg)
                    elif member == "GetUnit":
                        reply = new_error(msg, "org.freedesktop.systemd1.NoSuchUnit", "s",
                                          (f"Unit {msg.body[0]} not loaded.",))
                    else:
                        reply = new_error(msg, "org.freedesktop.DBus.Error.AccessDenied", "s",
                                          ("Access denied",))
                    conn.sendall(reply.serialise(serial=1000 + len(self.calls)))

    def close(self):
        self.sock.close()


@pytest.fixture
def fake_manager(tmp_path):
    manager = FakeManager(tmp_path / "private")
    yield manager
    manager.close()


def test_signals_right_behind_the_auth_answer_are_framed_not_dropped(fake_manager):
    """The manager's private socket sends a new connection its signals at once: bytes right
    behind the OK line belong to the next messages. Dropping them (as the client once did)
    broke the framing of every later message, and the call timed out: the systemd backend
    ran 7.4 jobs/s and lost a scope start in 100."""
    fake_manager.greeting_signals = 40  # more than one read: a message is cut at its end
    with SystemdManager(fake_manager.path, timeout=2) as m:
        assert m.version() == "252-fake"


def test_the_client_calls_the_manager_and_keeps_dbus_error_names(fake_manager):
    with SystemdManager(fake_manager.path, timeout=5) as m:
        assert m.version() == "252-fake"
        assert m.unit_path("motor-jobs-jX.slice") is None  # NoSuchUnit: not loaded
        assert m.active_state("motor-jobs-jX.slice") is None
        with pytest.raises(SystemdError) as err:
            m.start_transient("motor-jobs-jX.slice", slice_properties(JOB, [1], 64 * MiB))
    assert err.value.name == "org.freedesktop.DBus.Error.AccessDenied"
    assert "Access denied" in str(err.value)
    members = [c[0] for c in fake_manager.calls]
    assert members == ["Get", "GetUnit", "GetUnit", "StartTransientUnit"]
    name, mode, props, aux = fake_manager.calls[-1][1]
    assert (name, mode, aux) == ("motor-jobs-jX.slice", "fail", [])
    assert ("MemoryMax", ("t", 64 * MiB)) in props


def test_an_unreachable_manager_is_a_clear_isolation_error(tmp_path):
    with pytest.raises(IsolationError, match="cannot connect to .*nothing-here"):
        SystemdManager(str(tmp_path / "nothing-here")).connect()


def test_a_refusing_manager_never_blocks_finish(fake_manager):
    backend = SystemdBackend(systemd_run="/usr/bin/systemd-run", address=fake_manager.path)
    assert backend.finish(JOB, signal.SIGKILL) == {
        "oom_killed": False, "cpu_time_ms": None, "cleanup_error": None}  # unit already gone
    assert backend.adopt(JOB) is False
    with pytest.raises(IsolationError, match="AccessDenied"):
        backend.prepare(JOB, [0], 64 * MiB)


def test_the_start_up_sweep_stops_job_slices_the_store_does_not_know(fake_manager):
    backend = SystemdBackend(systemd_run="/usr/bin/systemd-run", address=fake_manager.path)
    known = job_slice("motor-jobs", JOB)
    fake_manager.units = [known, "motor-jobs-jdeadbeef.slice"]
    assert backend.sweep({JOB}) == ["unit motor-jobs-jdeadbeef.slice: stopped"]
    assert fake_manager.units == [known]
    listed = [c[1] for c in fake_manager.calls if c[0] == "ListUnitsByPatterns"]
    assert listed == [([], ["motor-jobs-j*.slice", "motor-jobs-j*.scope"])]


def test_the_start_up_sweep_leaves_slices_of_jobs_this_state_dir_never_held(fake_manager):
    """Two runners on one jobs slice: a runner sweeps only its own jobs' leftovers."""
    backend = SystemdBackend(systemd_run="/usr/bin/systemd-run", address=fake_manager.path)
    fake_manager.units = ["motor-jobs-jdeadbeef.slice", "motor-jobs-jfeedbeef.slice"]
    assert backend.sweep(set(), owned={"deadbeef"}) == [
        "unit motor-jobs-jdeadbeef.slice: stopped",
        "unit motor-jobs-jfeedbeef.slice: left alone (not a job of this state dir)"]
    assert fake_manager.units == ["motor-jobs-jfeedbeef.slice"]


def test_systemd_health_never_touches_the_bus(tmp_path):
    """`/metrics` and `motor health` run on the event loop: the systemd backend's health
    reports the jobs slice's MemoryMax as last read (at start-up, then by maintenance, off
    the loop), never with a blocking D-Bus call of its own. A manager socket that accepts
    but never answers would stall the loop for the read timeout."""
    import socket as socketlib

    from motor.isolation.systemd import SystemdBackend

    path = str(tmp_path / "stalled-manager")
    listener = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    try:
        listener.bind(path)
        listener.listen(4)
        listener.setblocking(False)
        health = SystemdBackend(address=path).health()
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            conn = None
        else:
            conn.close()
    finally:
        listener.close()
    assert conn is None, "health() connected to the systemd manager"
    assert health["backend"] == "systemd" and health["memory_max"] is None  # nothing read yet


def test_the_join_step_asks_systemd_for_the_scope_with_its_own_pid(fake_manager):
    """The keeper's join step (motor/isolation/join.py) starts the job's scope with its own
    pid; the start job's JobRemoved ends the wait; a refusal keeps systemd's error name and
    words."""
    from motor.isolation.join import JoinError, join_confinement

    fake_manager.accept_scopes = True
    spec = SystemdBackend(address=fake_manager.path).spec_fields(JOB, [1], 64 * MiB)
    assert join_confinement(spec) is True
    member, (name, mode, props, aux) = fake_manager.calls[-1]
    assert member == "StartTransientUnit" and mode == "fail" and aux == []
    assert name == job_scope("motor-jobs", JOB)
    assert dict(props) == {"Description": ("s", f"motor job {JOB}"),
                           "Slice": ("s", job_slice("motor-jobs", JOB)),
                           "CollectMode": ("s", "inactive-or-failed"),
                           "PIDs": ("au", [os.getpid()])}
    with pytest.raises(JoinError, match="UnitExists: Unit .* already exists"):
        join_confinement(spec)  # the scope's name is taken now
    fake_manager.accept_scopes = False
    with pytest.raises(JoinError, match="AccessDenied"):
        join_confinement({"systemd_scope": dict(spec["systemd_scope"], scope="x.scope")})
    with pytest.raises(JoinError, match="cannot connect"):
        join_confinement({"systemd_scope": dict(spec["systemd_scope"], address="/nonexistent")})


def test_prepare_and_finish_reuse_one_connection(fake_manager):
    """A job's prepare and finish do not each connect and authenticate: the backend keeps
    idle connections (and closes one the manager dropped)."""
    backend = SystemdBackend(address=fake_manager.path)
    for _ in range(3):
        backend.finish(JOB)
        assert backend.adopt(JOB) is False
    assert fake_manager.accepted == 1
    backend.pool.close()  # idle connections closed (as after IDLE_CLOSE_S): connect again
    backend.finish(JOB)
    assert fake_manager.accepted == 2


def test_the_join_step_through_a_bus_daemon_says_hello_and_listens(tmp_path):
    """Not root: the system bus. The join step says Hello, asks for JobRemoved signals
    (AddMatch, Subscribe), then starts the scope."""
    from motor.isolation.join import join_confinement

    manager = FakeManager(tmp_path / "system_bus_socket")
    try:
        manager.accept_scopes = True
        spec = SystemdBackend(address=manager.path).spec_fields(JOB, [1], 64 * MiB)
        assert join_confinement(spec) is True
        assert [c[0] for c in manager.calls] == ["Hello", "AddMatch", "Subscribe",
                                                 "StartTransientUnit"]
        assert "member='JobRemoved'" in manager.calls[1][1][0]
    finally:
        manager.close()


def test_an_idle_pooled_connection_is_closed(fake_manager):
    """systemd's private socket sends every signal to every connection: a pooled
    connection left idle is closed by the janitor, not kept piling them up."""
    from polling import wait_for

    from motor.isolation.systemd import ConnectionPool

    pool = ConnectionPool(fake_manager.path, idle_close_s=0.05)
    with pool.connection() as m:
        assert m.version() == "252-fake"
    assert len(pool._idle) == 1
    wait_for(lambda: not pool._idle and m._sock is None, timeout=10,
             what="the idle connection to be closed")
    with pool.connection() as again:  # a new one when needed
        assert again is not m and again.version() == "252-fake"
    assert pool.opened == 2
    pool.close()


def test_a_slot_slice_holds_one_job_at_a_time_and_one_with_the_same_limits_costs_no_call(
        fake_manager, tmp_path, monkeypatch):
    """Per job in a slot slice: D-Bus only when the slice is new or its limits change
    (`SetUnitProperties`); a job with a free slot's limits is prepared, settled and
    released with reads alone (`prepare_is_light`, `settle_quick`, `release_is_light`: the
    runner runs them on its event loop). A slot holds one job from `prepare` to `settle`,
    and none while a process runs in it. A restarted runner takes the job's counters before
    it from the spec."""
    fake_manager.accept_slices = True
    root = tmp_path / "cg"
    backend = SystemdBackend(address=fake_manager.path, cgroup_root=str(root))
    s0, s1, s2 = ("/motor.slice/motor-jobs.slice/motor-jobs-s%d.slice" % n for n in range(3))
    for group in (s0, s1):
        write(root, "unified" + group, "cpu.stat", "usage_usec 1000\n")
        write(root, "unified" + group, "cgroup.procs", "")
    jobs = [f"0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a{n:02x}" for n in range(6)]
    assert not backend.prepare_is_light([0], 64 * MiB)
    first = backend.prepare(jobs[0], [0], 64 * MiB)
    assert first["systemd_scope"]["slice"] == "motor-jobs-s0.slice"
    assert first["systemd_base"]["usage_usec"] == 1000
    # a job prepared while the first is not settled (claims that overlap): the next slot
    other = backend.prepare(jobs[1], [0], 64 * MiB)
    assert other["systemd_scope"]["slice"] == "motor-jobs-s1.slice"
    started = [c for c in fake_manager.calls if c[0] == "StartTransientUnit"]
    assert [c[1][0] for c in started] == ["motor-jobs-s0.slice", "motor-jobs-s1.slice"]
    assert ("MemoryMax", ("t", 64 * MiB)) in started[0][1][2]
    assert ("AllowedCPUs", ("ay", b"\x01")) in started[0][1][2]
    write(root, "unified" + s0, "cpu.stat", "usage_usec 251000\n")  # the job ran 250 ms
    assert backend.settle_quick(jobs[0])["cpu_time_ms"] == 250
    assert backend.release_is_light(jobs[0]) and backend.release(jobs[0]) is None

    calls = len(fake_manager.calls)
    assert backend.prepare_is_light([0], 64 * MiB)  # s0 is free again, with these limits
    second = backend.prepare(jobs[2], [0], 64 * MiB)
    assert second["systemd_scope"]["slice"] == "motor-jobs-s0.slice"
    assert second["systemd_base"]["usage_usec"] == 251000
    write(root, "unified" + s0, "cgroup.procs", "4242\n")  # something left: a thread's work
    assert backend.settle_quick(jobs[2]) is None
    write(root, "unified" + s0, "cgroup.procs", "")
    write(root, "unified" + s0, "cpu.stat", "usage_usec 256000\n")
    assert backend.settle_quick(jobs[2])["cpu_time_ms"] == 5
    assert backend.release(jobs[2]) is None
    assert len(fake_manager.calls) == calls  # not one call for that job

    # a process in a free slot (an adopted job's, or a stranger's): not taken (once its
    # last job's end is more than EMPTIED_FRESH_S ago, the slice is read)
    monkeypatch.setattr(systemd, "EMPTIED_FRESH_S", 0.0)
    write(root, "unified" + s0, "cgroup.procs", "4343\n")
    assert not backend.prepare_is_light([0], 64 * MiB)
    third = backend.prepare(jobs[3], [0, 1], None)
    assert third["systemd_scope"]["slice"] == "motor-jobs-s2.slice"  # s1 is still held
    write(root, "unified" + s0, "cgroup.procs", "")
    # other limits on a free slot: one SetUnitProperties on the active slice
    backend.settle(jobs[1])
    fourth = backend.prepare(jobs[4], [1], None)
    assert fourth["systemd_scope"]["slice"] == "motor-jobs-s0.slice"
    member, (name, runtime, props) = fake_manager.calls[-1]
    assert (member, name, runtime) == ("SetUnitProperties", "motor-jobs-s0.slice", True)
    assert dict(props) == {"MemoryMax": ("t", 2**64 - 1), "AllowedCPUs": ("ay", b"\x02")}

    # a restarted runner (a new backend, the manager unreachable): the spec's counters
    restarted = SystemdBackend(address=str(tmp_path / "gone"), cgroup_root=str(root))
    assert restarted.needs_spec(jobs[4]) and not backend.needs_spec(jobs[4])
    write(root, "unified" + s0, "cpu.stat", "usage_usec 356000\n")
    facts = restarted.settle(jobs[4], spec=fourth)
    assert facts["cpu_time_ms"] == 100 and facts["cleanup_error"] is None, facts
    assert restarted.release_is_light(jobs[4]) and restarted.release(jobs[4]) is None
