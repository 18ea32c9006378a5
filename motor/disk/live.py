"""Which workspaces live jobs hold: an index maintained from job-record changes.

The disk actor needs, on every check, the workspace names that jobs in setup or running use
(`running`), those that queued or bundle-waiting jobs reserve (`reserved`), the bundles live
jobs still need, the jobs setting up and whether a cache fill is active. Recomputing that from
every live record on each job end (decode each record, resolve each path) made the disk actor
the bottleneck of a 10,000-job drain. `LiveIndex` keeps it instead: `apply(record)` is called
with every committed record (the store's `ChangeHub.saved`), removes the job's previous hold
and adds its new one (nothing when the record is terminal). Names are reference-counted, so a
workspace stays held while any job holds it. Work per change: the names of that one job.

The index is built once from the live records (`load`, e.g. `Database.live`) on first use;
changes applied before that are already in what `load` reads (the store commits before it
tells the index), so they are skipped. `from_records` is the straightforward reference: the
same index computed from a list of live records in one pass.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from ..lifecycle import ACTIVE_STATES, SETUP
from ..records import TERMINAL_STATES

INFLIGHT_S = 60.0  # an admission protects its workspaces until recorded, at most this long
MAX_CHANGES = 100_000


@dataclass(frozen=True)
class Hold:
    names: tuple[str, ...]  # workspace and siblings, as the record names them
    running: bool  # setup or running (else: queued, awaiting bundles: reserved)
    in_setup: bool
    filling: bool  # a cache_fill job in setup or running
    bundle: str | None


def hold_of(record: Any) -> Hold | None:
    """What a record holds; None for a terminal record."""
    if record.state in TERMINAL_STATES:
        return None
    return hold_of_live(record)


class LiveIndex:
    def __init__(self, load: Callable[[], Iterable[Any]] | None = None):
        self._load = load
        self.loaded = load is None
        self.jobs: dict[str, Hold] = {}
        self.running: Counter[str] = Counter()
        self.reserved: Counter[str] = Counter()
        self.bundles: Counter[str] = Counter()
        self.in_setup: set[str] = set()
        self.filling = 0
        #: Bumped on every change of `running`/`reserved` names (derived views cache on it).
        self.version = 0
        #: Names that became held or free since the consumer last looked, in order:
        #: (which, name, held) with which "running" | "reserved". None once more than
        #: MAX_CHANGES piled up (the consumer then recomputes from the counters).
        self.changes: list[tuple[str, str, bool]] | None = []

    @classmethod
    def from_records(cls, records: Iterable[Any]) -> "LiveIndex":
        """The reference: every given record taken as live (a `live_jobs()` answer)."""
        index = cls()
        for r in records:
            index._add(r.job_id, hold_of_live(r))
        return index

    def ensure_loaded(self) -> None:
        if self.loaded:
            return
        records = list(self._load())
        self.loaded = True
        for r in records:
            self.apply(r)

    def apply(self, record: Any) -> None:
        """A committed record: replace its job's hold."""
        if not self.loaded:
            return  # `load` will read it
        job_id = record.job_id
        new = hold_of(record)
        old = self.jobs.get(job_id)
        if old == new:
            return
        if old is not None:
            self._remove(job_id, old)
        if new is not None:
            self._add(job_id, new)

    def forget(self, job_id: str) -> None:
        old = self.jobs.get(job_id)
        if old is not None:
            self._remove(job_id, old)

    def __contains__(self, job_id: str) -> bool:
        return job_id in self.jobs

    # -- counting ----------------------------------------------------------------------

    def _add(self, job_id: str, hold: Hold) -> None:
        self.jobs[job_id] = hold
        which = "running" if hold.running else "reserved"
        names = self.running if hold.running else self.reserved
        for n in hold.names:
            if names[n] == 0:
                self.version += 1
                self._changed(which, n, True)
            names[n] += 1
        if hold.in_setup:
            self.in_setup.add(job_id)
        if hold.filling:
            self.filling += 1
        if hold.bundle:
            self.bundles[hold.bundle] += 1

    def _remove(self, job_id: str, hold: Hold) -> None:
        del self.jobs[job_id]
        which = "running" if hold.running else "reserved"
        names = self.running if hold.running else self.reserved
        for n in hold.names:
            left = names[n] - 1
            if left <= 0:
                del names[n]
                self.version += 1
                self._changed(which, n, False)
            else:
                names[n] = left
        if hold.in_setup:
            self.in_setup.discard(job_id)
        if hold.filling:
            self.filling -= 1
        if hold.bundle:
            left = self.bundles[hold.bundle] - 1
            if left <= 0:
                del self.bundles[hold.bundle]
            else:
                self.bundles[hold.bundle] = left

    def _changed(self, which: str, name: str, held: bool) -> None:
        if self.changes is not None:
            self.changes.append((which, name, held))
            if len(self.changes) > MAX_CHANGES:
                self.changes = None

    def take_changes(self) -> list[tuple[str, str, bool]] | None:
        """The changes since the last call (None: too many, recompute), and start afresh."""
        changes, self.changes = self.changes, []
        return changes

    def view(self) -> tuple[frozenset[str], frozenset[str], frozenset[str], frozenset[str], bool]:
        """(running names, reserved names, bundles, jobs setting up, filling): plain sets,
        for comparisons."""
        return (frozenset(self.running), frozenset(self.reserved), frozenset(self.bundles),
                frozenset(self.in_setup), self.filling > 0)


