"""The wire and record types of motor: requests, job records, events, refusals.

Decode at the boundary, typed inside.  Wire structs ignore unknown fields so clients and
runners of different versions can mix; defaults are omitted when encoding.

Field names follow the spec's design/interface.md (kept beside this repository, not in it);
they are the public contract.
"""

from __future__ import annotations

import re
from base64 import b64decode
from typing import Literal, Union

import msgspec

from .wire import BEFORE_START_CODES, CAPABILITIES  # noqa: F401 (one definition, shared with the CLI)

# --- vocabulary -------------------------------------------------------------------------

JobState = Literal[
    "queued", "setup", "running", "succeeded", "failed", "cancelled", "timed_out",
    "refused_before_start", "lost",
]
TERMINAL_STATES: frozenset[str] = frozenset(
    {"succeeded", "failed", "cancelled", "timed_out", "refused_before_start", "lost"}
)
JobKind = Literal["job", "warm_build", "cache_fill"]
WorkspaceKind = Literal["task", "head"]
WaitingOn = Literal["permits", "workspace_owner", "sibling_user", "workspace_setup"]

# Refusal codes and the HTTP status each travels with.
REFUSAL_HTTP_STATUS: dict[str, int] = {
    "runner_full": 503,
    "runner_disk_full": 503,
    "workspace_setup_failed": 422,
    "bad_request": 400,
    "not_found": 404,
    "history_expired": 410,
    "body_too_large": 413,
    "request_timeout": 408,
    "too_many_connections": 503,
    "unauthorized": 401,
    "method_not_allowed": 405,
    "queue_wait_exceeded": 409,
    "already_ended": 409,
    "internal_error": 500,
    "submit_unconfirmed": 503,
    "runner_busy": 503,
    "idempotency_key_reused": 409,
}
#: Codes that mean "refused before start": `motor run` exits 75 on them.
WORKSPACE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MAX_COMMAND_ARGS = 4096
#: the most siblings a job may name: each is resolved, held and rotated like its own
#: workspace, on the disk actor's and dispatcher's loop (5,000 cost 175 ms a submit in stop
#: 59, blocking every other request meanwhile; a 1 MiB body holds 200,000 short names)
MAX_SIBLINGS = 256
#: the longest timeout_s or queue_wait_limit_s (about 31.7 years): a larger value, e.g.
#: 1e308, overflowed the dispatcher's millisecond arithmetic and crashed it (stop 57)
MAX_SECONDS = 10**9
#: the largest memory_max_bytes (a signed 64-bit count, what the store and the kernel's
#: limit files take; more than any host has, so as good as no cap)
MAX_MEMORY_BYTES = 2**63 - 1
#: a submit's idempotency key: 1-128 printable ASCII characters, no space (docs/protocol.md)
IDEMPOTENCY_KEY = re.compile(r"[\x21-\x7e]{1,128}")
#: the fields of a request (and of its job's record) that must match for a submit with an
#: idempotency key already used to be answered with that job (else idempotency_key_reused)
IDEMPOTENT_FIELDS = ("command", "workspace", "workspace_kind", "siblings", "repository", "env",
                     "kind", "bundle_sha256", "timeout_s", "queue_wait_limit_s", "spill_eligible")


def valid_workspace_name(name: str) -> bool:
    """A plain name: no path separators, no `..`, no leading dot or dash."""
    return bool(WORKSPACE_NAME.fullmatch(name)) and ".." not in name


def valid_caller_path(path: str) -> bool:
    """A caller's absolute path (served only through a matching `--caller-root`): normal
    form, no `.`/`..` components, no NUL, at most 1024 characters."""
    if not path.startswith("/") or len(path) > 1024 or "\x00" in path or path == "/":
        return False
    parts = path[1:].split("/")
    return all(p and p not in (".", "..") for p in parts)


def caller_root_for(path: str, caller_roots: dict[str, str]) -> tuple[str, str] | None:
    """(caller prefix, host dir) of the --caller-root that serves `path`, or None."""
    for caller, host in caller_roots.items():
        caller = caller.rstrip("/")
        if path.startswith(caller + "/"):
            return caller, host
    return None


# --- requests ----------------------------------------------------------------------------


class JobRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """`POST /v1/jobs`: what a client asks the runner to run."""

    command: list[str]
    workspace: str = "default"
    weight_hint: int | None = None
    queue_wait_limit_s: float | None = None
    timeout_s: float | None = None
    gate: bool = False
    kind: JobKind = "job"
    workspace_kind: WorkspaceKind = "task"
    siblings: list[str] = []
    repository: str | None = None
    env: dict[str, str] = {}
    memory_max_bytes: int | None = None
    bundle_sha256: str | None = None
    spill_eligible: bool = False
    capabilities: list[str] = []
    #: the client's name for this submit: a submit with a key a retained job was accepted
    #: with is answered with that job, not a second one (docs/protocol.md, "Idempotent submits")
    idempotency_key: str | None = None


