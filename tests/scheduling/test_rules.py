"""The seed's scheduling rules (scheduling.md: vCPU claims, Capacity, Queue order, Queue wait)
tested on the pure core.  Time is explicit float seconds; nothing here runs trio."""

from __future__ import annotations

import pytest

from motor.scheduling.core import (
    GATE_QUEUE_WAIT_S,
    JobSpec,
    LocalDeadline,
    Scheduler,
    claim_for,
    gate_honoured,
    queue_wait_budget_s,
    retry_delay_s,
)


def sched(max_weight: int = 8, *, depth: int = 64, limit: int | None = None, **kw) -> Scheduler:
    return Scheduler(max_weight=max_weight, max_queue_depth=depth,
                     claim_limit=limit if limit is not None else max_weight, **kw)


def add(s: Scheduler, job_id: str, ws: str, now: float = 0.0, *, ready: bool = True, **kw) -> JobSpec:
    spec = JobSpec(job_id, ws, **kw)
    assert s.accept(spec, now) is None
    if ready:
        assert s.ready(job_id, now)
    return spec


def started(s: Scheduler, now: float) -> list[str]:
    return [st.job_id for st in s.decide(now)]


def run(s: Scheduler, job_id: str, ws: str, now: float = 0.0, **kw) -> None:
    """Accept, ready and start a job at once (it must be startable)."""
    add(s, job_id, ws, now, **kw)
    assert job_id in started(s, now), s.story(job_id)
    s.setup_done(job_id, now)


def ms(s: Scheduler, job_id: str, now: float) -> int:
    return s.wait_status(job_id, now).queue_wait_ms


# --- vCPU claims --------------------------------------------------------------------------


def test_claims_are_exact_and_unsized_jobs_always_claim_two():
    assert claim_for(12, "job", 16) == 12
    assert claim_for(1, "job", 16) == 1
    assert claim_for(None, "job", 16) == 2
    assert claim_for(None, "job", 64) == 2
    assert claim_for(3, "warm_build", 16) == 3  # a hint is exact for background jobs too
    s = sched(8, limit=16)
    add(s, "a", "wa", claim=claim_for(None, "job", 16))
    add(s, "b", "wb", claim=claim_for(5, "job", 16))
    starts = s.decide(0.0)
    assert [(st.job_id, st.claim) for st in starts] == [("a", 2), ("b", 5)]
    assert s.statistics().held_permits == 7


def test_oversized_and_zero_claims_are_refused_before_start_with_limit_detail():
    s = sched(8, limit=16)
    for claim in (0, 17, -1):
        refusal = s.accept(JobSpec(f"j{claim}", "w", claim=claim), 0.0)
        assert refusal is not None and refusal.code == "runner_full"
        assert "claim limit of 16 vCPUs" in refusal.detail
        assert f"claim {claim} vCPUs" in refusal.detail
        assert s.job_state(f"j{claim}") is None  # refused before anything is recorded
    assert s.statistics().pending == 0
    assert s.check_claim(16) is None and s.check_claim(1) is None
    # a refused id can be submitted again with a valid claim
    assert s.accept(JobSpec("j0", "w", claim=2), 0.0) is None

    confined = sched(16, limit=16, confined_cpu_list="12-15,28-31")
    refusal = confined.accept(JobSpec("big", "w", claim=17), 0.0)
    assert refusal.code == "runner_full"
    assert refusal.detail.endswith("claim limit of 16 vCPUs (--linux-cpus 12-15,28-31)")
    assert confined.accept(JobSpec("twelve", "w", claim=12), 0.0) is None
    # with a CPU list the claim limit is max_weight: anything else is a wiring bug
    with pytest.raises(ValueError):
        Scheduler(max_weight=16, max_queue_depth=64, claim_limit=32, confined_cpu_list="12-15")


def test_oversized_vcpu_refusal_detail_names_the_limit_core():
    s = sched(16, limit=16, confined_cpu_list="12-15,28-31")
    refusal = s.check_claim(40)
    assert refusal.code == "runner_full"
    assert refusal.detail == ("claim 40 vCPUs exceeds this runner's claim limit of 16 vCPUs "
                              "(--linux-cpus 12-15,28-31)")
    unconfined = sched(28, limit=30)
    assert unconfined.check_claim(40).detail == \
        "claim 40 vCPUs exceeds this runner's claim limit of 30 vCPUs"


def test_pinned_job_waits_until_its_exact_claim_fits_max_weight():
    s = sched(8, limit=16)
    run(s, "r", "wr", claim=4)
    add(s, "six", "w6", claim=6)
    assert started(s, 0.0) == []  # 6 > 8 - 4: waits for its exact claim, never shrinks
    assert s.wait_status("six", 1.0).waiting_on == "permits"
    s.finished("r", 10.0)
    assert [(st.job_id, st.claim) for st in s.decide(10.0)] == [("six", 6)]
    s.finished("six", 20.0)

    # above max_weight but within the claim limit: accepted, waits (max_weight is a hard
    # bound, so it never starts, not even on an idle host), and never blocks other jobs,
    # even once it has waited past 60 s; its clock advances, so its budget applies
    run(s, "small", "ws", 20.0, claim=2)
    add(s, "big", "wb", 20.0, claim=12, runner_enforces_budget=True, queue_wait_limit_s=200)
    assert started(s, 20.0) == []
    add(s, "s2", "w2", 100.0, claim=2)
    assert started(s, 100.0) == ["s2"]  # big is aged but does not fence
    s.finished("small", 110.0)
    s.finished("s2", 120.0)
    assert s.decide(120.0) == [] and s.statistics().held_permits == 0  # idle host: still waits
    status = s.wait_status("big", 121.0)
    assert status.waiting_on == "permits" and status.queue_wait_ms == 101_000
    assert "exceeds max_weight 8" in status.waiting_detail
    add(s, "s3", "w3", 121.0, claim=8)
    assert started(s, 121.0) == ["s3"]  # blocks no one
    assert s.next_wakeup(121.0) == pytest.approx(220.0)  # its budget applies
    assert s.expired(220.0) == ["big"]


