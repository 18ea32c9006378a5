"""What a runner prepares at its start. systemd: its slot slices (`--start-slots`,
docs/isolation.md, "Slots made at the start"): how many, on which CPUs, with which memory
limit; what keeperd is asked to prepare; a slot that cannot be made is logged and the
start goes on. cgroup v1: the parent groups keeperd fills its pool of spares in."""

from __future__ import annotations

import logging

import pytest

from motor.config import ConfigError, RunnerConfig
from motor.cpu.topology import Topology
from motor.isolation.base import AFFINITY
from motor.memory.core import MemoryCeiling
from motor.runner.host import Host
from motor.runner.tree import START_SLOTS, _make_slots, spawner_preparation

GiB = 1 << 30


class Backend:
    name = "systemd"
    address = "unix:path=/run/systemd/private"

    def __init__(self, refuse: set[int] = frozenset()) -> None:
        self.asked: list = []
        self.refuse = refuse

    def make_slots(self, slots):
        self.asked.append(slots)
        made = [{"address": self.address, "slice": f"motor-jobs-s{n}.slice", "slot": True}
                for n in range(len(slots)) if n not in self.refuse]
        return made, [f"slot slice motor-jobs-s{n}.slice: refused" for n in sorted(self.refuse)]


def host(backend, cpus: int, slice_max: int | None = None) -> Host:
    # two threads per core: CPU n and n + cpus/2 are siblings
    half = cpus // 2
    topology = Topology(online=tuple(range(cpus)),
                        cores=tuple((n, n + half) for n in range(half)))
    return Host(topology=topology, allowed=tuple(range(cpus)), kept_back=(), claim_limit=cpus,
                backend=backend, ceiling=MemoryCeiling(slice_max_bytes=slice_max))


async def test_one_slot_per_cpu_of_the_first_one_cpu_jobs_bounded_by_max_weight_and_eight():
    for cpus, max_weight, expected in ((4, 28, 4), (4, 2, 2), (32, 28, START_SLOTS)):
        backend = Backend()
        config = RunnerConfig(max_weight=max_weight)
        scopes = await _make_slots(config, host(backend, cpus))
        (asked,) = backend.asked
        assert len(asked) == expected == len(scopes)
        # each on its own CPU, as the allocator places the first jobs of one CPU (a core's
        # threads before its sibling's: whole pairs stay free as long as they can)
        chosen = [tuple(c) for c, _ in asked]
        assert all(len(c) == 1 for c in chosen) and len(set(chosen)) == expected, chosen
        assert all(memory == 4 * GiB for _, memory in asked)  # a claim of 1's default


async def test_the_memory_limit_is_clamped_to_the_jobs_slice_and_the_per_vcpu_option():
    backend = Backend()
    await _make_slots(RunnerConfig(memory_per_vcpu_bytes="1G"), host(backend, 2))
    assert [m for _, m in backend.asked[0]] == [GiB, GiB]
    backend = Backend()
    await _make_slots(RunnerConfig(), host(backend, 2, slice_max=3 * GiB))
    assert [m for _, m in backend.asked[0]] == [3 * GiB, 3 * GiB]


async def test_none_at_start_slots_zero_and_for_backends_without_slots():
    backend = Backend()
    assert await _make_slots(RunnerConfig(start_slots=0), host(backend, 4)) == []
    assert backend.asked == []
    assert await _make_slots(RunnerConfig(), host(AFFINITY, 4)) == []
    assert spawner_preparation(AFFINITY, []) is None
    backend = Backend()
    assert len(await _make_slots(RunnerConfig(start_slots=3), host(backend, 2))) == 3


async def test_a_slot_that_cannot_be_made_is_logged_and_keeperd_prepares_the_others(caplog):
    backend = Backend(refuse={0})
    with caplog.at_level(logging.WARNING, logger="motor.isolation"):
        scopes = await _make_slots(RunnerConfig(), host(backend, 2))
    assert [s["slice"] for s in scopes] == ["motor-jobs-s1.slice"]
    assert "motor-jobs-s0.slice: refused; its first job makes it" in caplog.text
    prepare = spawner_preparation(backend, scopes)
    assert prepare == {"systemd_address": backend.address, "slots": scopes}
    assert spawner_preparation(backend, []) == {"systemd_address": backend.address}


def test_start_slots_out_of_range_is_a_config_error():
    with pytest.raises(ConfigError, match="--start-slots must be within 0..1024"):
        RunnerConfig(start_slots=-1).validate()


def test_a_cgroup_v1_runner_names_its_parent_groups_for_keeperds_pool():
    parents = {"cpuset": "/sys/fs/cgroup/cpuset/motor-jobs",
               "memory": "/sys/fs/cgroup/memory/motor-jobs"}
    v1 = type("V1", (), {"name": "cgroup", "spare_parents": lambda self: parents})()
    assert spawner_preparation(v1) == {"spare_parents": parents}
    v2 = type("V2", (), {"name": "cgroup", "spare_parents": lambda self: None})()
    assert spawner_preparation(v2) is None
