"""The HTTP API of motor as a plain ASGI application (no framework).

`make_app(runner)` returns an ASGI callable that answers the routes of
../../docs/protocol.md on behalf of a `Runner` (the facade in ../runner/facade.py).  It speaks
lifespan (hypercorn sends startup/shutdown), JSON bodies, and newline-delimited JSON
streams (`application/x-ndjson`), one event a line, flushed per event.

Every error is a refusal: `{"refused": true, "code": ..., "detail": ...}` with the HTTP
status of `records.REFUSAL_HTTP_STATUS`.  An unexpected exception becomes a 500
`internal_error` (logged with its traceback) and the server keeps serving.

Who may do what: requests on the Unix socket (hypercorn gives them no `server` address)
need no token, the socket's mode is the access control. Requests over TCP (the scope names
a `server` address) need `Authorization: Bearer <token>` when the app has a token; without
a token (`--listen` on loopback with no `--token-file`) TCP serves only the read-only
dashboard routes of `PUBLIC_ON_TCP` and answers everything else 401 `unauthorized`.

Request bodies have a deadline (`body_timeout_s`): a JSON body must arrive whole within it,
a streamed bundle upload must never pause longer than it. Past it: 408 `request_timeout`
and the connection is closed, so a stalled client cannot hold memory.
"""

from __future__ import annotations

import hmac
import inspect
import logging
import re
from pathlib import Path
from typing import Any, Awaitable, Callable
from urllib.parse import parse_qs

import msgspec
import trio

from motor import faults
from motor.records import (
    CAPABILITIES,
    JobRequest,
    Refusal,
    RefusedError,
    encode_event,
    public_record,
)

log = logging.getLogger("motor.api")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]

JSON = b"application/json"
NDJSON = b"application/x-ndjson"
METRICS_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
HTML = b"text/html; charset=utf-8"

_encoder = msgspec.json.Encoder()
_request_decoder = msgspec.json.Decoder(JobRequest)
_batch_decoder = msgspec.json.Decoder(list[msgspec.Raw])


#: (method, path) served over TCP without a token: the dashboard page, the two reports it
#: draws, and the Prometheus metrics. Read-only; job records, output and writes need the token.
PUBLIC_ON_TCP = frozenset({("GET", "/"), ("GET", "/metrics"), ("GET", "/v1/health"),
                           ("GET", "/v1/status")})
#: A declared body larger than this cannot be a file (off_t is signed 64-bit).
MAX_DECLARED_BYTES = 2**63 - 1


def event_line(event: Any) -> bytes:
    """One NDJSON line (every field present, `seq` included)."""
    return encode_event(event) + b"\n"


class _Disconnected(Exception):
    """The client went away while we were reading its request."""


def refusal_body(refusal: Refusal) -> dict:
    """A refusal as the wire shows it: always with `"refused": true`."""
    data = msgspec.to_builtins(refusal)
    data["refused"] = True
    return data


def read_token_file(path: str | Path) -> str:
    """The bearer token in a token file (surrounding whitespace stripped)."""
    from motor.config import ConfigError
    from motor.smallfiles import read_named

    try:
        token = read_named(path).decode().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read token file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"token file {path} is not UTF-8 text") from None
    if not token:
        raise ConfigError(f"token file {path} is empty")
    return token


def _with_key_header(scope: Scope, req: JobRequest) -> JobRequest:
    """A single submit's `Idempotency-Key` header as its request's idempotency_key (the
    body's field, if it has one, must say the same)."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"idempotency-key":
            key = value.decode("latin-1")
            if req.idempotency_key not in (None, key):
                raise _refuse("bad_request", "the Idempotency-Key header and the body's "
                                             "idempotency_key differ")
            return msgspec.structs.replace(req, idempotency_key=key)
    return req


def _declared_length(scope: Scope) -> int | None:
    """The request's Content-Length, None without one (h11 has checked it is digits)."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                raise _refuse("bad_request", "Content-Length is not a number") from None
    return None


def _decode_error(exc: Exception) -> str:
    """A job request's decoding error as its refusal says it: a field of the wrong type as
    msgspec words it (`Expected ... - at $.field`); JSON that does not parse always says so
    (msgspec's own words for some of it, a lone UTF-16 surrogate escape among them, were
    only "Input data was truncated")."""
    detail = str(exc)
    if isinstance(exc, msgspec.ValidationError) or detail.startswith("JSON is malformed"):
        return detail
    return f"JSON is malformed: {detail}"