def hold_of_live(record: Any) -> Hold:
    """What a record known to be live holds (its state is not checked for terminal)."""
    names = tuple(n for n in (record.workspace, *(record.siblings or ())) if n)
    running = record.state in ACTIVE_STATES  # held from setup to the end
    return Hold(names=names, running=running, in_setup=record.state == SETUP,
                filling=running and getattr(record, "kind", "job") == "cache_fill",
                bundle=getattr(record, "bundle_sha256", None) or None)


# --- the disk actor's view of what is held (moved from disk/actor.py) ---------------------


class Held:
    """Membership in held names or their canonical paths (containers kept by the index and
    the actor, not copied), plus extra keys (admissions in flight, reservations)."""

    __slots__ = ("names", "paths", "extra")

    def __init__(self, names=frozenset(), paths=frozenset(), extra: frozenset = frozenset()):
        self.names, self.paths, self.extra = names, paths, extra

    def __contains__(self, key: str) -> bool:
        return key in self.names or key in self.paths or key in self.extra

    def __or__(self, keys) -> "Held":
        return Held(self.names, self.paths, self.extra | frozenset(keys))

    def __iter__(self):
        return iter({*self.names, *self.paths, *self.extra})


@dataclass
class Live:
    running: Held = field(default_factory=Held)
    reserved: Held = field(default_factory=Held)
    bundles: set[str] = field(default_factory=set)
    in_setup: set[str] = field(default_factory=set)  # job ids
    filling: bool = False  # a cache_fill job is setting up or running


def live_view(index: LiveIndex, running_paths, reserved_paths,
              extra: Iterable[frozenset[str]] = ()) -> Live:
    """What is held now, from the index (names) and their canonical paths, plus extra
    reserved keys (admissions in flight, reservations): a pure function of its inputs."""
    live = Live(running=Held(index.running, running_paths),
                reserved=Held(index.reserved, reserved_paths),  # `|=` below makes a new view
                bundles=set(index.bundles), in_setup=set(index.in_setup),
                filling=index.filling > 0)
    for touched in extra:
        live.reserved |= touched
    return live


