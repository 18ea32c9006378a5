"""Topology reading, CPU lists, kept-back core, --linux-cpus validation, claim limit."""

from __future__ import annotations

import os

import pytest
from fakesysfs import smt_siblings, write_fake_sysfs
from hypothesis import given
from hypothesis import strategies as st

from motor.cpu.core import CpuPlacement
from motor.cpu.host import read_topology
from motor.cpu.topology import (
    MAX_CPU,
    Topology,
    TopologyError,
    allocatable,
    claim_limit,
    format_cpu_list,
    kept_back,
    parse_cpu_list,
    topology_from_texts,
    validate_linux_cpus,
)

# ------------------------------------------------------------------ CPU lists


@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        ("0", (0,)),
        ("0-3,8,10-11", (0, 1, 2, 3, 8, 10, 11)),
        ("0-31\n", tuple(range(32))),
        ("12-15,28-31", (12, 13, 14, 15, 28, 29, 30, 31)),
        ("5,3,3,1-2", (1, 2, 3, 5)),
        (" 1 , 4-5 ", (1, 4, 5)),
        ("7-7", (7,)),
    ],
)
def test_parse_cpu_list(text, cpus):
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize(
    "text", ["", "\n", "a", "1,,2", "1,", ",1", "3-1", "1-", "-1", "1-2-3", "0x1", "1.5", "²", f"0-{MAX_CPU + 1}"]
)
def test_parse_cpu_list_rejects_garbage(text):
    with pytest.raises(ValueError, match="CPU list"):
        parse_cpu_list(text)


@pytest.mark.parametrize(
    ("cpus", "text"),
    [
        ((), ""),
        ((0,), "0"),
        ((0, 1), "0,1"),
        ((0, 1, 2, 3, 8, 10, 11), "0-3,8,10,11"),
        ((31, 12, 13, 14, 15, 28, 29, 30), "12-15,28-31"),
        ((4, 4, 2), "2,4"),
    ],
)
def test_format_cpu_list(cpus, text):
    assert format_cpu_list(cpus) == text


@given(st.sets(st.integers(0, 300), min_size=1))
def test_parse_format_round_trip(cpus):
    text = format_cpu_list(cpus)
    assert parse_cpu_list(text) == tuple(sorted(cpus))
    assert format_cpu_list(parse_cpu_list(text)) == text


# ------------------------------------------------------------------ reading sysfs


def test_topology_reads_online_siblings_and_reserves_cpu_zero_core(tmp_path):
    write_fake_sysfs(tmp_path)  # 32 threads, two-way SMT: cpu N and N+16 are siblings
    topo = read_topology(tmp_path)
    assert topo.online == tuple(range(32))
    assert topo.physical_cores == 16
    assert topo.cores == tuple((n, n + 16) for n in range(16))
    assert topo.siblings(0) == (0, 16)
    assert topo.siblings(21) == (5, 21)
    # The first core and its sibling are kept for the runner and the system.
    assert kept_back(topo) == (0, 16)
    cpus = allocatable(topo, None)
    assert cpus == tuple(c for c in range(32) if c not in (0, 16))
    assert claim_limit(cpus, max_weight=28, confined=False) == 30
    # Placement never touches the kept-back core, even when every CPU is shared.
    placement = CpuPlacement(topo, cpus)
    for i in range(20):
        assert not {0, 16} & set(placement.place(f"j{i}", 8).cpus)


def test_kept_back_core_is_the_lowest_online_cpus_core(tmp_path):
    # cpu0 offline (as after a hot-unplug): the core holding the lowest online CPU is kept.
    sib = smt_siblings(32)
    write_fake_sysfs(tmp_path, online="1-15,17-31", siblings=sib)
    topo = read_topology(tmp_path)
    assert 0 not in topo.online and 16 not in topo.online
    assert topo.siblings(1) == (1, 17)
    assert kept_back(topo) == (1, 17)


