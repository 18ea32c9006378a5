"""Client commands: run, submit, attach, cancel, withdraw, status, jobs, health, workspaces."""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from typing import Any, Callable, Iterable

import msgspec

from motor.cli.outcome import (
    EXIT_CANCELLED,
    EXIT_FAILURE,
    EXIT_UNAVAILABLE,
    exit_status,
    outcome_line,
)
from motor.client import Client, RunnerUnavailable
from motor.config import ConfigError, default_socket, parse_size
from motor.records import (
    Accepted,
    JobRequest,
    Output,
    Queued,
    RefusedError,
    Started,
    Terminal,
    Truncated,
    encode_event,
)

# This module is on the path of every client command: it imports neither the runner nor
# its API server, trio or hypercorn (tests/cli/test_lean_client.py pins it).  `rich`
# (motor.cli.render) and the queue-wait deadline are imported where used.


def event_line(event: Any) -> bytes:
    """One NDJSON line, as the API server writes it (motor.api.app.event_line)."""
    return encode_event(event) + b"\n"


def _render():
    from motor.cli import render

    return render


# --- options ----------------------------------------------------------------------------


def _client_options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("runner")
    g.add_argument("--socket", metavar="PATH",
                   help="the runner's Unix socket (default $MOTOR_SOCKET, else <state-dir>/motor.sock)")
    g.add_argument("--url", metavar="URL", help="talk HTTP to http://HOST:PORT instead of the socket")
    g.add_argument("--token-file", metavar="FILE", help="bearer token for --url")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    return p


def _job_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("job")
    g.add_argument("--workspace", metavar="NAME", default="default", help="workspace name (default: default)")
    g.add_argument("--weight", metavar="N", type=int, help="vCPU weight hint (the claim)")
    g.add_argument("--queue-wait-limit", metavar="SECONDS", type=float,
                   help="give up (refused_before_start/queue_wait_exceeded) when not started by then")
    g.add_argument("--timeout", metavar="SECONDS", type=float, help="execution timeout")
    g.add_argument("--gate", action="store_true", help="a gate job (honoured when both sides speak gate_jobs)")
    g.add_argument("--kind", choices=["job", "warm_build", "cache_fill"], default="job", help="job kind (default job)")
    g.add_argument("--head", action="store_true", help="workspace_kind head")
    g.add_argument("--sibling", metavar="NAME", action="append", default=[], help="sibling workspace (repeatable)")
    g.add_argument("--repository", metavar="PATH", help="the repository the job builds")
    g.add_argument("--env", metavar="K=V", action="append", default=[], help="environment variable (repeatable)")
    g.add_argument("--memory-max", metavar="BYTES", help="memory cap (bytes or 8G, 512MiB, ...)")
    g.add_argument("--bundle", metavar="FILE", help="tar or git bundle to upload as the workspace's source")
    g.add_argument("--spill-eligible", action="store_true", help="may run on another worker")
    p.add_argument("cmd", nargs="*", metavar="CMD", help="the command, after --")


def register(sub: argparse._SubParsersAction) -> None:
    common = _client_options()

    p = sub.add_parser("run", parents=[common], help="submit a job and follow it",
                       usage="motor run [options] -- CMD [ARG...]",
                       description="Submit a job and follow it: its output goes to the terminal; "
                                   "the exit status is the job's (see docs/cli.md).")
    _job_options(p)
    p.set_defaults(handler=cmd_run, takes_command=True)

    p = sub.add_parser("submit", parents=[common], help="submit a job, print its id",
                       usage="motor submit [options] -- CMD [ARG...]")
    _job_options(p)
    p.set_defaults(handler=cmd_submit, takes_command=True)

    p = sub.add_parser("attach", parents=[common], help="replay a job's output and follow it")
    p.add_argument("job", metavar="JOB")
    p.add_argument("--from-seq", metavar="N", type=int, default=0, help="replay from event N (default 0)")
    p.set_defaults(handler=cmd_attach)

    p = sub.add_parser("cancel", parents=[common], help="cancel a job")
    p.add_argument("job", metavar="JOB")
    p.set_defaults(handler=cmd_cancel)

    p = sub.add_parser("withdraw", parents=[common], help="withdraw a queued job (prints withdrawn or started; an ended job is refused already_ended)")
    p.add_argument("job", metavar="JOB")
    p.set_defaults(handler=cmd_withdraw)

    p = sub.add_parser("status", parents=[common], help="queued and running jobs")
    p.add_argument("--watch", nargs="?", const=2.0, type=float, metavar="SECONDS",
                   help="redraw every SECONDS (default 2) until interrupted")
    p.set_defaults(handler=cmd_status)

    p = sub.add_parser("jobs", parents=[common], help="retained job records")
    p.add_argument("--all", action="store_true", help="every retained record, not only current and recent")
    p.set_defaults(handler=cmd_jobs)

    p = sub.add_parser("health", parents=[common], help="the health report")
    p.set_defaults(handler=cmd_health)

    p = sub.add_parser("workspaces", parents=[common], help="workspaces and their cached sizes")
    p.set_defaults(handler=cmd_workspaces)


