"""The pure eviction planner (motor/disk/core.py): the seed's passes and protections.

The seed-named pressure tests run through the disk actor's re-probe loop on real trees
(tests/disk/test_actor.py); the `test_plan_*` ones here check one plan of the pure core."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from motor.disk.core import (
    DropIncremental, DropStaleUnits, EvictWorkspace, PlanInput, RECENT_MS, RemoveStaging,
    Repair, Staging, Workspace, guard_action, idle_expired, plan_cleanup, protection,
)

GB = 10**9
NOW = 10_000_000_000
HOUR = 3600 * 1000
ROOT = "/srv/ws"


def ws(name, alloc=GB, *, idle_ms=2 * HOUR, inc=0, stale=0, target=None, **kw) -> Workspace:
    return Workspace(name=name, path=f"{ROOT}/{name}", root=ROOT, allocated_bytes=alloc,
                     target_bytes=alloc if target is None else target, incremental_bytes=inc,
                     stale_bytes=stale, last_used_ms=NOW - idle_ms, **kw)


def plan(workspaces, *, free, floor=100 * GB, goal=None, staging=(), incoming=()):
    return plan_cleanup(PlanInput(
        workspaces=tuple(workspaces), staging=tuple(staging), free_bytes=free, floor_bytes=floor,
        goal_bytes=2 * floor if goal is None else goal, now_ms=NOW, allowed_roots=(ROOT,),
        incoming=frozenset(incoming)))


def names(actions):
    return [(type(a).__name__, getattr(a, "workspace", getattr(a, "path", None))) for a in actions]


def test_disk_soft_cleanup_does_nothing_at_twice_the_floor():
    wss = [ws("a", 50 * GB, idle_ms=30 * 24 * HOUR, inc=5 * GB, stale=5 * GB)]
    assert plan(wss, free=200 * GB, floor=100 * GB) == []
    assert plan(wss, free=250 * GB, floor=100 * GB) == []
    assert plan(wss, free=200 * GB - 1, floor=100 * GB) != []


def test_plan_disk_pressure_stale_pass_reaches_goal_without_dropping_incremental():
    wss = [ws("a", 50 * GB, inc=20 * GB, stale=8 * GB), ws("b", 50 * GB, inc=30 * GB, stale=4 * GB)]
    actions = plan(wss, free=190 * GB)
    assert actions == [DropStaleUnits("a", f"{ROOT}/a", 8 * GB), DropStaleUnits("b", f"{ROOT}/b", 4 * GB)]
    # the stale pass stops as soon as the goal is reached: a alone is enough here
    assert plan(wss, free=195 * GB) == [DropStaleUnits("a", f"{ROOT}/a", 8 * GB)]


def test_plan_disk_pressure_incremental_pass_prefers_largest_and_retains_workspaces():
    wss = [ws("small", 40 * GB, inc=5 * GB), ws("large", 40 * GB, inc=30 * GB),
           ws("mid", 40 * GB, inc=10 * GB)]
    actions = plan(wss, free=165 * GB)
    assert names(actions) == [("DropIncremental", "large"), ("DropIncremental", "mid")]
    assert not any(isinstance(a, EvictWorkspace) for a in actions)


def test_disk_eviction_bytes_times_idle_prefers_huge_workspace_over_older_small_ones():
    huge = ws("huge", 80 * GB, idle_ms=2 * HOUR)  # 160 GB*h
    old1 = ws("old1", 2 * GB, idle_ms=40 * HOUR)  # 80 GB*h
    old2 = ws("old2", 1 * GB, idle_ms=70 * HOUR)  # 70 GB*h
    actions = plan([old1, old2, huge], free=150 * GB)
    assert names(actions) == [("EvictWorkspace", "huge")]


def test_disk_soft_cleanup_evicts_lru_before_the_hard_floor():
    # above the floor (soft pressure) equal-sized idle workspaces go least recently used first
    wss = [ws(f"w{i}", 10 * GB, idle_ms=(i + 1) * HOUR) for i in range(5)]
    actions = plan(wss, free=175 * GB)  # floor 100, goal 200: 25 GB to find
    assert names(actions) == [("EvictWorkspace", "w4"), ("EvictWorkspace", "w3"),
                              ("EvictWorkspace", "w2")]


def test_plan_disk_soft_pressure_evicts_only_candidates_used_over_30_minutes_ago():
    recent = ws("recent", 90 * GB, idle_ms=29 * 60 * 1000)
    old = ws("old", 5 * GB, idle_ms=31 * 60 * 1000)
    actions = plan([recent, old], free=150 * GB)  # above the floor: recent is protected
    assert names(actions) == [("EvictWorkspace", "old")]
    assert protection(recent, PlanInput((), 150 * GB, 100 * GB, 200 * GB, NOW,
                                        allowed_roots=(ROOT,)), hard=False) == \
        "used in the last 30 minutes"


def test_plan_disk_hard_pressure_evicts_recent_candidates_in_lru_order_until_soft_goal():
    old = ws("old", 10 * GB, idle_ms=5 * HOUR)
    r1 = ws("r1", 30 * GB, idle_ms=10 * 60 * 1000)
    r2 = ws("r2", 30 * GB, idle_ms=20 * 60 * 1000)
    r3 = ws("r3", 30 * GB, idle_ms=5 * 60 * 1000)
    actions = plan([r1, r2, r3, old], free=90 * GB)  # below the floor: recent ones are eligible
    # the old one first, then the recent ones least recently used first, until 200 GB
    assert names(actions) == [("EvictWorkspace", "old"), ("EvictWorkspace", "r2"),
                              ("EvictWorkspace", "r1"), ("EvictWorkspace", "r3")]
    actions = plan([r1, r2, r3, old], free=130 * GB)  # above the floor: only the old one
    assert names(actions) == [("EvictWorkspace", "old")]
    # a cleanup that started below the floor stays hard (the actor passes hard=True)
    actions = plan_cleanup(PlanInput((r1, r2, r3, old), 130 * GB, 100 * GB, 200 * GB, NOW,
                                     allowed_roots=(ROOT,), hard=True))
    assert names(actions) == [("EvictWorkspace", "old"), ("EvictWorkspace", "r2"),
                              ("EvictWorkspace", "r1")]


def test_disk_eviction_skips_reserved_and_running_workspaces():
    wss = [ws("running", 90 * GB, idle_ms=99 * HOUR, running=True),
           ws("reserved", 90 * GB, idle_ms=99 * HOUR, reserved=True),
           ws("free", 1 * GB, idle_ms=1 * HOUR)]
    actions = plan(wss, free=10 * GB)  # hard pressure: still never running/reserved
    assert names(actions) == [("EvictWorkspace", "free")]


def test_disk_admission_preserves_incoming_ordinary_workspace_and_sibling():
    wss = [ws("app", 90 * GB, idle_ms=99 * HOUR, inc=10 * GB, stale=1 * GB),
           ws("lib", 90 * GB, idle_ms=99 * HOUR, inc=10 * GB),
           ws("other", 5 * GB, idle_ms=1 * HOUR)]
    actions = plan(wss, free=10 * GB, incoming={f"{ROOT}/app", "lib"})
    assert names(actions) == [("EvictWorkspace", "other")]


def test_only_catalogued_workspaces_under_allowed_roots_are_touched():
    outside = Workspace(name="x", path="/elsewhere/x", root="", allocated_bytes=90 * GB,
                        last_used_ms=0)
    uncatalogued = ws("u", 90 * GB, idle_ms=99 * HOUR, catalogued=False)
    root_itself = Workspace(name="r", path=ROOT, root=ROOT, allocated_bytes=90 * GB, last_used_ms=0)
    assert plan([outside, uncatalogued, root_itself], free=10 * GB) == []


def test_unreferenced_sibling_snapshots_go_first_in_the_whole_tree_pass():
    snap = ws("snap", 1 * GB, idle_ms=1 * HOUR, kind="snapshot", referenced_by=("gone",))
    used = ws("used-snap", 1 * GB, idle_ms=1 * HOUR, kind="snapshot", referenced_by=("big",))
    big = ws("big", 50 * GB, idle_ms=50 * HOUR)
    actions = plan([big, used, snap], free=199 * GB)
    assert names(actions) == [("EvictWorkspace", "snap")]


def test_staging_is_ranked_with_workspaces_by_bytes_times_idle():
    stg = Staging(path="/state/staging/x", allocated_bytes=40 * GB, last_used_ms=NOW - 10 * HOUR)
    busy = Staging(path="/state/staging/y", allocated_bytes=99 * GB, last_used_ms=0, active=True)
    w = ws("w", 10 * GB, idle_ms=10 * HOUR)
    actions = plan([w], free=170 * GB, staging=[stg, busy])
    assert actions == [RemoveStaging("/state/staging/x", 40 * GB)]


def test_incomplete_estimates_are_repaired_oldest_first_after_complete_ones():
    complete = ws("c", 5 * GB, idle_ms=3 * HOUR)
    inc_old = ws("io", 1 * GB, idle_ms=9 * HOUR, complete=False, inc=None)
    inc_new = ws("in", 1 * GB, idle_ms=4 * HOUR, complete=False, inc=None)
    # the incremental pass repairs first (it must measure before deciding)
    actions = plan([complete, inc_new, inc_old], free=150 * GB)
    assert isinstance(actions[-1], Repair) and actions[-1].pass_name == "incremental"
    # whole-workspace pass: complete estimates first, then one repair, oldest first
    c2 = ws("c", 5 * GB, idle_ms=3 * HOUR)
    io2 = Workspace(**{**inc_old.__dict__, "incremental_bytes": 0})
    in2 = Workspace(**{**inc_new.__dict__, "incremental_bytes": 0})
    # mark the incremental pass done for the incomplete ones by giving them complete=False but
    # no incremental work: the planner still repairs them in pass 2 first; emulate the repair
    repaired = [Workspace(**{**io2.__dict__, "complete": True, "allocated_bytes": 30 * GB})]
    actions = plan([c2, *repaired], free=160 * GB)
    assert names(actions) == [("EvictWorkspace", "io"), ("EvictWorkspace", "c")]
    # the goal met by complete estimates: no repair at all
    assert not any(isinstance(a, Repair) for a in plan([ws("c", 50 * GB), inc_old], free=180 * GB)
                   if a.pass_name == "whole")


def test_guard_drops_only_incremental_and_defers_busy_workspaces():
    big = ws("w", 10 * GB, target=9 * GB, inc=3 * GB)
    assert guard_action(big, 8 * GB) == DropIncremental("w", f"{ROOT}/w", 3 * GB, pass_name="guard", purge=False)
    assert guard_action(big, 10 * GB) is None
    assert guard_action(ws("w", 10 * GB, target=9 * GB, inc=3 * GB, reserved=True), 8 * GB) is None
    assert isinstance(guard_action(ws("w", complete=False), 8 * GB), Repair)


def test_idle_expiry_spares_heads():
    assert idle_expired(ws("t", idle_ms=24 * HOUR), NOW)
    assert not idle_expired(ws("t", idle_ms=23 * HOUR), NOW)
    assert not idle_expired(ws("h", idle_ms=99 * HOUR, kind="head"), NOW)


# --- property ------------------------------------------------------------------------------

_ws = st.builds(
    lambda i, alloc, idle, inc, stale, running, reserved, catalogued, complete, outside: Workspace(
        name=f"w{i}", path=(f"/other/w{i}" if outside else f"{ROOT}/w{i}"), root=ROOT,
        allocated_bytes=alloc, target_bytes=alloc, incremental_bytes=min(inc, alloc),
        stale_bytes=min(stale, alloc), complete=complete, last_used_ms=NOW - idle,
        running=running, reserved=reserved, catalogued=catalogued),
    st.integers(0, 10**6), st.integers(0, 100 * GB), st.integers(0, 100 * HOUR),
    st.integers(0, 10 * GB), st.integers(0, 10 * GB), st.booleans(), st.booleans(),
    st.booleans(), st.booleans(), st.booleans())


@settings(max_examples=300, deadline=None)
@given(st.lists(_ws, max_size=12, unique_by=lambda w: w.name), st.integers(0, 300 * GB),
       st.integers(0, 150 * GB), st.integers(0, 100 * GB), st.sets(st.integers(0, 10**6), max_size=3))
def test_planner_never_selects_protected_and_stops_at_the_goal(wss, free, floor, extra, incoming_ids):
    goal = floor + extra
    incoming = frozenset(f"{ROOT}/w{i}" for i in incoming_ids)
    inp = PlanInput(workspaces=tuple(wss), free_bytes=free, floor_bytes=floor, goal_bytes=goal,
                    now_ms=NOW, allowed_roots=(ROOT,), incoming=incoming)
    actions = plan_cleanup(inp)
    hard = free < floor
    by_name = {w.name: w for w in wss}
    if free >= goal:
        assert actions == []
    simulated = free
    for i, a in enumerate(actions):
        w = by_name[a.workspace]
        assert protection(w, inp, hard=hard) is None, (a, w)
        assert not w.running and not w.reserved and w.catalogued and w.path not in incoming
        if not hard:
            assert NOW - w.last_used_ms >= RECENT_MS
        assert simulated < goal, "an action was planned after the goal was met"
        if isinstance(a, Repair):
            assert i == len(actions) - 1
        simulated += a.bytes
    evicted = [a.workspace for a in actions if isinstance(a, EvictWorkspace)]
    assert len(evicted) == len(set(evicted))
