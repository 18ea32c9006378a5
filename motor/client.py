"""Clients of the motor HTTP API: `Client` (synchronous, for the CLI and scripts) and
`AsyncClient` (same methods, async; works under trio and asyncio).

    from motor.client import Client
    with Client() as c:                                  # $MOTOR_SOCKET or the default socket
        rec = c.submit(JobRequest(command=["make"]))     # -> JobRecord
        with c.events(rec.job_id) as stream:             # replay, then follow
            for event in stream:
                ...

A refusal raises `records.RefusedError` (its `.refusal` is the decoded `Refusal`); a runner
that cannot be reached raises `RunnerUnavailable`.  Requests carry the client's
`capabilities`; the runner's come back in the `Motor-Capabilities` header and are kept in
`client.runner_capabilities`.

`Client` speaks HTTP/1.1 itself over the socket (the `_Wire` below, standard library only):
it is the transport of every `motor` client command, and httpx alone costs more to import
than a whole `motor run -- date` may take (docs/cli.md, "Start-up cost").  `AsyncClient`
uses httpx, imported when the first AsyncClient is made.

Importing this module loads only the standard library pieces a request needs (socket, json):
msgspec and motor.records (the typed records and events) are imported when a typed answer
is first asked for (`submit` -> JobRecord, decoded events, a refusal), so the CLI, which
asks for the wire's plain dicts (`call`, `submit_raw`, `events(..., raw=True)`), never loads
them on its way to a job (tests/cli/test_lean_client.py pins it).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import _socket
import io

from motor.wire import CAPABILITIES, MAX_BATCH_JOBS, answer_wait_s, default_socket_str

TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover - annotations only (typing costs milliseconds to import)
    from pathlib import Path
    from typing import Any, AsyncIterator, Iterable, Iterator

    import httpx

    from motor.records import AnyEvent, JobRecord, JobRequest, Refusal

#: answers at least this large are decoded with the cyclic garbage collector paused
GC_PAUSE_BYTES = 256 * 1024
MSGSPEC_BYTES = 4 * 1024 * 1024  # `_loads`: an answer this large is decoded by msgspec


def _loads(data: bytes) -> Any:
    """`json.loads`, with the collector paused for a large answer (issue 14). `GET
    /v1/status?full=1` with 10,000 queued jobs is 6 MB (the rows of `GET /v1/status` 3 MB),
    some 300,000 new containers: they trigger
    a young collection every 700 and full passes over everything the process holds, which
    cost as much as the decode itself and found nothing to free (a decoded document has no
    reference cycles). Named here, not `json.loads`: methods below take a `json=` argument
    that hides the module."""
    if len(data) < GC_PAUSE_BYTES:
        return json.loads(data)
    # msgspec decodes a large answer in half json's time (6 MB: ~28 against ~55 ms of CPU),
    # but importing it costs ~25 ms: for a client that has it already, or an answer so large
    # that one decode pays for the import (stop 23)
    decode = _msgspec_decode() if "msgspec" in sys.modules or len(data) >= MSGSPEC_BYTES \
        else json.loads
    if not gc.isenabled():
        return decode(data)
    gc.disable()
    try:
        return decode(data)
    finally:
        gc.enable()


def _msgspec_decode():
    import msgspec

    return msgspec.json.decode


DEFAULT_TIMEOUT = 30.0
#: `submit_many` keeps each batch (at most MAX_BATCH_JOBS requests) under this many bytes
#: (the runner's default body limit is 1 MiB)
MAX_BATCH_BYTES = 512 * 1024


class RunnerUnavailable(ConnectionError):
    """No runner answered (socket missing, connection refused, or the connection broke)."""

    #: the request was sent whole and its answer did not come: the runner may have acted
    #: on it (a submit may have been accepted)
    sent = False


def default_socket_path() -> Path:
    """`motor.config.default_socket()` without importing motor.config (msgspec)."""
    from pathlib import Path

    return Path(default_socket_str())


def parse_endpoint(endpoint: str) -> dict:
    """`unix:/path/motor.sock` or `http://host:port` -> Client keyword arguments."""
    if endpoint.startswith("unix:"):
        return {"socket_path": endpoint[5:]}
    if endpoint.startswith(("http://", "https://")):
        return {"url": endpoint}
    raise ValueError(f"endpoint wants unix:/path or http://host:port, got {endpoint!r}")


def json_bytes(obj: Any) -> bytes:
    """Compact UTF-8 JSON, byte for byte what msgspec.json.encode writes for builtins."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")


def refusal_fields(status: int, body: bytes) -> dict:
    """A refusal answer as a dict (`refused`, `code`, `detail`, extras): the runner's own, or
    one made from the HTTP status when the body is not a refusal (a proxy's error page)."""
    try:
        data = _loads(body)
    except ValueError:
        data = None
    if isinstance(data, dict) and data.get("refused") and isinstance(data.get("code"), str):
        if not isinstance(data.get("detail"), str):
            data["detail"] = str(data.get("detail", ""))
        return data
    from motor.records import REFUSAL_HTTP_STATUS

    by_status: dict[int, str] = {}
    for code, http_status in REFUSAL_HTTP_STATUS.items():
        by_status.setdefault(http_status, code)
    text = body.decode("utf-8", "replace").strip()[:200] or f"HTTP {status}"
    return {"refused": True, "code": by_status.get(status, "internal_error" if status >= 500 else "bad_request"),
            "detail": text}