def test_internal_warm_build_shrinks_to_a_small_host():
    assert claim_for(None, "warm_build", 16) == 4
    assert claim_for(None, "warm_build", 4) == 4
    assert claim_for(None, "warm_build", 2) == 2
    assert claim_for(None, "cache_fill", 1) == 1
    small = sched(2, limit=2)
    claim = claim_for(None, "warm_build", small.claim_limit)
    add(small, "warm", "w", kind="warm_build", claim=claim)
    assert [(st.job_id, st.claim) for st in small.decide(0.0)] == [("warm", 2)]


# --- capacity -----------------------------------------------------------------------------


def test_dispatch_indexes_add_each_starting_weight_and_cpu_claim_before_selecting_next_core():
    s = sched(8)
    for i, claim in enumerate((3, 3, 3, 2)):
        add(s, f"j{i}", f"w{i}", float(i) * 0.001, claim=claim)
    starts = s.decide(1.0)
    # each start is counted before the next head is looked at: 3 + 3 fit, the third 3 does
    # not (it would make 9), the 2 does
    assert [(st.job_id, st.claim) for st in starts] == [("j0", 3), ("j1", 3), ("j3", 2)]
    stats = s.statistics()
    assert stats.held_permits == 8 and stats.setup_permits == 8 and stats.setup == 3
    assert stats.queued == 1 and s.job_state("j2") == "queued"
    assert s.decide(1.0) == []
    s.setup_done("j0", 2.0)
    assert s.statistics().setup_permits == 5 and s.statistics().held_permits == 8
    s.finished("j0", 3.0)
    assert started(s, 3.0) == ["j2"]


def test_queue_depth_counts_sixty_four_awaiting_bundles_core():
    s = sched(8, depth=64)
    for i in range(64):
        add(s, f"j{i}", f"w{i}", ready=False)  # still uploading: not queued yet
    assert s.statistics().pending == 64 and s.statistics().awaiting_bundles == 64
    refusal = s.accept(JobSpec("j64", "w64"), 1.0)
    assert refusal is not None and refusal.code == "runner_full"
    assert "64" in refusal.detail
    assert s.job_state("j64") is None and s.statistics().pending == 64
    # a job in setup is accepted and not yet running: it still counts
    s.ready("j0", 2.0)
    assert started(s, 2.0) == ["j0"] and s.job_state("j0") == "setup"
    assert s.statistics().pending == 64
    assert s.accept(JobSpec("j64", "w64"), 3.0).code == "runner_full"
    # once it runs, there is room again
    s.setup_done("j0", 4.0)
    assert s.statistics().pending == 63
    assert s.accept(JobSpec("j64", "w64"), 5.0) is None


def test_waiting_gate_does_not_stop_or_repin_running_workers_core():
    s = sched(8)
    run(s, "w1", "a", claim=4)
    run(s, "w2", "b", claim=4)
    add(s, "gate", "g", 1.0, claim=8, gate=True)
    assert s.decide(1.0) == []  # the core never emits a stop: running jobs keep running
    assert s.job_state("w1") == "running" and s.job_state("w2") == "running"
    assert s.wait_status("gate", 5.0).waiting_on == "permits"
    add(s, "small", "c", 6.0, claim=2)
    s.finished("w1", 10.0)
    assert s.decide(10.0) == []  # 4 free: the gate does not fit and fences the small worker
    assert s.job_state("w2") == "running"
    s.finished("w2", 20.0)
    assert started(s, 20.0) == ["gate"]


# --- queue order --------------------------------------------------------------------------


def test_gate_gets_next_eight_permits_before_older_workers_and_later_gates():
    s = sched(8)
    run(s, "r", "wr", claim=8)
    add(s, "old_small", "wa", 0.0, claim=2)
    add(s, "old_big", "wb", 0.0, claim=8)
    add(s, "gate1", "wg1", 100.0, claim=8, gate=True)
    add(s, "gate2", "wg2", 101.0, claim=2, gate=True)
    s.finished("r", 150.0)
    assert started(s, 150.0) == ["gate1"]  # the next eight permits go to the first gate
    for j in ("old_small", "old_big", "gate2"):
        assert s.job_state(j) == "queued"
    s.finished("gate1", 200.0)
    # then the later gate, then aged heads oldest first; old_big (aged) fences
    assert started(s, 200.0) == ["gate2", "old_small"]
    assert s.job_state("old_big") == "queued"


def test_gate_mark_is_honored_only_after_capability_negotiation():
    assert gate_honoured(True, ("gate_jobs", "follow")) is True
    assert gate_honoured(True, ("follow",)) is False
    assert gate_honoured(True, ()) is False
    assert gate_honoured(False, ("gate_jobs",)) is False

    def order(capabilities) -> list[str]:
        s = sched(2)
        run(s, "r", "wr", claim=2)
        add(s, "worker", "wa", 1.0)
        add(s, "terminal", "wb", 2.0, gate=gate_honoured(True, capabilities))
        s.finished("r", 10.0)
        first = started(s, 10.0)
        s.finished(first[0], 11.0)
        return first + started(s, 11.0)

    assert order(("gate_jobs",)) == ["terminal", "worker"]
    assert order(()) == ["worker", "terminal"]  # unmarked: an ordinary job, oldest first


