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
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, AsyncIterator, Iterator
from urllib.parse import quote

import httpx
import msgspec

from motor.records import (
    CAPABILITIES,
    REFUSAL_HTTP_STATUS,
    AnyEvent,
    JobRecord,
    JobRequest,
    Refusal,
    RefusedError,
    decode_event,
)

DEFAULT_TIMEOUT = 30.0
_STATUS_CODE = {}
for _code, _status in REFUSAL_HTTP_STATUS.items():
    _STATUS_CODE.setdefault(_status, _code)


class RunnerUnavailable(ConnectionError):
    """No runner answered (socket missing, connection refused, or the connection broke)."""


def default_socket_path() -> Path:
    from motor.config import default_socket

    return default_socket()


def parse_endpoint(endpoint: str) -> dict:
    """`unix:/path/motor.sock` or `http://host:port` -> Client keyword arguments."""
    if endpoint.startswith("unix:"):
        return {"socket_path": endpoint[5:]}
    if endpoint.startswith(("http://", "https://")):
        return {"url": endpoint}
    raise ValueError(f"endpoint wants unix:/path or http://host:port, got {endpoint!r}")


def _refusal_from_response(status: int, body: bytes) -> Refusal:
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError:
        data = None
    if isinstance(data, dict) and data.get("refused") and isinstance(data.get("code"), str):
        try:
            return msgspec.convert(data, Refusal)
        except msgspec.ValidationError:
            pass
    text = body.decode("utf-8", "replace").strip()[:200] or f"HTTP {status}"
    return Refusal(code=_STATUS_CODE.get(status, "internal_error" if status >= 500 else "bad_request"),
                   detail=text)


def _jp(job_id: str) -> str:
    return quote(str(job_id), safe="")


def _record(data: Any) -> JobRecord:
    return msgspec.convert(data, JobRecord)


def _decode_line(line: str) -> AnyEvent | None:
    if not line.strip():
        return None
    try:
        return decode_event(line)
    except msgspec.ValidationError:
        return None  # an event kind this client does not know: skip it


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
            self.socket_path: Path | None = Path(socket_path) if socket_path else default_socket_path()
            self.base_url = "http://motor"
        else:
            self.socket_path = None
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
    def where(self) -> str:
        return str(self.socket_path) if self.socket_path is not None else self.base_url

    def _check_socket(self) -> None:
        if self.socket_path is not None and not self.socket_path.exists():
            raise RunnerUnavailable(f"no runner answered at {self.socket_path}: no such socket")

    def _unavailable(self, exc: Exception) -> RunnerUnavailable:
        return RunnerUnavailable(f"no runner answered at {self.where}: {exc}")

    def _note(self, response: httpx.Response) -> None:
        caps = response.headers.get("motor-capabilities")
        if caps is not None:
            self.runner_capabilities = [c for c in caps.split(",") if c]

    def request_body(self, req: JobRequest | dict) -> dict:
        data = msgspec.to_builtins(req) if isinstance(req, JobRequest) else dict(req)
        if not data.get("capabilities"):
            data["capabilities"] = self.capabilities
        return data

    def _stream_timeout(self) -> httpx.Timeout:
        return httpx.Timeout(self.timeout, read=None)


# --- synchronous ------------------------------------------------------------------------