def _refusal(fields: dict) -> Refusal:
    import msgspec

    from motor.records import Refusal

    known = {k: v for k, v in fields.items() if k in Refusal.__struct_fields__}
    try:
        return msgspec.convert(known, Refusal)
    except msgspec.ValidationError:
        return Refusal(code=str(fields.get("code")), detail=str(fields.get("detail", "")))


def _refusal_from_response(status: int, body: bytes) -> Refusal:
    return _refusal(refusal_fields(status, body))


def _refused_error(fields: dict) -> Exception:
    from motor.records import RefusedError

    return RefusedError(_refusal(fields))


def refusal_of(exc: BaseException) -> Refusal | None:
    """The Refusal a `RefusedError` carries, else None, without importing motor.records
    (a RefusedError can only have been raised once that module is loaded): lets the CLI
    catch refusals without paying for msgspec on its way to a job."""

    records = sys.modules.get("motor.records")
    if records is not None and isinstance(exc, records.RefusedError):
        return exc.refusal
    return None


#: the characters `urllib.parse.quote(s, safe="")` leaves as they are
_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-~")


def _quote(text: str) -> str:
    """`urllib.parse.quote(text, safe="")` (urllib.parse costs milliseconds to import)."""
    return "".join(chr(b) if b in _UNRESERVED else f"%{b:02X}" for b in str(text).encode("utf-8"))


def _query(params: dict) -> str:
    """`urllib.parse.urlencode(params)` for str keys and values."""
    return "&".join(f"{_quote(k).replace('%20', '+')}={_quote(v).replace('%20', '+')}"
                    for k, v in params.items())


def _jp(job_id: str) -> str:
    return _quote(str(job_id))


def _record(data: Any) -> JobRecord:
    import msgspec

    from motor.records import JobRecord

    return msgspec.convert(data, JobRecord)


def _decode_line(line: str) -> AnyEvent | None:
    if not line.strip():
        return None
    import msgspec

    from motor.records import decode_event

    try:
        return decode_event(line)
    except msgspec.ValidationError:
        return None  # an event kind this client does not know: skip it


def _raw_line(line: str) -> dict | None:
    """One event line as the wire's dict; None for a blank or non-object line."""
    if not line.strip():
        return None
    try:
        event = _loads(line)
    except ValueError:
        return None
    return event if isinstance(event, dict) and isinstance(event.get("event"), str) else None


def _is_terminal(event: Any) -> bool:
    """A stream's last event: `terminal` (a decoded Terminal, or the wire's dict)."""
    if isinstance(event, dict):
        return event.get("event") == "terminal"
    return getattr(getattr(type(event), "__struct_config__", None), "tag", None) == "terminal"


# --- a lean HTTP/1.1 client (the synchronous Client's transport) --------------------------


class TransportError(OSError):
    """The connection failed, broke, timed out, or the peer did not speak HTTP/1.1."""

    sent = False  # as RunnerUnavailable.sent


class _Headers(dict):
    """Response headers, names lower-cased; repeated headers are joined with ", "."""

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        return super().get(name.lower(), default)


class _SocketReader(io.RawIOBase):
    """The reading side of a C socket, for io.BufferedReader (what socket.makefile("rb")
    gives a socket.socket; closing it leaves the socket to its owner)."""

    def __init__(self, sock: _socket.socket):
        super().__init__()
        self._sock = sock

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        return self._sock.recv_into(buffer)