def test_small_hosts_keep_every_cpu_allocatable(tmp_path):
    # 2 threads on one core.
    write_fake_sysfs(tmp_path / "a", online="0-1", siblings={0: "0-1", 1: "0-1"}, present=range(2))
    one_core = read_topology(tmp_path / "a")
    assert one_core.cores == ((0, 1),)
    assert kept_back(one_core) == ()
    assert allocatable(one_core, None) == (0, 1)
    assert claim_limit(allocatable(one_core, None), 28, confined=False) == 2
    assert CpuPlacement(one_core, allocatable(one_core, None)).place("j", 2).cpus == (0, 1)

    # 2 threads on two cores (no SMT).
    write_fake_sysfs(tmp_path / "b", online="0-1", siblings={0: "0", 1: "1"}, present=range(2))
    two_cores = read_topology(tmp_path / "b")
    assert two_cores.cores == ((0,), (1,))
    assert kept_back(two_cores) == ()
    assert allocatable(two_cores, None) == (0, 1)

    # Three physical cores with SMT: still small, nothing kept back.
    write_fake_sysfs(tmp_path / "c", online="0-5", siblings=smt_siblings(6), present=range(6))
    three = read_topology(tmp_path / "c")
    assert three.physical_cores == 3
    assert allocatable(three, None) == tuple(range(6))

    # Four physical cores without SMT: the threshold, cpu0 kept back.
    write_fake_sysfs(tmp_path / "d", online="0-3", siblings=smt_siblings(4, smt=1), present=range(4))
    four = read_topology(tmp_path / "d")
    assert kept_back(four) == (0,)
    assert allocatable(four, None) == (1, 2, 3)

    # Eight threads but only three cores online: counts online physical cores.
    write_fake_sysfs(tmp_path / "e", online="0-2,4-6", siblings=smt_siblings(8), present=range(8))
    partial = read_topology(tmp_path / "e")
    assert partial.physical_cores == 3
    assert allocatable(partial, None) == (0, 1, 2, 4, 5, 6)


def test_offline_cpus_are_not_in_the_topology(tmp_path):
    # Offline CPUs 8-15: their siblings 24-31 are lone threads; sibling lists still name
    # the offline CPU (as a kernel may), which is ignored.
    write_fake_sysfs(tmp_path, online="0-7,16-31")
    topo = read_topology(tmp_path)
    assert topo.online == tuple(range(8)) + tuple(range(16, 32))
    assert topo.siblings(24) == (24,)
    assert topo.siblings(3) == (3, 19)
    assert topo.physical_cores == 16
    with pytest.raises(ValueError, match="not online"):
        topo.siblings(8)


def test_core_cpus_list_fallback_and_missing_topology_dir(tmp_path):
    write_fake_sysfs(tmp_path, online="0-31", use_core_cpus_list=True, without_topology=[5, 21])
    topo = read_topology(tmp_path)
    assert topo.siblings(3) == (3, 19)
    assert topo.siblings(5) == (5,)
    assert topo.siblings(21) == (21,)
    assert topo.physical_cores == 17