# --- helpers ----------------------------------------------------------------------------


def _err(line: str) -> None:
    sys.stderr.write(line.rstrip("\n") + "\n")
    sys.stderr.flush()


def make_client(args: argparse.Namespace, *, timeout: float | None = 30.0) -> Client:
    from motor.cli import UsageError

    token = None
    if getattr(args, "token_file", None):
        try:
            with open(args.token_file) as f:
                token = f.read().strip()
        except OSError as exc:
            raise UsageError(f"cannot read token file {args.token_file}: {exc.strerror}") from None
    if getattr(args, "url", None):
        try:
            return Client(url=args.url, token=token, timeout=timeout)
        except ValueError as exc:
            raise UsageError(f"--url: {exc}") from None
    socket_path = args.socket or os.environ.get("MOTOR_SOCKET") or str(default_socket())
    return Client(socket_path, token=token, timeout=timeout)


def job_request(args: argparse.Namespace) -> JobRequest:
    """The JobRequest of run/submit options; UsageError for a bad option."""
    from motor.cli import UsageError

    command = list(args.cmd) + list(args.tail or [])
    if not command:
        raise UsageError(f"{args.command} needs a command: motor {args.command} [options] -- CMD [ARG...]")
    bundle_sha256 = None
    if args.bundle:  # sha256 the file now; run/submit upload it before submitting
        bundle_sha256 = _bundle_digest(args.bundle)
    env: dict[str, str] = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--env wants K=V, got {item!r}")
        env[key] = value
    memory_max = None
    if args.memory_max is not None:
        try:
            memory_max = parse_size(args.memory_max)
        except ConfigError as exc:
            raise UsageError(f"--memory-max: {exc}") from None
    repository = args.repository
    if repository and "://" not in repository and os.path.exists(repository):
        repository = os.path.abspath(repository)
    return JobRequest(
        command=command,
        workspace=args.workspace,
        weight_hint=args.weight,
        queue_wait_limit_s=args.queue_wait_limit,
        timeout_s=args.timeout,
        gate=args.gate,
        kind=args.kind,
        workspace_kind="head" if args.head else "task",
        siblings=list(args.sibling),
        repository=repository,
        env=env,
        memory_max_bytes=memory_max,
        spill_eligible=args.spill_eligible,
        bundle_sha256=bundle_sha256,
    )


def _bundle_digest(path: str) -> str:
    import hashlib

    from motor.cli import UsageError

    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    except OSError as exc:
        raise UsageError(f"--bundle: cannot read {path}: {exc.strerror}") from None
    return digest.hexdigest()


def _upload_bundle(client: Client, args: argparse.Namespace, req: JobRequest) -> None:
    """`--bundle FILE`: PUT the file (streamed) under its sha256 before the job is submitted."""
    if getattr(args, "bundle", None) and req.bundle_sha256:
        client.put_bundle(req.bundle_sha256, args.bundle)


def _print_json(data: Any) -> None:
    sys.stdout.write(msgspec.json.format(msgspec.json.encode(data), indent=2).decode() + "\n")
    sys.stdout.flush()


def _refused(exc: RefusedError) -> int:
    _err(exc.refusal.line())
    return exit_status(exc.refusal)


def _refusal_terminal(refusal) -> None:
    """`run --json`: a refusal at admission still ends the stream with a terminal event,
    whose record says refused_before_start with the refusal's code and detail (no job was
    accepted, so it has no job id)."""
    record = {"job_id": None, "state": "refused_before_start", "reason": refusal.code,
              "detail": refusal.detail}
    for extra in ("free_bytes", "floor_bytes"):
        if getattr(refusal, extra, None) is not None:
            record[extra] = getattr(refusal, extra)
    sys.stdout.write(msgspec.json.encode({"event": "terminal", "seq": 0, "record": record}).decode() + "\n")
    sys.stdout.flush()