def _refuse(code: str, detail: str, **extra: Any) -> RefusedError:
    return RefusedError(Refusal(code=code, detail=detail, **extra))


def _flag(query: dict[str, list[str]], name: str) -> bool:
    values = query.get(name)
    if not values:
        return False
    value = values[-1].strip().lower()
    if value in ("1", "true", "yes", "on", ""):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise _refuse("bad_request", f"query parameter {name} wants 1 or 0, got {values[-1]!r}")


_INT64_MAX = 2**63 - 1


def _int_param(query: dict[str, list[str]], name: str, default: int) -> int:
    values = query.get(name)
    if not values:
        return default
    try:
        value = int(values[-1])
    except ValueError:
        raise _refuse("bad_request", f"query parameter {name} wants an integer, got {values[-1]!r}") from None
    if value < 0:
        raise _refuse("bad_request", f"query parameter {name} must be >= 0")
    if value > _INT64_MAX:  # the job database's integers are 64-bit
        raise _refuse("bad_request", f"query parameter {name} must be at most {_INT64_MAX}")
    return value


class MotorApp:
    """The ASGI callable; one per runner.  Create it with `make_app`."""

    def __init__(self, runner: Any, *, token: str | None = None, max_body_bytes: int | None = None,
                 body_timeout_s: float | None = None):
        self.runner = runner
        self.token = token
        config = getattr(runner, "config", None)
        if max_body_bytes is None:
            max_body_bytes = getattr(config, "max_body_bytes", 1024 * 1024)
        self.max_body_bytes = max_body_bytes
        if body_timeout_s is None:
            body_timeout_s = getattr(config, "body_timeout_s", 30.0)
        self.body_timeout_s = body_timeout_s
        caps = tuple(getattr(runner, "capabilities", CAPABILITIES))
        self.capabilities = list(caps)
        self._caps_header = (b"motor-capabilities", ",".join(caps).encode("ascii"))
        #: set by `stop()`: the runner is stopping (docs/protocol.md, "When the runner stops")
        self.stopping = trio.Event()
        # (compiled path pattern, {method: handler})
        self.routes: list[tuple[re.Pattern[str], dict[str, Callable[..., Awaitable[None]]]]] = [
            (re.compile(r"/"), {"GET": self.index}),
            (re.compile(r"/metrics"), {"GET": self.metrics}),
            (re.compile(r"/v1/health"), {"GET": self.health}),
            (re.compile(r"/v1/status"), {"GET": self.status}),
            (re.compile(r"/v1/workspaces"), {"GET": self.workspaces}),
            (re.compile(r"/v1/jobs"), {"GET": self.list_jobs, "POST": self.submit}),
            (re.compile(r"/v1/jobs/(?P<job_id>[^/]+)"), {"GET": self.get_job}),
            (re.compile(r"/v1/jobs/(?P<job_id>[^/]+)/events"), {"GET": self.events}),
            (re.compile(r"/v1/jobs/(?P<job_id>[^/]+)/cancel"), {"POST": self.cancel}),
            (re.compile(r"/v1/jobs/(?P<job_id>[^/]+)/withdraw"), {"POST": self.withdraw}),
            (re.compile(r"/v1/bundles/(?P<sha256>[^/]+)"), {"PUT": self.put_bundle}),
        ]

    # -- ASGI entry ------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self._lifespan(receive, send)
            return
        if kind == "websocket":
            await send({"type": "websocket.close", "code": 1003})
            return
        if kind != "http":
            return

        started = False

        async def tracking_send(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self._dispatch(scope, receive, tracking_send)
        except RefusedError as exc:
            if started:
                log.warning("refusal after the response started: %s", exc)
            else:
                await self._send_refusal(tracking_send, exc.refusal)
        except _Disconnected:
            pass
        except trio.TooSlowError as exc:  # a part busy past its answer's bound (an actor call)
            log.warning("%s %s: no answer in time: %s", scope.get("method"), scope.get("path"), exc)
            if not started:
                await self._send_refusal(tracking_send, Refusal(code="runner_busy", detail=(
                    f"the runner did not answer in time ({exc}); `motor health` says what it "
                    "waits for (e.g. the job database, on a slow disk or another process's "
                    "lock); retry later")))
        except Exception as exc:  # the server keeps serving
            log.exception("internal error answering %s %s", scope.get("method"), scope.get("path"))
            if not started:
                detail = f"{type(exc).__name__}: {exc}"[:200]
                await self._send_refusal(tracking_send, Refusal(code="internal_error", detail=detail))

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        if len(path) > 1 and path.endswith("/"):
            path = path.rstrip("/") or "/"
        method = scope["method"]
        if scope.get("server") is not None:  # TCP
            if self.token is not None:
                self._check_token(scope)
            elif (method, path) not in PUBLIC_ON_TCP:
                raise _refuse(
                    "unauthorized",
                    "this TCP listener has no --token-file: it serves only GET /, /metrics, "
                    "/v1/health and /v1/status; use the Unix socket, or start the runner "
                    "with --token-file and send Authorization: Bearer <token>")
        for pattern, handlers in self.routes:
            match = pattern.fullmatch(path)
            if match is None:
                continue
            handler = handlers.get(method)
            if handler is None:
                allowed = ", ".join(sorted(handlers))
                raise _refuse(
                    "method_not_allowed", f"{method} is not allowed on {path} (allowed: {allowed})"
                )
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
            await handler(scope, receive, send, query, **match.groupdict())
            return
        raise _refuse("not_found", f"no route {method} {path}")

    def _check_token(self, scope: Scope) -> None:
        given = None
        for name, value in scope.get("headers", ()):
            if name.lower() == b"authorization":
                given = value.decode("latin-1")
                break
        if given is None:
            raise _refuse("unauthorized", "missing Authorization: Bearer token")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode("utf-8", "surrogateescape"), self.token.encode("utf-8")
        ):
            raise _refuse("unauthorized", "wrong bearer token")

    # -- responses -------------------------------------------------------------------------

    def stop(self) -> None:
        """The runner is stopping: answers from now on say `connection: close` (the server
        closes each connection after its answer), and event streams end cleanly now."""
        self.stopping.set()

    def _headers(self, content_type: bytes, length: int | None = None, extra=()) -> list:
        headers = [(b"content-type", content_type), self._caps_header, (b"cache-control", b"no-store")]
        if self.stopping.is_set():
            headers.append((b"connection", b"close"))
        if length is not None:
            headers.append((b"content-length", str(length).encode("ascii")))
        headers.extend(extra)
        return headers

    async def _send_bytes(self, send: Send, status: int, content_type: bytes, body: bytes) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": self._headers(content_type, len(body))})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _send_json(self, send: Send, status: int, obj: Any) -> None:
        await self._send_bytes(send, status, JSON, _encoder.encode(obj) + b"\n")

    async def _send_refusal(self, send: Send, refusal: Refusal) -> None:
        await self._send_json(send, refusal.http_status, refusal_body(refusal))

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        """The request body, refusing (413) once it passes max_body_bytes (never buffering
        more) and (408) when it is not complete within body_timeout_s."""
        limit = self.max_body_bytes
        declared = _declared_length(scope)
        if declared is not None and declared > limit:
            raise _refuse("body_too_large", f"request body of {declared} bytes exceeds the limit of {limit} bytes")
        body = bytearray()
        with trio.move_on_after(self.body_timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise _Disconnected()
                chunk = message.get("body", b"")
                if len(body) + len(chunk) > limit:
                    raise _refuse("body_too_large", f"request body exceeds the limit of {limit} bytes")
                body += chunk
                if not message.get("more_body", False):
                    return bytes(body)
        got = f"{len(body)} of {declared}" if declared is not None else f"{len(body)}"
        raise _refuse("request_timeout",
                      f"request body not complete within {self.body_timeout_s:g} s "
                      f"({got} bytes received)")

    async def _stream_events(self, receive: Receive, send: Send, status: int, events: Any) -> None:
        """Send an event iterator as NDJSON, flushed per event, until it ends or the client leaves.

        The first event is fetched before the response starts, so a refusal raised on the
        first `anext` (not_found, history_expired) still gets its own status code.
        """
        iterator = events.__aiter__()
        try:
            try:
                first = await iterator.__anext__()
            except StopAsyncIteration:
                first = None
            await send({"type": "http.response.start", "status": status,
                        "headers": self._headers(NDJSON)})
            disconnected = False

            async def watch_disconnect(cancel_scope: trio.CancelScope) -> None:
                nonlocal disconnected
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        disconnected = True
                        cancel_scope.cancel()
                        return

            async def watch_stop(cancel_scope: trio.CancelScope) -> None:
                await self.stopping.wait()
                cancel_scope.cancel()  # the stream ends cleanly; the client follows it again

            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch_disconnect, nursery.cancel_scope)
                nursery.start_soon(watch_stop, nursery.cancel_scope)
                try:
                    if first is not None:
                        await send({"type": "http.response.body",
                                    "body": event_line(first), "more_body": True})
                        async for event in iterator:
                            await send({"type": "http.response.body",
                                        "body": event_line(event), "more_body": True})
                            # a write to a connection its client closed fails quietly (the
                            # server marks it closed and says so to `watch_disconnect`) and
                            # a stored replay yields with no schedule point: here the
                            # disconnect ends the replay (stop 56: before, the rest of a
                            # job's output was read and encoded for nobody)
                            await trio.lowlevel.checkpoint()
                except RefusedError as exc:
                    log.warning("event stream ended by a refusal: %s", exc)
                except Exception:
                    log.exception("event stream failed")
                nursery.cancel_scope.cancel()
            if not disconnected:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                with trio.CancelScope(shield=True):
                    await aclose()

    # -- handlers --------------------------------------------------------------------------

    async def index(self, scope, receive, send, query) -> None:
        from motor.accounting.dashboard import PAGE_BYTES  # the dashboard (GET /)

        await self._send_bytes(send, 200, HTML, PAGE_BYTES)

    async def metrics(self, scope, receive, send, query) -> None:
        text = self.runner.metrics_text()
        if inspect.isawaitable(text):
            text = await text
        if isinstance(text, str):
            text = text.encode("utf-8")
        await self._send_bytes(send, 200, METRICS_TYPE, text)

    async def health(self, scope, receive, send, query) -> None:
        await self._send_json(send, 200, await self.runner.health())

    async def status(self, scope, receive, send, query) -> None:
        # already encoded: the queued records are spliced from cached bytes (issue 14)
        await self._send_bytes(send, 200, JSON,
                               await self.runner.status_json(full=_flag(query, "full")))

    async def workspaces(self, scope, receive, send, query) -> None:
        await self._send_json(send, 200, await self.runner.workspaces())

    async def list_jobs(self, scope, receive, send, query) -> None:
        records = await self.runner.jobs(all=_flag(query, "all"))
        await self._send_json(send, 200, [public_record(r) for r in records])

    async def get_job(self, scope, receive, send, query, job_id: str) -> None:
        await self._send_json(send, 200, public_record(await self.runner.get(job_id)))

    async def submit(self, scope, receive, send, query) -> None:
        follow = _flag(query, "follow")
        body = await self._read_body(scope, receive)
        if not body.strip():
            raise _refuse("bad_request", "request body is empty (malformed JSON); expected a JSON job request")
        if body.lstrip()[:1] == b"[":
            await self._submit_batch(send, body, follow)
            return
        try:
            req = _request_decoder.decode(body)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise _refuse("bad_request", _decode_error(exc)) from None
        except RecursionError:
            raise _refuse("bad_request", "malformed job request: JSON nested too deeply") from None
        req = _with_key_header(scope, req)
        # the runner validates the request (records.validate_request, once, in the dispatcher)
        # and refuses it bad_request: the same answer for the API and embedded callers
        record = await self.runner.submit(req, follow=follow)
        await faults.ahit("api.submitted")  # tests: accepted and recorded, not yet answered
        # A job that starts at once had its actor started in the dispatcher's turn that
        # answered: let it take its turn (the job directory, spec.json, keeperd's request)
        # before this answer is written, not after it at random (trio runs the tasks made
        # runnable together in either order): the answer waits about as long as the start
        # would have, the start no longer waits for the answer
        await trio.lowlevel.cancel_shielded_checkpoint()
        if follow:
            await self._stream_events(receive, send, 202, self.runner.follow(record.job_id))
        else:
            data = public_record(record)
            data["capabilities"] = self.capabilities
            await self._send_json(send, 202, data)

    async def _submit_batch(self, send: Send, body: bytes, follow: bool) -> None:
        """`POST /v1/jobs` with a JSON list of job requests: 200 and a list answering each
        item in order, its accepted record or its refusal (`"refused": true`, code, detail).
        A body that is not a JSON list, an empty list, `follow=1`, or more than MAX_BATCH_JOBS
        items is refused whole (nothing is submitted)."""
        from motor.wire import MAX_BATCH_JOBS

        if follow:
            raise _refuse("bad_request", "follow=1 takes one job request, not a list: submit the batch "
                                         "without follow and follow each job with GET /v1/jobs/{id}/events")
        try:
            items = _batch_decoder.decode(body)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise _refuse("bad_request", f"malformed batch: {exc}") from None
        except RecursionError:
            raise _refuse("bad_request", "malformed batch: JSON nested too deeply") from None
        if not items:  # most likely a client's bug (and `[]` was never a job request)
            raise _refuse("bad_request", "empty batch: a batch submit needs at least one job request")
        if len(items) > MAX_BATCH_JOBS:
            raise _refuse("batch_too_large",
                          f"a batch submit carries at most {MAX_BATCH_JOBS} jobs, got {len(items)}")
        answers: list[Any] = [None] * len(items)
        reqs: list[JobRequest] = []
        where: list[int] = []
        for i, raw in enumerate(items):
            try:
                reqs.append(_request_decoder.decode(raw))
                where.append(i)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                answers[i] = refusal_body(Refusal(code="bad_request", detail=_decode_error(exc)))
            except RecursionError:
                answers[i] = refusal_body(Refusal(code="bad_request",
                                                  detail="malformed job request: JSON nested too deeply"))
        for i, outcome in zip(where, await self.runner.submit_many(reqs)):
            answers[i] = refusal_body(outcome) if isinstance(outcome, Refusal) else public_record(outcome)
        await self._send_json(send, 200, answers)

    async def events(self, scope, receive, send, query, job_id: str) -> None:
        from_seq = _int_param(query, "from_seq", 0)
        await self._stream_events(receive, send, 200, self.runner.events(job_id, from_seq))

    async def cancel(self, scope, receive, send, query, job_id: str) -> None:
        await self._send_json(send, 200, public_record(await self.runner.cancel(job_id)))

    async def withdraw(self, scope, receive, send, query, job_id: str) -> None:
        result = await self.runner.withdraw(job_id)
        await self._send_json(send, 200, {"result": result})

    async def put_bundle(self, scope, receive, send, query, sha256: str) -> None:
        """Stream the body to the runner's bundle store chunk by chunk (never buffered whole).
        The runner refuses (runner_disk_full, with free_bytes and floor_bytes) before the
        first chunk is read when free space is below the floor. The upload may take as long
        as it needs, but it never pauses longer than body_timeout_s (408 request_timeout)."""
        declared = _declared_length(scope)
        if declared is not None and declared > MAX_DECLARED_BYTES:
            raise _refuse("body_too_large",
                          f"Content-Length {declared} is larger than any file can be")
        timeout = self.body_timeout_s

        async def chunks():
            received = 0
            while True:
                message = None
                with trio.move_on_after(timeout):
                    message = await receive()
                if message is None:
                    raise _refuse("request_timeout",
                                  f"bundle upload paused for more than {timeout:g} s "
                                  f"({received} bytes received)")
                if message["type"] == "http.disconnect":
                    raise _Disconnected()
                body = message.get("body", b"")
                received += len(body)
                if body:
                    yield body
                if not message.get("more_body", False):
                    return

        put = getattr(self.runner, "put_bundle", None)
        if put is None:
            raise _refuse("not_found", "bundle upload is not supported by this runner")
        body = chunks()
        try:
            result = await put(sha256, body)
        except RefusedError:
            # Read the rest of the body into nowhere before answering (bounded), so the
            # client sees the refusal instead of a connection reset mid-upload.
            drained = 0
            with trio.move_on_after(30):
                try:
                    async for chunk in body:
                        drained += len(chunk)
                        if drained > DRAIN_LIMIT:
                            break
                except (_Disconnected, RefusedError):  # gone, or paused past the deadline
                    pass
            raise
        await self._send_json(send, 201, result)


DRAIN_LIMIT = 1024**3  # bytes of a refused upload read and dropped before the answer


def make_app(runner: Any, *, token: str | None = None, max_body_bytes: int | None = None,
             body_timeout_s: float | None = None) -> MotorApp:
    """The ASGI app for `runner`.

    `token`: bearer token required on TCP requests; when None and `runner.config.token_file`
    is set, the token is read from that file (ConfigError when unreadable or empty).
    `max_body_bytes`: request body limit; default `runner.config.max_body_bytes`.
    `body_timeout_s`: request body deadline; default `runner.config.body_timeout_s`.
    """
    if token is None:
        token_file = getattr(getattr(runner, "config", None), "token_file", None)
        if token_file:
            token = read_token_file(token_file)
    return MotorApp(runner, token=token, max_body_bytes=max_body_bytes,
                    body_timeout_s=body_timeout_s)
