"""CPU topology and placement (pure). The trio actor lives in motor.cpu.actor."""

from .core import CpuPlacement, Placement, PlacementStats, RateLimitedWarning
from .topology import (
    Topology,
    TopologyError,
    allocatable,
    claim_limit,
    format_cpu_list,
    kept_back,
    parse_cpu_list,
    read_topology,
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