class HeldPaths:
    """The canonical paths of the names an index holds, kept from its changes:
    {which: {name: path}} and {which: Counter(path)}; recomputed when `key` (the catalog's
    generation and the actor's canon epoch) changes."""

    def __init__(self) -> None:
        self.path_of: dict[str, dict[str, str]] = {"running": {}, "reserved": {}}
        self.count: dict[str, Counter] = {"running": Counter(), "reserved": Counter()}
        self.key: tuple = ()

    def follow(self, index: LiveIndex, key: tuple, canon: Callable[[str], str],
               added: Iterable[str] = ()) -> None:
        """Bring the held paths up to date with the index: the names that became held or
        free since the last check, and the held names newly catalogued (`added`: their path
        is the catalog's now) (work per change, not per live job); all of them again after
        the catalog changed or dropped an entry, at maintenance, or after a flood of
        changes."""
        changes = index.take_changes()
        if changes is None or key != self.key:
            self.key = key
            for which, names in (("running", index.running), ("reserved", index.reserved)):
                self.path_of[which] = {n: canon(n) for n in names}
                self.count[which] = Counter(self.path_of[which].values())
            return
        for name in added:
            for which in ("running", "reserved"):
                path_of, count = self.path_of[which], self.count[which]
                old = path_of.get(name)
                if old is None:
                    continue
                new = path_of[name] = canon(name)
                if new != old:
                    count[new] += 1
                    count[old] -= 1
                    if count[old] <= 0:
                        del count[old]
        for which, name, held in changes:
            path_of, count = self.path_of[which], self.count[which]
            if held:
                path = path_of[name] = canon(name)
                count[path] += 1
            else:
                path = path_of.pop(name, None)
                if path is None:
                    continue
                left = count[path] - 1
                if left <= 0:
                    del count[path]
                else:
                    count[path] = left


class Holds:
    """Everything that protects workspaces now (moved from disk/actor.py's `_live`): live
    jobs (the index kept from record changes, or without one the reference: `live_jobs()`
    read and indexed on each check), admissions in flight and explicit reservations.

    An admission protects its workspace and siblings from `Admit` until the job is recorded
    (`recorded(job_id)`, or the index has it), until it ends (`release`) or until its
    deadline passes. Bookkeeping only: the caller passes the time and `names` (an object with
    `canon(name)` and `key()`, disk/names.py) that resolves names to canonical paths."""

    def __init__(self, live_index: LiveIndex | None = None,
                 live_jobs: Callable[[], Iterable[Any]] | None = None,
                 recorded: Callable[[str], bool] | None = None):
        self.live_index = live_index
        self.live_jobs = live_jobs or (lambda: ())
        self.recorded = recorded or (lambda job_id: False)
        self.inflight: dict[str, tuple[frozenset[str], float]] = {}
        self.reservations: dict[str, frozenset[str]] = {}
        #: canonical paths of the names the index holds, kept from its changes
        self.held_paths = HeldPaths()

    def admit(self, job_id: str | None, touched: frozenset[str], now: float) -> None:
        """An admission (of a job with an id) protects `touched` until its job is recorded,
        ends or INFLIGHT_S pass."""
        if job_id is not None:
            self.inflight[job_id] = (touched, now + INFLIGHT_S)

    def release(self, job_id: str | None) -> None:
        self.inflight.pop(job_id, None)

    def reserve(self, token: str, keys: frozenset[str]) -> None:
        self.reservations[token] = keys

    def unreserve(self, token: str) -> None:
        self.reservations.pop(token, None)

    def view(self, now: float, names: Any) -> Live:
        for job_id, (_, until) in list(self.inflight.items()):
            if until < now:
                del self.inflight[job_id]
        if self.live_index is not None:
            index = self.live_index
            index.ensure_loaded()
            self.held_paths.follow(index, names.key(), names.canon, names.take_added())
            running, reserved = self.held_paths.count["running"], self.held_paths.count["reserved"]
        else:
            index = LiveIndex.from_records(self.live_jobs())
            running = frozenset(names.canon(n) for n in index.running)
            reserved = frozenset(names.canon(n) for n in index.reserved)
        for job_id in [j for j in self.inflight if j in index or self.recorded(j)]:
            del self.inflight[job_id]
        return live_view(index, running, reserved,
                         [*(t for t, _ in self.inflight.values()), *self.reservations.values()])
