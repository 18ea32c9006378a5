"""Exit statuses of `motor run` / `motor attach` (interface.md), as pure functions.

On every client command's path, so it imports neither msgspec nor motor.records: the typed
forms (JobRecord, Refusal, RefusedError) are recognised by the module that defines them,
which is loaded already whenever one of them exists."""

from __future__ import annotations

import sys

TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from typing import Any

from motor.wire import BEFORE_START_CODES

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_DATAERR = 65        # bad_request
EXIT_UNAVAILABLE = 69    # no runner answered
EXIT_SOFTWARE = 70       # the job was lost
EXIT_TEMPFAIL = 75       # refused before start
EXIT_TIMEOUT = 124       # execution timeout
EXIT_CANCELLED = 130     # cancelled (also Ctrl-C)


def _as_dict(obj: Any) -> dict:
    if isinstance(obj, dict):
        return obj
    records = sys.modules.get("motor.records")
    if records is not None and isinstance(obj, (records.JobRecord, records.Refusal)):
        import msgspec

        return msgspec.to_builtins(obj) | ({"refused": True} if isinstance(obj, records.Refusal) else {})
    raise TypeError(f"exit_status wants a terminal record or a refusal, got {type(obj).__name__}")


def exit_status(outcome: Any) -> int:
    """The exit status for a terminal job record or a refusal.

    Accepts a JobRecord, a Refusal, a RefusedError, a RunnerUnavailable, or their dict
    forms (a record dict, or `{"refused": true, "code": ...}`).
    """
    from motor.client import RunnerUnavailable

    from motor.client import refusal_of

    if isinstance(outcome, RunnerUnavailable):
        return EXIT_UNAVAILABLE
    if isinstance(outcome, BaseException) and refusal_of(outcome) is not None:
        outcome = refusal_of(outcome)
    data = _as_dict(outcome)
    if data.get("refused"):
        code = data.get("code")
        if code in BEFORE_START_CODES:
            return EXIT_TEMPFAIL
        if code == "bad_request":
            return EXIT_DATAERR
        return EXIT_FAILURE
    state = data.get("state")
    if state in ("succeeded", "failed"):
        signal = data.get("signal")
        if signal:
            return 128 + int(signal)
        code = data.get("exit_code")
        if code is None:
            return EXIT_OK if state == "succeeded" else EXIT_FAILURE
        return int(code) & 0xFF
    if state == "timed_out":
        return EXIT_TIMEOUT
    if state == "cancelled":
        return EXIT_CANCELLED
    if state == "refused_before_start":
        return EXIT_TEMPFAIL
    if state == "lost":
        return EXIT_SOFTWARE
    raise ValueError(f"job state {state!r} is not terminal")


def outcome_line(record: dict) -> str | None:
    """The stderr line `run`/`attach` print for a terminal record, or None when the job
    simply exited (its own output says enough)."""
    state = record.get("state")
    reason = record.get("reason")
    detail = record.get("detail")
    if state == "refused_before_start":
        return f"motor: refused: {reason or 'refused_before_start'}: {detail or 'the job did not start'}"
    if state == "lost":
        return f"motor: job {record.get('job_id')} was lost: {detail or reason or 'no detail'}"
    if state == "timed_out":
        return f"motor: job {record.get('job_id')} timed out" + (f": {detail}" if detail else "")
    if state == "cancelled":
        return f"motor: job {record.get('job_id')} was cancelled" + (f": {detail}" if detail else "")
    if state in ("succeeded", "failed") and record.get("signal"):
        why = (f" ({reason})" if reason else "") + (f": {detail}" if detail else "")
        return f"motor: job {record.get('job_id')} was killed by signal {record['signal']}{why}"
    if state == "failed" and record.get("exit_code") is None:
        return f"motor: job {record.get('job_id')} failed: {detail or reason or 'no detail'}"
    return None
