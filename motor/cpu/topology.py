"""Host CPU topology: online CPUs, hyperthread sibling groups, the kept-back core,
the allocatable CPU set and the vCPU claim limit.

Everything here is pure: the sysfs reader, :func:`motor.cpu.host.read_topology`, hands
the file contents to :func:`topology_from_texts`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

__all__ = [
    "MAX_CPU",
    "Topology",
    "TopologyError",
    "allocatable",
    "claim_limit",
    "format_cpu_list",
    "kept_back",
    "parse_cpu_list",
    "topology_from_texts",
    "validate_linux_cpus",
]

#: Highest CPU number accepted in a CPU list (the kernel's NR_CPUS is at most 8192);
#: guards against "0-999999999" building a huge tuple.
MAX_CPU = 65535

#: A host needs at least this many physical cores before one is kept back.
KEEP_BACK_MIN_CORES = 4


class TopologyError(ValueError):
    """The sysfs CPU description is missing or malformed."""


# --------------------------------------------------------------------------- lists


def _parse_cpu_number(token: str, text: str) -> int:
    token = token.strip()
    if not token.isdigit() or not token.isascii():
        raise ValueError(f"invalid CPU list {text!r}: {token!r} is not a CPU number")
    n = int(token)
    if n > MAX_CPU:
        raise ValueError(f"invalid CPU list {text!r}: CPU {n} is above {MAX_CPU}")
    return n


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """Parse the kernel CPU list syntax (``"0-3,8,10-11"``) into sorted unique CPUs.

    Surrounding whitespace (a trailing newline from sysfs) is ignored, and so is
    whitespace around items. Raises ValueError on an empty list, an empty item,
    a non-number, a descending range or a CPU above :data:`MAX_CPU`.
    """
    if not isinstance(text, str):
        raise TypeError(f"CPU list must be a str, not {type(text).__name__}")
    stripped = text.strip()
    if not stripped:
        raise ValueError("invalid CPU list: the list is empty")
    cpus: set[int] = set()
    for item in stripped.split(","):
        if not item.strip():
            raise ValueError(f"invalid CPU list {stripped!r}: empty item")
        if "-" in item:
            lo_s, sep, hi_s = item.partition("-")
            if "-" in hi_s:
                raise ValueError(f"invalid CPU list {stripped!r}: bad range {item.strip()!r}")
            lo = _parse_cpu_number(lo_s, stripped)
            hi = _parse_cpu_number(hi_s, stripped)
            if hi < lo:
                raise ValueError(
                    f"invalid CPU list {stripped!r}: range {item.strip()!r} runs backwards"
                )
            cpus.update(range(lo, hi + 1))
        else:
            cpus.add(_parse_cpu_number(item, stripped))
    return tuple(sorted(cpus))


def format_cpu_list(cpus: Iterable[int]) -> str:
    """Format CPUs in compact kernel list syntax; the inverse of :func:`parse_cpu_list`.

    Input may be unsorted and hold duplicates; an empty input gives ``""``.
    """
    ordered = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        lo, hi = ordered[i], ordered[j]
        if lo == hi:
            parts.append(str(lo))
        elif hi == lo + 1:
            parts.append(f"{lo},{hi}")
        else:
            parts.append(f"{lo}-{hi}")
        i = j + 1
    return ",".join(parts)


# --------------------------------------------------------------------------- topology


@dataclass(frozen=True)
class Topology:
    """Online logical CPUs grouped into physical cores (hyperthread sibling groups).

    ``online`` is sorted and unique. ``cores`` partitions ``online``: each group is
    sorted and the groups are ordered by their lowest CPU. Construct with
    :meth:`from_groups` (normalises) or directly (validated).
    """

    online: tuple[int, ...]
    cores: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not self.online:
            raise ValueError("a topology needs at least one online CPU")
        if list(self.online) != sorted(set(self.online)):
            raise ValueError("Topology.online must be sorted and unique")
        seen: list[int] = []
        for core in self.cores:
            if not core or list(core) != sorted(set(core)):
                raise ValueError(f"Topology core {core!r} must be non-empty, sorted and unique")
            seen.extend(core)
        if sorted(seen) != list(self.online):
            raise ValueError("Topology.cores must partition the online CPUs exactly")
        lows = [core[0] for core in self.cores]
        if lows != sorted(lows):
            raise ValueError("Topology.cores must be ordered by their lowest CPU")

    @classmethod
    def from_groups(cls, online: Iterable[int], groups: Iterable[Iterable[int]] = ()) -> Topology:
        """Build a topology from online CPUs and any sibling groups.

        Groups are intersected with ``online``; overlapping groups are merged; an
        online CPU in no group is its own core.
        """
        online_t = tuple(sorted(set(online)))
        online_set = set(online_t)
        parent = {cpu: cpu for cpu in online_t}

        def find(x: int) -> int:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for group in groups:
            members = [cpu for cpu in group if cpu in online_set]
            for other in members[1:]:
                a, b = find(members[0]), find(other)
                if a != b:
                    parent[max(a, b)] = min(a, b)
        by_root: dict[int, list[int]] = {}
        for cpu in online_t:
            by_root.setdefault(find(cpu), []).append(cpu)
        cores = tuple(sorted((tuple(sorted(g)) for g in by_root.values()), key=lambda c: c[0]))
        return cls(online=online_t, cores=cores)

    @classmethod
    def synthetic(
        cls, physical_cores: int, threads_per_core: int = 2, offline: Iterable[int] = ()
    ) -> Topology:
        """A Linux-style numbered host: CPU ``c + k * physical_cores`` is thread ``k`` of core ``c``.

        With 16 cores and 2 threads, CPUs N and N+16 are siblings. ``offline`` CPUs are dropped.
        """
        if physical_cores < 1 or threads_per_core < 1:
            raise ValueError("a synthetic topology needs at least one core and one thread per core")
        gone = set(offline)
        groups = [
            [c + k * physical_cores for k in range(threads_per_core)] for c in range(physical_cores)
        ]
        online = [cpu for g in groups for cpu in g if cpu not in gone]
        return cls.from_groups(online, groups)

    @cached_property
    def _core_of(self) -> dict[int, tuple[int, ...]]:
        return {cpu: core for core in self.cores for cpu in core}

    def siblings(self, cpu: int) -> tuple[int, ...]:
        """The online CPUs sharing ``cpu``'s physical core, ``cpu`` included."""
        try:
            return self._core_of[cpu]
        except KeyError:
            raise ValueError(f"CPU {cpu} is not online") from None

    @property
    def physical_cores(self) -> int:
        return len(self.cores)

    def is_online(self, cpu: int) -> bool:
        return cpu in self._core_of


