"""The pure parts of the isolation backends: parsing, choose_backend's order, the v2 layout
on a fake cgroupfs (a plain directory tree), the no-op methods of affinity/none."""

from __future__ import annotations

import os

import pytest

import motor.isolation.cgroup as cg
from motor.isolation import AFFINITY, NONE, Backend, IsolationError, choose_backend
from motor.isolation.cgroup import (
    CgroupBackend,
    CgroupV1,
    CgroupV2,
    clamp,
    detect,
    format_cpus,
    group_name,
    oom_kills_v1,
    oom_kills_v2,
    parse_keyed,
    parse_limit,
    usage_usec_v2,
)
from motor.isolation.systemd import SystemdBackend

# -- parsing ---------------------------------------------------------------------------------


def test_oom_control_v1():
    assert oom_kills_v1("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n") == 3
    assert oom_kills_v1("oom_kill_disable 0\nunder_oom 0\noom_kill 0\n") == 0
    assert oom_kills_v1("oom_kill_disable 0\nunder_oom 1\n") is None  # kernels before 4.13


def test_memory_events_v2():
    text = "low 0\nhigh 12\nmax 40\noom 2\noom_kill 1\noom_group_kill 0\n"
    assert oom_kills_v2(text) == 1
    assert oom_kills_v2("low 0\nhigh 0\nmax 0\noom 0\n") is None


def test_cpu_stat_v2():
    text = ("usage_usec 1234567\nuser_usec 1000000\nsystem_usec 234567\n"
            "core_sched.force_idle_usec 0\nnr_periods 0\n")
    assert usage_usec_v2(text) == 1234567
    assert usage_usec_v2("") is None


def test_parse_keyed_skips_junk():
    assert parse_keyed("a 1\nbad\nb x\nc 2 3\n\nd -4\n") == {"a": 1, "d": -4}


def test_limits():
    assert parse_limit("9223372036854771712\n") is None  # v1 "unlimited"
    assert parse_limit("max\n") is None  # v2
    assert parse_limit("67108864\n") == 64 << 20
    assert clamp(None, None) is None
    assert clamp(1 << 30, None) == 1 << 30
    assert clamp(None, 1 << 30) == 1 << 30  # no own limit: the slice's
    assert clamp(1 << 34, 1 << 30) == 1 << 30  # never above the slice
    assert clamp(1 << 20, 1 << 30) == 1 << 20


def test_cpu_lists_and_group_names():
    assert format_cpus([3, 0, 1, 2, 5, 7, 8]) == "0-3,5,7-8"
    assert format_cpus([1]) == "1"
    assert group_name("0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b") == \
        "job-0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b"
    for bad in ("", "..", "../x", "a/b", ".hidden", "a b"):
        with pytest.raises(IsolationError):
            group_name(bad)


# -- choose_backend's order --------------------------------------------------------------------


class FakeProbe:
    def __init__(self, pid1="init", cgroup=None, affinity=True, systemd=None):
        self._pid1, self._cgroup, self._affinity = pid1, cgroup, affinity
        self._systemd = systemd
        self.asked: list[str] = []

    def pid1(self):
        self.asked.append("pid1")
        return self._pid1

    def systemd(self):
        self.asked.append("systemd")
        if isinstance(self._systemd, Exception) or self._systemd is None:
            raise self._systemd or IsolationError("systemd: no manager in this fake")
        return self._systemd

    def cgroup(self):
        self.asked.append("cgroup")
        if isinstance(self._cgroup, Exception):
            raise self._cgroup
        return self._cgroup

    def affinity(self):
        self.asked.append("affinity")
        return self._affinity


CG = CgroupBackend(notes=("cgroup v1",), flavour=CgroupV1("/nonexistent"))
MISSING = IsolationError("no cgroup v1 memory hierarchy under /sys/fs/cgroup")