def test_heads_rotate_between_workspaces_by_least_recent_dispatch():
    s = sched(2)
    add(s, "a1", "a", 0.0)
    add(s, "a2", "a", 0.1)
    add(s, "b1", "b", 0.2)
    add(s, "c1", "c", 0.3)
    assert started(s, 1.0) == ["a1"]
    s.finished("a1", 2.0)
    assert started(s, 2.0) == ["b1"]  # b and c never dispatched: before a again
    s.finished("b1", 3.0)
    assert started(s, 3.0) == ["c1"]
    s.finished("c1", 4.0)
    assert started(s, 4.0) == ["a2"]


def test_background_jobs_go_last_and_aged_heads_oldest_first():
    def order(s: Scheduler, t: float, n: int) -> list[str]:
        out = []
        for _ in range(n):
            got = started(s, t)
            assert len(got) == 1
            out += got
            t += 1.0
            s.finished(got[0], t)
        return out

    def setup() -> Scheduler:
        s = sched(2)
        run(s, "before", "w2", 0.0, claim=2)  # w2 was dispatched most recently
        s.finished("before", 5.0)
        run(s, "r", "wr", 5.0, claim=2)
        add(s, "warm", "w0", 5.0, kind="warm_build", claim=2)
        add(s, "early", "w2", 10.0)
        add(s, "late", "w1", 50.0)
        return s

    # within 60 s: rotation by least recent dispatch puts w1 (never dispatched) first
    s = setup()
    s.finished("r", 55.0)
    assert order(s, 55.0, 3) == ["late", "early", "warm"]
    # both aged: oldest first; the warm build, oldest of all, still last
    s = setup()
    add(s, "fresh", "w3", 100.0)
    s.finished("r", 120.0)
    assert order(s, 120.0, 4) == ["early", "late", "fresh", "warm"]


def test_capacity_blocked_gate_still_fences_smaller_workers():
    s = sched(8)
    run(s, "r", "wr", claim=6)
    add(s, "gate", "wg", 1.0, claim=4, gate=True)
    add(s, "small", "ws", 2.0, claim=2)  # would fit the 2 free permits
    assert s.decide(2.0) == []
    assert s.wait_status("small", 3.0).waiting_on == "permits"
    assert s.wait_status("small", 3.0).queue_wait_ms == 1000  # a fence is a shared blocker
    s.finished("r", 10.0)
    assert started(s, 10.0) == ["gate", "small"]


def test_capped_head_allows_backfill_only_until_its_grace_expires():
    s = sched(8)
    run(s, "r", "wr", claim=6)
    add(s, "capped", "wc", 0.0, claim=4)
    add(s, "s1", "w1", 1.0, claim=2)
    assert started(s, 1.0) == ["s1"]  # backfill during the capped head's first 60 s
    assert s.next_wakeup(1.0) == pytest.approx(60.0)  # its grace ends
    s.finished("s1", 30.0)
    add(s, "s2", "w2", 30.0, claim=2)
    assert started(s, 30.0) == ["s2"]
    s.finished("s2", 59.0)
    add(s, "s3", "w3", 59.0, claim=2)
    add(s, "s4", "w4", 59.5, claim=2)
    assert started(s, 59.0) == ["s3"]
    s.finished("s3", 60.0)
    assert s.decide(60.0) == []  # grace over: nothing passes it until it fits
    assert s.decide(90.0) == []
    s.finished("r", 100.0)
    assert started(s, 100.0) == ["capped", "s4"]


def test_a_gate_in_its_start_retry_delay_still_fences_capacity():
    s = sched(8)
    add(s, "gate", "wg", 0.0, claim=4, gate=True)
    assert started(s, 0.0) == ["gate"]
    s.start_failed("gate", 1.0)  # retry in 1 s
    add(s, "small", "ws", 1.2, claim=2)
    assert s.decide(1.5) == []  # 8 free, but the gate keeps its place and its claim
    assert s.wait_status("gate", 1.5).waiting_on == "permits"
    assert s.next_wakeup(1.5) == pytest.approx(2.0)
    assert started(s, 2.0) == ["gate", "small"]
    s.start_failed("gate", 3.0)  # second consecutive failure: 2 s
    assert s.decide(4.9) == []
    assert started(s, 5.0) == ["gate"]
    assert [retry_delay_s(n) for n in range(1, 9)] == [1, 2, 4, 8, 16, 32, 60, 60]

    # an ordinary head in its first 60 s does not fence while in its retry delay
    t = sched(8)
    add(t, "w", "wa", 0.0, claim=4)
    assert started(t, 0.0) == ["w"]
    t.start_failed("w", 1.0)
    add(t, "other", "wb", 1.1, claim=2)
    assert started(t, 1.1) == ["other"]
    assert t.wait_status("w", 1.2).waiting_on == "permits"


def test_a_gate_with_cleanup_pending_fences_nothing():
    s = sched(8)
    add(s, "gate", "wg", 0.0, claim=4, gate=True)
    assert started(s, 0.0) == ["gate"]
    s.start_failed("gate", 1.0, cleanup_pending=True)
    add(s, "small", "ws", 1.2, claim=2)
    assert started(s, 1.2) == ["small"]
    status = s.wait_status("gate", 1.5)
    assert status.waiting_on == "workspace_setup" and status.waiting_on_job is None
    assert s.decide(30.0) == []  # retry delay long over, cleanup still pending
    assert s.cleanup_done("gate", 40.0) is True
    assert s.cleanup_done("gate", 40.0) is False
    assert started(s, 40.0) == ["gate"]


