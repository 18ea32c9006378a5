"""Property tests: random topologies and random place/release/register sequences."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

from motor.cpu.core import CpuPlacement
from motor.cpu.topology import Topology, allocatable, kept_back


@st.composite
def topologies(draw):
    cores = draw(st.integers(1, 64))
    smt = draw(st.sampled_from([1, 2]))
    total = cores * smt
    offline = draw(st.sets(st.integers(0, total - 1), max_size=total - 1))
    return Topology.synthetic(cores, smt, offline=offline)


@st.composite
def allowed_sets(draw, topo):
    if draw(st.booleans()):
        return allocatable(topo, None)
    listed = draw(st.sets(st.sampled_from(topo.online), min_size=1))
    return allocatable(topo, sorted(listed))


@given(topologies())
def test_random_topologies_are_partitions_and_keep_back_rule(topo):
    flat = sorted(c for core in topo.cores for c in core)
    assert flat == list(topo.online)
    held = kept_back(topo)
    if topo.physical_cores >= 4:
        assert held == topo.siblings(topo.online[0])
    else:
        assert held == ()
    assert set(allocatable(topo, None)) == set(topo.online) - set(held)


class PlacementMachine(RuleBasedStateMachine):
    jobs = Bundle("jobs")

    @initialize(data=st.data())
    def setup(self, data):
        self.topo = data.draw(topologies())
        self.allowed = data.draw(allowed_sets(self.topo))
        self.p = CpuPlacement(self.topo, self.allowed)
        self.model: dict[str, tuple[int, ...]] = {}
        self.n = 0
        # The Windows CPUs (a fixed set) and whether the slot is active.
        self.windows = frozenset(data.draw(st.sets(st.sampled_from(self.topo.online))))
        self.slot_active = False

    # ---------------------------------------------------------------- model helpers

    def claims(self) -> Counter:
        c: Counter = Counter()
        for cpus in self.model.values():
            c.update(cpu for cpu in cpus if cpu in self.allowed)
        return c

    def usable_cores(self, usable: set[int]) -> list[tuple[int, ...]]:
        out = []
        for core in self.topo.cores:
            kept = tuple(c for c in core if c in usable)
            if kept:
                out.append(kept)
        return out

    # ---------------------------------------------------------------- rules

    @rule(active=st.booleans())
    def toggle_slot(self, active):
        self.slot_active = active

    @rule(target=jobs, claim=st.integers(1, 20))
    def place(self, claim):
        job = f"j{self.n}"
        self.n += 1
        before = self.claims()
        avoid = self.windows if self.slot_active else frozenset()
        allowed = set(self.allowed)
        usable = allowed - avoid
        fail_open = not usable
        if fail_open:
            usable = allowed
        free = {c for c in usable if before[c] == 0}
        cores = self.usable_cores(usable)
        whole_free = [core for core in cores if len(core) >= 2 and all(c in free for c in core)]
        lone_free = free - {c for core in whole_free for c in core}

        got = self.p.place(job, claim, avoid=avoid)
        cpus = set(got.cpus)
        k = min(claim, len(usable))

        assert list(got.cpus) == sorted(cpus)
        assert len(got.cpus) == k
        assert got.failed_open == (fail_open and bool(avoid))
        assert cpus <= usable  # never outside allowed, never on avoided CPUs unless failing open
        if len(free) >= k:
            assert cpus <= free, "overlap while enough free CPUs remain"
        else:
            assert free <= cpus, "free CPUs must be used before overlapping"
        # Overlap only on the least-claimed CPUs.
        rest = usable - cpus
        if rest:
            assert max(before[c] for c in cpus) <= min(before[c] for c in rest)
        # Even claims take whole free pairs when enough of them exist.
        pairs = [core for core in whole_free if len(core) == 2]
        if k % 2 == 0 and len(pairs) >= k // 2 and len(pairs) == len(whole_free):
            taken = [core for core in pairs if set(core) <= cpus]
            assert len(taken) == k // 2, (got, pairs)
        # Odd claims fill an already split pair (a lone free thread) first.
        if k % 2 == 1 and lone_free and len(free) >= k:
            assert cpus & lone_free

        self.model[job] = got.cpus
        return job

    @rule(job=consumes(jobs))
    def release(self, job):
        assert self.p.release(job) == self.model.pop(job)

    @rule(target=jobs, data=st.data())
    def register(self, data):
        cpus = data.draw(st.sets(st.sampled_from(self.topo.online), max_size=8))
        job = f"r{self.n}"
        self.n += 1
        assert self.p.register(job, cpus) == tuple(sorted(cpus))
        self.model[job] = tuple(sorted(cpus))
        return job

    @rule()
    def restart(self):
        """A restarted runner re-registers every recorded live set and matches exactly."""
        fresh = CpuPlacement(self.topo, self.allowed)
        for job, cpus in self.p.snapshot().items():
            fresh.register(job, cpus)
        assert fresh.statistics() == self.p.statistics()
        assert fresh.free_cpus() == self.p.free_cpus()
        assert all(fresh.claims(c) == self.p.claims(c) for c in self.allowed)
        self.p = fresh

    # ---------------------------------------------------------------- invariants

    @invariant()
    def counts_match_the_model(self):
        if not hasattr(self, "p"):
            return
        claims = self.claims()
        assert self.p.snapshot() == self.model
        assert all(self.p.claims(c) == claims[c] for c in self.allowed)
        assert self.p.free_cpus() == tuple(c for c in self.allowed if claims[c] == 0)
        stats = self.p.statistics()
        assert stats.allowed == len(self.allowed)
        assert stats.free + stats.claimed == stats.allowed
        assert stats.total_claims == sum(claims.values())


PlacementMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_placement_machine = PlacementMachine.TestCase
