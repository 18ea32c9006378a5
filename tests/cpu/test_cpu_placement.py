"""Placement rules of the CPU allocator, at the core level (no trio, no I/O)."""

from __future__ import annotations

import pytest

from motor.cpu.core import CpuPlacement, Placement, RateLimitedWarning
from motor.cpu.topology import (
    Topology,
    allocatable,
    claim_limit,
    parse_cpu_list,
    validate_linux_cpus,
)

HOST32 = Topology.synthetic(16)  # 32 threads, cpu N and N+16 are siblings


def host32() -> CpuPlacement:
    return CpuPlacement(HOST32, allocatable(HOST32, None))


def is_whole_pairs(cpus, topo=HOST32) -> bool:
    return all(set(topo.siblings(c)) <= set(cpus) for c in cpus)


def test_even_claims_use_whole_pairs_without_overlap_while_free():
    p = host32()  # 15 allocatable pairs (core 0/16 kept back)
    used: set[int] = set()
    for i, claim in enumerate([2, 4, 2, 6, 2, 8, 2]):  # 26 of 30 threads
        cpus = p.place(f"j{i}", claim).cpus
        assert len(cpus) == claim
        assert is_whole_pairs(cpus), cpus
        assert not used & set(cpus), "overlap while free CPUs remain"
        used |= set(cpus)
    last = p.place("last", 4).cpus  # the two remaining pairs, still without overlap
    assert last == (14, 15, 30, 31) and not used & set(last)
    assert p.free_cpus() == ()
    assert p.snapshot()["j0"] == (1, 17)
    assert p.snapshot()["j1"] == (2, 3, 18, 19)
    # A 2-claim finds the last whole free pair even after odd jobs split others.
    q = host32()
    q.place("odd", 1)  # splits pair 1/17
    assert q.place("even", 2).cpus == (2, 18)
    assert q.place("even4", 4).cpus == (3, 4, 19, 20)
    assert all(q.claims(c) <= 1 for c in q.allowed)


def test_odd_claims_prefer_an_already_split_pair():
    p = host32()
    assert p.place("a", 1).cpus == (1,)  # breaks a pair: nothing was split yet
    # The next single takes the split pair's free thread rather than breaking another pair.
    assert p.place("b", 1).cpus == (17,)
    # No split pair left: a 3-claim takes a whole pair and breaks the next one (3/19).
    assert p.place("c", 3).cpus == (2, 3, 18)
    # A 3-claim now fills the split pair (19) and takes one whole pair.
    assert p.place("d", 3).cpus == (4, 19, 20)
    # A 5-claim with no split pair: two whole pairs and one thread of the next pair.
    assert p.place("e", 5).cpus == (5, 6, 7, 21, 22)
    # The split left by "e" (23 free) is preferred by the next odd claim.
    assert p.place("f", 1).cpus == (23,)
    # With several split pairs the lowest free thread goes first.
    q = host32()
    for i, cpu in enumerate((3, 5)):
        q.register(f"r{i}", [cpu])
    assert q.place("odd", 3).cpus == (1, 17, 19)


def test_fragmented_even_claim_uses_free_threads_before_overlap():
    p = host32()
    # One single on each pair: 15 lone free threads, no whole free pair.
    for i in range(1, 16):
        p.register(f"s{i}", [i])
    assert p.statistics().free == 15
    cpus = p.place("even", 4).cpus
    assert cpus == (17, 18, 19, 20)
    assert all(p.claims(c) == 1 for c in cpus)  # no overlap
    # Mixed: a whole pair first, then lone free threads, still no overlap.
    p.release("s15")  # pair 15/31 whole free again
    cpus = p.place("even6", 6).cpus
    assert cpus == (15, 21, 22, 23, 24, 31)
    assert all(p.claims(c) == 1 for c in cpus)
    # Six lone threads remain (25-30): an 8-claim takes all six free, then overlaps two.
    cpus = p.place("even8", 8).cpus
    assert {25, 26, 27, 28, 29, 30} <= set(cpus)
    assert sum(p.claims(c) == 2 for c in cpus) == 2
    assert p.free_cpus() == ()


