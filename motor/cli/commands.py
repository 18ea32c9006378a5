"""Client commands: run, submit, attach, cancel, withdraw, status, jobs, health, workspaces."""

from __future__ import annotations

import argparse
import os
import sys
import time

from motor.cli.outcome import (
    EXIT_CANCELLED,
    EXIT_FAILURE,
    EXIT_UNAVAILABLE,
    exit_status,
    outcome_line,
)
from motor.cli.text import printable
from motor.client import Client, RunnerUnavailable, default_socket_str, json_bytes, refusal_of

TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from typing import Any, Callable, Iterable

    from motor.records import JobRequest

# This module is on the path of every client command: it imports neither the runner nor
# its API server, trio or hypercorn, nor msgspec and motor.records (tests/cli/
# test_lean_client.py pins it): requests and events travel as the wire's plain dicts.
# `rich` (motor.cli.render), threading (the queue-wait timer, once a job's clock is seen
# advancing) and motor.config (--memory-max) are imported where used.


def event_line(event: Any) -> bytes:
    """One NDJSON line, as the API server writes it (motor.api.app.event_line): an event
    dict as it came off the wire, or a typed event."""
    if isinstance(event, dict):
        return json_bytes(event) + b"\n"
    from motor.records import encode_event

    return encode_event(event) + b"\n"


def _event_dict(event: Any) -> dict:
    """A typed event (motor.records) as the wire's dict; a dict as it is."""
    if isinstance(event, dict):
        return event
    import json

    return json.loads(event_line(event))


def _render():
    from motor.cli import render

    return render


# --- options ----------------------------------------------------------------------------


def _client_options() -> argparse.ArgumentParser:
    from motor.cli import Parser

    p = Parser(add_help=False)
    g = p.add_argument_group("runner")
    g.add_argument("--socket", metavar="PATH",
                   help="the runner's Unix socket (default $MOTOR_SOCKET, else <state-dir>/motor.sock)")
    g.add_argument("--url", metavar="URL", help="talk HTTP to http://HOST:PORT instead of the socket")
    g.add_argument("--token-file", metavar="FILE", help="bearer token for --url")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    return p