class RequestError(ValueError):
    """A request that decoded but breaks a rule; carries the `bad_request` detail."""


#: (encoder, decoder) of `_check_types`, made at its first use (the CLI imports this module)
_ROUND_TRIP: tuple | None = None


def _check_types(req: JobRequest) -> None:
    """Every field of `req` of its declared type. msgspec checks types when it decodes, not
    when a struct is made in Python: a request built by an embedder (`Runner.submit`)
    could carry a `kind` outside its Literal, a `str` for `command`, an object no encoder
    takes, and be stored, to break every later read of its record. So encode it as JSON and
    decode it back as a `JobRequest`: each field is checked as the API's decoder checks the
    body of `POST /v1/jobs` (a float that JSON cannot hold, NaN or infinity, becomes null
    there; `validate_request` refuses it on the request itself)."""
    global _ROUND_TRIP
    if not isinstance(req, JobRequest):
        raise RequestError(f"a job request is a JobRequest, not {type(req).__name__}")
    if _ROUND_TRIP is None:
        _ROUND_TRIP = (msgspec.json.Encoder(), msgspec.json.Decoder(JobRequest))
    encoder, decoder = _ROUND_TRIP
    try:
        decoder.decode(encoder.encode(req))
    except (msgspec.MsgspecError, TypeError, ValueError) as exc:
        raise RequestError(f"malformed request: {exc}") from None


def validate_request(req: JobRequest) -> None:
    """Check the request's field types (`_check_types`), then what msgspec's types cannot;
    raise RequestError naming the field."""
    _check_types(req)
    if not req.command:
        raise RequestError("command must not be empty")
    if len(req.command) > MAX_COMMAND_ARGS:
        raise RequestError(f"command has more than {MAX_COMMAND_ARGS} arguments")
    if not req.command[0]:
        raise RequestError("command[0] must not be empty")
    for arg in req.command:
        if "\x00" in arg:
            raise RequestError("command arguments must not contain NUL bytes")
    if not (valid_workspace_name(req.workspace) or valid_caller_path(req.workspace)):
        raise RequestError(
            f"workspace {req.workspace!r} is not a plain name "
            "(allowed: [A-Za-z0-9][A-Za-z0-9._-]{0,127}, no '..'; or an absolute caller path "
            "served through --caller-root)"
        )
    if len(req.siblings) > MAX_SIBLINGS:
        raise RequestError(f"siblings: {len(req.siblings)} named, at most {MAX_SIBLINGS}")
    for sib in req.siblings:
        if not (valid_workspace_name(sib) or valid_caller_path(sib)):
            raise RequestError(f"sibling {sib!r} is not a plain workspace name")
        if sib == req.workspace:
            raise RequestError(f"sibling {sib!r} is the job's own workspace")
    if req.weight_hint is not None and req.weight_hint < 0:
        raise RequestError("weight_hint must not be negative")
    for field in ("queue_wait_limit_s", "timeout_s"):
        value = getattr(req, field)
        if value is not None and not 0 <= value <= MAX_SECONDS:  # (NaN compares false)
            raise RequestError(f"{field} must be a number of seconds from 0 to {MAX_SECONDS}")
    if req.memory_max_bytes is not None and not 0 < req.memory_max_bytes <= MAX_MEMORY_BYTES:
        raise RequestError(f"memory_max_bytes must be positive and at most {MAX_MEMORY_BYTES}")
    if req.bundle_sha256 is not None and not re.fullmatch(r"[0-9a-f]{64}", req.bundle_sha256):
        raise RequestError("bundle_sha256 must be 64 lowercase hex digits")
    if req.idempotency_key is not None and not IDEMPOTENCY_KEY.fullmatch(req.idempotency_key):
        raise RequestError("idempotency_key must be 1-128 printable ASCII characters, no space")
    for key, value in req.env.items():
        if not key or "=" in key or "\x00" in key:
            raise RequestError(f"env key {key!r} is not a valid variable name")
        if "\x00" in value:
            raise RequestError(f"env value of {key!r} must not contain NUL bytes")


# --- records -----------------------------------------------------------------------------


class ReservationUse(msgspec.Struct, kw_only=True):
    cpu_time_ms: int
    wall_time_ms: int
    average_use_ppm: int


