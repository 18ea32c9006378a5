"""Build fake ``/sys/devices/system/cpu`` trees for topology tests."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path


def smt_siblings(threads: int, smt: int = 2) -> dict[int, str]:
    """Linux-style numbering: with 32 threads and SMT 2, cpu N and N+16 are siblings."""
    cores = threads // smt
    out: dict[int, str] = {}
    for c in range(cores):
        group = [c + k * cores for k in range(smt)]
        text = ",".join(str(cpu) for cpu in group)
        for cpu in group:
            out[cpu] = text
    return out


def write_fake_sysfs(
    root: Path,
    online: str = "0-31",
    siblings: Mapping[int, str] | None = None,
    *,
    present: Iterable[int] | None = None,
    use_core_cpus_list: bool = False,
    without_topology: Iterable[int] = (),
    write_online: bool = True,
) -> Path:
    """Write ``<root>/devices/system/cpu/{online,cpuN/topology/...}``; returns ``root``.

    ``siblings`` maps cpu -> raw file text (default: two-way SMT over ``present``,
    which defaults to 0..31). Offline CPUs still get directories, as on Linux.
    ``use_core_cpus_list`` writes ``core_cpus_list`` instead of
    ``thread_siblings_list``; CPUs in ``without_topology`` get no topology dir.
    """
    present_l = sorted(present) if present is not None else list(range(32))
    if siblings is None:
        siblings = smt_siblings(len(present_l))
    base = root / "devices" / "system" / "cpu"
    base.mkdir(parents=True, exist_ok=True)
    if write_online:
        (base / "online").write_text(online + "\n")
    skip = set(without_topology)
    for cpu in present_l:
        cpu_dir = base / f"cpu{cpu}"
        cpu_dir.mkdir(exist_ok=True)
        if cpu in skip or cpu not in siblings:
            continue
        topo = cpu_dir / "topology"
        topo.mkdir(exist_ok=True)
        name = "core_cpus_list" if use_core_cpus_list else "thread_siblings_list"
        (topo / name).write_text(siblings[cpu] + "\n")
    return root
