"""What the runner and its clients share on the wire, in the standard library only.

The command-line client imports this and never msgspec, the records or the runner (its
start-up cost is the point: docs/cli.md, "Start-up cost"); `motor.records`,
`motor.config` and the runner facade take these same objects from here, so there is one
definition of each.
"""

from __future__ import annotations

import os

__all__ = ["BEFORE_START_CODES", "CAPABILITIES", "CHANGE_ANSWER_S", "CHANGE_TIMEOUT_S",
           "DISK_ADMIT_TIMEOUT_S", "MAX_BATCH_JOBS", "SUBMIT_ANSWER_S", "SUBMIT_TIMEOUT_S",
           "answer_wait_s", "default_socket_str", "default_state_dir_str"]

#: refusal codes that end a job before it started (interface.md: exit status 75)
BEFORE_START_CODES: frozenset[str] = frozenset(
    {"runner_full", "runner_disk_full", "workspace_setup_failed", "queue_wait_exceeded",
     "too_many_connections"}
)

#: what this runner negotiates (`Motor-Capabilities`)
CAPABILITIES: tuple[str, ...] = ("gate_jobs", "follow", "withdraw")

#: The most job requests one batch submit (`POST /v1/jobs` with a list) may carry; a larger
#: batch is refused whole with `batch_too_large` (docs/protocol.md). Clients split longer
#: lists into batches of this size.
MAX_BATCH_JOBS = 1000

#: How long one disk admission may take (its cleanup included) before the dispatcher refuses
#: the submit `runner_disk_full`; the runner's submitters wait SUBMIT_TIMEOUT_S for the
#: dispatcher, and HTTP clients SUBMIT_ANSWER_S for the answer to `POST /v1/jobs`, each
#: longer than the step before, so a submitter always gets the runner's answer
#: (docs/scheduling.md, "Admission and the disk").
DISK_ADMIT_TIMEOUT_S = 300.0
SUBMIT_TIMEOUT_S = DISK_ADMIT_TIMEOUT_S + 30.0
SUBMIT_ANSWER_S = SUBMIT_TIMEOUT_S + 30.0

#: How long the runner waits for its dispatcher to take a cancel or a withdraw (busy with a
#: save on a slow disk or under another process's lock) before it answers 503 `runner_busy`,
#: the request still queued and carried out later (docs/protocol.md); HTTP clients wait
#: CHANGE_ANSWER_S for the answer, so they get that one rather than time out first.
CHANGE_TIMEOUT_S = 30.0
CHANGE_ANSWER_S = CHANGE_TIMEOUT_S + 15.0


def answer_wait_s(method: str, path: str) -> float | None:
    """How long a client waits for the answer to `method path`, when longer than its own
    timeout may be (a submit, a cancel, a withdraw); None: its own timeout."""
    if method != "POST":
        return None
    if path == "/v1/jobs":
        return SUBMIT_ANSWER_S
    if path.startswith("/v1/jobs/") and path.endswith(("/cancel", "/withdraw")):
        return CHANGE_ANSWER_S
    return None


def default_state_dir_str() -> str:
    """$MOTOR_STATE_DIR, else $XDG_STATE_HOME/motor, else ~/.local/state/motor."""
    if env := os.environ.get("MOTOR_STATE_DIR"):
        return env
    if xdg := os.environ.get("XDG_STATE_HOME"):
        return os.path.join(xdg, "motor")
    return os.path.join(os.path.expanduser("~"), ".local", "state", "motor")


def default_socket_str() -> str:
    """$MOTOR_SOCKET, else <default state dir>/motor.sock."""
    if env := os.environ.get("MOTOR_SOCKET"):
        return env
    return os.path.join(default_state_dir_str(), "motor.sock")