class EventStream:
    """An open NDJSON event stream: iterate for decoded events; close (or use `with`)."""

    def __init__(self, client: "Client", response: httpx.Response):
        self._client = client
        self.response = response
        self._lines: Iterator[str] | None = None

    def __iter__(self) -> "EventStream":
        return self

    def __next__(self) -> AnyEvent:
        if self._lines is None:
            self._lines = self.response.iter_lines()
        try:
            while True:
                event = _decode_line(next(self._lines))
                if event is not None:
                    return event
        except StopIteration:
            self.close()
            raise
        except httpx.TransportError as exc:
            self.close()
            raise RunnerUnavailable(f"lost the connection to the runner at {self._client.where}: {exc}") from exc

    def close(self) -> None:
        self.response.close()

    def __enter__(self) -> "EventStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Client(_Base):
    """Synchronous client.  `Client(socket_path=None, *, url=None, token=None, timeout=30)`."""

    def __init__(self, socket_path=None, *, url=None, token=None, timeout=DEFAULT_TIMEOUT,
                 capabilities=CAPABILITIES):
        super().__init__(socket_path, url=url, token=token, timeout=timeout, capabilities=capabilities)
        transport = httpx.HTTPTransport(uds=str(self.socket_path)) if self.socket_path else None
        self._http = httpx.Client(base_url=self.base_url, transport=transport, headers=self._headers,
                                  timeout=timeout)

    @classmethod
    def for_endpoint(cls, endpoint: str, **kwargs) -> "Client":
        return cls(**parse_endpoint(endpoint), **kwargs)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- plumbing --------------------------------------------------------------------------

    def _send(self, method: str, path: str, *, json: Any = None, params: dict | None = None,
              stream: bool = False) -> httpx.Response:
        request = self._http.build_request(
            method, path, json=json, params=params,
            timeout=self._stream_timeout() if stream else httpx.USE_CLIENT_DEFAULT,
        )
        self._check_socket()
        try:
            response = self._http.send(request, stream=stream)
        except httpx.TransportError as exc:
            raise self._unavailable(exc) from exc
        self._note(response)
        if response.status_code >= 400:
            try:
                body = response.read()
            except httpx.TransportError:
                body = b""
            finally:
                response.close()
            raise RefusedError(_refusal_from_response(response.status_code, body))
        return response

    def call(self, method: str, path: str, *, json: Any = None, params: dict | None = None) -> Any:
        """One request; the decoded JSON body (refusals raise RefusedError)."""
        response = self._send(method, path, json=json, params=params)
        return msgspec.json.decode(response.content)

    def _stream(self, method: str, path: str, *, json: Any = None, params: dict | None = None) -> EventStream:
        return EventStream(self, self._send(method, path, json=json, params=params, stream=True))

    # -- API -------------------------------------------------------------------------------

    def submit(self, req: JobRequest | dict, follow: bool = False) -> JobRecord | EventStream:
        """Submit; the accepted JobRecord, or with follow=True an open EventStream
        (first event `accepted`, last `terminal`)."""
        body = self.request_body(req)
        if follow:
            return self._stream("POST", "/v1/jobs", json=body, params={"follow": "1"})
        return _record(self.call("POST", "/v1/jobs", json=body))

    def get(self, job_id: str) -> JobRecord:
        return _record(self.call("GET", f"/v1/jobs/{_jp(job_id)}"))

    def jobs(self, all: bool = False) -> list[JobRecord]:
        return [_record(r) for r in self.call("GET", "/v1/jobs", params={"all": "1"} if all else None)]

    def events(self, job_id: str, from_seq: int = 0) -> EventStream:
        """Replay from `from_seq`, then follow until the terminal event."""
        return self._stream("GET", f"/v1/jobs/{_jp(job_id)}/events", params={"from_seq": str(from_seq)})

    def cancel(self, job_id: str) -> JobRecord:
        return _record(self.call("POST", f"/v1/jobs/{_jp(job_id)}/cancel"))

    def withdraw(self, job_id: str) -> str:
        """"withdrawn" (it will end refused_before_start) or "started" (too late)."""
        return self.call("POST", f"/v1/jobs/{_jp(job_id)}/withdraw")["result"]

    def health(self) -> dict:
        return self.call("GET", "/v1/health")

    def status(self) -> dict:
        return self.call("GET", "/v1/status")

    def workspaces(self) -> list[dict]:
        return self.call("GET", "/v1/workspaces")

    def put_bundle(self, sha256: str, source) -> dict:
        """Upload a source bundle (a path, bytes, or a file object), streamed in chunks,
        as `PUT /v1/bundles/{sha256}`; refusals (runner_disk_full, bad_request on a digest
        mismatch) raise RefusedError."""
        content, close = _bundle_content(source)
        try:
            request = self._http.build_request(
                "PUT", f"/v1/bundles/{_jp(sha256)}", content=content,
                headers={"content-type": "application/octet-stream"},
                timeout=httpx.Timeout(self.timeout, read=None, write=None))
            self._check_socket()
            try:
                response = self._http.send(request)
            except httpx.TransportError as exc:
                raise self._unavailable(exc) from exc
            self._note(response)
            if response.status_code >= 400:
                raise RefusedError(_refusal_from_response(response.status_code, response.content))
            return msgspec.json.decode(response.content)
        finally:
            close()

    def metrics(self) -> str:
        return self._send("GET", "/metrics").text


# --- asynchronous -----------------------------------------------------------------------


class AsyncEventStream:
    """An open NDJSON event stream: `async for` decoded events; `aclose()` or `async with`."""

    def __init__(self, client: "AsyncClient", response: httpx.Response):
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
        except httpx.TransportError as exc:
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
                    stream: bool = False) -> httpx.Response:
        request = self._http.build_request(
            method, path, json=json, params=params,
            timeout=self._stream_timeout() if stream else httpx.USE_CLIENT_DEFAULT,
        )
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
            raise RefusedError(_refusal_from_response(response.status_code, body))
        return response

    async def call(self, method: str, path: str, *, json: Any = None, params: dict | None = None) -> Any:
        response = await self._send(method, path, json=json, params=params)
        return msgspec.json.decode(response.content)

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

    async def status(self) -> dict:
        return await self.call("GET", "/v1/status")

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
            raise RefusedError(_refusal_from_response(response.status_code, response.content))
        return msgspec.json.decode(response.content)

    async def metrics(self) -> str:
        return (await self._send("GET", "/metrics")).text


_BUNDLE_CHUNK = 256 * 1024


def _bundle_content(source):
    """(content for httpx, close) for a bundle given as bytes, a path or a file object."""
    if isinstance(source, (bytes, bytearray)):
        return bytes(source), lambda: None
    if hasattr(source, "read"):
        f, owned = source, False
    else:
        f, owned = open(os.fspath(source), "rb"), True

    def chunks():
        while chunk := f.read(_BUNDLE_CHUNK):
            yield chunk

    return chunks(), (f.close if owned else (lambda: None))