def topology_from_texts(
    online_text: str,
    siblings_texts: Mapping[int, str | None],
    *,
    online_path: str = "online",
    siblings_paths: Mapping[int, str] | None = None,
) -> Topology:
    """Pure parser behind :func:`motor.cpu.host.read_topology`.

    ``siblings_texts`` maps an online CPU to the contents of its siblings file, or
    None when it has none (the CPU is its own core). Paths are only used in errors.
    """
    try:
        online = parse_cpu_list(online_text)
    except ValueError as exc:
        raise TopologyError(f"{online_path}: {exc}") from None
    groups: list[tuple[int, ...]] = []
    for cpu in online:
        text = siblings_texts.get(cpu)
        if text is None:
            continue
        path = (siblings_paths or {}).get(cpu, f"cpu{cpu} siblings")
        try:
            group = parse_cpu_list(text)
        except ValueError as exc:
            raise TopologyError(f"{path}: {exc}") from None
        if cpu not in group:
            raise TopologyError(f"{path}: sibling list {text.strip()!r} does not contain cpu{cpu}")
        groups.append(group)
    return Topology.from_groups(online, groups)


# --------------------------------------------------------------------------- allocation


def kept_back(topology: Topology) -> tuple[int, ...]:
    """CPUs kept for the runner and the system.

    On a host with at least four physical cores, the core holding the lowest online
    CPU (normally cpu0) with all its siblings; smaller hosts keep nothing back.
    """
    if topology.physical_cores < KEEP_BACK_MIN_CORES:
        return ()
    return topology.siblings(topology.online[0])


def validate_linux_cpus(topology: Topology, cpus: Sequence[int], max_weight: int) -> tuple[int, ...]:
    """Check a ``--linux-cpus`` list against the host; return it sorted and unique.

    Raises ValueError with a one-line message for an empty list, a CPU that is not
    online (named), or a ``--max-weight`` below 1.
    """
    listed = tuple(sorted(set(cpus)))
    if not listed:
        raise ValueError("--linux-cpus: the CPU list is empty")
    offline = [cpu for cpu in listed if not topology.is_online(cpu)]
    if offline:
        which = "CPU" if len(offline) == 1 else "CPUs"
        raise ValueError(
            f"--linux-cpus {format_cpu_list(listed)}: {which} {format_cpu_list(offline)} "
            f"not online (online: {format_cpu_list(topology.online)})"
        )
    if max_weight < 1:
        raise ValueError(
            f"--max-weight {max_weight}: must be at least 1 with --linux-cpus "
            "(it is the claim limit of a confined runner)"
        )
    return listed


def allocatable(topology: Topology, linux_cpus: Sequence[int] | None) -> tuple[int, ...]:
    """CPUs jobs may be placed on.

    Without a list: the online CPUs minus :func:`kept_back`. With ``--linux-cpus``:
    exactly the listed CPUs (nothing held back; a sibling outside the list is never
    used). Raises ValueError if the list is empty or names a CPU that is not online.
    """
    if linux_cpus is None:
        held = set(kept_back(topology))
        return tuple(cpu for cpu in topology.online if cpu not in held)
    return validate_linux_cpus(topology, linux_cpus, max_weight=1)


def claim_limit(allocatable_cpus: Sequence[int], max_weight: int, confined: bool) -> int:
    """The largest vCPU claim admitted: the allocatable CPU count, or max_weight when
    Linux jobs are confined to a CPU list."""
    return max_weight if confined else len(allocatable_cpus)