def _unavailable(exc: RunnerUnavailable) -> int:
    _err(f"motor: {exc}")
    return EXIT_UNAVAILABLE


def _guard(fn: Callable[[], int]) -> int:
    """Map the client's errors to lines and exit statuses."""
    try:
        return fn()
    except RefusedError as exc:
        return _refused(exc)
    except RunnerUnavailable as exc:
        return _unavailable(exc)


# --- following a job --------------------------------------------------------------------


class _Writer:
    """Binary-safe writes of job output to our stdout/stderr."""

    def __init__(self) -> None:
        self.broken: set[str] = set()

    def write(self, stream: str, data: str) -> None:
        if stream in self.broken:
            return
        target = sys.stderr if stream == "stderr" else sys.stdout
        try:
            raw = data.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            raw = data.encode("utf-8", "replace")
        try:
            target.flush()
            buffer = getattr(target, "buffer", None)
            if buffer is not None:
                buffer.write(raw)
                buffer.flush()
            else:
                target.write(raw.decode("utf-8", "replace"))
                target.flush()
        except BrokenPipeError:
            self.broken.add(stream)


class QueueWaitWatch:
    """The client side of the queue-wait rule: a local deadline kept from the streamed
    `queue_wait_ms` (queue_wait.LocalDeadline: only observed permit wait counts, a
    paused clock sets no deadline); when it passes, call `withdraw` once. The runner's
    answer ("withdrawn" or "started") decides."""

    def __init__(self, withdraw: Callable[[], Any], fallback_budget_ms: int | None = None):
        self._withdraw = withdraw
        self._fallback = fallback_budget_ms
        self._deadline = None  # a queue_wait.LocalDeadline once a budget is known
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()
        self.done = False
        self.result: Any = None

    def queued(self, event: Queued) -> None:
        budget = event.queue_wait_budget_ms if event.queue_wait_budget_ms is not None else self._fallback
        if budget is None or self.done:
            return
        now = time.monotonic()
        with self._lock:
            if self._deadline is None or self._deadline.budget_ms != budget:
                from motor.queue_wait import LocalDeadline

                self._deadline = LocalDeadline(budget / 1000.0)
            self._deadline.observe(event.queue_wait_ms, now)
            remaining = self._deadline.remaining_s(now)
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if remaining is not None:
                self._timer = threading.Timer(remaining, self._fire)
                self._timer.daemon = True
                self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            if self.done or self._deadline is None or not self._deadline.should_withdraw(time.monotonic()):
                return
            self.done = True
        try:
            self.result = self._withdraw()
        except Exception as exc:  # noqa: BLE001 - best effort; the runner enforces its own limit
            self.result = exc

    def stop(self) -> None:
        with self._lock:
            self.done = True
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None


def follow(events: Iterable, *, as_json: bool, on_job_id: Callable[[str], None] | None = None,
           watch: QueueWaitWatch | None = None) -> int:
    """Print a job's events (output, or JSON lines) until the terminal one; its exit status."""
    writer = _Writer()
    for event in events:
        if as_json:
            sys.stdout.write(event_line(event).decode("utf-8"))
            sys.stdout.flush()
        tag = type(event)
        if tag is Accepted and on_job_id is not None:
            on_job_id(event.job_id)
        elif tag is Queued:
            if watch is not None:
                watch.queued(event)
        elif tag is Started:
            if watch is not None:
                watch.stop()
        elif tag is Output:
            if not as_json:
                writer.write(event.stream, event.data)
        elif tag is Truncated:
            if not as_json:
                _err(f"motor: output before event {event.truncated_before_seq} is no longer retained")
        elif tag is Terminal:
            if watch is not None:
                watch.stop()
            record = event.record
            line = outcome_line(record)
            if line:
                _err(line)
            return exit_status(record)
    if watch is not None:
        watch.stop()
    _err("motor: the runner closed the stream before the job ended")
    return EXIT_UNAVAILABLE


