"""CPU topology and placement (pure). The sysfs reader lives in motor.cpu.host, the trio
actor in motor.cpu.actor."""

from .core import CpuPlacement, Placement, PlacementStats, RateLimitedWarning
from .host import read_topology
from .topology import (
    Topology,
    TopologyError,
    allocatable,
    claim_limit,
    format_cpu_list,
    kept_back,
    parse_cpu_list,
    topology_from_texts,
    validate_linux_cpus,
)

__all__ = [
    "CpuPlacement",
    "Placement",
    "PlacementStats",
    "RateLimitedWarning",
    "Topology",
    "TopologyError",
    "allocatable",
    "claim_limit",
    "format_cpu_list",
    "kept_back",
    "parse_cpu_list",
    "read_topology",
    "topology_from_texts",
    "validate_linux_cpus",
]