def test_workspace_conflicted_gate_does_not_block_independent_workers():
    s = sched(8)
    run(s, "owner", "shared", claim=2)
    add(s, "gate", "shared", 1.0, claim=4, gate=True)
    add(s, "sib_gate", "own", 1.0, claim=2, gate=True, siblings=("shared",))
    add(s, "worker", "wk", 2.0, claim=2)
    assert started(s, 2.0) == ["worker"]
    assert s.wait_status("gate", 3.0) .waiting_on == "workspace_owner"
    assert s.wait_status("gate", 3.0).waiting_on_job == "owner"
    assert s.wait_status("sib_gate", 3.0).waiting_on == "workspace_owner"
    s.finished("owner", 5.0)
    assert started(s, 5.0) == ["gate"]  # sib_gate now conflicts with the gate's workspace


def test_jobs_waiting_on_a_workspace_keep_fifo_order():
    s = sched(8)
    run(s, "a", "w", claim=2)
    run(s, "x", "other", claim=4)
    add(s, "b", "w", 1.0, claim=4)
    add(s, "c", "w", 2.0, claim=2)
    add(s, "d", "w", 3.0, claim=1)
    for j in ("b", "c", "d"):
        st = s.wait_status(j, 4.0)
        assert (st.waiting_on, st.waiting_on_job) == ("workspace_owner", "a")
    s.finished("a", 5.0)
    assert started(s, 5.0) == ["b"]
    s.finished("x", 6.0)
    assert s.decide(6.0) == []
    s.finished("b", 7.0)
    assert started(s, 7.0) == ["c"]
    s.finished("c", 8.0)
    assert started(s, 8.0) == ["d"]
    # a smaller later job never overtakes the head of its own workspace
    t = sched(8)
    run(t, "x", "other", claim=6)
    add(t, "big", "w", 1.0, claim=4)
    add(t, "tiny", "w", 2.0, claim=1)
    assert t.decide(3.0) == []
    st = t.wait_status("tiny", 3.0)
    assert (st.waiting_on, st.waiting_on_job) == ("workspace_owner", "big")


def test_cancelled_workspace_waiter_is_removed_from_the_queue():
    s = sched(8)
    run(s, "a", "w")
    add(s, "b", "w", 1.0)
    add(s, "c", "w", 2.0)
    assert s.cancel("b", 3.0) is True
    assert s.job_state("b") is None
    assert s.statistics().queued == 1
    with pytest.raises(KeyError):
        s.wait_status("b", 3.0)
    assert s.cancel("b", 3.0) is False
    s.finished("a", 4.0)
    assert started(s, 4.0) == ["c"]
    assert s.cancel("c", 5.0) is False  # started: not a queued job any more
    # a job cancelled while its bundles upload cannot join the queue later
    add(s, "u", "w2", 6.0, ready=False)
    assert s.cancel("u", 7.0) is True
    assert s.ready("u", 8.0) is False


# --- queue wait ---------------------------------------------------------------------------


def test_upload_fetch_and_setup_do_not_spend_queue_wait_budget_core():
    s = sched(8)
    run(s, "r", "wr", claim=8)
    add(s, "j", "w", 0.0, ready=False, claim=2, queue_wait_limit_s=60, runner_enforces_budget=True)
    assert s.wait_status("j", 100.0).queue_wait_ms == 0  # uploading and fetching
    assert s.expired(100.0) == []
    s.ready("j", 100.0)  # bundles verified and pinned: the clock starts
    assert ms(s, "j", 120.0) == 20_000
    s.finished("r", 130.0)
    assert started(s, 130.0) == ["j"]
    assert ms(s, "j", 500.0) == 30_000  # setup does not count
    assert s.expired(500.0) == []
    s.setup_done("j", 500.0)
    assert ms(s, "j", 900.0) == 30_000


def test_a_fetched_job_behind_its_workspace_owner_starts_paused():
    s = sched(8)
    run(s, "owner", "w", claim=2)
    add(s, "j", "w", 0.0, ready=False)
    s.ready("j", 5.0)
    st = s.wait_status("j", 100.0)
    assert (st.waiting_on, st.waiting_on_job, st.queue_wait_ms) == ("workspace_owner", "owner", 0)
    s.finished("owner", 100.0)
    assert started(s, 100.0) == ["j"]
    assert ms(s, "j", 101.0) == 0


def test_a_requeued_job_is_not_charged_for_its_failed_setup():
    s = sched(8)
    run(s, "r", "wr", claim=8)
    add(s, "j", "w", 0.0, claim=4)
    s.finished("r", 10.0)
    assert started(s, 10.0) == ["j"]
    assert ms(s, "j", 30.0) == 10_000  # setting up: clock stopped
    s.start_failed("j", 40.0)
    assert ms(s, "j", 40.0) == 10_000  # resumes at requeue from its value
    assert ms(s, "j", 40.5) == 10_500
    assert started(s, 41.0) == ["j"]
    assert ms(s, "j", 41.0) == 11_000


