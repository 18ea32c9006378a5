"""The disk actor's messages (motor/disk/actor.py handles them; `actor` re-exports them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Admit:
    """Reply: a Refusal, or None when there is room (after cleanup)."""

    job_id: str | None = None
    workspace: str | None = None
    siblings: tuple[str, ...] = ()


@dataclass(frozen=True)
class AdmitUpload:
    """Before an upload's body is read. Reply: a Refusal, or None."""

    sha256: str


@dataclass(frozen=True)
class MakeRoom:
    """A file system the disk manager keeps room on is below its floor (`Room.watch`): the
    cleanup now, as at a maintenance pass. Cast by the actor to itself."""


@dataclass(frozen=True)
class BeginUpload:
    """Reply: a bundles.Upload to write chunks into (raises BundleError on a bad name)."""

    sha256: str


@dataclass(frozen=True)
class CommitUpload:
    """Reply: the bundle size; or the BundleError (digest mismatch, nothing kept) or OSError
    to raise: returned, not raised, so a bad upload does not restart the disk actor."""

    upload: Any


@dataclass(frozen=True)
class HasBundle:
    """Reply: True when the verified bundle is stored (its retention clock restarts)."""

    sha256: str


@dataclass(frozen=True)
class PrepareSetup:
    """Before a job's setup: floor check again, catalog its workspace.
    Reply: SetupPlan."""

    job_id: str
    workspace: str
    siblings: tuple[str, ...] = ()
    kind: str = "task"
    bundle_sha256: str | None = None


@dataclass(frozen=True)
class SetupPlan:
    refusal: Any  # Refusal | None
    path: str = ""
    root: str = ""
    bundle: str | None = None


@dataclass(frozen=True)
class JobIdle:
    """A job left its workspace: touch it, measure it, apply the build-folder cap."""

    job_id: str
    workspace: str
    siblings: tuple[str, ...] = ()


@dataclass(frozen=True)
class GuardDue:
    """The disk actor's own: the build-folder guard of the workspaces jobs left since the
    last one (`JobIdle` casts, `GUARD_DELAY_S` after the first)."""


@dataclass(frozen=True)
class Walked:
    """The disk actor's own: a walk off its turn (walking.py) of `looked` (catalog entries)
    is done, `found` its survey (host.py `survey`): decide on it. `kind`: "guard",
    "maintenance" or "listing"; `answers`: the deferred replies of the calls it serves;
    `trash_left`: a maintenance pass's trash entries that stay; `scans`: its daily sweeps'
    unit scans (host.py `stale_scans`), by workspace name."""

    kind: str
    looked: list
    found: tuple
    answers: list = field(default_factory=list)
    trash_left: int = 0
    scans: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Register:
    """Catalog a workspace (caller-root trees and snapshots). Reply: the entry."""

    name: str
    path: str
    kind: str = "task"
    caller_path: str | None = None
    referenced_by: tuple[str, ...] = ()


@dataclass(frozen=True)
class Reserve:
    """Protect workspaces (by name or path) under `token` until `Unreserve(token)`."""

    token: str
    names: tuple[str, ...]


@dataclass(frozen=True)
class Unreserve:
    token: str


@dataclass(frozen=True)
class Periodic:
    """Maintenance: trash, idle expiry, daily sweep, guard, bundle retention, cleanup.
    Reply: a summary dict."""


@dataclass(frozen=True)
class Sample:
    """Reply: the current DiskSample of the state filesystem."""


@dataclass(frozen=True)
class Listing:
    """Reply: the catalog as rows for `motor workspaces`."""