def test_auto_prefers_cgroup_and_says_why_systemd_was_skipped():
    probe = FakeProbe(cgroup=CG)
    backend = choose_backend("auto", probe=probe)
    assert backend.name == "cgroup" and probe.asked == ["pid1", "cgroup"]
    assert any("systemd backend skipped" in n and "'init'" in n for n in backend.notes)
    assert backend.flavour is CG.flavour


def test_auto_falls_back_to_affinity_then_none_with_the_reason():
    backend = choose_backend("auto", probe=FakeProbe(cgroup=MISSING))
    assert backend.name == "affinity" and backend.enforces == ("cpus",)
    assert any("memory hierarchy" in n for n in backend.notes)
    backend = choose_backend("auto", probe=FakeProbe(cgroup=MISSING, affinity=False))
    assert backend.name == "none" and backend.enforces == ()
    assert any("sched_setaffinity" in n for n in backend.health()["notes"])


SD = SystemdBackend(notes=("systemd 252",), address="/nonexistent/private")


def test_auto_takes_systemd_when_it_is_pid1_and_answers():
    probe = FakeProbe(pid1="systemd", systemd=SD, cgroup=CG)
    assert choose_backend("auto", probe=probe) is SD
    assert probe.asked == ["pid1", "systemd"]


def test_auto_with_an_unreachable_systemd_uses_cgroup_and_says_why():
    unreachable = IsolationError("systemd: cannot connect to /run/systemd/private: Permission denied")
    backend = choose_backend("auto", probe=FakeProbe(pid1="systemd", systemd=unreachable, cgroup=CG))
    assert backend.name == "cgroup"
    assert any("systemd backend unavailable" in n and "Permission denied" in n
               for n in backend.notes)


def test_explicit_requests_never_downgrade():
    with pytest.raises(IsolationError, match="systemd is not PID 1 on this host"):
        choose_backend("systemd", probe=FakeProbe(pid1="process_api"))
    with pytest.raises(IsolationError, match="--isolation systemd: systemd: no manager"):
        choose_backend("systemd", probe=FakeProbe(pid1="systemd", cgroup=CG))
    assert choose_backend("systemd", probe=FakeProbe(pid1="systemd", systemd=SD)) is SD
    with pytest.raises(IsolationError, match="--isolation cgroup: no cgroup v1 memory"):
        choose_backend("cgroup", probe=FakeProbe(cgroup=MISSING))
    assert choose_backend("cgroup", probe=FakeProbe(cgroup=CG)) is CG
    with pytest.raises(IsolationError, match="sched_setaffinity"):
        choose_backend("affinity", probe=FakeProbe(affinity=False))
    assert choose_backend("affinity", probe=FakeProbe()) is AFFINITY
    probe = FakeProbe()
    assert choose_backend("none", probe=probe) is NONE and probe.asked == []
    with pytest.raises(IsolationError, match="unknown backend"):
        choose_backend("bogus", probe=FakeProbe())


def test_affinity_and_none_have_no_op_lifecycle():
    for backend in (AFFINITY, NONE):
        assert isinstance(backend, Backend)
        fields = backend.prepare("j1", [0, 1], 1 << 30)
        assert fields == {"pin": backend is AFFINITY, "cgroup_procs": []}
        assert backend.finish("j1", 9) == {"oom_killed": False, "cpu_time_ms": None}
        assert backend.adopt("j1") is True
        assert backend.parent_memory_limit() is None
        assert set(backend.health()) == {"backend", "enforces", "notes"}


# -- detection and the v2 layout on a fake tree ------------------------------------------------


def test_detect_names_what_is_missing(tmp_path):
    (tmp_path / "unified").mkdir()
    (tmp_path / "unified" / "cgroup.controllers").write_text("hugetlb\n")
    with pytest.raises(IsolationError) as err:
        detect(str(tmp_path))
    text = str(err.value)
    assert "not a cgroup v2" in text and "no cgroup v1 cpuset, memory, cpuacct" in text
    assert "unified has controllers: hugetlb" in text