class JobRecord(msgspec.Struct, kw_only=True, omit_defaults=False):
    """The durable record of one job (API and `--json` outputs)."""

    job_id: str
    state: JobState
    workspace: str
    workspace_kind: WorkspaceKind = "task"
    siblings: list[str] = []
    repository: str | None = None
    command: list[str] = []
    kind: JobKind = "job"
    gate: bool = False
    claim: int = 2
    cpus: list[int] | None = None
    memory_max_bytes: int | None = None
    accepted_at_ms: int = 0
    queued_at_ms: int | None = None
    started_at_ms: int | None = None
    ended_at_ms: int | None = None
    queue_wait_ms: int = 0
    waiting_on: WaitingOn | None = None
    waiting_on_job: str | None = None
    #: Why a queued job waits, in words, when waiting_on alone does not say it (a claim
    #: above max_weight).
    waiting_detail: str | None = None
    exit_code: int | None = None
    signal: int | None = None
    reason: str | None = None
    detail: str | None = None
    attempts: int = 0
    timeout_s: float | None = None
    queue_wait_limit_s: float | None = None
    spill_eligible: bool = False
    follow: bool = False
    env: dict[str, str] = {}
    bundle_sha256: str | None = None
    reservation_use: ReservationUse | None = None
    idempotency_key: str | None = None
    # The dispatcher's persisted queue-wait clock (internal; not in the API): a restart
    # resumes the clock and the 60 s aging from these instead of from zero.  `queue_wait_ms`
    # holds the clock's value at `queue_clock_at_ms` (wall ms); `queue_clock_running` says
    # whether it was advancing then. `ready_at_ms` is when the job joined its queue.
    ready_at_ms: int | None = None
    queue_clock_at_ms: int | None = None
    queue_clock_running: bool = False
    #: Who enforces the queue-wait budget: "client" (a follower) or "runner".
    budget_enforced_by: Literal["client", "runner"] | None = None

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES


_INTERNAL_FIELDS = ("ready_at_ms", "queue_clock_at_ms", "queue_clock_running", "budget_enforced_by")


def public_record(record: JobRecord) -> dict:
    """The record as the API shows it: `env` withheld, `reservation_use` absent when unmeasured."""
    data = msgspec.to_builtins(record)
    data.pop("env", None)
    for name in _INTERNAL_FIELDS:
        data.pop(name, None)
    if data.get("waiting_detail") is None:
        data.pop("waiting_detail", None)
    if data.get("reservation_use") is None:
        data.pop("reservation_use", None)
    return data


# --- events ------------------------------------------------------------------------------


class Event(msgspec.Struct, kw_only=True, tag_field="event"):
    """Every event carries `event` (its tag) and `seq` (per job, from 1, increasing)."""

    seq: int = 0


class Accepted(Event, tag="accepted"):
    job_id: str
    claim: int
    capabilities: list[str] = []


class Queued(Event, tag="queued"):
    queue_wait_ms: int = 0
    waiting_on: WaitingOn | None = None
    waiting_on_job: str | None = None
    queue_wait_budget_ms: int | None = None
    waiting_detail: str | None = None


class Started(Event, tag="started"):
    cpus: list[int] | None = None
    attempt: int = 1


class Output(Event, tag="output", omit_defaults=True):
    """`data`: the output as text (UTF-8; bytes that are not valid UTF-8 become U+FFFD).
    `data_b64`: present only then, the exact bytes, base64 (docs/protocol.md, "Events")."""

    stream: Literal["stdout", "stderr"]
    data: str
    data_b64: str | None = None

    def raw(self) -> bytes:
        """The exact bytes of this piece of output."""
        return b64decode(self.data_b64) if self.data_b64 is not None else self.data.encode()


class Truncated(Event, tag="truncated"):
    truncated_before_seq: int


class Terminal(Event, tag="terminal"):
    record: dict


AnyEvent = Union[Accepted, Queued, Started, Output, Truncated, Terminal]

_event_decoder = msgspec.json.Decoder(AnyEvent)
_encoder = msgspec.json.Encoder()


def encode_event(event: Event) -> bytes:
    return _encoder.encode(event)


def decode_event(data: bytes | str) -> AnyEvent:
    return _event_decoder.decode(data)


# --- refusals ----------------------------------------------------------------------------


class Refusal(msgspec.Struct, kw_only=True, omit_defaults=True):
    """`{"refused": true, "code", "detail", ...}`: why the runner said no."""

    code: str
    detail: str
    refused: bool = True
    free_bytes: int | None = None
    floor_bytes: int | None = None
    free_inodes: int | None = None  # a refusal for inodes (runner_disk_full)
    floor_inodes: int | None = None
    job_id: str | None = None

    @property
    def http_status(self) -> int:
        return REFUSAL_HTTP_STATUS.get(self.code, 400)

    def line(self) -> str:
        return f"motor: refused: {self.code}: {self.detail}"


class RefusedError(Exception):
    """Raised by the embedding API and the client when the runner refuses."""

    def __init__(self, refusal: Refusal):
        super().__init__(refusal.line())
        self.refusal = refusal


def to_json(obj) -> bytes:
    return _encoder.encode(obj)