def test_workspace_owner_wait_does_not_spend_queue_wait_budget():
    s = sched(8)
    run(s, "owner", "w", claim=2)
    add(s, "j", "w", 0.0, queue_wait_limit_s=30, runner_enforces_budget=True)
    assert s.expired(1000.0) == []
    st = s.wait_status("j", 1000.0)
    assert (st.waiting_on, st.waiting_on_job, st.queue_wait_ms) == ("workspace_owner", "owner", 0)
    assert s.next_wakeup(1000.0) is None  # a paused clock cannot run out on its own


def test_queue_wait_clock_resumes_for_capacity_after_workspace_owner_finishes():
    s = sched(8)
    run(s, "x", "wx", claim=6)
    run(s, "owner", "w", claim=2)
    add(s, "j", "w", 0.0, claim=2)  # would fit once the owner frees its 2 permits: paused
    assert ms(s, "j", 50.0) == 0
    add(s, "gate", "wg", 50.0, claim=2, gate=True)
    s.finished("owner", 50.0)
    assert started(s, 50.0) == ["gate"]  # the gate takes the permits: j now waits on capacity
    st = s.wait_status("j", 80.0)
    assert (st.waiting_on, st.queue_wait_ms) == ("permits", 30_000)
    s.finished("gate", 90.0)
    assert started(s, 90.0) == ["j"]
    assert ms(s, "j", 91.0) == 40_000


def test_sibling_user_wait_is_named_with_its_holder_and_does_not_spend_queue_wait_budget():
    s = sched(8)
    run(s, "user", "a", claim=2, siblings=("b",))
    add(s, "j", "b", 0.0, claim=2, queue_wait_limit_s=10, runner_enforces_budget=True)
    st = s.wait_status("j", 100.0)
    assert (st.waiting_on, st.waiting_on_job, st.queue_wait_ms) == ("sibling_user", "user", 0)
    assert s.expired(100.0) == []
    s.finished("user", 100.0)
    assert started(s, 100.0) == ["j"]
    assert ms(s, "j", 100.0) == 0


def test_sibling_user_wait_still_spends_budget_when_capacity_would_also_block():
    s = sched(8)
    run(s, "user", "a", claim=2, siblings=("b",))
    run(s, "x", "wx", claim=6)
    add(s, "j", "b", 0.0, claim=4)  # 8 - (8 - 2) = 2 < 4: would not fit even without the user
    st = s.wait_status("j", 30.0)
    assert (st.waiting_on, st.waiting_on_job, st.queue_wait_ms) == ("sibling_user", "user", 30_000)
    s.finished("x", 30.0)  # now it would fit once the user frees: paused again
    assert ms(s, "j", 60.0) == 30_000
    s.finished("user", 60.0)
    assert started(s, 60.0) == ["j"]


def test_worker_behind_gate_keeps_its_full_queue_wait_budget():
    worker = JobSpec("w", "wa", spill_eligible=True)
    assert queue_wait_budget_s(worker) == 300.0
    assert queue_wait_budget_s(JobSpec("x", "wa", timeout_s=600)) == 600.0
    assert queue_wait_budget_s(JobSpec("x", "wa", timeout_s=7200)) == GATE_QUEUE_WAIT_S
    assert queue_wait_budget_s(JobSpec("x", "wa")) == 1800.0
    assert queue_wait_budget_s(JobSpec("x", "wa", queue_wait_limit_s=45, spill_eligible=True)) == 45
    assert queue_wait_budget_s(JobSpec("g", "wg", gate=True, queue_wait_limit_s=5)) == 1800.0
    assert queue_wait_budget_s(worker, default_spill_s=120) == 120.0

    s = sched(8)
    run(s, "r", "wr", claim=8)
    add(s, "gate", "wg", 0.0, claim=8, gate=True)
    add(s, "w", "wa", 0.0, claim=2, spill_eligible=True, runner_enforces_budget=True)
    assert s.budget_s("w") == 300.0
    assert s.expired(299.0) == []
    assert s.next_wakeup(299.0) == pytest.approx(300.0)
    assert s.expired(300.0) == ["w"]
    assert s.withdraw("w", 300.0) == "withdrawn"


def test_only_observed_permit_wait_can_withdraw_not_elapsed_acceptance():
    s = sched(8)
    run(s, "r", "wr", claim=8)
    add(s, "j", "w", 0.0, ready=False, queue_wait_limit_s=300, runner_enforces_budget=True)
    s.ready("j", 200.0)  # 200 s of upload and fetch
    assert s.expired(450.0) == []  # 450 s since acceptance, 250 s of observed wait
    assert ms(s, "j", 450.0) == 250_000
    assert s.next_wakeup(450.0) == pytest.approx(500.0)
    assert s.expired(500.0) == ["j"]

    # the client side: a deadline from streamed queue_wait_ms, not from its own stopwatch
    local = LocalDeadline(300)
    assert local.should_withdraw(450.0) is False  # no observation: acceptance time never counts
    local.observe(0, 200.0)
    local.observe(250_000, 450.0)
    assert local.should_withdraw(450.0) is False
    assert local.should_withdraw(499.9) is False
    assert local.should_withdraw(500.0) is True

    # time paused behind a workspace owner is neither observed nor charged
    t = sched(8)
    run(t, "owner", "w", claim=2)
    add(t, "k", "w", 0.0, queue_wait_limit_s=300, runner_enforces_budget=True)
    follower = LocalDeadline(300)
    for now in (0.0, 200.0, 400.0, 600.0):
        follower.observe(t.wait_status("k", now).queue_wait_ms, now)
        assert not follower.should_withdraw(now)
        assert t.expired(now) == []
    assert t.withdraw("k", 600.0) == "withdrawn"  # only if asked: the answer decides