def test_thread_siblings_list_wins_over_core_cpus_list(tmp_path):
    write_fake_sysfs(tmp_path, online="0-3", siblings={0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"}, present=range(4))
    (tmp_path / "devices/system/cpu/cpu0/topology/core_cpus_list").write_text("0-3\n")
    topo = read_topology(tmp_path)
    assert topo.cores == ((0, 2), (1, 3))


def test_missing_online_file_is_a_topology_error(tmp_path):
    write_fake_sysfs(tmp_path, write_online=False)
    with pytest.raises(TopologyError, match=r"devices/system/cpu/online.*cannot read"):
        read_topology(tmp_path)
    with pytest.raises(TopologyError):
        read_topology(tmp_path / "nowhere")


@pytest.mark.parametrize("online", ["", "0-x", "3-1", "0,,1"])
def test_malformed_online_file_is_a_topology_error(tmp_path, online):
    write_fake_sysfs(tmp_path, online=online)
    with pytest.raises(TopologyError, match=r"devices/system/cpu/online: invalid CPU list") as info:
        read_topology(tmp_path)
    assert isinstance(info.value, ValueError)


def test_malformed_siblings_file_is_a_topology_error(tmp_path):
    sib = smt_siblings(32)
    sib[7] = "seven"
    write_fake_sysfs(tmp_path, siblings=sib)
    with pytest.raises(TopologyError, match=r"cpu7/topology/thread_siblings_list: invalid CPU list"):
        read_topology(tmp_path)


def test_siblings_file_without_its_own_cpu_is_a_topology_error(tmp_path):
    sib = smt_siblings(32)
    sib[4] = "5,21"
    write_fake_sysfs(tmp_path, siblings=sib)
    with pytest.raises(TopologyError, match=r"cpu4/topology/thread_siblings_list: .*does not contain cpu4"):
        read_topology(tmp_path)


def test_empty_siblings_file_is_a_topology_error(tmp_path):
    sib = smt_siblings(32)
    sib[9] = ""
    write_fake_sysfs(tmp_path, siblings=sib, use_core_cpus_list=True)
    with pytest.raises(TopologyError, match=r"cpu9/topology/core_cpus_list"):
        read_topology(tmp_path)


def test_read_topology_of_this_host_when_available():
    if not os.path.exists("/sys/devices/system/cpu/online"):
        pytest.skip("no sysfs")
    topo = read_topology("/sys")
    assert topo.online and topo.physical_cores >= 1


def test_topology_from_texts_is_pure():
    topo = topology_from_texts("0-3", {0: "0,2", 1: "1,3", 2: "0,2\n", 3: None})
    # cpu3 had no file but cpu1 names it: the groups are merged.
    assert topo.cores == ((0, 2), (1, 3))


def test_topology_constructors_validate():
    assert Topology.synthetic(16).cores[0] == (0, 16)
    assert Topology.synthetic(4, 1, offline=[2]).online == (0, 1, 3)
    with pytest.raises(ValueError):
        Topology(online=(0, 1), cores=((0,),))
    with pytest.raises(ValueError):
        Topology(online=(1, 0), cores=((0,), (1,)))
    with pytest.raises(ValueError):
        Topology(online=(), cores=())
    with pytest.raises(ValueError):
        Topology(online=(0, 1), cores=((1,), (0,)))


# ------------------------------------------------------------------ --linux-cpus


def test_linux_cpu_list_must_name_online_cpus(tmp_path):
    # 32-thread host with CPUs 24-31 offline.
    write_fake_sysfs(tmp_path, online="0-23")
    topo = read_topology(tmp_path)
    assert validate_linux_cpus(topo, parse_cpu_list("12-15,20-23"), 16) == (12, 13, 14, 15, 20, 21, 22, 23)

    with pytest.raises(ValueError) as info:
        validate_linux_cpus(topo, parse_cpu_list("12-15,28-31"), 16)
    msg = str(info.value)
    assert "\n" not in msg
    assert "28-31" in msg and "not online" in msg and "online: 0-23" in msg

    with pytest.raises(ValueError, match=r"CPU 40 not online"):
        validate_linux_cpus(topo, [12, 40], 16)
    with pytest.raises(ValueError, match="empty"):
        validate_linux_cpus(topo, [], 16)
    with pytest.raises(ValueError, match=r"--max-weight 0"):
        validate_linux_cpus(topo, [12, 13], 0)
    with pytest.raises(ValueError, match="not online"):
        allocatable(topo, [12, 99])
    with pytest.raises(ValueError, match="empty"):
        allocatable(topo, [])
    with pytest.raises(ValueError, match="empty"):
        parse_cpu_list("")


def test_linux_cpu_list_keeps_nothing_back():
    topo = Topology.synthetic(16)
    assert allocatable(topo, [0, 16, 3]) == (0, 3, 16)
    assert claim_limit((0, 3, 16), max_weight=16, confined=True) == 16
    assert claim_limit((0, 3, 16), max_weight=2, confined=True) == 2
