"""CPU placement: which logical CPUs each job's vCPU claim is pinned to.

A deterministic, pure state object: no clock, no I/O, no trio. The runner's CPU
actor owns one :class:`CpuPlacement` and calls it from a single task.

Placement order for a claim of ``n`` (``k = min(n, usable CPUs)`` CPUs are chosen):

1. Free CPUs before any overlap. Among free CPUs:
   a. whole free cores (sibling pairs), lowest first, while they fit: an even
      claim is all whole pairs while enough exist;
   b. then *lone* free threads, lowest first (a free thread whose sibling is
      claimed or not usable): the odd thread of an odd claim fills an already
      split pair, and a fragmented even claim uses these before overlapping;
   c. then threads of the next whole free core (a pair is broken only when needed).
2. When no free CPUs are left, the same order is applied to the least-claimed CPUs
   (claim level 1, then 2, ...): at a level, a "whole" core is one whose usable
   threads all carry that many claims, so overlap keeps siblings together and then
   prefers the lowest CPU.

``avoid`` (the Windows slot's CPUs while the slot is active) is removed from the
usable CPUs, unless that leaves none: then placement fails open and uses them.

Incremental state: per-CPU claim counts, and per claim level the set of whole
cores and the set of lone threads at that level. A claim change touches only the
cores of the CPUs involved, so a placement costs O(candidates at the levels it
visits), not a rebuild of the host.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .topology import Topology, format_cpu_list

__all__ = [
    "CpuPlacement",
    "Placement",
    "PlacementStats",
    "RateLimitedWarning",
]


@dataclass(frozen=True)
class Placement:
    """CPUs chosen for one job, sorted; ``failed_open`` when the avoided (Windows)
    CPUs were used because avoiding them left no allowed CPU."""

    cpus: tuple[int, ...]
    failed_open: bool = False


@dataclass(frozen=True)
class PlacementStats:
    allowed: int  # allocatable CPUs
    free: int  # allowed CPUs with no claim
    claimed: int  # allowed CPUs with at least one claim
    jobs: int  # registered jobs
    total_claims: int  # sum over allowed CPUs of the jobs pinned to them
    max_claims: int  # most jobs sharing one CPU


class _Level:
    """Index of the allowed CPUs carrying exactly one claim count."""

    __slots__ = ("whole", "lone")

    def __init__(self) -> None:
        self.whole: set[int] = set()  # core indices: >= 2 threads, all at this level
        self.lone: set[int] = set()  # cpus at this level whose core is not whole here


class CpuPlacement:
    """Per-CPU claim counts and job CPU sets over the allocatable CPUs."""

    def __init__(self, topology: Topology, allowed: Sequence[int]) -> None:
        allowed_t = tuple(sorted(set(allowed)))
        if not allowed_t:
            raise ValueError("CpuPlacement needs at least one allowed CPU")
        not_online = [cpu for cpu in allowed_t if not topology.is_online(cpu)]
        if not_online:
            raise ValueError(f"allowed CPUs {format_cpu_list(not_online)} are not online")
        self.topology = topology
        self.allowed: tuple[int, ...] = allowed_t
        self._allowed_set = frozenset(allowed_t)
        # Cores restricted to allowed CPUs; a sibling outside `allowed` does not exist here.
        cores: list[tuple[int, ...]] = []
        for core in topology.cores:
            kept = tuple(cpu for cpu in core if cpu in self._allowed_set)
            if kept:
                cores.append(kept)
        self._cores: tuple[tuple[int, ...], ...] = tuple(cores)  # ordered by lowest cpu
        self._core_of: dict[int, int] = {cpu: ci for ci, core in enumerate(cores) for cpu in core}
        self._claims: dict[int, int] = dict.fromkeys(allowed_t, 0)
        self._levels: dict[int, _Level] = {}
        self._jobs: dict[str, tuple[int, ...]] = {}
        # (avoid set, avoided allowed CPUs, touched core indices, their usable threads)
        self._avoid_cache: (
            tuple[frozenset[int], frozenset[int], frozenset[int], tuple[tuple[int, tuple[int, ...]], ...]]
            | None
        ) = None
        for ci in range(len(cores)):
            self._index_core(ci)

    # ------------------------------------------------------------------ index upkeep

    def _level(self, n: int) -> _Level:
        lvl = self._levels.get(n)
        if lvl is None:
            lvl = self._levels[n] = _Level()
        return lvl

    def _index_core(self, ci: int) -> None:
        core = self._cores[ci]
        claims = self._claims
        first = claims[core[0]]
        if len(core) >= 2 and all(claims[cpu] == first for cpu in core):
            self._level(first).whole.add(ci)
        else:
            for cpu in core:
                self._level(claims[cpu]).lone.add(cpu)

    def _unindex_core(self, ci: int) -> None:
        levels = self._levels
        for cpu in self._cores[ci]:
            n = self._claims[cpu]
            lvl = levels.get(n)
            if lvl is None:
                continue
            lvl.whole.discard(ci)
            lvl.lone.discard(cpu)
            if not lvl.whole and not lvl.lone:
                del levels[n]

    def _adjust(self, cpus: Iterable[int], delta: int) -> None:
        by_core: dict[int, list[int]] = {}
        for cpu in cpus:
            by_core.setdefault(self._core_of[cpu], []).append(cpu)
        claims = self._claims
        for ci, members in by_core.items():
            self._unindex_core(ci)
            for cpu in members:
                claims[cpu] += delta
            self._index_core(ci)

    # ------------------------------------------------------------------ placement

    def _avoidance(self, avoid: frozenset[int]) -> tuple[frozenset[int], frozenset[int]]:
        """(avoided allowed CPUs, indices of cores touched by them), cached per avoid set."""
        cache = self._avoid_cache
        if cache is not None and cache[0] == avoid:
            return cache[1], cache[2]
        hit = avoid & self._allowed_set
        touched = frozenset(self._core_of[cpu] for cpu in hit)
        usable = tuple(
            (ci, tuple(cpu for cpu in self._cores[ci] if cpu not in hit)) for ci in sorted(touched)
        )
        self._avoid_cache = (avoid, hit, touched, usable)
        return hit, touched

    def _candidates(
        self, n: int, lvl: _Level, avoided: frozenset[int], touched: frozenset[int]
    ) -> tuple[list[tuple[int, ...]], list[int]]:
        """Whole cores (as usable thread tuples, lowest first) and lone threads at level n."""
        cores = self._cores
        if not touched:
            whole = [cores[ci] for ci in sorted(lvl.whole)]
            lone = sorted(lvl.lone)
            return whole, lone
        # Cores touched by the avoided CPUs are re-judged on their usable threads only.
        core_of = self._core_of
        whole_idx = [ci for ci in lvl.whole if ci not in touched]
        lone = [cpu for cpu in lvl.lone if core_of[cpu] not in touched]
        claims = self._claims
        extra_whole: list[tuple[int, tuple[int, ...]]] = []
        assert self._avoid_cache is not None and self._avoid_cache[2] is touched
        for ci, usable in self._avoid_cache[3]:
            at = [cpu for cpu in usable if claims[cpu] == n]
            if len(usable) >= 2 and len(at) == len(usable):
                extra_whole.append((ci, usable))
            else:
                lone.extend(at)
        merged = [(ci, cores[ci]) for ci in whole_idx] + extra_whole
        merged.sort()
        lone.sort()
        return [threads for _, threads in merged], lone

    def _choose(self, want: int, avoided: frozenset[int], touched: frozenset[int]) -> list[int]:
        chosen: list[int] = []
        r = want
        for n in sorted(self._levels):  # level 0 = free CPUs, then least claimed first
            if r == 0:
                break
            whole, lone = self._candidates(n, self._levels[n], avoided, touched)
            # a. whole cores while they fit (an even claim is all whole pairs)
            wi = 0
            while wi < len(whole) and len(whole[wi]) <= r:
                chosen.extend(whole[wi])
                r -= len(whole[wi])
                wi += 1
            # b. lone threads: an odd remainder fills an already split pair, a
            #    fragmented even claim uses these before any overlap
            li = 0
            while r and li < len(lone):
                chosen.append(lone[li])
                li += 1
                r -= 1
            # c. break the next whole cores only when needed
            while r and wi < len(whole):
                take = whole[wi][:r]
                chosen.extend(take)
                r -= len(take)
                wi += 1
        return chosen

    def place(self, job_id: str, claim: int, avoid: frozenset[int] = frozenset()) -> Placement:
        """Choose ``min(claim, usable CPUs)`` CPUs for ``job_id`` and register them.

        ``avoid`` CPUs are never used unless avoiding them would leave no allowed
        CPU; then they are used and the result has ``failed_open=True``. Raises
        ValueError if ``job_id`` already holds CPUs or ``claim`` is below 1.
        """
        if job_id in self._jobs:
            raise ValueError(f"job {job_id!r} already has CPUs {format_cpu_list(self._jobs[job_id])}")
        if claim < 1:
            raise ValueError(f"claim must be at least 1, got {claim}")
        if not isinstance(avoid, frozenset):
            avoid = frozenset(avoid)
        failed_open = False
        avoided: frozenset[int] = frozenset()
        touched: frozenset[int] = frozenset()
        if avoid:
            avoided, touched = self._avoidance(avoid)
            if len(avoided) == len(self.allowed):
                failed_open = True
                avoided = touched = frozenset()
        usable = len(self.allowed) - len(avoided)
        chosen = self._choose(min(claim, usable), avoided, touched)
        cpus = tuple(sorted(chosen))
        self._adjust(cpus, +1)
        self._jobs[job_id] = cpus
        return Placement(cpus=cpus, failed_open=failed_open)

    def register(self, job_id: str, cpus: Iterable[int]) -> tuple[int, ...]:
        """Re-register a recorded live CPU set (after a runner restart).

        Counts exactly as if it had been placed. CPUs that are not allowed here
        (the host or ``--linux-cpus`` changed) are kept in the job's record but
        carry no claim, since placement never uses them. Returns the sorted set.
        Raises ValueError if ``job_id`` already holds CPUs.
        """
        if job_id in self._jobs:
            raise ValueError(f"job {job_id!r} already has CPUs {format_cpu_list(self._jobs[job_id])}")
        recorded = tuple(sorted(set(cpus)))
        self._adjust((cpu for cpu in recorded if cpu in self._allowed_set), +1)
        self._jobs[job_id] = recorded
        return recorded

    def release(self, job_id: str) -> tuple[int, ...]:
        """Drop a job's claim; returns its CPUs, or () when the job is unknown (idempotent)."""
        cpus = self._jobs.pop(job_id, None)
        if cpus is None:
            return ()
        self._adjust((cpu for cpu in cpus if cpu in self._allowed_set), -1)
        return cpus

    # ------------------------------------------------------------------ queries

    def cpus_of(self, job_id: str) -> tuple[int, ...] | None:
        return self._jobs.get(job_id)

    def claims(self, cpu: int) -> int:
        """How many registered jobs are pinned to ``cpu`` (0 for a CPU not allowed)."""
        return self._claims.get(cpu, 0)

    def free_cpus(self) -> tuple[int, ...]:
        """Allowed CPUs with no claim, sorted."""
        lvl = self._levels.get(0)
        if lvl is None:
            return ()
        free = list(lvl.lone)
        for ci in lvl.whole:
            free.extend(self._cores[ci])
        return tuple(sorted(free))

    def snapshot(self) -> dict[str, tuple[int, ...]]:
        """job_id -> its CPUs (a copy)."""
        return dict(self._jobs)

    def statistics(self) -> PlacementStats:
        values = self._claims.values()
        free = sum(1 for v in values if v == 0)
        return PlacementStats(
            allowed=len(self.allowed),
            free=free,
            claimed=len(self.allowed) - free,
            jobs=len(self._jobs),
            total_claims=sum(values),
            max_claims=max(values),
        )

    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs


class RateLimitedWarning:
    """Decides when to emit a repeated warning (the fail-open warning): at most once
    per ``interval`` seconds. Pure; the caller passes a monotonic ``now``.

    After :meth:`should_warn` returns True, :attr:`suppressed` is the number of
    occurrences swallowed since the previous emitted warning.
    """

    def __init__(self, interval: float = 60.0) -> None:
        if interval < 0:
            raise ValueError("interval must not be negative")
        self.interval = interval
        self._last: float | None = None
        self._pending = 0
        self.suppressed = 0

    def should_warn(self, now: float) -> bool:
        if self._last is None or now - self._last >= self.interval:
            self._last = now
            self.suppressed = self._pending
            self._pending = 0
            return True
        self._pending += 1
        return False