def test_streamed_elapsed_queue_time_sets_a_local_deadline():
    local = LocalDeadline(300)
    local.observe(0, 1000.0)
    assert local.deadline is None  # the clock has not been seen to advance yet
    local.observe(5000, 1005.0)
    assert local.deadline == pytest.approx(1300.0)
    assert local.remaining_s(1100.0) == pytest.approx(200.0)
    assert not local.should_withdraw(1299.9)
    assert local.should_withdraw(1300.0)
    local.observe(5000, 1010.0)  # paused (workspace owner): no extrapolated deadline
    assert local.deadline is None and not local.should_withdraw(5000.0)
    local.observe(6000, 1020.0)
    assert local.deadline == pytest.approx(1314.0)
    local.observe(4000, 1021.0)  # a stale heartbeat never moves the deadline back
    assert local.deadline == pytest.approx(1314.0)
    local.observe(300_000, 1030.0)
    assert local.should_withdraw(1030.0)
    zero = LocalDeadline(0)
    zero.observe(0, 1.0)
    assert zero.should_withdraw(1.0)


def test_zero_queue_wait_withdraws_and_cancel_is_idempotent_core():
    s = sched(8)
    run(s, "r", "wr", claim=8)
    add(s, "z", "w", 1.0, queue_wait_limit_s=0, runner_enforces_budget=True)
    assert s.budget_s("z") == 0.0
    assert s.expired(1.0) == ["z"]
    assert s.withdraw("z", 1.0) == "withdrawn"
    assert s.job_state("z") is None and s.statistics().queued == 0
    assert s.withdraw("z", 2.0) == "already_ended"  # asked twice: it already ended
    assert s.cancel("z", 2.0) is False
    assert s.cancel("z", 2.0) is False
    assert s.withdraw("r", 3.0) == "started"
    assert s.withdraw("nobody", 3.0) == "unknown"
    add(s, "q", "w2", 4.0)
    assert s.cancel("q", 5.0) is True
    assert s.cancel("q", 5.0) is False
    assert s.withdraw("q", 5.0) == "already_ended"


# --- further core behaviour -----------------------------------------------------------------


def test_next_wakeup_and_story():
    s = sched(8)
    assert s.next_wakeup(0.0) is None
    run(s, "r", "wr", claim=8)
    add(s, "j", "w", 10.0, runner_enforces_budget=True, queue_wait_limit_s=500)
    assert s.next_wakeup(10.0) == pytest.approx(70.0)  # it ages at 60 s
    assert s.next_wakeup(80.0) == pytest.approx(510.0)  # its budget
    story = s.story("j")
    assert any("accepted" in line for line in story)
    assert any("waiting on permits" in line for line in story)
    s.finished("r", 90.0)
    started(s, 90.0)
    assert any("started" in line for line in s.story("j"))
    s.finished("j", 91.0)
    assert s.story("j")[-1].endswith("finished")


def test_a_story_tells_each_clock_flip_with_the_clock_at_that_time():
    """Clock lines are kept unformatted and written when the story is read (issue 14: a
    workspace freed or taken flips every clock queued there): the same text, with the
    clock's value at the flip."""
    s = sched(2)
    run(s, "r", "wr", claim=2)  # holds every permit
    add(s, "w", "ws", 0.0, claim=2)  # the head of ws, waiting for permits
    add(s, "q", "ws", 1.0, claim=2)  # behind a queued head: its clock advances
    s.finished("r", 3.0)
    assert started(s, 3.0) == ["w"]  # w owns ws now: q pauses behind its owner
    s.finished("w", 7.0)
    assert ms(s, "q", 7.0) == 2000  # read before the next start: ws is free, q advances
    assert started(s, 7.0) == ["q"]
    lines = s.story("q")
    flips = [line for line in lines if line.split(" ", 1)[1].startswith("clock")]
    assert flips == ["t=1.000 clock advancing at 0.000s", "t=3.000 clock paused at 2.000s",
                     "t=7.000 clock advancing at 2.000s"], lines
    s.finished("q", 9.0)
    ended = s.story("q")  # an ended job's story is read from the ended record
    assert ended[:len(lines)] == lines and ended[-1] == "t=9.000 finished"


def test_an_end_and_the_next_start_at_one_instant_flip_no_clock_queued_behind():
    """A deep workspace drained one job after another (issue 14): the job that ended and
    the next one started in the same instant leave the workspace occupied throughout, so
    the clocks queued behind stay paused and are neither flipped nor reported changed; a
    read between the two sees the workspace free and the clocks advancing, as before."""
    s = sched(2)
    run(s, "a", "ws", 0.0, claim=1)
    for i in range(5):
        add(s, f"q{i}", "ws", 1.0, claim=1)  # behind the owner: paused
    s.take_clock_changes(1.0)
    s.finished("a", 4.0)
    assert started(s, 4.0) == ["q0"]
    assert s.take_clock_changes(4.0) == set()  # q1..q4 never changed course
    assert [s.clock_state(f"q{i}", 4.9)[:2] for i in range(1, 5)] == [(0.0, False)] * 4
    assert not any(" clock " in line for line in s.story("q3") if line.startswith("t=4.000"))
    # the same end with a read before the start: the clocks advance from 5.0, then pause
    s.setup_done("q0", 5.0)
    s.finished("q0", 5.0)
    assert ms(s, "q1", 5.0) == 0 and s.clock_state("q1", 5.0)[1] is True
    assert started(s, 5.0) == ["q1"]
    assert s.take_clock_changes(5.0) == {"q1", "q2", "q3", "q4"}  # advanced, paused
    assert s.clock_state("q4", 5.0)[:2] == (0.0, False)
    # an end at one instant and the start at a later one: they advanced in between
    s.setup_done("q1", 6.0)
    s.finished("q1", 6.0)
    assert started(s, 6.5) == ["q2"]
    assert s.clock_state("q4", 8.0)[:2] == (0.5, False)
    assert ms(s, "q3", 8.0) == 500