def seconds(text: str) -> float:
    """An argparse type: a finite number of seconds, 0 or more (inf or nan would reach the
    request's JSON, which has no such numbers)."""
    value = float(text)  # ValueError: argparse says "invalid seconds value"
    if not (0.0 <= value < float("inf")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number of seconds >= 0")
    return value


def _job_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("job")
    g.add_argument("--workspace", metavar="NAME", default="default", help="workspace name (default: default)")
    g.add_argument("--weight", metavar="N", type=int, help="vCPU weight hint (the claim)")
    g.add_argument("--queue-wait-limit", metavar="SECONDS", type=seconds,
                   help="give up (refused_before_start/queue_wait_exceeded) when not started by then")
    g.add_argument("--timeout", metavar="SECONDS", type=seconds, help="execution timeout")
    g.add_argument("--gate", action="store_true", help="a gate job (honoured when both sides speak gate_jobs)")
    g.add_argument("--kind", choices=["job", "warm_build", "cache_fill"], default="job", help="job kind (default job)")
    g.add_argument("--head", action="store_true", help="workspace_kind head")
    g.add_argument("--sibling", metavar="NAME", action="append", default=[], help="sibling workspace (repeatable)")
    g.add_argument("--repository", metavar="PATH", help="the repository the job builds")
    g.add_argument("--env", metavar="K=V", action="append", default=[], help="environment variable (repeatable)")
    g.add_argument("--memory-max", metavar="BYTES", help="memory cap (bytes or 8G, 512MiB, ...)")
    g.add_argument("--bundle", metavar="FILE", help="tar or git bundle to upload as the workspace's source")
    g.add_argument("--spill-eligible", action="store_true", help="may run on another worker")
    g.add_argument("--idempotency-key", metavar="KEY",
                   help="this submit's key (default: a new one each time): a submit the runner may "
                        "have taken before the connection broke is sent again with it (--retry-for), "
                        "and makes at most one job")
    g.add_argument("--retry-for", metavar="SECONDS", type=seconds, default=SUBMIT_RETRY_S,
                   help="how long to send such a submit again until a runner answers "
                        f"(default {SUBMIT_RETRY_S:g}; 0: not at all)")
    p.add_argument("cmd", nargs="*", metavar="CMD", help="the command, after --")


#: the destinations of the job options (`motor submit --from FILE` takes none of them)
_JOB_DESTS = ("workspace", "weight", "queue_wait_limit", "timeout", "gate", "kind", "head", "sibling",
              "repository", "env", "memory_max", "bundle", "spill_eligible", "idempotency_key",
              "retry_for")
#: how long run/submit send a keyed submit again whose answer did not come (a runner that
#: crashed or restarted after it was sent: restart to healthy takes about a second)
SUBMIT_RETRY_S = 30.0


def register(sub: argparse._SubParsersAction, only: str | None = None) -> None:
    """Add the client commands to `sub`; `only`: just that one (argparse takes milliseconds
    to build each subparser, so `main` builds only the command it runs)."""
    common = _client_options()

    def wanted(name: str) -> bool:
        return only is None or only == name

    if wanted("run"):
        p = sub.add_parser("run", parents=[common], help="submit a job and follow it",
                           usage="motor run [options] -- CMD [ARG...]",
                           description="Submit a job and follow it: its output goes to the terminal; "
                                       "the exit status is the job's (see docs/cli.md).")
        _job_options(p)
        p.set_defaults(handler=cmd_run, takes_command=True)

    if wanted("submit"):
        p = sub.add_parser("submit", parents=[common], help="submit a job (or a batch: --from FILE), print its id",
                           usage="motor submit [options] -- CMD [ARG...]\n       motor submit --from FILE [--json]",
                           description="Submit a job and print its id; with --from FILE, submit every job "
                                       "request in FILE (see docs/cli.md, 'Batch submit').")
        p.add_argument("--from", dest="from_file", metavar="FILE",
                       help="submit the job requests in FILE (JSON lines, or one JSON list; - = stdin) in "
                            "batches; prints one line per job, in order")
        _job_options(p)
        p.set_defaults(handler=cmd_submit, takes_command=True,
                       job_defaults={dest: p.get_default(dest) for dest in _JOB_DESTS})

    if wanted("attach"):
        p = sub.add_parser("attach", parents=[common], help="replay a job's output and follow it")
        p.add_argument("job", metavar="JOB")
        p.add_argument("--from-seq", metavar="N", type=int, default=0, help="replay from event N (default 0)")
        p.set_defaults(handler=cmd_attach)

    if wanted("cancel"):
        p = sub.add_parser("cancel", parents=[common], help="cancel a job")
        p.add_argument("job", metavar="JOB")
        p.set_defaults(handler=cmd_cancel)

    if wanted("withdraw"):
        p = sub.add_parser("withdraw", parents=[common], help="withdraw a queued job (prints withdrawn or started; an ended job is refused already_ended)")
        p.add_argument("job", metavar="JOB")
        p.set_defaults(handler=cmd_withdraw)

    if wanted("status"):
        p = sub.add_parser("status", parents=[common], help="queued and running jobs")
        p.add_argument("--watch", nargs="?", const=2.0, type=float, metavar="SECONDS",
                       help="redraw every SECONDS (default 2) until interrupted")
        p.add_argument("--full", action="store_true",
                       help="with --json: each job's whole record, not its status row")
        p.set_defaults(handler=cmd_status)

    if wanted("jobs"):
        p = sub.add_parser("jobs", parents=[common], help="retained job records")
        p.add_argument("--all", action="store_true", help="every retained record, not only current and recent")
        p.set_defaults(handler=cmd_jobs)

    if wanted("health"):
        p = sub.add_parser("health", parents=[common], help="the health report")
        p.set_defaults(handler=cmd_health)

    if wanted("workspaces"):
        p = sub.add_parser("workspaces", parents=[common], help="workspaces and their cached sizes")
        p.set_defaults(handler=cmd_workspaces)


# --- helpers ----------------------------------------------------------------------------


def _err(line: str) -> None:
    """One line on stderr; the runner's text in it (a detail may quote a job's command)
    with its control characters escaped (motor/cli/text.py)."""
    sys.stderr.write(printable(line.rstrip("\n")) + "\n")
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
    socket_path = args.socket or default_socket_str()
    return Client(socket_path, token=token, timeout=timeout)


def job_request(args: argparse.Namespace) -> JobRequest:
    """The JobRequest of run/submit options; UsageError for a bad option."""
    import msgspec

    from motor.records import JobRequest

    return msgspec.convert(request_fields(args), JobRequest)


def request_fields(args: argparse.Namespace) -> dict:
    """The job request of run/submit options as the JSON body's dict; UsageError for a bad
    option."""
    from motor.cli import UsageError, require_text

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
        from motor.config import ConfigError, parse_size

        try:
            memory_max = parse_size(args.memory_max)
        except ConfigError as exc:
            raise UsageError(f"--memory-max: {exc}") from None
    repository = args.repository
    if repository and "://" not in repository and os.path.exists(repository):
        repository = os.path.abspath(repository)
    require_text([("the command's word", word) for word in command]
                 + [("--workspace", args.workspace), ("--repository", repository)]
                 + [("--sibling", name) for name in args.sibling]
                 + [("--env", f"{key}={value}") for key, value in env.items()])
    return dict(
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
        # 16 random bytes: `uuid` costs the CLI's start-up more than this (docs/cli.md)
        idempotency_key=args.idempotency_key or os.urandom(16).hex(),
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


def _upload_bundle(client: Client, args: argparse.Namespace, req: dict) -> None:
    """`--bundle FILE`: PUT the file (streamed) under its sha256 before the job is submitted."""
    if getattr(args, "bundle", None) and req.get("bundle_sha256"):
        client.put_bundle(req["bundle_sha256"], args.bundle)


def _print_json(data: Any) -> None:
    import json

    sys.stdout.write(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def _refused(exc: BaseException, req: dict | None = None) -> int:
    """Print a RefusedError's line; its exit status. Anything else is re-raised. `req`: the
    submit's request, named by its key when the job may still be accepted."""
    refusal = refusal_of(exc)
    if refusal is None:
        raise exc
    _err(refusal.line())
    if refusal.code == "submit_unconfirmed" and req is not None:
        _may_be_accepted(req, "the runner may still accept the job")
    return exit_status(refusal)


def _may_be_accepted(req: dict, why: str) -> None:
    _err(f"motor: {why}; submitting it again with --idempotency-key {req['idempotency_key']} "
         "answers with that job instead of starting a second one")


def _refusal_terminal(refusal) -> None:
    """`run --json`: a refusal at admission still ends the stream with a terminal event,
    whose record says refused_before_start with the refusal's code and detail (no job was
    accepted, so it has no job id)."""
    record = {"job_id": None, "state": "refused_before_start", "reason": refusal.code,
              "detail": refusal.detail}
    for extra in ("free_bytes", "floor_bytes", "free_inodes", "floor_inodes"):
        if getattr(refusal, extra, None) is not None:
            record[extra] = getattr(refusal, extra)
    sys.stdout.write(json_bytes({"event": "terminal", "seq": 0, "record": record}).decode() + "\n")
    sys.stdout.flush()


def _unavailable(exc: RunnerUnavailable, req: dict | None = None) -> int:
    _err(f"motor: {exc}")
    if exc.sent and req is not None:
        _may_be_accepted(req, "the runner may have accepted the job before the connection broke")
    return EXIT_UNAVAILABLE


def _guard(fn: Callable[[], int]) -> int:
    """Map the client's errors to lines and exit statuses."""
    try:
        return fn()
    except RunnerUnavailable as exc:
        return _unavailable(exc)
    except Exception as exc:  # a RefusedError (anything else is re-raised by _refused)
        return _refused(exc)


# --- following a job --------------------------------------------------------------------


class _Writer:
    """Binary-safe writes of job output to our stdout/stderr."""

    def __init__(self) -> None:
        self.broken: set[str] = set()

    def write(self, stream: str, data: str, data_b64: str | None = None) -> None:
        """`data`, or where the event has them the exact bytes (`data_b64`: the job wrote
        bytes that are not UTF-8; before stop 58 they came out as U+FFFD)."""
        if stream in self.broken:
            return
        target = sys.stderr if stream == "stderr" else sys.stdout
        if data_b64 is not None:
            import binascii  # (only here: the CLI's start-up imports stay few)
            raw = binascii.a2b_base64(data_b64)
        else:
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
        self._timer = None  # a threading.Timer once a deadline is set
        import _thread  # threading (~1.6 ms to import) only once a timer is needed

        self._lock = _thread.allocate_lock()
        self.done = False
        self.result: Any = None

    def queued(self, event: Any) -> None:
        """A `queued` event (the wire's dict, or a typed motor.records.Queued)."""
        event = _event_dict(event)
        budget = event.get("queue_wait_budget_ms")
        if budget is None:
            budget = self._fallback
        if budget is None or self.done:
            return
        now = time.monotonic()
        with self._lock:
            if self._deadline is None or self._deadline.budget_ms != budget:
                from motor.queue_wait import LocalDeadline

                self._deadline = LocalDeadline(budget / 1000.0)
            self._deadline.observe(event.get("queue_wait_ms") or 0, now)
            remaining = self._deadline.remaining_s(now)
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if remaining is not None:  # the clock was seen advancing: a job that waits
                import threading

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
    """Print a job's events (output, or JSON lines) until the terminal one; its exit status
    (RunnerUnavailable when the stream breaks or ends before it).
    Events are the wire's dicts (`events(..., raw=True)`) or typed motor.records events; with
    `as_json`, every event is printed as one JSON line, kinds this client does not know too."""
    writer = _Writer()
    for event in events:
        event = _event_dict(event)
        if as_json:
            sys.stdout.write(event_line(event).decode("utf-8"))
            sys.stdout.flush()
        tag = event.get("event")
        if tag == "accepted" and on_job_id is not None:
            on_job_id(event["job_id"])
        elif tag == "queued":
            if watch is not None:
                watch.queued(event)
        elif tag == "started":
            if watch is not None:
                watch.stop()
        elif tag == "output":
            if not as_json:
                writer.write(event.get("stream"), event.get("data", ""), event.get("data_b64"))
        elif tag == "truncated":
            if not as_json:
                _err(f"motor: output before event {event.get('truncated_before_seq')} is no longer retained")
        elif tag == "terminal":
            if watch is not None:
                watch.stop()
            record = event.get("record") or {}
            line = outcome_line(record)
            if line:
                _err(line)
            return exit_status(record)
    if watch is not None:
        watch.stop()
    # (a runner that stops ends its streams: the job goes on, and can be followed again)
    raise RunnerUnavailable("the runner closed the stream before the job ended")


# --- commands ---------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    req = request_fields(args)
    client = make_client(args)
    job_id: list[str] = []
    stream = None
    watch = None
    try:
        try:
            _upload_bundle(client, args, req)
            stream = client.submit(req, follow=True, raw=True, retry_s=args.retry_for)
        except RunnerUnavailable as exc:
            return _unavailable(exc, req)
        except Exception as exc:  # a RefusedError (anything else is re-raised by _refused)
            refusal = refusal_of(exc)
            if args.json and refusal is not None:
                _refusal_terminal(refusal)
            return _refused(exc, req)

        def withdraw() -> str | None:
            if not job_id:
                return None
            with make_client(args, timeout=10.0) as other:
                return other.withdraw(job_id[0])

        limit_s = req.get("queue_wait_limit_s")
        fallback = int(limit_s * 1000) if limit_s is not None else None
        watch = QueueWaitWatch(withdraw, fallback)
        try:
            return follow(stream, as_json=args.json, on_job_id=job_id.append, watch=watch)
        except RunnerUnavailable as exc:
            status = _unavailable(exc)
            if job_id:  # accepted: it is not lost with the connection (a runner restart)
                _err(f"motor: job {job_id[0]} was accepted and is not lost with the connection;"
                     f" follow it again with: motor attach {job_id[0]}")
            return status
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
            except Exception as exc:  # noqa: BLE001 - a refusal or no runner: say so, exit anyway
                if not isinstance(exc, RunnerUnavailable) and refusal_of(exc) is None:
                    raise
                _err(f"motor: could not cancel job {job_id[0]}: {exc}")
        return EXIT_CANCELLED
    finally:
        if watch is not None:
            watch.stop()
        client.close()


def cmd_submit(args: argparse.Namespace) -> int:
    if getattr(args, "from_file", None) is not None:
        return _submit_from(args)
    req = request_fields(args)

    def go() -> int:
        with make_client(args) as client:
            _upload_bundle(client, args, req)
            try:
                record = client.submit(req, raw=True, retry_s=args.retry_for)
            except RunnerUnavailable as exc:
                return _unavailable(exc, req)
            except Exception as exc:  # a RefusedError (anything else is re-raised by _refused)
                return _refused(exc, req)
            if args.json:
                _print_json(record)
            else:
                print(record["job_id"], flush=True)
        return 0

    return _guard(go)


def read_requests(path: str) -> list:
    """The job requests of `motor submit --from FILE`: one JSON list, or JSON lines (one
    request a line, blank lines skipped); "-" reads stdin. UsageError names the line of
    anything that is not JSON (nothing is submitted then). Items are not checked here: the
    runner answers each one (a bad one is refused bad_request, the others go on)."""
    import json

    from motor.cli import UsageError

    try:
        if path == "-":
            data = sys.stdin.buffer.read()
        else:
            with open(path, "rb") as f:
                data = f.read()
    except OSError as exc:
        raise UsageError(f"--from: cannot read {path}: {exc.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"--from {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if text.lstrip()[:1] == "[":
        try:
            items = json.loads(text, parse_constant=_not_json)
        except ValueError as exc:
            raise UsageError(f"--from {path}: not a JSON list: {exc}") from None
        if not isinstance(items, list):
            raise UsageError(f"--from {path}: not a JSON list")
        return items
    items = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            items.append(json.loads(line, parse_constant=_not_json))
        except ValueError as exc:
            raise UsageError(f"--from {path}: line {number} is not JSON: {exc}") from None
    return items


def _not_json(name: str):
    """Python's json reads NaN and Infinity, which JSON has not (nor can a request carry)."""
    raise ValueError(f"{name} is not a JSON value")


def _submit_from(args: argparse.Namespace) -> int:
    """`motor submit --from FILE`: every request in FILE, in batches; one line per job on
    stdout, in order (its id, or `refused CODE`; with --json the answer as one JSON line),
    each refusal's detail on stderr. Exit 0 when every job was accepted, else the exit
    status of the first refusal (75 refused before start, 65 bad_request, 1 otherwise)."""
    from motor.cli import UsageError

    if args.cmd or args.tail:
        raise UsageError("submit --from FILE takes no command after --: each request in FILE has its own")
    given = [dest for dest, default in args.job_defaults.items() if getattr(args, dest) != default]
    if given:
        names = ", ".join("--" + dest.replace("_", "-") for dest in given)
        raise UsageError(f"submit --from FILE takes the job options from FILE, not from {names}")
    reqs = read_requests(args.from_file)

    def go() -> int:
        status = 0
        with make_client(args) as client:
            for index, answer in enumerate(client.iter_submit_many(reqs, raw=True)):
                refused = isinstance(answer, dict) and answer.get("refused")
                if args.json:
                    sys.stdout.write(json_bytes(answer).decode("utf-8") + "\n")
                elif refused:
                    sys.stdout.write(f"refused {answer.get('code')}\n")
                else:
                    sys.stdout.write(f"{answer.get('job_id')}\n")
                if refused:
                    _err(f"motor: job [{index}]: refused: {answer.get('code')}: {answer.get('detail')}")
                    if status == 0:
                        status = exit_status(answer)
                sys.stdout.flush()
        return status

    return _guard(go)


def cmd_attach(args: argparse.Namespace) -> int:
    if args.from_seq < 0:
        from motor.cli import UsageError

        raise UsageError("--from-seq must be >= 0")
    client = make_client(args)
    try:
        try:
            stream = client.events(args.job, args.from_seq, raw=True)
        except RunnerUnavailable as exc:
            return _unavailable(exc)
        except Exception as exc:  # a RefusedError (anything else is re-raised by _refused)
            refusal = refusal_of(exc)
            if refusal is not None and refusal.code == "history_expired":
                _err(f"motor: history_expired: {refusal.detail}")
                return EXIT_FAILURE
            return _refused(exc)
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
            record = client.call("POST", f"/v1/jobs/{_q(args.job)}/cancel")
            if args.json:
                _print_json(record)
            else:
                print(record["state"], flush=True)
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
            full = args.json and args.full
            data = client.status(full)
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
                    data = client.status(full)
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
    from motor.client import _quote

    return _quote(job_id)


__all__ = ["register", "job_request", "request_fields", "read_requests", "make_client", "follow",
           "QueueWaitWatch"]
