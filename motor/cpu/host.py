"""The CPU subsystem's read of the host: online CPUs and hyperthread siblings from sysfs.

Kept apart from topology.py (pure), as memory/host.py and accounting/host.py are: this
module only reads files and hands their text to :func:`topology_from_texts`.
"""

from __future__ import annotations

import os

from .topology import Topology, TopologyError, parse_cpu_list, topology_from_texts

__all__ = ["read_topology"]


def _read_text(path: str) -> str:
    with open(path, encoding="ascii", errors="strict") as f:
        return f.read()


def read_topology(sysfs_root: str | os.PathLike[str] = "/sys") -> Topology:
    """Read online CPUs and hyperthread siblings from ``<sysfs_root>/devices/system/cpu``.

    Per online CPU: ``cpuN/topology/thread_siblings_list``, else ``core_cpus_list``;
    a CPU with neither (or no topology directory) is its own core. Raises
    TopologyError naming the path on a missing or malformed ``online`` file or a
    malformed or unreadable siblings file.
    """
    base = os.path.join(os.fspath(sysfs_root), "devices", "system", "cpu")
    online_path = os.path.join(base, "online")
    try:
        online_text = _read_text(online_path)
    except (OSError, UnicodeDecodeError) as exc:
        raise TopologyError(f"{online_path}: cannot read: {exc}") from None
    try:
        online = parse_cpu_list(online_text)
    except ValueError as exc:
        raise TopologyError(f"{online_path}: {exc}") from None
    texts: dict[int, str | None] = {}
    paths: dict[int, str] = {}
    for cpu in online:
        topo_dir = os.path.join(base, f"cpu{cpu}", "topology")
        texts[cpu] = None
        for name in ("thread_siblings_list", "core_cpus_list"):
            path = os.path.join(topo_dir, name)
            try:
                texts[cpu] = _read_text(path)
            except FileNotFoundError:
                continue
            except (OSError, UnicodeDecodeError) as exc:
                raise TopologyError(f"{path}: cannot read: {exc}") from None
            paths[cpu] = path
            break
    return topology_from_texts(online_text, texts, online_path=online_path, siblings_paths=paths)