# --- commands ---------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    req = job_request(args)
    client = make_client(args)
    job_id: list[str] = []
    stream = None
    watch = None
    try:
        try:
            _upload_bundle(client, args, req)
            stream = client.submit(req, follow=True)
        except RefusedError as exc:
            if args.json:
                _refusal_terminal(exc.refusal)
            return _refused(exc)
        except RunnerUnavailable as exc:
            return _unavailable(exc)

        def withdraw() -> str | None:
            if not job_id:
                return None
            with make_client(args, timeout=10.0) as other:
                return other.withdraw(job_id[0])

        fallback = int(req.queue_wait_limit_s * 1000) if req.queue_wait_limit_s is not None else None
        watch = QueueWaitWatch(withdraw, fallback)
        try:
            return follow(stream, as_json=args.json, on_job_id=job_id.append, watch=watch)
        except RunnerUnavailable as exc:
            return _unavailable(exc)
    except KeyboardInterrupt:
        if watch is not None:
            watch.stop()
        if stream is not None:
            try:
                stream.close()
            except Exception:  # noqa: BLE001
                pass
        if job_id:
            try:
                with make_client(args, timeout=10.0) as other:
                    other.cancel(job_id[0])
                _err(f"motor: cancelled job {job_id[0]}")
            except (RefusedError, RunnerUnavailable) as exc:
                _err(f"motor: could not cancel job {job_id[0]}: {exc}")
        return EXIT_CANCELLED
    finally:
        if watch is not None:
            watch.stop()
        client.close()


def cmd_submit(args: argparse.Namespace) -> int:
    req = job_request(args)

    def go() -> int:
        with make_client(args) as client:
            _upload_bundle(client, args, req)
            if args.json:
                _print_json(client.call("POST", "/v1/jobs", json=client.request_body(req)))
            else:
                print(client.submit(req).job_id, flush=True)
        return 0

    return _guard(go)


def cmd_attach(args: argparse.Namespace) -> int:
    if args.from_seq < 0:
        from motor.cli import UsageError

        raise UsageError("--from-seq must be >= 0")
    client = make_client(args)
    try:
        try:
            stream = client.events(args.job, args.from_seq)
        except RefusedError as exc:
            if exc.refusal.code == "history_expired":
                _err(f"motor: history_expired: {exc.refusal.detail}")
                return EXIT_FAILURE
            return _refused(exc)
        except RunnerUnavailable as exc:
            return _unavailable(exc)
        try:
            return follow(stream, as_json=args.json)
        except RunnerUnavailable as exc:
            return _unavailable(exc)
    except KeyboardInterrupt:
        return EXIT_CANCELLED  # detaching does not cancel the job
    finally:
        client.close()


def cmd_cancel(args: argparse.Namespace) -> int:
    def go() -> int:
        with make_client(args) as client:
            if args.json:
                _print_json(client.call("POST", f"/v1/jobs/{_q(args.job)}/cancel"))
            else:
                record = client.cancel(args.job)
                print(record.state, flush=True)
        return 0

    return _guard(go)


def cmd_withdraw(args: argparse.Namespace) -> int:
    def go() -> int:
        with make_client(args) as client:
            result = client.withdraw(args.job)
            if args.json:
                _print_json({"result": result})
            else:
                print(result, flush=True)
        return 0

    return _guard(go)


def cmd_status(args: argparse.Namespace) -> int:
    def go() -> int:
        with make_client(args) as client:
            data = client.status()
            if args.json:
                _print_json(data)
            else:
                _render().status(data)
            interval = getattr(args, "watch", None)
            if interval is None:
                return 0
            try:
                import time as _time

                while True:  # live view: redraw until interrupted
                    _time.sleep(max(0.2, interval))
                    data = client.status()
                    if args.json:
                        _print_json(data)
                    else:
                        con = _render().console()
                        con.clear()
                        _render().status(data, con)
            except KeyboardInterrupt:
                return 0

    return _guard(go)


def cmd_jobs(args: argparse.Namespace) -> int:
    def go() -> int:
        with make_client(args) as client:
            data = client.call("GET", "/v1/jobs", params={"all": "1"} if args.all else None)
        if args.json:
            _print_json(data)
        else:
            _render().jobs(data)
        return 0

    return _guard(go)


def cmd_health(args: argparse.Namespace) -> int:
    def go() -> int:
        with make_client(args) as client:
            data = client.health()
        if args.json:
            _print_json(data)
        else:
            _render().health(data)
        return 0

    return _guard(go)


def cmd_workspaces(args: argparse.Namespace) -> int:
    def go() -> int:
        with make_client(args) as client:
            data = client.workspaces()
        if args.json:
            _print_json(data)
        else:
            _render().workspaces(data)
        return 0

    return _guard(go)


def _q(job_id: str) -> str:
    from urllib.parse import quote

    return quote(job_id, safe="")


__all__ = ["register", "job_request", "make_client", "follow", "QueueWaitWatch"]