def test_time_never_goes_back_and_misuse_is_refused():
    s = sched(8)
    run(s, "r", "wr", claim=8)
    add(s, "j", "w", 10.0)
    assert ms(s, "j", 20.0) == 10_000
    assert ms(s, "j", 15.0) == 10_000  # a stale `now` counts as the latest time seen
    with pytest.raises(ValueError):
        s.accept(JobSpec("j", "w"), 20.0)
    with pytest.raises(ValueError):
        s.finished("j", 20.0)
    with pytest.raises(ValueError):
        s.setup_done("j", 20.0)
    with pytest.raises(ValueError):
        s.ready("j", 20.0)


def test_a_fence_ahead_is_a_shared_blocker_even_behind_a_workspace_owner():
    s = sched(8)
    run(s, "x", "wx", claim=6)
    run(s, "owner", "w", claim=2)
    add(s, "j", "w", 0.0, claim=2)  # would fit once the owner frees: paused
    assert ms(s, "j", 10.0) == 0
    add(s, "gate", "wg", 10.0, claim=4, gate=True)  # does not fit: fences everything behind
    assert s.decide(10.0) == []
    st = s.wait_status("j", 20.0)
    assert (st.waiting_on, st.waiting_on_job, st.queue_wait_ms) == ("workspace_owner", "owner", 10_000)
    s.finished("x", 20.0)
    assert started(s, 20.0) == ["gate"]  # the fence is gone: j is paused again
    assert ms(s, "j", 50.0) == 10_000


def test_an_aging_head_turns_into_a_fence_without_any_event():
    s = sched(8)
    run(s, "x", "wx", claim=6)
    run(s, "owner", "w", claim=2)
    add(s, "capped", "wc", 0.0, claim=4)  # not a fence during its first 60 s
    add(s, "j", "w", 5.0, claim=2)  # paused behind its owner
    assert ms(s, "j", 59.0) == 0
    # capped ages at t=60 and fences j (younger) from then on; nobody called in between
    assert ms(s, "j", 100.0) == 40_000


def test_adopted_running_job_holds_its_claim_and_workspace_until_finished():
    """After a restart, a job recorded as running counts exactly as a started one."""
    s = Scheduler(max_weight=4, max_queue_depth=8, claim_limit=4)
    s.adopt_running(JobSpec(job_id="old", workspace="w", claim=3), 0.0)
    assert s.statistics().held_permits == 3
    s.accept(JobSpec(job_id="same-ws", workspace="w", claim=1), 1.0)
    s.ready("same-ws", 1.0)
    s.accept(JobSpec(job_id="big", workspace="x", claim=2), 1.0)
    s.ready("big", 1.0)
    assert s.decide(1.0) == []
    assert s.wait_status("same-ws", 1.0).waiting_on == "workspace_owner"
    assert s.wait_status("same-ws", 1.0).waiting_on_job == "old"
    assert s.wait_status("big", 1.0).waiting_on == "permits"
    s.finished("old", 2.0)
    assert sorted(st.job_id for st in s.decide(2.0)) == ["big", "same-ws"]


# --- issue 11: the rules as the seed says them ------------------------------------------------


def test_a_due_budget_wakes_the_runner_at_once_and_rounding_never_skips_a_deadline():
    s = sched(8)
    run(s, "r", "wr", claim=8)
    add(s, "z", "w", 1.0, queue_wait_limit_s=0, runner_enforces_budget=True)
    assert s.next_wakeup(1.0) == 1.0  # due now, not at the next aging breakpoint
    assert s.expired(1.0) == ["z"]
    s.withdraw("z", 1.0)
    add(s, "t", "w3", 1.1, queue_wait_limit_s=0.3, runner_enforces_budget=True)
    at = s.next_wakeup(1.1)
    assert at == pytest.approx(1.4)
    assert s.expired(at) == ["t"]  # the timer firing at exactly that float time expires it


def test_queue_wait_advances_behind_a_queued_head_and_for_a_busy_own_sibling():
    s = sched(8)
    run(s, "big", "x", claim=6)
    add(s, "head", "w", 0.0, claim=4)  # waits for capacity
    add(s, "behind", "w", 0.0, claim=1)  # behind a queued head that waits for capacity
    assert s.wait_status("behind", 0.0).waiting_on == "workspace_owner"
    assert ms(s, "behind", 10.0) == 10_000 and ms(s, "head", 10.0) == 10_000
    # a head whose own sibling workspace is owned: not one of the seed's two pause cases
    run(s, "sibowner", "lib", 10.0, claim=1)
    add(s, "needs_lib", "v", 10.0, claim=1, siblings=("lib",))
    st = s.wait_status("needs_lib", 10.0)
    assert (st.waiting_on, st.waiting_on_job) == ("workspace_owner", "sibowner")
    assert ms(s, "needs_lib", 15.0) == 5_000
    # while an owner of its own workspace still pauses it
    run(s, "vown", "u", 15.0, claim=1)
    add(s, "paused", "u", 15.0, claim=1)
    assert ms(s, "paused", 20.0) == 0