def test_overlap_uses_least_claimed_cpus_only_after_free_cpus():
    topo = Topology.synthetic(4)  # 8 threads, pairs (0,4) (1,5) (2,6) (3,7)
    p = CpuPlacement(topo, topo.online)
    assert p.place("a", 6).cpus == (0, 1, 2, 4, 5, 6)
    # Two free CPUs left: a 4-claim takes both free, then the least-claimed (claim 1) pair.
    b = p.place("b", 4).cpus
    assert set(b) >= {3, 7}
    assert b == (0, 3, 4, 7)
    assert [p.claims(c) for c in range(8)] == [2, 1, 1, 1, 2, 1, 1, 1]
    # No free CPUs: a 2-claim overlaps a whole pair at the lowest claim level (1/5),
    # never the twice-claimed 0/4.
    assert p.place("c", 2).cpus == (1, 5)
    # Level 1 now holds 2/6 and 3/7; an odd claim takes a lone least-claimed thread first.
    assert p.place("d", 3).cpus == (2, 3, 6)
    assert p.place("e", 1).cpus == (7,)
    assert {p.claims(c) for c in range(8)} == {2}
    # Claims above the CPU count: one CPU each, spread at the least-claimed level.
    assert p.place("f", 20).cpus == tuple(range(8))
    p.release("f")
    p.release("a")  # a's CPUs drop to claim 1
    assert p.free_cpus() == ()
    assert p.place("g", 2).cpus == (0, 4)  # a's old CPUs are the least claimed now
    st = p.statistics()
    assert (st.allowed, st.free, st.claimed, st.jobs) == (8, 0, 8, 5)
    assert st.total_claims == sum(len(c) for c in p.snapshot().values())


def test_recorded_live_cpu_sets_reregister_after_restart():
    before = host32()
    for i, claim in enumerate([2, 3, 1, 4, 6, 5]):
        before.place(f"j{i}", claim)
    before.release("j2")
    recorded = before.snapshot()  # what the job records hold

    after = host32()  # the restarted runner
    for job_id, cpus in recorded.items():
        assert after.register(job_id, cpus) == cpus
    assert after.snapshot() == recorded
    assert [after.claims(c) for c in range(32)] == [before.claims(c) for c in range(32)]
    assert after.free_cpus() == before.free_cpus()
    assert after.statistics() == before.statistics()
    # The next claim is placed around the re-registered sets exactly as before the restart.
    nxt = after.place("next", 4)
    assert nxt == before.place("next", 4)
    busy = {c for cpus in recorded.values() for c in cpus}
    assert not busy & set(nxt.cpus)
    # Re-registered jobs release like placed ones.
    after.release("j4")
    before.release("j4")
    assert [after.claims(c) for c in range(32)] == [before.claims(c) for c in range(32)]
    assert after.place("again", 6) == before.place("again", 6)
    # A recorded CPU no longer allocatable is remembered but not counted.
    odd = CpuPlacement(HOST32, [12, 13, 14, 15, 28, 29, 30, 31])
    assert odd.register("old", [0, 12, 16]) == (0, 12, 16)
    assert odd.claims(12) == 1 and odd.claims(0) == 0
    assert odd.release("old") == (0, 12, 16)
    assert odd.claims(12) == 0
    with pytest.raises(ValueError):
        after.register("j0", [1])


def test_placing_a_job_twice_is_refused_and_release_is_idempotent():
    p = host32()
    p.place("j", 2)
    with pytest.raises(ValueError, match="already"):
        p.place("j", 2)
    with pytest.raises(ValueError, match="at least 1"):
        p.place("z", 0)
    assert p.release("j") == (1, 17)
    assert p.release("j") == ()
    assert p.statistics().free == 30
    with pytest.raises(ValueError):
        CpuPlacement(HOST32, [])
    with pytest.raises(ValueError, match="not online"):
        CpuPlacement(Topology.synthetic(2), [0, 9])


def test_linux_cpu_list_confines_placement_and_admits_claims_up_to_max_weight():
    listed = validate_linux_cpus(HOST32, parse_cpu_list("12-15,28-31"), max_weight=16)
    cpus = allocatable(HOST32, listed)
    assert cpus == (12, 13, 14, 15, 28, 29, 30, 31)  # no core held back
    limit = claim_limit(cpus, max_weight=16, confined=True)
    assert limit == 16  # max_weight, not the 8 listed CPUs; 17 would be refused by the caller
    p = CpuPlacement(HOST32, cpus)
    long_job = p.place("twelve", 12)
    assert long_job == Placement(cpus=(12, 13, 14, 15, 28, 29, 30, 31), failed_open=False)
    # Further claims share the listed CPUs like overlapping claims, and stay on them.
    assert set(p.place("sixteen", limit).cpus) == set(cpus)
    for i in range(10):
        assert set(p.place(f"x{i}", 1 + i % 3).cpus) <= set(cpus)

    # A sibling outside the list is never used: 12-15 listed, their siblings 28-31 are not.
    half = CpuPlacement(HOST32, allocatable(HOST32, [12, 13, 14, 15]))
    seen: set[int] = set()
    for i in range(12):
        seen |= set(half.place(f"h{i}", 2).cpus)
    assert seen == {12, 13, 14, 15}
    # Listed CPUs without their siblings are lone threads: a 2-claim takes two of them.
    assert CpuPlacement(HOST32, [12, 13, 14, 15]).place("h", 2).cpus == (12, 13)


