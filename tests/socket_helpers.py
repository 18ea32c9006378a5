"""Socket reads the tests' fake servers share."""

from __future__ import annotations

import socket
import threading
from typing import Callable


def read_until(conn: socket.socket, marker: bytes) -> tuple[bytes, bool]:
    """Read from `conn` until `marker` has arrived (a request's head, an authentication's
    end); (all bytes read, whether the marker came before the peer closed)."""
    buf = b""
    while marker not in buf:
        data = conn.recv(65536)
        if not data:
            return buf, False
        buf += data
    return buf, True


def take_response(buf: bytearray) -> tuple[bytes, bytes] | None:
    """One whole HTTP response with a Content-Length body from the front of `buf`: (head,
    body), removed from `buf`; None while `buf` does not hold all of it yet (read more)."""
    head, sep, rest = bytes(buf).partition(b"\r\n\r\n")
    if not sep:
        return None
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    if len(rest) < length:
        return None
    buf[:] = rest[length:]
    return head, rest[:length]


def response_head(sock: socket.socket) -> bytes:
    """The head of one whole response read from a blocking socket; b"closed" or b"reset"
    when the peer closed or reset the connection first."""
    buf = bytearray()
    try:
        while (got := take_response(buf)) is None:
            data = sock.recv(65536)
            if not data:
                return b"closed"
            buf += data
    except ConnectionResetError:
        return b"reset"
    return got[0]


def serve_each(listener: socket.socket, on_conn: Callable[[socket.socket], None]) -> threading.Thread:
    """Accept on `listener` until it is closed, each connection handled by `on_conn` in a
    thread of its own; the accepting thread (started)."""
    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=on_conn, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    return thread