def test_a_failed_start_keeps_its_rotation_place_during_its_retry_delay():
    s = sched(2)
    for job_id, ws, t in (("a1", "a", 0.0), ("b1", "b", 1.0)):
        add(s, job_id, ws, t, claim=2)
        assert started(s, t) == [job_id]
        s.finished(job_id, t + 0.5)
    add(s, "a2", "a", 2.0, claim=2)
    assert started(s, 2.0) == ["a2"]
    s.start_failed("a2", 3.0)  # retry at 4.0; a's failed attempt is not a dispatch
    add(s, "h", "h", 3.0, claim=2)
    assert started(s, 3.0) == ["h"]  # the retry delay holds a2 back: h backfills
    add(s, "b3", "b", 3.1, claim=2)
    s.finished("h", 5.0)
    # a dispatched (a1) before b (b1): a2 keeps that place and goes before b3
    assert started(s, 5.0) == ["a2"]


def test_a_restored_job_resumes_its_clock_and_its_aging():
    s = sched(8)
    run(s, "r", "wr", claim=8)
    add(s, "old", "w", 100.0, ready=False, queue_wait_limit_s=100, runner_enforces_budget=True)
    s.ready("old", 100.0, waited_s=40.0, ready_age_s=70.0)  # as persisted before a restart
    assert ms(s, "old", 100.0) == 40_000
    add(s, "new", "v", 100.0, claim=2)
    # old has waited 70 s since ready: aged, so it fences the newer head behind it
    s.finished("r", 101.0)
    s2 = s.decide(101.0)
    assert [st.job_id for st in s2] == ["old", "new"]
    assert s.story("old")[1].endswith("resuming at 40.000s waited, ready 70.000s ago")
    fresh = sched(8)
    run(fresh, "r", "wr", claim=8)
    add(fresh, "old", "w", 100.0, ready=False, queue_wait_limit_s=100, runner_enforces_budget=True)
    fresh.ready("old", 100.0, waited_s=40.0, ready_age_s=70.0)
    assert fresh.next_wakeup(100.0) == pytest.approx(160.0)  # 60 s of budget left


def test_a_job_adopted_while_setting_up_whose_start_then_fails_is_requeued():
    """After a restart a job recorded in `setup` is adopted as running; if its setup then
    fails (it never spawned), it goes back to its queue like any failed start."""
    s = Scheduler(max_weight=4, max_queue_depth=8, claim_limit=4)
    s.adopt_running(JobSpec(job_id="old", workspace="w", claim=3), 0.0)
    s.start_failed("old", 1.0)
    assert s.job_state("old") == "queued"
    stats = s.statistics()
    assert stats.held_permits == 0 and stats.setup_permits == 0
    assert s.decide(1.0) == []  # its retry delay first
    assert [st.job_id for st in s.decide(1.0 + 3600)] == ["old"]


def test_a_drain_of_aged_deep_workspaces_re_decides_only_the_clocks_a_fence_moves(monkeypatch):
    """Per-event clock work in a deep queue over few workspaces (issue 14): 2,000 jobs over
    4 workspaces, 2 at a time, drained in rotation (each end frees one workspace, the
    start at the same instant takes another) once the heads have aged. Each start moves
    the fence (the oldest head waiting for permits), and the workspaces freed and taken
    hold some 500 jobs each; a clock pauses only at or ahead of the fence, so the pass
    looks at the jobs between two fences and those ahead of one, a few per event, not at
    every job queued in the workspaces the event touched (it did: 953 per event).
    The answers are the reference core's (test_differential.py)."""
    looked_at = []
    set_clock = Scheduler._set_clock

    def counted(self, job, now, advancing):
        looked_at.append(job.job_id)
        return set_clock(self, job, now, advancing)

    monkeypatch.setattr(Scheduler, "_set_clock", counted)
    s = sched(2, depth=10_000)
    now = 0.0
    for i in range(2000):
        add(s, f"j{i}", f"w{i % 4}", now, claim=1, runner_enforces_budget=i % 2 == 0)
        now += 0.001
    running = started(s, now)
    for job_id in running:
        s.setup_done(job_id, now)
    now = 70.0  # every head has aged: a head waiting for permits fences
    looked_at.clear()
    for _ in range(200):
        now += 0.01
        s.finished(running.pop(0), now)
        for job_id in started(s, now):
            s.setup_done(job_id, now)
            running.append(job_id)
    assert s.statistics().queued > 1700  # still deep: some 450 per workspace
    assert len(looked_at) <= 200 * 20, f"{len(looked_at) / 200:.1f} clocks looked at per event"


def test_a_head_fences_at_its_own_aging_point_whatever_the_float_rounding():
    """A head readied at 4.07 s ages at its breakpoint, 4.07 + 60, and fences from that very
    instant: a smaller job readied then is not backfilled past it. (Computed as `now -
    ready_at`, 64.07 - 4.07 is 59.99999999999999 in floats: the head was not aged at its
    own breakpoint and fenced only from the next event, seen through the runner.)"""
    ready = 4.07
    aging_point = ready + 60.0
    assert aging_point - ready < 60.0  # the float case this test is about
    s = sched(2)
    run(s, "holder", "w0", 0.0, claim=1)
    add(s, "big", "w1", ready, claim=2)  # waits for both permits
    assert started(s, ready) == []
    add(s, "small", "w2", aging_point, claim=1)
    assert started(s, aging_point) == []  # big has aged: no backfill past it
    assert s.wait_status("small", aging_point).waiting_on == "permits"
