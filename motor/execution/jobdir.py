"""The job execution actor's blocking file work: the job directory and the workspace.

Every function here blocks (file system, a bundle's unpacking) and is called by
execution/actor.py through its injected offloader (`JobDeps.offload`: a worker thread in
production, inline in actor-level tests), never on the event loop. The rules stay in
execution/core.py; the on-disk format, shared with the keeper, in execution/joblog.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..disk.bundles import unpack_into
from ..records import Output
from . import joblog
from .core import OutputDecoder

__all__ = ["claimed", "look", "prepare", "read_output", "read_status", "write_spec"]


def look(job_dir: Path) -> tuple[dict[str, Any] | None, bool, bool]:
    """What is in the job directory, for `core.found`: keeper.json's contents (None when
    absent; JobDirError when corrupt), whether status.json and the directory exist."""
    keeper = joblog.read_keeper(job_dir)
    return keeper, (job_dir / joblog.STATUS_FILE).exists(), job_dir.exists()


def claimed(job_dir: Path) -> bool:
    """A keeper's claim (keeper.json) is in the job directory."""
    return (job_dir / joblog.KEEPER_FILE).exists()


def prepare(cwd: Path, job_dir: Path, bundle: str | None, root: str | None, job_id: str) -> None:
    """Make the workspace (its source unpacked from `bundle`, if any: BundleError when the
    bundle cannot be unpacked) and the job directory."""
    cwd.mkdir(parents=True, exist_ok=True)
    if bundle is not None:
        unpack_into(Path(bundle), str(cwd), root, job_id)
    job_dir.mkdir(parents=True, exist_ok=True)


def write_spec(job_dir: Path, spec: dict[str, Any]) -> None:
    """The keeper's spec.json, atomically (mode 0600: it holds the environment)."""
    joblog.write_json_atomic(job_dir / joblog.SPEC_FILE, spec)


def read_output(job_dir: Path, offset: int, max_bytes: int,
                decoder: OutputDecoder) -> tuple[list[Output], int]:
    """One batch of output.log from `offset` as output events, and the offset after it
    (JobDirError or OSError when the log cannot be read). The raw bytes live only here:
    the caller holds one batch of events, never the log."""
    records, new_offset = joblog.read_records(job_dir / joblog.OUTPUT_FILE, offset, max_bytes)
    return decoder.events(records), new_offset


def read_status(job_dir: Path) -> dict[str, Any] | None:
    """The keeper's status.json (None when absent; JobDirError when corrupt)."""
    return joblog.read_status(job_dir)