def test_detect_v2_without_memory_controller(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io pids\n")
    assert "lacks the memory controller" in CgroupV2(str(tmp_path)).missing()


V2_FILES = {"cgroup.procs": "", "cgroup.subtree_control": "", "cpuset.cpus": "",
            "memory.max": "max\n", "memory.events": "oom 0\noom_kill 0\n",
            "cpu.stat": "usage_usec 0\n"}


@pytest.fixture
def fake_v2(tmp_path, monkeypatch):
    """A directory tree that looks like a v2 hierarchy (mkdir populates the knobs)."""
    real_mkdir = cg._mkdir

    def mkdir(path):
        made = real_mkdir(path)
        if made:
            for name, text in V2_FILES.items():
                (tmp_path / path / name).write_text(text)
        return made

    real_rmdir = cg._rmdir_retry

    def rmdir(path, deadline):
        for name in V2_FILES:  # the kernel's knobs go with the group
            if os.path.exists(os.path.join(path, name)):
                os.unlink(os.path.join(path, name))
        return real_rmdir(path, deadline)

    monkeypatch.setattr(cg, "_mkdir", mkdir)
    monkeypatch.setattr(cg, "_rmdir_retry", rmdir)
    for name, text in V2_FILES.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    return tmp_path


def test_v2_layout_on_a_fake_tree(fake_v2):
    flavour = detect(str(fake_v2))
    assert isinstance(flavour, CgroupV2)
    backend = CgroupBackend(flavour=flavour)
    (fake_v2 / "motor-jobs").mkdir()
    for name, text in V2_FILES.items():
        (fake_v2 / "motor-jobs" / name).write_text(text)
    (fake_v2 / "motor-jobs" / "memory.max").write_text("1073741824\n")
    flavour.ensure_parent()  # once, when the backend opens (open_cgroup_backend's probe)
    fields = backend.prepare("j1", [2, 3], 4 << 30)
    group = fake_v2 / "motor-jobs" / "job-j1"
    assert fields == {"pin": True, "cgroup_procs": [str(group / "cgroup.procs")]}
    assert (fake_v2 / "cgroup.subtree_control").read_text() == "+cpuset +memory"
    assert (fake_v2 / "motor-jobs" / "cgroup.subtree_control").read_text() == "+cpuset +memory"
    assert (group / "cpuset.cpus").read_text() == "2-3"
    assert (group / "memory.max").read_text() == "1073741824"  # clamped to the parent
    assert backend.parent_memory_limit() == 1 << 30 and backend.adopt("j1")
    (group / "memory.events").write_text("low 0\nhigh 0\nmax 9\noom 1\noom_kill 1\n")
    (group / "cpu.stat").write_text("usage_usec 2500000\nuser_usec 2400000\n")
    result = backend.finish("j1", 9)
    assert result["oom_killed"] is True and result["cpu_time_ms"] == 2500
    assert result["cleanup_error"] is None and not group.exists()
    health = backend.health()
    assert health["version"] == 2 and health["parent"] == str(fake_v2 / "motor-jobs")


def test_finish_never_raises_even_without_a_group(fake_v2):
    backend = CgroupBackend(flavour=CgroupV2(str(fake_v2)))
    result = backend.finish("never-prepared")
    assert result["oom_killed"] is False and result["cpu_time_ms"] is None
    assert result["cleanup_error"] is None
    assert backend.finish("../bad")["cleanup_error"]
    assert backend.adopt("never-prepared") is False and backend.adopt("../bad") is False


def test_favordynmods_is_read_from_the_cgroup_mount_options(tmp_path):
    from motor.isolation.cgroup import favordynmods

    mounts = tmp_path / "mounts"
    mounts.write_text("cgroup /sys/fs/cgroup/cpuset cgroup rw,relatime,cpuset 0 0\n"
                      "tmpfs /run tmpfs rw,favordynmods 0 0\n")
    assert favordynmods(str(mounts)) is False  # not a cgroup mount
    mounts.write_text("cgroup2 /sys/fs/cgroup cgroup2 rw,nsdelegate,favordynmods 0 0\n")
    assert favordynmods(str(mounts)) is True
    assert favordynmods(str(tmp_path / "absent")) is False