class _Response:
    """One HTTP/1.1 response. Closing it gives its connection back to the wire when the
    body was read to its end and the runner did not say `connection: close`; else the
    connection closes with it."""

    def __init__(self, sock: _socket.socket, reader, status_code: int, headers: _Headers, method: str,
                 wire: "_Wire | None" = None):
        self._sock = sock
        self._wire = wire
        self._reader = reader
        self.status_code = status_code
        self.headers = headers
        self._content: bytes | None = None
        self._closed = False
        self._owners: set | None = None  # the client's set of open streams, while this is one
        te = headers.get("transfer-encoding", "").lower()
        if method == "HEAD" or status_code in (204, 304) or 100 <= status_code < 200:
            self._mode, self._left = "length", 0
        elif "chunked" in te:
            self._mode, self._left = "chunked", 0
        elif headers.get("content-length") is not None:
            try:
                self._left = int(headers["content-length"])
            except ValueError:
                raise TransportError(f"bad content-length {headers['content-length']!r}") from None
            self._mode = "length"
        else:
            self._mode, self._left = "close", 0
        self._eof = self._mode == "length" and self._left == 0

    def set_read_timeout(self, timeout: float | None) -> None:
        self._sock.settimeout(timeout)

    def iter_bytes(self) -> Iterator[bytes]:
        """The body as it arrives (chunks decoded)."""
        try:
            while not self._eof:
                if self._mode == "length":
                    data = self._reader.read1(min(self._left, 1 << 16))
                    if not data:
                        raise TransportError("the connection closed in the middle of the body")
                    self._left -= len(data)
                    self._eof = self._left == 0
                elif self._mode == "chunked":
                    if self._left == 0:
                        line = self._reader.readline(1024)
                        if not line.endswith(b"\n"):
                            raise TransportError("the connection closed in the middle of a chunked body")
                        try:
                            self._left = int(line.split(b";", 1)[0].strip(), 16)
                        except ValueError:
                            raise TransportError(f"bad chunk size line {line[:40]!r}") from None
                        if self._left == 0:  # the last chunk: skip trailers
                            while self._reader.readline(8192).strip():
                                pass
                            self._eof = True
                            break
                    data = self._reader.read1(min(self._left, 1 << 16))
                    if not data:
                        raise TransportError("the connection closed in the middle of a chunk")
                    self._left -= len(data)
                    if self._left == 0:
                        self._reader.readline(8)  # the CRLF after the chunk
                else:
                    data = self._reader.read1(1 << 16)
                    if not data:
                        self._eof = True
                        break
                if data:
                    yield data
        except TransportError:
            raise
        except (OSError, ValueError) as exc:  # a timeout, a reset, or a read after close
            raise TransportError(str(exc) or type(exc).__name__) from exc
        finally:
            if self._eof:
                self.close()

    def iter_lines(self) -> Iterator[str]:
        pending = b""
        for data in self.iter_bytes():
            pending += data
            if b"\n" in data:
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    yield line.rstrip(b"\r").decode("utf-8", "surrogateescape")
        if pending:
            yield pending.rstrip(b"\r").decode("utf-8", "surrogateescape")

    def read(self) -> bytes:
        if self._content is None:
            self._content = b"".join(self.iter_bytes())
            self.close()
        return self._content

    @property
    def content(self) -> bytes:
        return self.read()

    @property
    def text(self) -> str:
        return self.read().decode("utf-8", "replace")

    def close(self, *, last_event_read: bool = False) -> None:
        """`last_event_read`: the caller read an event stream's last event (`terminal`),
        which the runner follows at once with the chunked body's end: the connection goes
        back to the wire with that end still to read (`ended_quietly`, by the next request
        that takes it), so a client that follows one job after another keeps one
        connection, and a closing one (the CLI's) waits for nothing."""
        if not self._closed:
            self._closed = True
            if self._owners is not None:
                self._owners.discard(self)
            if (self._mode != "close" and self._wire is not None
                    and "close" not in self.headers.get("connection", "").lower()):
                if self._eof:
                    self._wire.give(self._sock, self._reader)
                    return
                if last_event_read and self._mode == "chunked":
                    self._wire.give(self._sock, self._reader, rest=self)
                    return
            try:
                self._reader.close()
            finally:
                self._sock.close()

    def ended_quietly(self, timeout: float) -> bool:
        """Read what is left of the body, within `timeout`: whether it ended with no data
        left in it (else, or on any error, the connection is not to be used again)."""
        try:
            self._sock.settimeout(timeout)
            for _ in self.iter_bytes():
                return False  # more after the stream's last event: not a body we know
        except (TransportError, OSError):
            return False
        return self._eof


