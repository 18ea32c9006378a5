"""Pure disk-admission rules.

The runner checks free space on the filesystem holding its state before it accepts an
upload, and again before setup (scheduling.md, "Disk admission"). A floor of 0 disables
the check.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..records import Refusal


@dataclass(frozen=True)
class DiskSample:
    free_bytes: int
    total_bytes: int


def admission(sample: DiskSample, floor_bytes: int) -> Refusal | None:
    """`runner_disk_full` with free_bytes and floor_bytes when below the floor, else None."""
    if floor_bytes <= 0 or sample.free_bytes >= floor_bytes:
        return None
    return Refusal(
        code="runner_disk_full",
        detail=(f"free space {sample.free_bytes} bytes is below the floor of {floor_bytes} bytes "
                "on the runner's state filesystem"),
        free_bytes=sample.free_bytes,
        floor_bytes=floor_bytes,
    )