def test_confined_linux_cpus_share_windows_threads_while_the_slot_is_active():
    cpus = allocatable(HOST32, parse_cpu_list("12-15,28-31"))
    p = CpuPlacement(HOST32, cpus)
    windows = frozenset(parse_cpu_list("8-15,24-31"))  # the Windows CPUs cover the whole list
    warn = RateLimitedWarning(interval=60.0)
    got = p.place("a", 4, avoid=windows)
    assert got.failed_open is True
    assert got.cpus == (12, 13, 28, 29)  # placed normally, on the Windows threads
    assert warn.should_warn(now=100.0) is True
    got = p.place("b", 12, avoid=windows)
    assert got.failed_open and got.cpus == cpus  # never waits for the slot
    assert warn.should_warn(now=130.0) is False  # rate-limited
    assert warn.should_warn(now=161.0) is True
    assert warn.suppressed == 1
    # Slot inactive: no avoidance, no fail-open.
    assert p.place("c", 2).failed_open is False


def test_linux_cpu_list_shares_the_windows_threads_while_the_slot_is_active():
    cpus = allocatable(HOST32, parse_cpu_list("12-15,28-31"))
    p = CpuPlacement(HOST32, cpus)
    # Windows CPUs cover part of the list: those threads are avoided while the slot is active.
    windows = frozenset(parse_cpu_list("12,13,28,29"))
    got = p.place("a", 4, avoid=windows)
    assert got == Placement(cpus=(14, 15, 30, 31), failed_open=False)
    # Even a claim above the remaining CPUs stays off the Windows threads (overlapping instead).
    got = p.place("b", 12, avoid=windows)
    assert got == Placement(cpus=(14, 15, 30, 31), failed_open=False)
    # Half a pair avoided: the usable sibling counts as a lone thread.
    q = CpuPlacement(HOST32, cpus)
    half = frozenset({12, 13})
    assert q.place("odd", 1, avoid=half).cpus == (28,)
    assert q.place("even", 2, avoid=half).cpus == (14, 30)
    # When the slot ends, the Windows threads are the free ones.
    assert p.place("c", 4).cpus == (12, 13, 28, 29)
    # Whole list covered: fail open and share the Windows threads with running jobs.
    got = p.place("d", 2, avoid=frozenset(cpus))
    assert got.failed_open and set(got.cpus) <= set(cpus)


def test_windows_avoidance_on_an_unconfined_host():
    p = host32()
    windows = frozenset(range(1, 12)) | frozenset(range(17, 28))
    got = p.place("a", 8, avoid=windows)
    assert got == Placement(cpus=(12, 13, 14, 15, 28, 29, 30, 31), failed_open=False)
    got = p.place("b", 2, avoid=windows)  # overlaps rather than touching the slot's CPUs
    assert not set(got.cpus) & windows and not got.failed_open
    # Avoid set naming only CPUs outside the allowed set changes nothing.
    assert p.place("c", 2, avoid=frozenset({0, 16})).cpus == (1, 17)
    # Every allowed CPU avoided: fail open.
    assert p.place("d", 2, avoid=frozenset(range(32))).failed_open


def test_rate_limited_warning():
    w = RateLimitedWarning()
    assert w.should_warn(0.0)
    assert not w.should_warn(59.9)
    assert not w.should_warn(1.0)
    assert w.should_warn(60.0)
    assert w.suppressed == 2
    assert not w.should_warn(60.0)
    with pytest.raises(ValueError):
        RateLimitedWarning(-1)


def test_docs_worked_example():
    """The table in docs/cpu.md."""
    topo = Topology.synthetic(4)
    p = CpuPlacement(topo, topo.online)
    got = [p.place(job, claim).cpus for job, claim in [("a", 2), ("b", 1), ("c", 3), ("d", 4), ("e", 1)]]
    assert got == [(0, 4), (1,), (2, 5, 6), (0, 3, 4, 7), (1,)]
