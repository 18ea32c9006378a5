"""The dispatcher's inbox: what the api, the job actors and maintenance send it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..memory.core import MemoryCeiling
from ..records import JobRequest


from ..wire import DISK_ADMIT_TIMEOUT_S, SUBMIT_TIMEOUT_S  # noqa: F401 (the admission timeouts)


@dataclass(frozen=True)
class Submit:
    """Reply: the accepted JobRecord, or a Refusal. Answered once the disk has admitted the
    job (a cleanup may run first): call it with `timeout=SUBMIT_TIMEOUT_S`."""

    request: JobRequest
    follow: bool = False


@dataclass(frozen=True)
class SetupDone:
    job_id: str


@dataclass(frozen=True)
class StartFailed:
    job_id: str
    detail: str
    cleanup_pending: bool = False


@dataclass(frozen=True)
class Finished:
    """Reply: whether `ride` was saved. `ride`: the job's terminal save (a store `Save`),
    which the first save the dispatcher makes while handling this message takes along (the
    next job's start, mostly: one transaction for both); None when no save was made, or
    it failed: the job actor saves it then."""

    job_id: str
    ride: Any = None


@dataclass(frozen=True)
class CancelJob:
    """Reply: "cancelled" (was queued), "signalled" (setting up or running: its job actor
    ends it), "unknown" (not live here: never seen, or already ended)."""

    job_id: str


@dataclass(frozen=True)
class Withdraw:
    """Reply: "withdrawn" | "started" | "unknown", or an already_ended Refusal."""

    job_id: str


@dataclass(frozen=True)
class QueuedViews:
    """Reply: {job_id: (waiting_on, waiting_on_job, queue_wait_ms, waiting_detail)}, the live
    wait fields of those of `job_ids` still queued (a record or a listing's queued records,
    in one call; the caller puts them in its records, off the dispatcher)."""

    job_ids: tuple[str, ...]


@dataclass(frozen=True)
class StatusView:
    """Reply: {"queued": [status rows (scheduling/view.py ROW_FIELDS), live queue_wait_ms/
    waiting_on], "active": [job ids setting up or running], "capacity": {max_weight,
    claim_limit, held_permits, setup_permits, max_queue_depth, pending_jobs}}. `full`: whole
    public records instead of rows. `encoded`: "queued" is a list of each one's JSON bytes
    (what GET /v1/status splices; scheduling/view.py)."""

    encoded: bool = False
    full: bool = False


@dataclass(frozen=True)
class CapacityView:
    """Reply: the "capacity" part of the status view alone (what /v1/health reports):
    O(1), no per-job work."""


@dataclass(frozen=True)
class Tick:
    """Internal: a retry delay, grace or budget deadline has passed."""


@dataclass(frozen=True)
class Unfollowed:
    """The client following a queued job went away: the runner enforces its budget now."""

    job_id: str


@dataclass(frozen=True)
class Heartbeat:
    """Reply: a `queued` event with the live queue_wait_ms, waiting_on and budget, or None."""

    job_id: str


@dataclass(frozen=True)
class CeilingChanged:
    """Maintenance read a different memory ceiling (capacity file or jobs group limit)."""

    ceiling: "MemoryCeiling"


@dataclass(frozen=True)
class BundleArrived:
    """A source bundle was uploaded, verified and pinned: jobs awaiting it join their queues."""

    sha256: str
