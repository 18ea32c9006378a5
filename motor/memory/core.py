"""Pure rules for job memory: the unit limit, and admission against the 16 GiB floor.

scheduling.md, "Memory and the jobs slice":
- A job's memory limit is its claim's memory_max clamped to the jobs slice's limit (the
  cgroup backend's parent group plays motor-jobs.slice), never above it.
- Only hosts whose operator declared `jobs_min_bytes` in the capacity file promise the
  16 GiB per-job floor. On such a host, if the declared minimum or the live slice limit
  is below the floor, jobs are refused before start with `workspace_setup_failed` and a
  detail naming the repair: a host setup fault, not a full runner.
- Without a declaration, jobs are admitted with limits clamped to the slice, even when
  that is below 16 GiB.
- Both figures are read at start-up and at each maintenance pass, not on each admission:
  the dispatcher holds the latest `MemoryCeiling` and decides with it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..records import Refusal

GiB = 1024**3
FLOOR_BYTES = 16 * GiB
REPAIR = ("raise jobs_min_bytes in the capacity file and the jobs group's memory limit "
          "(provision the jobs slice again)")


@dataclass(frozen=True)
class MemoryCeiling:
    """What the last read of the host said.

    declared_min_bytes: the capacity file's `jobs_min_bytes`, None when undeclared.
    slice_max_bytes: the live limit of the jobs parent group, None when unlimited/unknown.
    """

    declared_min_bytes: int | None = None
    slice_max_bytes: int | None = None
    capacity_file: str = ""


class CapacityFileError(ValueError):
    """The capacity file exists but cannot be used (unreadable or malformed)."""


def parse_capacity_file(text: str, path: str = "capacity.json") -> int | None:
    """`jobs_min_bytes` from the capacity file's JSON text (None when not declared)."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise CapacityFileError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CapacityFileError(f"{path}: expected a JSON object")
    value = data.get("jobs_min_bytes")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CapacityFileError(f"{path}: jobs_min_bytes must be a non-negative integer, got {value!r}")
    return value


def unit_limit(memory_max_bytes: int, ceiling: MemoryCeiling) -> int:
    """The job's memory limit: its memory_max clamped to the slice, never above it."""
    if ceiling.slice_max_bytes is None:
        return memory_max_bytes
    return min(memory_max_bytes, ceiling.slice_max_bytes)


def admission(ceiling: MemoryCeiling) -> Refusal | None:
    """`workspace_setup_failed` when a declared host falls short of the floor, else None."""
    if ceiling.declared_min_bytes is None:
        return None
    shortfalls = []
    if ceiling.declared_min_bytes < FLOOR_BYTES:
        shortfalls.append(f"declared jobs_min_bytes {ceiling.declared_min_bytes}")
    if ceiling.slice_max_bytes is not None and ceiling.slice_max_bytes < FLOOR_BYTES:
        shortfalls.append(f"the jobs group's memory limit {ceiling.slice_max_bytes}")
    if not shortfalls:
        return None
    where = f" ({ceiling.capacity_file})" if ceiling.capacity_file else ""
    return Refusal(
        code="workspace_setup_failed",
        detail=(f"{' and '.join(shortfalls)} below the {FLOOR_BYTES} byte (16 GiB) per-job floor "
                f"this host declares{where}; repair: {REPAIR}"),
    )