class _Wire:
    """HTTP/1.1 to one runner: a Unix socket path, or `http(s)://host:port[/prefix]`.

    Keep-alive: the connection of a response read to its end goes back to the wire and the
    next request within `REUSE_S` takes it (issue 14: 200 submits one after the other
    through `motor serve`, 88.0 -> 96.5 jobs/s, docs/performance-history.md "Stop 30"; the
    runner's accept and its connection set-up are per connection). It is taken only
    after a non-blocking look finds it neither closed by the runner nor holding stray
    bytes, and the runner keeps an idle connection for its `--head-timeout` (5 s, at least
    2: motor/config.py), beyond `REUSE_S`. A request whose send on a kept connection fails
    (the runner closed it all the same) is sent again on a new one: nothing of it was
    read there. An event stream owns its connection (it may last as long as its job)."""

    #: how long an idle connection is kept for the next request (the runner closes one
    #: idle for 5 s)
    REUSE_S = 1.0
    #: how long the next request waits for the end of an event stream's body that was
    #: left after its last event (the runner sends it right after; past this, or with
    #: anything else in it, the connection is dropped and a new one made)
    REST_S = 1.0

    def __init__(self, socket_path: str | os.PathLike | None, base_url: str, headers: dict[str, str],
                 timeout: float | None):
        self.socket_path = socket_path
        self.timeout = timeout
        self.headers = dict(headers)
        # (socket, reader, since, the response whose body's end is still to read or None)
        self._idle: tuple[Any, Any, float, Any] | None = None
        if socket_path is not None:  # the Unix socket: no URL to parse (urllib.parse is not cheap)
            self.scheme, self.host, self.port, self.prefix, self.host_header = "http", "localhost", 80, "", "motor"
            return
        from urllib.parse import urlsplit

        parts = urlsplit(base_url)
        self.scheme = parts.scheme
        if self.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url wants http://HOST:PORT, got {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if self.scheme == "https" else 80)
        self.prefix = parts.path.rstrip("/")
        self.host_header = parts.netloc or "motor"

    def _connect(self) -> _socket.socket:
        try:
            if self.socket_path is not None:
                # the C socket: socket.py (with selectors, array, enum's IntEnums) is not
                # needed for one Unix stream, and costs milliseconds of every command's start
                sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
                try:
                    sock.settimeout(self.timeout)
                    sock.connect(os.fspath(self.socket_path))
                except BaseException:
                    sock.close()
                    raise
                return sock
            import socket

            sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.scheme == "https":
                import ssl

                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=self.host)
            return sock
        except OSError as exc:
            raise TransportError(str(exc) or type(exc).__name__) from exc

    def send(self, method: str, path: str, *, json: Any = None, params: dict | None = None,
             content: bytes | Iterable[bytes] | None = None, length: int | None = None,
             headers: dict[str, str] | None = None, read_timeout: float | None | str = "default"
             ) -> _Response:
        """Send one request; the response once its head has arrived (the body is read lazily).
        The connect is bounded by the client's timeout; `read_timeout=None` then lets the
        request and its answer take as long as they take (event streams, uploads)."""
        target = self.prefix + path
        if params:
            target += "?" + _query(params)
        head = {"host": self.host_header, "user-agent": "motor-client", "accept-encoding": "identity"}
        head.update(self.headers)
        head.update(headers or {})
        body: bytes | None = None
        chunks: Iterable[bytes] | None = None
        if json is not None:
            body = json_bytes(json)
            head["content-type"] = "application/json"
        elif isinstance(content, (bytes, bytearray)):
            body = bytes(content)
        elif content is not None:
            chunks = content
        if body is not None:
            head["content-length"] = str(len(body))
        elif chunks is not None:
            if length is not None:
                head["content-length"] = str(length)
            else:
                head["transfer-encoding"] = "chunked"
        elif method in ("POST", "PUT", "PATCH"):
            head["content-length"] = "0"
        lines = [f"{method} {target} HTTP/1.1"] + [f"{k}: {v}" for k, v in head.items()]
        request_head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        kept = self._take() if chunks is None else None
        sock, reader = kept or (self._connect(), None)
        sent = False
        sock.settimeout(self.timeout if read_timeout == "default" else read_timeout)  # type: ignore[arg-type]
        try:
            try:
                if body is not None:
                    try:
                        sock.sendall(request_head + body)
                    except OSError:
                        if kept is None:
                            raise
                        # the runner closed the kept connection after all: nothing of the
                        # request was read there; send it on a new one
                        self._drop(sock, reader)
                        sock, reader = self._connect(), None
                        sock.settimeout(self.timeout if read_timeout == "default" else read_timeout)  # type: ignore[arg-type]
                        sock.sendall(request_head + body)
                else:
                    sock.sendall(request_head)
                    if chunks is not None:
                        framed = "transfer-encoding" in head
                        for chunk in chunks:
                            if not chunk:
                                continue
                            if framed:
                                sock.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
                            else:
                                sock.sendall(chunk)
                        if framed:
                            sock.sendall(b"0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass  # the runner answered early (a refusal) and closed: read its answer
            if reader is None:
                reader = sock.makefile("rb") if hasattr(sock, "makefile") else io.BufferedReader(_SocketReader(sock))
            sent = True  # from here a failure leaves the runner's answer unknown
            try:
                status_code, response_headers = self._read_head(reader)
            except BaseException:
                reader.close()
                raise
        except BaseException as exc:
            sock.close()
            if isinstance(exc, TransportError):
                exc.sent = sent
                raise
            if isinstance(exc, (OSError, ValueError)):
                error = TransportError(str(exc) or type(exc).__name__)
                error.sent = sent
                raise error from exc
            raise
        return _Response(sock, reader, status_code, response_headers, method, self)

    def _take(self) -> tuple[Any, Any] | None:
        """The kept connection, if it is fresh and still open with nothing unread."""
        idle, self._idle = self._idle, None
        if idle is None:
            return None
        sock, reader, since, rest = idle
        if time.monotonic() - since > self.REUSE_S or (
                rest is not None and not rest.ended_quietly(self.REST_S)):
            self._drop(sock, reader)
            return None
        try:
            sock.setblocking(False)
            try:
                sock.recv(1, _socket.MSG_PEEK)
            finally:
                sock.setblocking(True)
        except BlockingIOError:
            return sock, reader  # open, nothing to read: as it should be
        except OSError:
            pass
        self._drop(sock, reader)  # closed by the runner (b""), or bytes no request asked for
        return None

    def give(self, sock: Any, reader: Any, rest: "_Response | None" = None) -> None:
        """A connection whose response was read to its end (or, with `rest`, to an event
        stream's last event: the body's end is read when the connection is taken), for the
        next request (not a TLS one: its look ahead would need the TLS layer)."""
        if self.scheme == "https":
            self._drop(sock, reader)
            return
        if self._idle is not None:
            self._drop(*self._idle[:2])
        self._idle = (sock, reader, time.monotonic(), rest)

    @staticmethod
    def _drop(sock: Any, reader: Any) -> None:
        try:
            if reader is not None:
                reader.close()
        finally:
            sock.close()

    def close(self) -> None:
        """Close the kept connection (if any)."""
        if self._idle is not None:
            idle, self._idle = self._idle, None
            self._drop(*idle[:2])

    def __del__(self) -> None:  # a client dropped without close(): its kept connection goes
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit the socket may be gone already
            pass

    @staticmethod
    def _read_head(reader) -> tuple[int, _Headers]:
        while True:
            line = reader.readline(65537)
            if not line:
                raise TransportError("the runner closed the connection without an answer")
            parts = line.decode("latin-1").split(None, 2)
            if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
                raise TransportError(f"not an HTTP/1.1 answer: {line[:60]!r}")
            status = int(parts[1])
            headers = _Headers()
            count = 0
            while True:
                raw = reader.readline(65537)
                if not raw:
                    raise TransportError("the runner closed the connection in the middle of the headers")
                if raw in (b"\r\n", b"\n"):
                    break
                count += 1
                if count > 200:
                    raise TransportError("too many response headers")
                name, sep, value = raw.decode("latin-1").partition(":")
                if not sep:
                    raise TransportError(f"bad response header {raw[:60]!r}")
                key, value = name.strip().lower(), value.strip()
                headers[key] = f"{headers[key]}, {value}" if key in headers else value
            if status == 100 or (101 < status < 200):
                continue  # an interim answer: the real one follows
            return status, headers


class _Base:
    def __init__(
        self,
        socket_path: str | os.PathLike | None = None,
        *,
        url: str | None = None,
        token: str | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
        capabilities: tuple[str, ...] | list[str] = CAPABILITIES,
    ):
        if url is None:
            self._socket: str | None = os.fspath(socket_path) if socket_path else default_socket_str()
            self.base_url = "http://motor"
        else:
            self._socket = None
            self.base_url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self.capabilities = list(capabilities)
        self.runner_capabilities: list[str] | None = None
        headers = {"accept": "application/json"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        self._headers = headers

    @property
    def socket_path(self) -> Path | None:
        """The runner's Unix socket (None for a client of `url`)."""
        if self._socket is None:
            return None
        from pathlib import Path

        return Path(self._socket)

    @property
    def where(self) -> str:
        return self._socket if self._socket is not None else self.base_url

    def _check_socket(self) -> None:
        if self._socket is not None and not os.path.exists(self._socket):
            raise RunnerUnavailable(f"no runner answered at {self._socket}: no such socket")

    def _unavailable(self, exc: Exception) -> RunnerUnavailable:
        error = RunnerUnavailable(f"no runner answered at {self.where}: {exc}")
        error.sent = getattr(exc, "sent", False)
        return error

    def _note(self, response: "httpx.Response | _Response") -> None:
        caps = response.headers.get("motor-capabilities")
        if caps is not None:
            self.runner_capabilities = [c for c in caps.split(",") if c]

    def request_body(self, req: JobRequest | dict) -> Any:
        """A job request as the JSON body of POST /v1/jobs, with this client's capabilities.
        Anything that is neither a dict nor a JobRequest is sent as it is, for the runner to
        refuse (`motor submit --from` a file with a stray `7` in it)."""
        if isinstance(req, dict):
            data = dict(req)
        elif hasattr(req, "__struct_fields__"):  # a JobRequest (msgspec is loaded, then)
            import msgspec

            data = msgspec.to_builtins(req)
        else:
            return req
        if not data.get("capabilities"):
            data["capabilities"] = self.capabilities
        return data

    def _stream_timeout(self) -> "httpx.Timeout":
        import httpx

        return httpx.Timeout(self.timeout, read=None)


# --- synchronous ------------------------------------------------------------------------


class EventStream:
    """An open NDJSON event stream: iterate for decoded events (with `raw=True`, each event
    as the wire's dict, every line a JSON object with an `event` key); close (or use `with`)."""

    def __init__(self, client: "Client", response: _Response, raw: bool = False):
        self._client = client
        self.response = response
        self._lines: Iterator[str] | None = None
        self._decode = _raw_line if raw else _decode_line
        self._last_read = False  # the stream's last event (terminal) was read

    def __iter__(self) -> "EventStream":
        return self

    def __next__(self) -> AnyEvent:
        if self._lines is None:
            self._lines = self.response.iter_lines()
        try:
            while True:
                event = self._decode(next(self._lines))
                if event is not None:
                    self._last_read = _is_terminal(event)
                    return event
        except StopIteration:
            self.close()
            raise
        except TransportError as exc:
            self._last_read = False
            self.close()
            raise RunnerUnavailable(f"lost the connection to the runner at {self._client.where}: {exc}") from exc

    def close(self) -> None:
        """Close the stream. After its last event (`terminal`) its connection is kept for
        the client's next request (`_Response.close`)."""
        self.response.close(last_event_read=self._last_read)

    def __enter__(self) -> "EventStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Client(_Base):
    """Synchronous client.  `Client(socket_path=None, *, url=None, token=None, timeout=30)`."""

    RETRY_GAP_S = 0.25  # between a keyed submit's tries (`submit`'s retry_s)

    def __init__(self, socket_path=None, *, url=None, token=None, timeout=DEFAULT_TIMEOUT,
                 capabilities=CAPABILITIES):
        super().__init__(socket_path, url=url, token=token, timeout=timeout, capabilities=capabilities)
        self._wire = _Wire(self._socket, self.base_url, self._headers, timeout)
        self._open: set[_Response] = set()  # open streams (each leaves it when it closes) close with the client

    @classmethod
    def for_endpoint(cls, endpoint: str, **kwargs) -> "Client":
        return cls(**parse_endpoint(endpoint), **kwargs)

    def close(self) -> None:
        """Close the connections of event streams still open, and the kept one."""
        for response in list(self._open):
            response.close()
        self._wire.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- plumbing --------------------------------------------------------------------------

    def _send(self, method: str, path: str, *, json: Any = None, params: dict | None = None,
              stream: bool = False, **extra: Any) -> _Response:
        self._check_socket()
        if stream:
            extra["read_timeout"] = None  # an event stream may idle for as long as the job runs
        elif self.timeout is not None and (wait := answer_wait_s(method, path)) is not None:
            # an admission may first clean the disk, a cancel wait for a busy dispatcher:
            # wait for the runner's answer
            extra.setdefault("read_timeout", max(self.timeout, wait))
        response = None
        try:
            response = self._wire.send(method, path, json=json, params=params, **extra)
            if stream:
                response._owners = self._open
                self._open.add(response)
            else:
                response.read()
        except TransportError as exc:
            if response is not None:
                exc.sent = True  # its answer's head came, its body broke off
                response.close()
            raise self._unavailable(exc) from exc
        self._note(response)
        if response.status_code >= 400:
            try:
                body = response.read()
            except TransportError:
                body = b""
            finally:
                response.close()
            raise _refused_error(refusal_fields(response.status_code, body))
        return response

    def _decoded(self, response: _Response) -> Any:
        try:
            return _loads(response.content)
        except ValueError as exc:
            raise self._unavailable(TransportError(f"the answer is not JSON: {exc}")) from exc

    def call(self, method: str, path: str, *, json: Any = None, params: dict | None = None) -> Any:
        """One request; the decoded JSON body (refusals raise RefusedError)."""
        return self._decoded(self._send(method, path, json=json, params=params))

    def _stream(self, method: str, path: str, *, json: Any = None, params: dict | None = None,
                raw: bool = False) -> EventStream:
        return EventStream(self, self._send(method, path, json=json, params=params, stream=True), raw)

    # -- API -------------------------------------------------------------------------------

    def submit(self, req: JobRequest | dict, follow: bool = False, *, raw: bool = False,
               retry_s: float = 0.0) -> JobRecord | dict | EventStream:
        """Submit; the accepted JobRecord, or with follow=True an open EventStream
        (first event `accepted`, last `terminal`). `raw=True`: the record, or each event,
        as the wire's dict (no msgspec on the way).

        `retry_s`: a request with an `idempotency_key` whose answer did not come (the
        connection broke after it was sent: the runner may have accepted it, then crashed
        or restarted) is sent again, every RETRY_GAP_S, until the runner answers or
        `retry_s` seconds have passed (then RunnerUnavailable): the runner answers a key
        it accepted with that job, so the retries make at most one job
        (docs/protocol.md, "Idempotent submits")."""
        body = self.request_body(req)
        key = body.get("idempotency_key") if isinstance(body, dict) else None
        deadline = None
        while True:
            try:
                if follow:
                    return self._stream("POST", "/v1/jobs", json=body, params={"follow": "1"}, raw=raw)
                data = self.call("POST", "/v1/jobs", json=body)
                return data if raw else _record(data)
            except RunnerUnavailable as exc:
                if key is None or retry_s <= 0 or (deadline is None and not exc.sent):
                    raise  # nothing sent (no runner there), or no key to make a retry safe
                deadline = deadline or time.monotonic() + retry_s
                if time.monotonic() >= deadline:
                    exc.sent = True  # (a later try's failure: the first may be accepted)
                    raise
                time.sleep(self.RETRY_GAP_S)

    def submit_batch(self, reqs: Iterable[JobRequest | dict], *, raw: bool = False) -> list:
        """One batch submit (`POST /v1/jobs` with a list, at most MAX_BATCH_JOBS requests):
        each request's accepted JobRecord or its Refusal, in order (`raw=True`: the wire's
        dicts, a refusal with `"refused": true`). A batch refused whole (batch_too_large,
        body_too_large, unauthorized, ...) raises RefusedError: nothing was submitted."""
        body = b"[" + b",".join(json_bytes(self.request_body(r)) for r in reqs) + b"]"
        return self._batch_answers(self._send("POST", "/v1/jobs", content=body,
                                              headers={"content-type": "application/json"}), raw)

    def _batch_answers(self, response: _Response, raw: bool) -> list:
        answers = self._decoded(response)
        if not isinstance(answers, list):
            raise self._unavailable(TransportError("the answer to a batch submit is not a JSON list"))
        return answers if raw else [_batch_item(a) for a in answers]

    def iter_submit_many(self, reqs: Iterable[JobRequest | dict], *, raw: bool = False) -> Iterator:
        """Submit any number of job requests in batches (MAX_BATCH_JOBS requests and about
        MAX_BATCH_BYTES of JSON each, one request per batch, sent when the previous
        batch's answers have been consumed); yields each request's answer in order, as
        `submit_batch`. A batch refused whole answers that refusal for each of its jobs and
        the next batch is still sent; a runner that stops answering raises
        RunnerUnavailable (the jobs of earlier batches stay accepted)."""
        for batch in _batches(json_bytes(self.request_body(r)) for r in reqs):
            try:
                response = self._send("POST", "/v1/jobs", content=b"[" + b",".join(batch) + b"]",
                                      headers={"content-type": "application/json"})
            except Exception as exc:
                refusal = refusal_of(exc)
                if refusal is None:
                    raise
                fields = _refusal_dict(refusal)
                for _ in batch:
                    yield fields if raw else refusal
                continue
            answers = self._batch_answers(response, raw)
            if len(answers) != len(batch):
                raise self._unavailable(TransportError(
                    f"the runner answered {len(answers)} items to a batch of {len(batch)}"))
            yield from answers

    def submit_many(self, reqs: Iterable[JobRequest | dict], *, raw: bool = False) -> list:
        """`list(iter_submit_many(reqs))`."""
        return list(self.iter_submit_many(reqs, raw=raw))

    def get(self, job_id: str) -> JobRecord:
        return _record(self.call("GET", f"/v1/jobs/{_jp(job_id)}"))

    def jobs(self, all: bool = False) -> list[JobRecord]:
        return [_record(r) for r in self.call("GET", "/v1/jobs", params={"all": "1"} if all else None)]

    def events(self, job_id: str, from_seq: int = 0, *, raw: bool = False) -> EventStream:
        """Replay from `from_seq`, then follow until the terminal event (`raw=True`: each
        event as the wire's dict)."""
        return self._stream("GET", f"/v1/jobs/{_jp(job_id)}/events", params={"from_seq": str(from_seq)},
                            raw=raw)

    def cancel(self, job_id: str) -> JobRecord:
        return _record(self.call("POST", f"/v1/jobs/{_jp(job_id)}/cancel"))

    def withdraw(self, job_id: str) -> str:
        """"withdrawn" (it will end refused_before_start) or "started" (too late)."""
        return self.call("POST", f"/v1/jobs/{_jp(job_id)}/withdraw")["result"]

    def health(self) -> dict:
        return self.call("GET", "/v1/health")

    def status(self, full: bool = False) -> dict:
        """Queued and running jobs as status rows (or whole records with `full`), capacity."""
        return self.call("GET", "/v1/status?full=1" if full else "/v1/status")

    def workspaces(self) -> list[dict]:
        return self.call("GET", "/v1/workspaces")

    def put_bundle(self, sha256: str, source) -> dict:
        """Upload a source bundle (a path, bytes, or a file object), streamed in chunks,
        as `PUT /v1/bundles/{sha256}`; refusals (runner_disk_full, bad_request on a digest
        mismatch) raise RefusedError."""
        content, close, length = _bundle_content(source)
        try:
            response = self._send("PUT", f"/v1/bundles/{_jp(sha256)}", content=content, length=length,
                                  headers={"content-type": "application/octet-stream"},
                                  read_timeout=None)  # the runner checks the digest before it answers
            return _loads(response.content)
        finally:
            close()

    def metrics(self) -> str:
        return self._send("GET", "/metrics").text


# --- asynchronous -----------------------------------------------------------------------


class AsyncEventStream:
    """An open NDJSON event stream: `async for` decoded events; `aclose()` or `async with`."""

    def __init__(self, client: "AsyncClient", response: "httpx.Response"):
        self._client = client
        self.response = response
        self._lines: AsyncIterator[str] | None = None

    def __aiter__(self) -> "AsyncEventStream":
        return self

    async def __anext__(self) -> AnyEvent:
        if self._lines is None:
            self._lines = self.response.aiter_lines()
        try:
            while True:
                event = _decode_line(await self._lines.__anext__())
                if event is not None:
                    return event
        except StopAsyncIteration:
            await self.aclose()
            raise
        except _httpx().TransportError as exc:
            await self.aclose()
            raise RunnerUnavailable(f"lost the connection to the runner at {self._client.where}: {exc}") from exc

    async def aclose(self) -> None:
        lines, self._lines = self._lines, None
        if lines is not None and hasattr(lines, "aclose"):
            await lines.aclose()
        await self.response.aclose()

    async def __aenter__(self) -> "AsyncEventStream":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class AsyncClient(_Base):
    """Asynchronous client with the methods of `Client` (each awaitable)."""

    def __init__(self, socket_path=None, *, url=None, token=None, timeout=DEFAULT_TIMEOUT,
                 capabilities=CAPABILITIES):
        super().__init__(socket_path, url=url, token=token, timeout=timeout, capabilities=capabilities)
        httpx = _httpx()
        transport = httpx.AsyncHTTPTransport(uds=str(self.socket_path)) if self.socket_path else None
        self._http = httpx.AsyncClient(base_url=self.base_url, transport=transport,
                                       headers=self._headers, timeout=timeout)

    @classmethod
    def for_endpoint(cls, endpoint: str, **kwargs) -> "AsyncClient":
        return cls(**parse_endpoint(endpoint), **kwargs)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def _send(self, method: str, path: str, *, json: Any = None, params: dict | None = None,
                    stream: bool = False) -> "httpx.Response":
        httpx = _httpx()
        timeout = self._stream_timeout() if stream else httpx.USE_CLIENT_DEFAULT
        wait = None if stream or self.timeout is None else answer_wait_s(method, path)
        if wait is not None:  # (as `Client._send`)
            timeout = httpx.Timeout(self.timeout, read=max(self.timeout, wait))
        request = self._http.build_request(method, path, json=json, params=params, timeout=timeout)
        self._check_socket()
        try:
            response = await self._http.send(request, stream=stream)
        except httpx.TransportError as exc:
            raise self._unavailable(exc) from exc
        self._note(response)
        if response.status_code >= 400:
            try:
                body = await response.aread()
            except httpx.TransportError:
                body = b""
            finally:
                await response.aclose()
            raise _refused_error(refusal_fields(response.status_code, body))
        return response

    async def call(self, method: str, path: str, *, json: Any = None, params: dict | None = None) -> Any:
        response = await self._send(method, path, json=json, params=params)
        return _loads(response.content)

    async def _stream(self, method, path, *, json=None, params=None) -> AsyncEventStream:
        return AsyncEventStream(self, await self._send(method, path, json=json, params=params, stream=True))

    async def submit(self, req: JobRequest | dict, follow: bool = False) -> JobRecord | AsyncEventStream:
        body = self.request_body(req)
        if follow:
            return await self._stream("POST", "/v1/jobs", json=body, params={"follow": "1"})
        return _record(await self.call("POST", "/v1/jobs", json=body))

    async def get(self, job_id: str) -> JobRecord:
        return _record(await self.call("GET", f"/v1/jobs/{_jp(job_id)}"))

    async def jobs(self, all: bool = False) -> list[JobRecord]:
        data = await self.call("GET", "/v1/jobs", params={"all": "1"} if all else None)
        return [_record(r) for r in data]

    async def events(self, job_id: str, from_seq: int = 0) -> AsyncEventStream:
        return await self._stream("GET", f"/v1/jobs/{_jp(job_id)}/events", params={"from_seq": str(from_seq)})

    async def cancel(self, job_id: str) -> JobRecord:
        return _record(await self.call("POST", f"/v1/jobs/{_jp(job_id)}/cancel"))

    async def withdraw(self, job_id: str) -> str:
        return (await self.call("POST", f"/v1/jobs/{_jp(job_id)}/withdraw"))["result"]

    async def health(self) -> dict:
        return await self.call("GET", "/v1/health")

    async def status(self, full: bool = False) -> dict:
        return await self.call("GET", "/v1/status?full=1" if full else "/v1/status")

    async def workspaces(self) -> list[dict]:
        return await self.call("GET", "/v1/workspaces")

    async def put_bundle(self, sha256: str, source) -> dict:
        """`Client.put_bundle`, awaitable: a path, bytes, or an async iterator of chunks."""
        close = lambda: None  # noqa: E731
        if isinstance(source, (bytes, bytearray)):
            content = bytes(source)
        elif hasattr(source, "__aiter__"):
            content = source
        else:
            path = os.fspath(source)

            async def chunks():
                with open(path, "rb") as f:
                    while chunk := f.read(_BUNDLE_CHUNK):
                        yield chunk

            content = chunks()
        httpx = _httpx()
        request = self._http.build_request(
            "PUT", f"/v1/bundles/{_jp(sha256)}", content=content,
            headers={"content-type": "application/octet-stream"},
            timeout=httpx.Timeout(self.timeout, read=None, write=None))
        self._check_socket()
        try:
            response = await self._http.send(request)
        except httpx.TransportError as exc:
            raise self._unavailable(exc) from exc
        finally:
            close()
        self._note(response)
        if response.status_code >= 400:
            raise _refused_error(refusal_fields(response.status_code, response.content))
        return _loads(response.content)

    async def metrics(self) -> str:
        return (await self._send("GET", "/metrics")).text


_BUNDLE_CHUNK = 256 * 1024


def _batches(bodies: Iterable[bytes]) -> Iterator[list[bytes]]:
    """Encoded job requests grouped into batches of at most MAX_BATCH_JOBS and, unless one
    request alone is larger, at most MAX_BATCH_BYTES of JSON."""
    batch: list[bytes] = []
    size = 2
    for body in bodies:
        if batch and (len(batch) >= MAX_BATCH_JOBS or size + len(body) + 1 > MAX_BATCH_BYTES):
            yield batch
            batch, size = [], 2
        batch.append(body)
        size += len(body) + 1
    if batch:
        yield batch


def _batch_item(answer: Any):
    """One answer of a batch submit: a Refusal for `{"refused": true, ...}`, else a JobRecord."""
    if isinstance(answer, dict) and answer.get("refused"):
        return _refusal(answer)
    return _record(answer)


def _refusal_dict(refusal: Refusal) -> dict:
    import msgspec

    return msgspec.to_builtins(refusal) | {"refused": True}


def _httpx():
    import httpx

    return httpx


def _bundle_content(source):
    """(content, close, length) for a bundle given as bytes, a path or a file object: a path
    is sent with its size as content-length, a file object chunked."""
    if isinstance(source, (bytes, bytearray)):
        return bytes(source), lambda: None, len(source)
    length = None
    if hasattr(source, "read"):
        f, owned = source, False
    else:
        f, owned = open(os.fspath(source), "rb"), True
        try:
            length = os.fstat(f.fileno()).st_size
        except OSError:
            length = None

    def chunks():
        sent = 0
        while chunk := f.read(_BUNDLE_CHUNK):
            if length is not None:  # the file grew: send what its length promised
                chunk = chunk[: length - sent]
                if not chunk:
                    break
            sent += len(chunk)
            yield chunk

    return chunks(), (f.close if owned else (lambda: None)), length
